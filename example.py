"""Chat prompts through nanovllm, as in nano-vllm's example.py.

With no --model, a tiny random-weight Qwen3 checkpoint is built in a temporary directory, so
this runs anywhere with no download; its completions are noise, not language.
"""
import argparse
import tempfile

from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm.testing.synthetic import build_checkpoint

PROMPTS = [
    "introduce yourself",
    "list all prime numbers within 100",
    "write a haiku about the sea",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local checkpoint directory (default: a tiny random-weight model)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="nanovllm-example-") as tmp:
        path = args.model
        if path is None:
            path = build_checkpoint(tmp)
            print("No --model given: using a tiny Qwen3 checkpoint with RANDOM weights, "
                  "so the completions below are meaningless text.")
        tokenizer = AutoTokenizer.from_pretrained(path)
        llm = LLM(path, device=args.device, enforce_eager=True)
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in PROMPTS
        ]
        outputs = llm.generate(prompts, SamplingParams(temperature=0.6, max_tokens=args.max_tokens))
        llm.exit()

    for prompt, output in zip(prompts, outputs):
        print(f"\nPrompt: {prompt!r}\nCompletion: {output['text']!r}")


if __name__ == "__main__":
    main()
