"""One Runner protocol: the plain, tensor-parallel and speculative runners all satisfy it, and the
engine loop drives them the same way, through one post-processing path (no speculative branch).
"""
import ast
import inspect
from pathlib import Path

import pytest

from helpers import greedy, random_prompts
from nanovllm import LLM
from nanovllm.scheduling.scheduler import Scheduler
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.runner.protocol import OverlappedRunner, Runner, RunnerOutput
from nanovllm.runner.speculative import SpeculativeRunner
from nanovllm.runner.tensor_parallel import TensorParallelRunner

LOOP = Path(__file__).resolve().parents[1] / "nanovllm" / "engine" / "engine_core.py"
STEP_FUNCTIONS = ("step", "_plain_step", "_overlapped_step", "drain", "_resolve", "_report", "_no_tokens")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def engine(path: str, **kwargs) -> LLM:
    return LLM(path, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, **kwargs)


def protocol_members(protocol: type) -> tuple[set[str], set[str]]:
    """The protocol's methods and its data attributes, by name."""
    methods = {name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")}
    return methods, set(getattr(protocol, "__annotations__", {}))


@pytest.mark.parametrize("cls", [ModelRunner, TensorParallelRunner, SpeculativeRunner], ids=lambda c: c.__name__)
def test_every_runner_class_has_the_protocols_methods_and_attributes(cls):
    """Structural: each method with the protocol's parameters, each attribute set in __init__
    (the tensor-parallel runner needs worker processes to build, so it is read, not built)."""
    methods, attributes = protocol_members(Runner)
    assert methods == {"run", "exit"} and attributes == {"num_kvcache_blocks", "num_swap_blocks",
                                                          "attention_backend"}
    for name in methods:
        expected = list(inspect.signature(getattr(Runner, name)).parameters)
        assert list(inspect.signature(getattr(cls, name)).parameters) == expected, f"{cls.__name__}.{name}"
    init = ast.parse(inspect.getsource(cls.__init__).strip())
    assigned = {t.attr for node in ast.walk(init) if isinstance(node, (ast.Assign, ast.AnnAssign))
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Attribute)}
    assert attributes <= assigned, f"{cls.__name__} never sets {attributes - assigned}"


def test_built_runners_are_runners_and_only_the_plain_one_overlaps(qwen3_tiny):
    with engine(qwen3_tiny) as plain, engine(qwen3_tiny, speculative_config=NGRAM) as spec:
        assert isinstance(plain.model_runner, ModelRunner) and isinstance(spec.model_runner, SpeculativeRunner)
        assert isinstance(plain.model_runner, Runner) and isinstance(spec.model_runner, Runner)
        assert isinstance(plain.model_runner, OverlappedRunner)
        assert not isinstance(spec.model_runner, OverlappedRunner)  # Config refuses async scheduling with it
        assert not isinstance(object(), Runner)  # the check can fail


def test_the_step_functions_never_branch_on_speculation():
    tree = ast.parse(LOOP.read_text())
    functions = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert set(STEP_FUNCTIONS) <= set(functions)
    for name in STEP_FUNCTIONS:
        text = ast.unparse(functions[name])
        assert "speculat" not in text, f"EngineCore.{name} mentions speculation"
    assert not hasattr(Scheduler, "postprocess_speculative")


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "speculative"])
def test_both_runners_go_through_the_same_postprocess(qwen3_tiny, spec, monkeypatch):
    """Every step of either runner ends in Scheduler.postprocess with the runner's RunnerOutput
    fields; only the speculative one says how many proposals each sequence accepted."""
    seen: list[tuple[bool, bool]] = []
    real = Scheduler.postprocess

    def recording(self, batch, token_ids, accepted=None, num_proposed=None):
        seen.append((accepted is not None, num_proposed is not None))
        return real(self, batch, token_ids, accepted, num_proposed)

    with engine(qwen3_tiny, speculative_config=spec) as llm:
        run = llm.model_runner.run

        def checked_run(*args, **kwargs):
            out = run(*args, **kwargs)
            assert isinstance(out, RunnerOutput)
            return out

        monkeypatch.setattr(llm.model_runner, "run", checked_run)
        monkeypatch.setattr(Scheduler, "postprocess", recording)
        chunk = random_prompts(200, [6], seed=5)[0]
        outputs = llm.generate([chunk * 3], greedy(12), use_tqdm=False)
        assert len(outputs[0]["token_ids"]) == 12
    assert seen and set(seen) == ({(True, True)} if spec else {(False, False)})
