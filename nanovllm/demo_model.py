"""The demo model: a small Qwen3 trained offline, in minutes, on the Python standard library.

Every machine with Python has the standard library's source (code, comments and docstrings), so
a model trained on it is a real model that needs no download: `python example.py`, the CLI's
`generate` / `chat` / `serve` and README's snippets use it when no model is named. It writes
recognisable Python, not good Python: a million parameters trained for two minutes.

What this module owns: reading the corpus (`corpus_files`, with a held-out split for
perplexity), training a byte-level BPE tokenizer on it with the `tokenizers` library, training a
Qwen3-architecture model with HF transformers, and saving both as a normal HF checkpoint
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json, a ChatML chat template).
`default_model()` is the cached copy under the user's cache dir, built once.

It knows nothing of the engine: nanovllm only ever sees the saved directory. The same Python
version (the same standard library), seed and settings give the same checkpoint.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from nanovllm.utils.paths import cache_dir

if TYPE_CHECKING:  # the heavy libraries load when a model is built, not when the CLI starts
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3ForCausalLM

EOS_TOKEN = "<|endoftext|>"  # Qwen's end of text; separates the files in the training stream
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
# Qwen's ChatML: <|im_start|>role\ncontent<|im_end|>\n per message, then the assistant header.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Folders of the standard library left out: third-party packages, and the test suites, whose
# generated data and odd fixtures are not the code a user wants to see imitated.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
# Every HELD_OUT_EVERY-th file (in sorted order) is never trained on: the perplexity text.
HELD_OUT_EVERY = 20
RECIPE_VERSION = 1  # bump when the recipe changes, so a cached model built by an older one is rebuilt
DEMO_DIR_NAME = "demo-model"
INFO_FILE = "nanovllm_demo.json"  # the recipe a saved demo model was built with
# Training runs on one thread: the sums then add up in the same order on any machine (the same
# checkpoint everywhere), and a small model's steps were 7x slower on 2 threads than on 1 when the
# 2 cores were shared with other work (OpenMP threads spin waiting for each other).
TRAIN_THREADS = 1
ADAM_BETAS = (0.9, 0.95)  # nanoGPT's: a shorter second-moment memory suits a short, high-rate run
GRAD_CLIP = 1.0  # max gradient norm; keeps the high learning rate's first steps from diverging
MIN_LR_FRACTION = 0.1  # the cosine schedule ends at this share of the peak rate
ROPE_THETA = 10_000.0  # the original RoPE base: plenty for a 2048-token context


@dataclass(frozen=True)
class DemoRecipe:
    """How the demo model is built. The defaults take about two minutes on 2 CPU cores; tests use
    fewer steps and less text (seconds)."""
    steps: int = 400  # optimizer steps: 2 min 16 s for the whole build on a busy 2-core host (BENCHMARKS.md)
    corpus_bytes: int = 4_000_000  # training text read (of ~12 MB of standard library)
    tokenizer_bytes: int = 2_000_000  # of that, the text the BPE merges are learned from
    vocab_size: int = 2048  # tokens, the special ones included; a multiple of 64 as real checkpoints pad
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # GQA, as Qwen3
    head_dim: int = 32
    intermediate_size: int = 384
    max_position_embeddings: int = 2048  # what the engine may use; training sees seq_len
    seq_len: int = 128  # tokens per training window
    batch_size: int = 16  # windows per step
    learning_rate: float = 3e-3  # peak, after warm-up; small models take a large rate
    warmup_steps: int = 30
    weight_decay: float = 0.01
    seed: int = 0


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(held_out: bool = False) -> list[Path]:
    """The standard library's .py files in sorted order: the training files, or (held_out=True)
    every HELD_OUT_EVERY-th one, which training never reads."""
    root = stdlib_dir()
    files = sorted(p for p in root.rglob("*.py") if not SKIPPED_DIRS.intersection(p.relative_to(root).parts[:-1]))
    if not files:
        raise RuntimeError(f"no Python standard library source under {root}: the demo model is trained on it")
    return [p for i, p in enumerate(files) if (i % HELD_OUT_EVERY == 0) == held_out]


def read_corpus(max_bytes: int, held_out: bool = False) -> list[str]:
    """Whole files, in sorted order, up to about `max_bytes` of text."""
    texts, total = [], 0
    for path in corpus_files(held_out):
        if total >= max_bytes:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
    return texts


def _train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)  # at the end of the vocabulary, as in Qwen
    return tokenizer


def _token_stream(tokenizer: Tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    import torch
    """Every text's tokens, each followed by EOS, as one long [num_tokens] tensor."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def _learning_rate(step: int, recipe: DemoRecipe) -> float:
    """Linear warm-up, then cosine decay to MIN_LR_FRACTION of the peak."""
    if step < recipe.warmup_steps:
        return recipe.learning_rate * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))  # 1 -> 0
    return recipe.learning_rate * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cosine)


def _train(model: Qwen3ForCausalLM, stream: torch.Tensor, recipe: DemoRecipe,
           log: Callable[[str], None]) -> tuple[float, float]:
    """Next-token training on random windows of `stream`; returns the first step's loss and the last's."""
    import torch
    generator = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, betas=ADAM_BETAS,
                                  weight_decay=recipe.weight_decay)
    model.train()
    log_every = max(1, recipe.steps // 10)
    first_loss, started = float("nan"), time.perf_counter()
    for step in range(recipe.steps):
        starts = torch.randint(0, len(stream) - recipe.seq_len - 1, (recipe.batch_size,), generator=generator)
        window = torch.stack([stream[s:s + recipe.seq_len + 1] for s in starts.tolist()])  # [batch, seq_len + 1]
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, recipe)
        logits = model(input_ids=window[:, :-1]).logits  # [batch, seq_len, vocab]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        if step == 0:
            first_loss = loss.item()
        if (step + 1) % log_every == 0 or step + 1 == recipe.steps:
            log(f"  step {step + 1}/{recipe.steps}: loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)")
    model.eval()
    return first_loss, loss.item()


def _to_stderr(message: str) -> None:
    """Progress goes to stderr, so a command's stdout holds only its output."""
    print(message, file=sys.stderr, flush=True)


def build_demo_model(path: str | os.PathLike, recipe: DemoRecipe = DemoRecipe(),
                     log: Callable[[str], None] = _to_stderr) -> str:
    """Train the demo model with `recipe` and save it to `path` as an HF checkpoint; returns the path.

    1. read the standard library's training files; 2. learn a byte-level BPE tokenizer on part of
    them; 3. train a Qwen3 on the token stream (fixed seed); 4. save the weights (float32), the
    tokenizer with its ChatML template and EOS, and the recipe (nanovllm_demo.json).
    """
    import torch
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    try:
        return _build(Path(path), recipe, log, started)
    finally:
        torch.set_num_threads(threads)


def _build(path: Path, recipe: DemoRecipe, log: Callable[[str], None], started: float) -> str:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging
    torch.manual_seed(recipe.seed)
    texts = read_corpus(recipe.corpus_bytes)
    tokenizer = _train_tokenizer(read_corpus(recipe.tokenizer_bytes), recipe.vocab_size)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    stream = _token_stream(tokenizer, texts, eos_id)
    log(f"  corpus: {len(texts)} files of the standard library ({sum(map(len, texts)) / 1e6:.1f} MB, "
        f"{len(stream)} tokens), tokenizer of {tokenizer.get_vocab_size()} tokens")
    config = Qwen3Config(
        vocab_size=recipe.vocab_size, hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers, num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads, head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    model = Qwen3ForCausalLM(config)
    first_loss, final_loss = _train(model, stream, recipe, log)

    path.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()  # transformers' "Writing model shards" bar: one shard, no news
    try:
        model.save_pretrained(path, safe_serialization=True)
    finally:
        hf_logging.enable_progress_bar()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                            chat_template=CHAT_TEMPLATE).save_pretrained(path)
    info = {"recipe_version": RECIPE_VERSION, "recipe": asdict(recipe), "first_loss": first_loss,
            "final_loss": final_loss,
            "python": sys.version.split()[0], "train_seconds": round(time.perf_counter() - started, 1)}
    (path / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    log(f"  saved to {path} in {info['train_seconds']} s")
    return str(path)


def _is_built(path: Path) -> bool:
    """A finished build of this RECIPE_VERSION (at any step count: `nanovllm demo-model --steps`)."""
    try:
        info = json.loads((path / INFO_FILE).read_text())
    except (OSError, ValueError):
        return False
    return info.get("recipe_version") == RECIPE_VERSION


def default_model(recipe: DemoRecipe = DemoRecipe(), log: Callable[[str], None] = _to_stderr) -> str:
    """The demo model's directory in the cache, built with `recipe` first (about two minutes) when
    it is missing or an older RECIPE_VERSION built it. It is built in a temporary folder beside it
    and renamed into place, so a build that is interrupted, or two builds at once, never leave a
    half-written model, and a finished one is never replaced under a process reading it."""
    path = cache_dir() / DEMO_DIR_NAME
    if _is_built(path):
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    log(f"nanovllm: building the demo model (a small Qwen3 trained on the Python standard library, "
        f"once, about two minutes) into {path}")
    staging = Path(tempfile.mkdtemp(prefix=f".{DEMO_DIR_NAME}-", dir=path.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the model is no secret
    try:
        build_demo_model(staging, recipe, log)
        if _is_built(path):  # a concurrent build finished first: keep it, drop ours
            return str(path)
        if path.exists():  # an older recipe's model, or the remains of something else
            shutil.rmtree(path, ignore_errors=True)
        try:
            os.rename(staging, path)
        except OSError:  # another process renamed its build into place first: use that one
            if not _is_built(path):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(path)


def add_subcommand(subparsers: "argparse._SubParsersAction") -> None:
    """Register `nanovllm demo-model [DIR] [--steps N]` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "demo-model", help="build the demo model (a small Qwen3 trained on the Python standard library)",
        description="Train the demo model (about two minutes on a CPU) and save it as an HF checkpoint in DIR. "
                    "With no DIR it is the cached copy that generate, chat and serve use when no MODEL is "
                    f"given ({cache_dir() / DEMO_DIR_NAME}), built only if missing.")
    parser.add_argument("dir", nargs="?", metavar="DIR", help="where to save it (default: the cache)")
    parser.add_argument("--steps", type=_positive_int, default=DemoRecipe.steps,
                        help="training steps (default: %(default)s); fewer is faster and worse")
    parser.set_defaults(run=_run_subcommand)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; it must be a whole number of at least 1")
    return int(text)


def _run_subcommand(args: argparse.Namespace) -> int:
    recipe = DemoRecipe(steps=args.steps)
    path = build_demo_model(args.dir, recipe) if args.dir else default_model(recipe)
    print(path)
    return 0
