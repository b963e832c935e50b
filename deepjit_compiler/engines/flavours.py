"""TensorRT and TensorRT-RTX: what differs between the two engine flavours, in this one place.

Both are driven the same way (the ONNX parser, Polygraphy's `NetworkFromOnnxPath` ->
`CreateConfig` -> `EngineBytesFromNetwork`, and the runtime's `deserialize_cuda_engine` /
`execute_async_v3`), and tensorrt.py holds that shared code. They differ in:

- the Python module and distribution (`tensorrt` | `tensorrt_rtx`), and Polygraphy's switch between
  them, `POLYGRAPHY_USE_TENSORRT_RTX`. Polygraphy reads it once per process (its TensorRT modules bind
  `tensorrt` or `tensorrt_rtx` when first imported), so plans are built in a child process whose
  environment names the flavour (worker.py);
- where a plan is built: TensorRT on the target GPU (or a compatible one, `hardware_compatibility`);
  TensorRT-RTX ahead of time for named compute capabilities, on any machine, no GPU needed, through
  `CreateConfigRTX(compute_capabilities=[(7, 5)])`. TensorRT-RTX 1.7 supports 7.5 (only when named),
  8.0, 8.6, 8.9, 12.0 and 12.1: no 9.0;
- typing: TensorRT-RTX is always strongly typed and has no precision builder flags; TensorRT 11 is
  strongly typed too, TensorRT 10.x may build weakly typed with fp16/bf16/int8 flags;
- caches: TensorRT's build-time timing cache (`engine.timing_cache`); TensorRT-RTX times nothing when it
  builds ahead of time, and compiles its kernels for the GPU at load instead, which its runtime cache
  keeps between loads (`config.runtime_cache_dir()`);
- the plan's file name in a bundle (`segment.plan` | `segment.rtx.plan`), so one bundle can carry both.
"""
from __future__ import annotations

from dataclasses import dataclass

from .._optional import LazyModule, lazy_import
from ..errors import EngineError
from ..spec.targets import compute_capability


@dataclass(frozen=True, slots=True)
class Flavour:
    name: str                      # the engine.backend value and the plan record's `flavour`
    title: str                     # for messages
    module_name: str               # what `import` takes
    dist: str                      # the distribution whose version a plan needs at run time
    extra: str                     # deepjit[...] that installs it
    plan_suffix: str               # <segment>.<suffix> in the bundle's engines/
    polygraphy_rtx: bool           # POLYGRAPHY_USE_TENSORRT_RTX for the process that builds with it
    ahead_of_time: bool            # builds for named compute capabilities without a GPU
    always_strongly_typed: bool    # no weakly typed networks, no precision builder flags
    timing_cache: bool             # uses engine.timing_cache at build time
    runtime_cache: bool            # keeps a runtime cache of the kernels it compiles at load

    @property
    def module(self) -> LazyModule:
        return _MODULES[self.name]

    def importable(self) -> bool:
        return self.module.available()

    def version(self) -> str:
        """The installed library's version (MissingDependency when it is absent)."""
        return str(self.module.__version__)

    def plan_file(self, segment: str) -> str:
        return f"{segment}.{self.plan_suffix}"

    def supported_sms(self) -> tuple[int, ...] | None:
        """The compute capabilities it builds for, read from the installed library (None: whatever
        GPU it builds on, as TensorRT). TensorRT-RTX: its ComputeCapability enum's SMxx members."""
        if not self.ahead_of_time:
            return None
        members = self.module.ComputeCapability.__members__
        return tuple(sorted(int(n[2:]) for n in members if n.startswith("SM") and n[2:].isdigit()))

    def check_target(self, target_sm: int | None) -> None:
        """EngineError unless the installed library builds ahead of time for `target_sm`."""
        if not self.ahead_of_time:
            return
        if target_sm is None:
            raise EngineError(f"{self.title} builds ahead of time for named compute capabilities: give the spec a "
                              "target (gpu or sm)")
        supported = self.supported_sms() or ()
        if target_sm not in supported:
            raise EngineError(f"{self.title} {self.version()} does not support {compute_capability(target_sm)} "
                              f"(sm_{target_sm}); it builds for {', '.join(map(compute_capability, supported))}")


TENSORRT = Flavour("tensorrt", "TensorRT", "tensorrt", "tensorrt", "tensorrt", "plan", polygraphy_rtx=False,
                   ahead_of_time=False, always_strongly_typed=False, timing_cache=True, runtime_cache=False)
TENSORRT_RTX = Flavour("tensorrt-rtx", "TensorRT-RTX", "tensorrt_rtx", "tensorrt_rtx", "tensorrt-rtx", "rtx.plan",
                       polygraphy_rtx=True, ahead_of_time=True, always_strongly_typed=True, timing_cache=False,
                       runtime_cache=True)
FLAVOURS = {f.name: f for f in (TENSORRT, TENSORRT_RTX)}

_MODULES = {
    "tensorrt": lazy_import("tensorrt", "building TensorRT engines needs TensorRT: install deepjit[tensorrt] or set "
                                        "engine.backend: onnxruntime"),
    "tensorrt-rtx": lazy_import("tensorrt_rtx", "TensorRT-RTX plans need TensorRT-RTX: install deepjit[tensorrt-rtx] "
                                                "or set engine.backend: onnxruntime"),
}

def flavour(name: str) -> Flavour:
    try:
        return FLAVOURS[name]
    except KeyError:
        raise EngineError(f"unknown engine flavour '{name}'; known: {', '.join(FLAVOURS)}") from None


def flavour_of_plan(path: str) -> Flavour:
    """The flavour a bundle's plan file was built with, by its name."""
    return TENSORRT_RTX if path.endswith("." + TENSORRT_RTX.plan_suffix) else TENSORRT
