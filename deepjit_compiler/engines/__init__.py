"""Engine backends behind one small interface: build a segment into an artifact, load an artifact
into a runner (Polygraphy's runner shape plus `enqueue` on a given stream and device pointers).

    decision = decide(settings)      # tensorrt now, tensorrt-rtx (ahead of time), deferred tensorrt, onnxruntime
    artifact = engine_from_segment("engine", segment, settings, decision, workdir=tmp)
    with runner_for(artifact) as runner: runner.infer({"images": x})

TensorRT and TensorRT-RTX share one backend (tensorrt.py, plans.py, worker.py); flavours.py is what
differs. Deferred engines: when neither can build for the target here, the artifact carries the
segment's ONNX (precision applied) and `deferred_settings`; `materialize` builds the plans on the target.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx

from .._optional import lazy_import
from ..errors import BundleError, SpecError
from ..files import atomic_write
from ..graph.serialize import model_bytes
from . import onnxrt
from .base import (
    BACKENDS,
    Decision,
    EngineArtifact,
    EngineSettings,
    InputProfile,
    PlanInfo,
    Runner,
    deferred_settings,
    select_backend,
)
from .flavours import FLAVOURS, TENSORRT, TENSORRT_RTX, Flavour, flavour, flavour_of_plan
from .plans import build_engine
from .tensorrt import TrtEngineRunner

__all__ = ["BACKENDS", "FLAVOURS", "TENSORRT", "TENSORRT_RTX", "Decision", "EngineArtifact", "EngineSettings",
           "Flavour", "InputProfile", "PlanInfo", "Runner", "decide", "deferred_settings", "engine_from_segment",
           "flavour", "flavour_of_plan", "local_device_sm", "materialize", "rtx_sms", "runner_for", "select_backend",
           "tensorrt_importable"]

log = logging.getLogger("deepjit.engines")
_cuda_core = lazy_import("cuda.core", "finding this machine's GPU needs cuda-core")


def tensorrt_importable() -> bool:
    return TENSORRT.importable()


def rtx_sms() -> tuple[int, ...] | None:
    """The compute capabilities the importable TensorRT-RTX builds for; None when it is not importable."""
    return TENSORRT_RTX.supported_sms() if TENSORRT_RTX.importable() else None


def local_device_sm() -> int | None:
    """This machine's first GPU as an SM number (e.g. 90), or None without a GPU or driver."""
    try:
        cc = _cuda_core.Device(0).compute_capability
        return cc.major * 10 + cc.minor
    except Exception:  # no driver, no device, or a driver too old: all mean "no usable GPU here"
        return None


def decide(settings: EngineSettings) -> Decision:
    """select_backend for this machine; logs the decision and why, for the build output."""
    decision = select_backend(settings, tensorrt_importable=tensorrt_importable(), device_sm=local_device_sm(),
                              rtx_sms=rtx_sms())
    log.info("engine backend: %s%s (%s)", decision.backend, " (deferred)" if decision.deferred else "", decision.reason)
    return decision


def engine_from_segment(name: str, segment: onnx.ModelProto, settings: EngineSettings, decision: Decision, *,
                        workdir: str | Path, timing_cache: str | Path | None = None,
                        cache_dir: Path | None = None) -> EngineArtifact:
    """Build one engine segment (precision already applied) the way `decision` says."""
    data = model_bytes(segment)
    if decision.deferred:
        log.info("segment '%s': TensorRT plan deferred to the target (%s)", name, decision.reason)
        return EngineArtifact("tensorrt", name, {f"{name}.onnx": data}, json.dumps(deferred_settings(settings),
                                                                                 sort_keys=True), deferred=True)
    if decision.backend == "onnxruntime":
        return onnxrt.build_engine(data, name, settings)
    path = Path(workdir) / f"{name}.onnx"
    atomic_write(path, data)
    return build_engine(path, settings, flavour=flavour(decision.backend), timing_cache=timing_cache,
                        segment_name=name, cache_dir=cache_dir, build_sm=local_device_sm())


def materialize(segment_paths: Mapping[str, str | Path] | Sequence[str | Path], settings_json: str | Mapping, *,
                timing_cache: str | Path | None = None) -> dict[str, EngineArtifact]:
    """Build segments into TensorRT plans on this machine's GPU: {segment name: artifact (plan + ONNX)}.
    `segment_paths` maps segment names to ONNX files (or lists files, named by their stem)."""
    try:
        raw = json.loads(settings_json) if isinstance(settings_json, str) else dict(settings_json)
        settings = EngineSettings.from_dict(raw)
    except (SpecError, ValueError, KeyError, TypeError) as e:
        raise BundleError(f"manifest engine.settings: deferred engine settings are malformed: {e}") from None
    named = segment_paths.items() if isinstance(segment_paths, Mapping) else [(Path(p).stem, p) for p in segment_paths]
    return {name: build_engine(path, settings, flavour=TENSORRT, timing_cache=timing_cache, segment_name=name,
                               build_sm=local_device_sm()) for name, path in named}


def runner_for(artifact: EngineArtifact, *, device: str = "auto", name: str | None = None,
               tf32: bool = False, device_id: int = 0) -> Runner:
    """A runner over an artifact: its plan (TensorRT or TensorRT-RTX, on the current CUDA device), else
    (ONNX Runtime or deferred) the segment ONNX (`tf32`: whether ONNX Runtime's CUDA provider may use
    TF32, from engine.tf32; `device_id`: the GPU its CUDA provider runs on)."""
    if artifact.backend in FLAVOURS and not artifact.deferred:
        f = flavour(artifact.backend)
        return TrtEngineRunner(_only(artifact, "." + f.plan_suffix), flavour=f,
                               name=name or f"{f.name}:{artifact.segment_name}")
    return onnxrt.OnnxrtEngineRunner(_only(artifact, ".onnx"), device=device, name=name or f"ort:{artifact.segment_name}",
                                     tf32=tf32, device_id=device_id)


def _only(artifact: EngineArtifact, suffix: str) -> bytes:
    found = [data for rel, data in artifact.files.items() if rel.endswith(suffix)
             and not (suffix == ".plan" and rel.endswith("." + TENSORRT_RTX.plan_suffix))]
    if len(found) != 1:
        raise BundleError(f"engine '{artifact.segment_name}': expected one {suffix} file, found "
                          f"{sorted(artifact.files)}")
    return found[0]
