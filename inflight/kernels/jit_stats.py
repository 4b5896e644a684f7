"""Which Triton specializations the package's kernels compile, and which a launch asks for.

Triton compiles a kernel once per *specialization*: argument types, whether each integer
argument equals 1 or is divisible by 16, whether each pointer is 16-byte aligned, the
constexpr values and the launch options. A launch whose key is new compiles (about a second
for an attention kernel on an H100) before it runs, so a request that brings a new key stalls
every row of its step. The engine precompiles every key it can ask for at start-up
(`inflight.runner.precompile`); this module is how that is checked:

- `num_compiled()`: variants compiled so far in this process by the package's kernels (the
  sizes of their in-memory JIT caches; 0 under the interpreter, which compiles nothing);
- `CompileLog`: a context that records every Triton compile (kernel, signature, seconds)
  through Triton's JIT hooks (GPU);
- `LaunchRecorder`: a context that records the specialization key of every launch of the
  package's kernels; works under the interpreter too, so CPU tests can check that the keys a
  workload asks for were all seen at start-up (`specialization_key` computes them as Triton's
  own binder does).
"""

from __future__ import annotations

import importlib
import inspect
import time
from dataclasses import dataclass, field

from inflight.kernels._common import triton

KERNEL_MODULES = ("activation", "fp8", "int4", "kv_cache", "norm", "paged_attention", "prefill_attention",
                  "rotary")


def launched_kernels() -> dict[str, object]:
    """`module.name` -> the jit (or interpreted) function of every kernel the package launches."""
    kernels = {}
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(f"inflight.kernels.{module_name}")
        for name, obj in vars(module).items():
            if name.startswith("_") and name.endswith("_kernel") and hasattr(obj, "fn"):
                kernels[f"{module_name}.{name}"] = obj
    return kernels


def num_compiled() -> int:
    """Compiled variants held by the package's kernels (every device), in this process."""
    total = 0
    for kernel in launched_kernels().values():
        for caches in list(getattr(kernel, "device_caches", {}).values()):
            total += len(caches[0])
    return total


def specialization_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """The key Triton's binder computes for `kernel[grid](*args, **kwargs)`: per parameter its
    type and value class (or its constexpr value), then the launch options."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    params = inspect.signature(kernel.fn).parameters
    options = getattr(kernel, "kwargs", {})  # the interpreter keeps the jit arguments here
    no_value = set(getattr(kernel, "do_not_specialize", None) or options.get("do_not_specialize") or ())
    no_align = set(getattr(kernel, "do_not_specialize_on_alignment", None)
                   or options.get("do_not_specialize_on_alignment") or ())
    bound = dict(zip(params, args))
    bound.update((k, v) for k, v in kwargs.items() if k in params)
    key = []
    for index, (name, param) in enumerate(params.items()):
        value = bound.get(name, param.default)
        if "constexpr" in str(param.annotation):
            key.append(("constexpr", value))
            continue
        specialize = name not in no_value and index not in no_value
        align = name not in no_align and index not in no_align
        key.append(tuple(native_specialize_impl(BaseBackend, value, False, specialize, align)[:2]))
    key.append(tuple(sorted((k, v) for k, v in kwargs.items() if k not in params)))
    return tuple(key)


class LaunchRecorder:
    """Records (kernel name, specialization key) of every launch of the package's kernels
    while active (compiled or interpreted). `keys` is the set seen."""

    def __init__(self) -> None:
        self.keys: set[tuple[str, tuple]] = set()
        self._names = {id(k): name for name, k in launched_kernels().items()}
        self._patched: list[tuple[type, object]] = []

    def __enter__(self) -> "LaunchRecorder":
        for cls in {type(k) for k in launched_kernels().values()}:
            original = cls.run
            self._patched.append((cls, original))
            cls.run = self._wrap(original)
        return self

    def _wrap(self, original):
        recorder = self

        def run(kernel, *args, **kwargs):
            name = recorder._names.get(id(kernel))
            if name is not None:
                launch = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
                recorder.keys.add((name, specialization_key(kernel, args, launch)))
            return original(kernel, *args, **kwargs)
        return run

    def __exit__(self, *exc) -> None:
        for cls, original in reversed(self._patched):
            cls.run = original
        self._patched.clear()


@dataclass
class CompileEvent:
    kernel: str  # module.function
    signature: str  # Triton's repr: options and every argument's specialized type
    seconds: float


@dataclass
class CompileLog:
    """Records every Triton JIT compile while active (through `triton.knobs.runtime`'s
    `jit_cache_hook` / `jit_post_compile_hook`, chained to any hook already set)."""

    events: list[CompileEvent] = field(default_factory=list)

    def __enter__(self) -> "CompileLog":
        runtime = triton.knobs.runtime
        self._saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        self._started: list[float] = []
        before, after = self._saved

        def on_start(**kw):
            self._started.append(time.perf_counter())
            return before(**kw) if before else None  # falsy: go on and compile

        def on_done(**kw):
            start = self._started.pop() if self._started else time.perf_counter()
            info = kw["fn"]
            self.events.append(CompileEvent(f"{info.module}.{info.name}", kw["repr"],
                                            time.perf_counter() - start))
            return after(**kw) if after else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_start, on_done
        return self

    def __exit__(self, *exc) -> None:
        triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook = self._saved

    @property
    def seconds(self) -> float:
        return sum(e.seconds for e in self.events)
