"""Prompts through nanovllm, as in nano-vllm's example.py.

With no --model it uses the demo model: a small Qwen3 trained on the Python standard library,
built once (about two minutes on a CPU) and cached (nanovllm/demo_model.py). It completes Python
code; it is no chat assistant, so the prompts here are the starts of Python functions. With
--model, the prompts go through the checkpoint's chat template when it has one.
"""
import argparse

from nanovllm import LLM, SamplingParams
from nanovllm.demo_model import default_model

# No trailing newline: the tokenizer joins a newline with the indentation after it, so a prompt
# ending in a bare "\n" would end in a token the model rarely saw there.
CODE_PROMPTS = [
    "def is_prime(n):",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):",
    "import os\n\n\ndef read_lines(path):",
]
# At the demo model's size plain greedy decoding soon repeats a phrase; a repetition penalty
# (vLLM's, as in SamplingParams) keeps it writing new code. Real checkpoints: nano-vllm's setting.
DEMO_PARAMS = dict(temperature=0.0, repetition_penalty=1.3)
MODEL_PARAMS = dict(temperature=0.6)
CHAT_PROMPTS = [
    "introduce yourself",
    "list all prime numbers within 100",
    "write a haiku about the sea",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local checkpoint directory (default: the demo model)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    args = parser.parse_args()

    path = args.model or default_model()
    with LLM(path, device=args.device) as llm:
        if args.model and llm.tokenizer.chat_template:
            prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                         add_generation_prompt=True) for p in CHAT_PROMPTS]
        else:
            prompts = CODE_PROMPTS
        params = SamplingParams(**(MODEL_PARAMS if args.model else DEMO_PARAMS), max_tokens=args.max_tokens)
        outputs = llm.generate(prompts, params)

    for prompt, output in zip(prompts, outputs):
        if args.model:
            print(f"\nPrompt: {prompt!r}\nCompletion: {output['text']!r}")
        else:  # code reads best as code
            print(f"\n--- {prompt.splitlines()[-1]}\n{prompt}{output['text']}")


if __name__ == "__main__":
    main()
