"""What every engine backend shares: the build settings, the built artifact, the runner interface,
and the `auto` backend decision.

A backend builds an engine segment (an ONNX graph, precision already applied) into an artifact,
and loads an artifact into a runner. Runners follow Polygraphy's runner shape (`activate`,
`infer(feed_dict) -> dict`, `deactivate`, context manager; they subclass Polygraphy's BaseRunner,
so the accuracy gate's Comparator runs them as they are) and add `enqueue`, which launches the
engine on a given CUDA stream over given device pointers, for the runtime and its CUDA graphs.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import MissingDependency, SpecError, closest
from ..spec.models import BACKENDS, HARDWARE_COMPATIBILITY, PRECISIONS
from ..spec.targets import compute_capability

log = logging.getLogger("deepjit.engines")

AMPERE_SM = 80
SETTINGS_FORMAT = 1

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class InputProfile:
    """The min/opt/max shapes one engine input must accept (one TensorRT optimization profile row)."""

    name: str
    min: Shape
    opt: Shape
    max: Shape

    def __post_init__(self):
        where = f"engine profile for input '{self.name}'"
        if not (len(self.min) == len(self.opt) == len(self.max)):
            raise SpecError(f"{where}: min/opt/max have different ranks: {self.min}, {self.opt}, {self.max}")
        for i, (lo, mid, hi) in enumerate(zip(self.min, self.opt, self.max)):
            if not 1 <= lo <= mid <= hi:
                raise SpecError(f"{where}: dim {i} needs 1 <= min <= opt <= max, got {lo}, {mid}, {hi}")


def _choice(field_name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SpecError(f"engine.{field_name}: must be one of {', '.join(allowed)}, got "
                        f"'{value}'{closest(value, allowed)}")


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """How to build engines: the spec's `engine` block, the inputs' profiles and the target's SM."""

    backend: str = "auto"
    precision: str = "fp32"
    workspace_bytes: int = 2**30
    timing_cache: Path | None = None
    optimization_level: int = 3
    hardware_compatibility: str = "none"
    profiles: tuple[InputProfile, ...] = ()
    target_sm: int | None = None
    # TensorRT 10.x only: False builds weakly typed with the precision's builder flags set too.
    # TensorRT 11 is always strongly typed.
    strongly_typed: bool = True
    tf32: bool = False  # ONNX Runtime's CUDA provider may use TF32 in fp32 segments

    def __post_init__(self):
        _choice("backend", self.backend, BACKENDS)
        _choice("precision", self.precision, PRECISIONS)
        _choice("hardware_compatibility", self.hardware_compatibility, HARDWARE_COMPATIBILITY)
        if not 0 <= self.optimization_level <= 5:
            raise SpecError(f"engine.optimization_level: must be 0..5, got {self.optimization_level}")
        if self.workspace_bytes <= 0:
            raise SpecError(f"engine.workspace: must be a positive number of bytes, got {self.workspace_bytes}")
        names = [p.name for p in self.profiles]
        if len(set(names)) != len(names):
            raise SpecError(f"engine profiles name an input twice: {names}")

    @classmethod
    def from_spec(cls, spec) -> EngineSettings:
        """From a `spec.Spec`: its engine block, its inputs' profiles and its target."""
        e = spec.engine
        profiles = tuple(InputProfile(name, inp.min_shape, inp.opt_shape, inp.max_shape)
                         for name, inp in spec.inputs.items())
        return cls(backend=e.backend, precision=e.precision, workspace_bytes=e.workspace,
                   timing_cache=e.timing_cache, optimization_level=e.optimization_level,
                   hardware_compatibility=e.hardware_compatibility, profiles=profiles,
                   target_sm=spec.target.resolved_sm, tf32=e.tf32)

    def profile(self, name: str) -> InputProfile | None:
        return next((p for p in self.profiles if p.name == name), None)

    def to_dict(self) -> dict:
        return {
            "format": SETTINGS_FORMAT,
            "backend": self.backend,
            "precision": self.precision,
            "workspace_bytes": self.workspace_bytes,
            "timing_cache": str(self.timing_cache) if self.timing_cache else None,
            "optimization_level": self.optimization_level,
            "hardware_compatibility": self.hardware_compatibility,
            "profiles": {p.name: {"min": list(p.min), "opt": list(p.opt), "max": list(p.max)} for p in self.profiles},
            "target_sm": self.target_sm,
            "strongly_typed": self.strongly_typed,
            "tf32": self.tf32,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> EngineSettings:
        if d.get("format") != SETTINGS_FORMAT:
            raise SpecError(f"engine settings: format {d.get('format')!r} is not {SETTINGS_FORMAT} "
                            "(written by another DeepJIT version)")
        profiles = tuple(InputProfile(n, tuple(p["min"]), tuple(p["opt"]), tuple(p["max"]))
                         for n, p in d.get("profiles", {}).items())
        tc = d.get("timing_cache")
        return cls(backend=d["backend"], precision=d["precision"], workspace_bytes=d["workspace_bytes"],
                   timing_cache=Path(tc) if tc else None, optimization_level=d["optimization_level"],
                   hardware_compatibility=d["hardware_compatibility"], profiles=profiles,
                   target_sm=d.get("target_sm"), strongly_typed=d.get("strongly_typed", True),
                   tf32=bool(d.get("tf32", False)))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()


def deferred_settings(settings: EngineSettings) -> dict:
    """The JSON-able build settings a bundle stores so `deepjit materialize` can build the plans on
    the target. The timing cache path is the build machine's, so it stays behind."""
    return {**settings.to_dict(), "timing_cache": None}


@dataclass(frozen=True, slots=True)
class PlanInfo:
    """What is known about a built plan without running it: the library (and version) it needs at run
    time, the compute capabilities it runs on, the network TensorRT parsed (layers, I/O tensors with
    dtypes, TensorRT's shapes with -1 for a dynamic dim) and the profile it was built with. `key` is
    the plan cache key, the digest of everything that built it. `to_record` is the manifest's entry:
    no timings (`build_seconds` goes to build-report.json)."""

    file: str  # relative to the bundle's engines/ folder
    flavour: str
    library: str
    version: str
    compute_capabilities: tuple[str, ...]
    network_layers: int
    inputs: tuple[Mapping[str, Any], ...]
    outputs: tuple[Mapping[str, Any], ...]
    profiles: Mapping[str, Mapping[str, list[int]]]
    key: str
    size: int = 0
    build_seconds: float = 0.0
    from_cache: bool = False

    def to_record(self) -> dict[str, Any]:
        return {"file": self.file, "flavour": self.flavour, "library": self.library, "version": self.version,
                "compute_capabilities": list(self.compute_capabilities), "network_layers": self.network_layers,
                "inputs": [dict(t) for t in self.inputs], "outputs": [dict(t) for t in self.outputs],
                "profiles": {k: dict(v) for k, v in self.profiles.items()}, "key": self.key}


@dataclass(frozen=True, slots=True)
class EngineArtifact:
    """A built (or deferred) engine for one segment: its files, relative to the bundle's engine
    folder, and the settings it was built with. Deferred: the files are the segment's ONNX, to be
    built into a plan on the target by `deepjit materialize`. A TensorRT-RTX plan travels with its
    segment's ONNX (what runs where the plan cannot, and what `materialize` builds from)."""

    backend: str
    segment_name: str
    files: Mapping[str, bytes] = field(default_factory=dict)
    settings_json: str = "{}"
    deferred: bool = False
    plan: PlanInfo | None = None

    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(json.dumps([self.backend, self.segment_name, self.settings_json, self.deferred]).encode())
        for rel in sorted(self.files):
            h.update(rel.encode() + b"\0" + hashlib.sha256(self.files[rel]).digest())
        return h.hexdigest()

    def file_digests(self) -> dict[str, str]:
        return {rel: hashlib.sha256(data).hexdigest() for rel, data in sorted(self.files.items())}


@runtime_checkable
class Runner(Protocol):
    """Polygraphy's runner shape plus `enqueue` for GPU engines."""

    name: str

    def activate(self) -> None: ...

    def infer(self, feed_dict, check_inputs: bool = True) -> dict: ...

    def deactivate(self) -> None: ...

    def __enter__(self): ...

    def __exit__(self, exc_type, exc, tb): ...

    def enqueue(self, stream_handle: int, bindings: Mapping[str, int], shapes: Mapping[str, Shape]) -> None:
        """Launch on the CUDA stream `stream_handle` (a cudaStream_t as int); `bindings` maps every
        input and output tensor to a device pointer, `shapes` gives their shapes. Returns without
        synchronizing."""
        ...


@dataclass(frozen=True, slots=True)
class Decision:
    """Which backend builds the engines: `tensorrt` (on this GPU), `tensorrt-rtx` (ahead of time, any
    machine), or `onnxruntime`; deferred means a TensorRT plan built later on the target, with ONNX
    Runtime running and validating the segments until then."""

    backend: str
    deferred: bool
    reason: str


def select_backend(settings: EngineSettings, *, tensorrt_importable: bool, device_sm: int | None,
                   rtx_sms: tuple[int, ...] | None = None) -> Decision:
    """Pick the backend for `settings.backend` given what this machine has; `rtx_sms`: the compute
    capabilities the importable TensorRT-RTX builds for (None: not importable).

    onnxruntime: always ONNX Runtime. tensorrt: TensorRT now when it imports and this GPU's engines
    run on the target, otherwise a deferred TensorRT engine. tensorrt-rtx: a TensorRT-RTX plan for the
    target's compute capability (SpecError for one it does not support). auto, in order: TensorRT when
    it builds for the target here; TensorRT-RTX when it imports and supports the target; a deferred
    TensorRT engine. Only auto without a target falls back to ONNX Runtime as the engine itself."""
    if settings.backend == "onnxruntime":
        return Decision("onnxruntime", False, "engine.backend is onnxruntime")
    if settings.backend == "tensorrt-rtx":
        return _rtx_asked(settings, rtx_sms)
    ok, why = _builds_here(settings, tensorrt_importable, device_sm)
    if ok:
        return Decision("tensorrt", False, why)
    if settings.backend == "auto" and settings.target_sm is None:
        return Decision("onnxruntime", False, f"{why}, and no target GPU is named: ONNX Runtime is the engine")
    if settings.backend == "auto":
        rtx_ok, rtx_why = _rtx_builds(settings.target_sm, rtx_sms)
        if rtx_ok:
            return Decision("tensorrt-rtx", False, f"{why}; {rtx_why}")
        why = f"{why}, and {rtx_why}"
    target = f"sm_{settings.target_sm}" if settings.target_sm is not None else "the target GPU"
    return Decision("tensorrt", True, f"{why}: the TensorRT plan is deferred to `deepjit materialize` on "
                                      f"{target}; ONNX Runtime validates the segments meanwhile")


def _rtx_builds(target_sm: int, rtx_sms: tuple[int, ...] | None) -> tuple[bool, str]:
    if rtx_sms is None:
        return False, "TensorRT-RTX is not importable here"
    if target_sm not in rtx_sms:
        return False, (f"TensorRT-RTX does not support {compute_capability(target_sm)} (it builds "
                       f"{', '.join(map(compute_capability, rtx_sms))})")
    return True, (f"TensorRT-RTX builds the plan ahead of time for compute capability {compute_capability(target_sm)}"
                  f" (sm_{target_sm}), no GPU needed")


def _rtx_asked(settings: EngineSettings, rtx_sms: tuple[int, ...] | None) -> Decision:
    if settings.target_sm is None:
        raise SpecError("engine.backend: tensorrt-rtx builds for named compute capabilities: give target.gpu or "
                        "target.sm")
    ok, why = _rtx_builds(settings.target_sm, rtx_sms)
    if ok:
        return Decision("tensorrt-rtx", False, f"engine.backend is tensorrt-rtx: {why}")
    if rtx_sms is None:
        raise MissingDependency("engine.backend: tensorrt-rtx needs TensorRT-RTX: install deepjit[tensorrt-rtx] "
                                "(pip install tensorrt_rtx), or set engine.backend: auto")
    raise SpecError(f"engine.backend: tensorrt-rtx: {why}; use backend auto (a deferred TensorRT plan) or tensorrt")


def _builds_here(settings: EngineSettings, trt: bool, device_sm: int | None) -> tuple[bool, str]:
    if not trt:
        return False, "TensorRT is not importable here"
    if device_sm is None:
        return False, "TensorRT needs the target GPU to build, and this machine has no GPU"
    target = settings.target_sm
    if target is None:
        return True, f"TensorRT builds for this GPU (sm_{device_sm})"
    if device_sm == target:
        return True, f"this GPU is the target (sm_{target})"
    if settings.hardware_compatibility == "ampere_plus" and min(device_sm, target) >= AMPERE_SM:
        return True, f"an ampere_plus engine built on sm_{device_sm} runs on the target sm_{target}"
    return False, f"TensorRT builds on the target GPU: this GPU is sm_{device_sm} and the target is sm_{target}"
