"""Triton kernel launches, observed for tests: their specialisation keys, and compiling them for a GPU
where there is none.

- `triton_kernels()`: every @triton.jit object of the nanovllm.kernels modules, by name.
- `recording(kernels)`: while active, each launch of those kernels runs as usual and its
  specialisation key (what Triton's kernel cache is keyed by: argument types, pointer alignment,
  integer classes, constexpr values, options) is appended to the list it yields. Computed with
  Triton's own binder, so it is the real key, also under TRITON_INTERPRET=1, which has no cache.
- `capturing(kernels)`: while active, launches do not run; each is appended, with its arguments,
  to the list it yields (needs no GPU: the wrappers only check and allocate on the host).
- `compile_for_cuda(launch, arch)`: a captured launch compiled by Triton's own compiler down to a
  cubin for that NVIDIA architecture, exactly as its first launch on such a GPU would compile it
  (the triton wheel ships ptxas: no GPU or driver needed). Needs compiled-mode kernels, i.e.
  TRITON_INTERPRET unset when the kernel modules were imported.
These touch Triton internals (KernelParam, the binder, JITFunction._pack_args) that are stable
across the 3.x releases this project uses, and nothing in nanovllm depends on this module.
"""
import importlib
import inspect
import pkgutil
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple

import nanovllm.kernels


class LaunchKey(NamedTuple):
    kernel: str  # module.function
    key: tuple  # the specialisation and options: equal keys share one compiled variant


class Launch(NamedTuple):
    kernel: str
    function: Any  # the JITFunction (or InterpretedFunction)
    args: tuple
    kwargs: dict


def triton_kernels() -> dict[str, Any]:
    """Every Triton kernel object defined in a nanovllm.kernels module ("module.name" -> object);
    device functions are included (they are never launched, so they are never recorded)."""
    from triton.runtime.jit import KernelInterface

    kernels = {}
    for info in pkgutil.iter_modules(nanovllm.kernels.__path__):
        module = importlib.import_module(f"nanovllm.kernels.{info.name}")
        for name, value in vars(module).items():
            # Defined here, not imported (reductions' combine functions come from triton.language).
            if isinstance(value, KernelInterface) and value.fn.__module__ == module.__name__:
                kernels[f"{info.name}.{name}"] = value
    return kernels


def _binder(kernel):
    """Triton's argument binder for `kernel`, built as JITFunction builds its own, with the base backend
    (whose specialisation of integers and pointers is the one every backend uses)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import KernelParam, create_function_from_signature

    fn = kernel.fn  # the Python function, for JITFunction and InterpretedFunction alike
    options = getattr(kernel, "kwargs", {})  # an InterpretedFunction keeps the decorator's arguments here
    never = set(getattr(kernel, "do_not_specialize", None) or options.get("do_not_specialize") or ())
    never_aligned = set(getattr(kernel, "do_not_specialize_on_alignment", None)
                        or options.get("do_not_specialize_on_alignment") or ())
    signature = inspect.signature(fn)
    params = [KernelParam(i, p, i in never or p.name in never, i in never_aligned or p.name in never_aligned)
              for i, p in enumerate(signature.parameters.values())]
    return create_function_from_signature(signature, params, BaseBackend)


def specialization_key(kernel, args: tuple, kwargs: dict) -> tuple:
    _, specialization, options = _binder(kernel)(*args, **kwargs)
    return tuple(specialization), tuple(sorted(options.items()))


@contextmanager
def _patched_runs(kernels: dict[str, Any], on_launch) -> Iterator[None]:
    """Replace each kernel's `run` (what kernel[grid](...) calls) by on_launch(name, kernel, run, ...)."""
    for name, kernel in kernels.items():
        original = kernel.run
        kernel.run = (lambda name, kernel, original: lambda *args, grid, warmup, **kwargs:
                      on_launch(name, kernel, original, args, grid, warmup, kwargs))(name, kernel, original)
    try:
        yield
    finally:
        for kernel in kernels.values():
            del kernel.run  # the class's own method again


@contextmanager
def recording(kernels: dict[str, Any]) -> Iterator[list[LaunchKey]]:
    launches: list[LaunchKey] = []

    def on_launch(name, kernel, run, args, grid, warmup, kwargs):
        launches.append(LaunchKey(name, specialization_key(kernel, args, kwargs)))
        return run(*args, grid=grid, warmup=warmup, **kwargs)

    with _patched_runs(kernels, on_launch):
        yield launches


@contextmanager
def capturing(kernels: dict[str, Any]) -> Iterator[list[Launch]]:
    launches: list[Launch] = []

    def on_launch(name, kernel, run, args, grid, warmup, kwargs):
        launches.append(Launch(name, kernel, args, kwargs))

    with _patched_runs(kernels, on_launch):
        yield launches


def compile_for_cuda(launch: Launch, arch: int = 90):
    """The launch's kernel compiled for NVIDIA sm_<arch> (Triton's CompiledKernel: .asm holds ttir,
    ttgir, llir, ptx and cubin), as JITFunction.run would compile it on such a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kernel = launch.function
    binder = _binder(kernel)
    bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound_args, specialization,
                                                              options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
