"""The folder tree states the layering, and the imports keep to it (read with ast, nothing run).

From the top down: the offline API (`llm.py`), then `engine/` (LLMEngine, EngineCore and the
request side), then `runner/` (everything that builds or runs tensors), then `scheduling/`
(plain-Python bookkeeping, no torch), and beside it the model side (`models/`, `layers/`,
`attention/`, `kernels/`), which knows nothing of sequences, scheduling or the runner. No import
runs back up, and no chain of imports (lazy ones included) comes back to where it started.

Hardware lives in `platform/`: no module outside it imports a kernel module (`kernels/`) or asks
which device or CPU it runs on (device_questions lists what counts as asking).
"""
import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nanovllm"
MODEL_SIDE = ("layers", "models", "kernels", "attention")
ABOVE_THE_MODEL_SIDE = ("nanovllm.scheduling", "nanovllm.engine", "nanovllm.runner", "nanovllm.llm")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, tree: ast.AST | None = None) -> set[str]:
    """Every module a file imports, by absolute name: `from a.b import c` counts as both a.b and
    a.b.c (c may be a module), and relative imports are resolved against the file's package.
    `tree`: the file's syntax tree as given (default: as read)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(tree or ast.parse(path.read_text(), str(path))):
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


# --- the platform layer ---------------------------------------------------------------------------
# Files outside platform/ that may ask about the device or the ISA, each with its reason (the
# kernels themselves, kernels/, are the hardware code the platform calls: not listed, never checked).
DEVICE_QUESTION_EXCEPTIONS: dict[str, str] = {
    "entrypoints/batch/ray.py": "a Ray replica asks Ray for a GPU unless it runs on the CPU",
}
# Files outside platform/ and kernels/ that may import a kernel module, each with its reason.
KERNEL_IMPORT_EXCEPTIONS: dict[str, str] = {
    "testing/kernel_launches.py": "a test helper that lists every Triton kernel to record its launches",
}
# Module-level checks of the hardware, as attribute chains: any use of these is a question.
DEVICE_ATTRIBUTES = re.compile(r"(^|\.)(device\.type|is_cuda|is_cpu)$|^torch\.(cuda|backends|ops\.mkldnn)\b")
DEVICE_NAMES = {"cuda", "cpu", "triton"}  # compared against: a device or a fused-kernel choice
ISA_NAMES = {"cpu_build", "CPU_ISA_ENV", "CPU_ISAS", "get_device_capability", "is_available", "TRITON_INTERPRET"}


def relative(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


def outside_the_platform() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "platform"]


def device_questions(path: Path) -> list[str]:
    """Each place a file asks which device or CPU it runs on (line: code): `x.device.type`,
    `.is_cuda`, torch.cuda / torch.backends / oneDNN calls, a comparison with "cuda", "cpu" or
    "triton", `is_available()`, the compute capability, and the CPU build's ISA names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        text = None
        if isinstance(node, ast.Attribute) and DEVICE_ATTRIBUTES.search(ast.unparse(node)):
            text = ast.unparse(node)
        elif isinstance(node, ast.Compare):
            values = [node.left, *node.comparators]
            if any(isinstance(v, ast.Constant) and v.value in DEVICE_NAMES for v in values):
                text = ast.unparse(node)
        elif isinstance(node, (ast.Name, ast.Attribute)) and (getattr(node, "id", None) in ISA_NAMES
                                                               or getattr(node, "attr", None) in ISA_NAMES):
            text = ast.unparse(node)
        elif isinstance(node, ast.Constant) and node.value == "TRITON_INTERPRET":
            text = repr(node.value)
        if text is not None:
            found.append(f"{node.lineno}: {text}")
    return found


def test_the_device_question_finder_finds_questions(tmp_path: Path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(x, config):\n    a = x.device.type == 'cpu'\n    b = x.is_cuda\n"
                      "    c = torch.cuda.synchronize()\n    d = config.device != 'cuda'\n"
                      "    e = torch.backends.mkldnn.is_available()\n    return cpu_build.load()\n")
    lines = {int(found.split(":")[0]) for found in device_questions(sample)}
    assert lines == {2, 3, 4, 5, 6, 7}
    plain = tmp_path / "plain.py"
    plain.write_text("def g(x, device):\n    return x.to(device).float() + x.size(0)  # cuda in a comment\n")
    assert device_questions(plain) == []


@pytest.mark.parametrize("path", [p for p in outside_the_platform()
                                  if p.relative_to(PACKAGE).parts[0] != "kernels"], ids=relative)
def test_no_module_outside_the_platform_asks_about_the_device(path: Path):
    questions = device_questions(path)
    if relative(path) in DEVICE_QUESTION_EXCEPTIONS:
        assert questions, f"{relative(path)} asks nothing any more: drop its exception"
        return
    assert not questions, f"{relative(path)} asks about the device or the ISA: {questions}"


@pytest.mark.parametrize("path", [p for p in outside_the_platform()
                                  if p.relative_to(PACKAGE).parts[0] != "kernels"], ids=relative)
def test_only_the_platform_imports_kernel_modules(path: Path):
    kernels = [m for m in imports_of(path) if within(m, ("nanovllm.kernels",))]
    if relative(path) in KERNEL_IMPORT_EXCEPTIONS:
        assert kernels, f"{relative(path)} imports no kernel any more: drop its exception"
        return
    assert not kernels, f"{relative(path)} imports {kernels}"


def run_time_imports(path: Path) -> set[str]:
    """imports_of without the imports under `if TYPE_CHECKING:` (read by type checkers, never run)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            node.body = [ast.Pass()]
    return imports_of(path, tree)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports when run, lazily or not (a name that is not a
    module, as `from a import f`'s a.f, is dropped)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in run_time_imports(path) if m in modules and m != name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycles():
    assert len(import_graph()) > 100
    assert cycles(import_graph()) == []
