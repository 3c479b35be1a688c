"""The folder tree states the layering, and the imports keep to it (read with ast, nothing run).

From the top down: the offline API (`llm.py`), then `engine/` (LLMEngine, EngineCore and the
request side), then `runner/` (everything that builds or runs tensors), then `scheduling/`
(plain-Python bookkeeping, no torch), and beside it the model side (`models/`, `layers/`,
`attention/`, `kernels/`), which knows nothing of sequences, scheduling or the runner. No import
runs back up.
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nanovllm"
MODEL_SIDE = ("layers", "models", "kernels", "attention")
ABOVE_THE_MODEL_SIDE = ("nanovllm.scheduling", "nanovllm.engine", "nanovllm.runner", "nanovllm.llm")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, by absolute name: `from a.b import c` counts as both a.b and
    a.b.c (c may be a module), and relative imports are resolved against the file's package."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def modules_under(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_import_reader_sees_what_files_import():
    """The rules below hold only if imports_of finds imports at all: checked on files whose
    imports are known (the runner uses torch and the engine; the loop uses both below it)."""
    runner = imports_of(PACKAGE / "runner" / "model_runner.py")
    assert "torch" in runner and "nanovllm.scheduling.sequence" in runner
    loop = imports_of(PACKAGE / "engine" / "llm_engine.py")
    assert "nanovllm.scheduling.scheduler" in loop and any(within(m, ("nanovllm.runner",)) for m in loop)
    assert "nanovllm.engine.llm_engine" in imports_of(PACKAGE / "llm.py")


@pytest.mark.parametrize("path", modules_under("scheduling"), ids=lambda p: p.name)
def test_scheduling_is_plain_python_below_the_runner(path: Path):
    imported = imports_of(path)
    assert not [m for m in imported if within(m, ("torch",))], f"{path.name} imports torch"
    above = [m for m in imported if within(m, ("nanovllm.runner", "nanovllm.engine", "nanovllm.llm"))]
    assert not above, f"{path.name} imports {above}, which sit above scheduling/"


@pytest.mark.parametrize("path", modules_under("engine"), ids=lambda p: p.name)
def test_engine_never_imports_the_offline_api(path: Path):
    above = [m for m in imports_of(path) if within(m, ("nanovllm.llm",))]
    assert not above, f"engine/{path.name} imports {above}"


@pytest.mark.parametrize("path", [p for folder in MODEL_SIDE for p in modules_under(folder)],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_model_side_never_imports_engine_or_runner(path: Path):
    above = [m for m in imports_of(path) if within(m, ABOVE_THE_MODEL_SIDE)]
    assert not above, f"{path.parent.name}/{path.name} imports {above}"


@pytest.mark.parametrize("path", modules_under("runner"), ids=lambda p: p.name)
def test_runner_never_imports_the_loop(path: Path):
    above = [m for m in imports_of(path) if within(m, ("nanovllm.engine", "nanovllm.llm"))]
    assert not above, f"runner/{path.name} imports {above}"


# The products on top, each above the ones after it: the CLI drives batch jobs and the server,
# batch jobs read OpenAI-format lines with the server's protocol, and the server sits on the engine.
ENTRYPOINTS = ("cli", "batch", "openai")


@pytest.mark.parametrize("path", [p for p in PACKAGE.rglob("*.py") if "entrypoints" not in p.parts
                                  and p.name != "__main__.py"], ids=lambda p: str(p.relative_to(PACKAGE)))
def test_nothing_below_the_entrypoints_imports_them(path: Path):
    above = [m for m in imports_of(path) if within(m, ("nanovllm.entrypoints",))]
    assert not above, f"{path.relative_to(PACKAGE)} imports {above}"


@pytest.mark.parametrize("rank", range(len(ENTRYPOINTS)), ids=ENTRYPOINTS)
def test_each_entrypoint_imports_only_those_below_it(rank: int):
    above = tuple(f"nanovllm.entrypoints.{name}" for name in ENTRYPOINTS[:rank])
    files = modules_under(f"entrypoints/{ENTRYPOINTS[rank]}")
    assert files, f"entrypoints/{ENTRYPOINTS[rank]} has no modules"
    arrows = {str(p.relative_to(PACKAGE)): [m for m in imports_of(p) if within(m, above)] for p in files}
    assert not {path: found for path, found in arrows.items() if found}


def test_entrypoints_are_the_three_products():
    """Every entrypoint module sits in one of the product packages the rules above cover."""
    loose = [p.name for p in (PACKAGE / "entrypoints").glob("*.py") if p.name != "__init__.py"]
    packages = sorted(p.name for p in (PACKAGE / "entrypoints").iterdir() if (p / "__init__.py").exists())
    assert not loose and packages == sorted(ENTRYPOINTS)


def test_nothing_in_the_engine_imports_the_testing_helpers():
    users = [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")
             if "testing" not in p.relative_to(PACKAGE).parts
             and any(within(m, ("nanovllm.testing",)) for m in imports_of(p))]
    assert not users


def test_conftest_and_the_attention_oracle_stand_apart():
    """conftest imports no torch at module level (tests of plain-Python logic load none), and the
    attention oracle shares no code with the backends it checks: it imports only the interface
    and the metadata type, and calls no SDPA."""
    tests = Path(__file__).resolve().parent
    assert not {"torch", "nanovllm.testing.synthetic"} & imports_of_top_level(tests / "conftest.py")
    oracle = tests / "reference_attention.py"
    nanovllm_imports = {name for name in imports_of(oracle) if name.startswith("nanovllm")}
    assert nanovllm_imports <= {"nanovllm.attention.base", "nanovllm.attention.base.AttentionBackend",
                                "nanovllm.utils.context", "nanovllm.utils.context.AttentionMetadata"}
    assert "scaled_dot_product_attention" not in oracle.read_text()


def imports_of_top_level(path: Path) -> set[str]:
    """The modules a file imports outside any function (what importing it loads at once)."""
    found = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module or "")
    return found


def test_structured_outputs_sit_beside_the_engine_and_the_engine_never_imports_them():
    """structured_outputs/ (xgrammar, which imports torch) is used by the loop and the server and
    read by the sampling pipeline through an interface; engine/ holds its matchers as opaque
    objects and never imports it, and it knows nothing of sequences, the runner or the loop."""
    for path in modules_under("scheduling"):
        found = [m for m in imports_of(path) if within(m, ("xgrammar", "nanovllm.structured_outputs"))]
        assert not found, f"scheduling/{path.name} imports {found}"
    files = modules_under("structured_outputs")
    assert files
    for path in files:
        found = [m for m in imports_of(path) if within(m, ABOVE_THE_MODEL_SIDE + ("nanovllm.layers",))]
        assert not found, f"structured_outputs/{path.name} imports {found}"


def test_the_architecture_page_names_every_module():
    """docs/architecture.md walks a request through the code naming each module: a new module
    that the page does not name fails here, so the page stays the map."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if p.name != "__init__.py" and p.name not in page)
    assert not missing, f"docs/architecture.md does not name {missing}"
