"""Engine backends behind one small interface: build a segment into an artifact, load an artifact
into a runner (Polygraphy's runner shape plus `enqueue` on a given stream and device pointers).

    decision = decide(settings)                    # tensorrt now, deferred tensorrt, or onnxruntime
    artifact = engine_from_segment("engine", segment, settings, decision, workdir=tmp)
    with runner_for(artifact) as runner: runner.infer({"images": x})

Deferred engines: when TensorRT cannot build for the target here, the artifact carries the segment's
ONNX (precision applied) and `deferred_settings`; `materialize` builds the plans on the target.
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
from . import onnxrt, tensorrt
from .base import (
    BACKENDS,
    Decision,
    EngineArtifact,
    EngineSettings,
    InputProfile,
    Runner,
    select_backend,
)

__all__ = ["BACKENDS", "Decision", "EngineArtifact", "EngineSettings", "InputProfile", "Runner", "decide",
           "deferred_settings", "engine_from_segment", "local_device_sm", "materialize", "runner_for",
           "select_backend", "tensorrt_importable"]

log = logging.getLogger("deepjit.engines")
_cuda_core = lazy_import("cuda.core", "finding this machine's GPU needs cuda-core")


def tensorrt_importable() -> bool:
    return tensorrt.trt.available()


def local_device_sm() -> int | None:
    """This machine's first GPU as an SM number (e.g. 90), or None without a GPU or driver."""
    try:
        cc = _cuda_core.Device(0).compute_capability
        return cc.major * 10 + cc.minor
    except Exception:  # no driver, no device, or a driver too old: all mean "no usable GPU here"
        return None


def decide(settings: EngineSettings) -> Decision:
    """select_backend for this machine; logs the decision and why, for the build output."""
    decision = select_backend(settings, tensorrt_importable=tensorrt_importable(), device_sm=local_device_sm())
    log.info("engine backend: %s%s (%s)", decision.backend, " (deferred)" if decision.deferred else "", decision.reason)
    return decision


def deferred_settings(settings: EngineSettings) -> dict:
    """The JSON-able build settings a bundle stores so `deepjit materialize` can build the plans on
    the target. The timing cache path is the build machine's, so it stays behind."""
    return {**settings.to_dict(), "timing_cache": None}


def engine_from_segment(name: str, segment: onnx.ModelProto, settings: EngineSettings, decision: Decision, *,
                        workdir: str | Path, timing_cache: str | Path | None = None) -> EngineArtifact:
    """Build one engine segment (precision already applied) the way `decision` says."""
    data = segment.SerializeToString()
    if decision.deferred:
        log.info("segment '%s': TensorRT plan deferred to the target (%s)", name, decision.reason)
        return EngineArtifact("tensorrt", name, {f"{name}.onnx": data}, json.dumps(deferred_settings(settings),
                                                                                 sort_keys=True), deferred=True)
    if decision.backend == "onnxruntime":
        return onnxrt.build_engine(data, name, settings)
    path = Path(workdir) / f"{name}.onnx"
    atomic_write(path, data)
    return tensorrt.build_engine(path, settings, timing_cache=timing_cache, segment_name=name)


def materialize(segment_paths: Mapping[str, str | Path] | Sequence[str | Path], settings_json: str | Mapping, *,
                timing_cache: str | Path | None = None) -> dict[str, bytes]:
    """Build deferred segments into TensorRT plans on this machine: {"<segment>.plan": plan bytes}.
    `segment_paths` maps segment names to ONNX files (or lists files, named by their stem)."""
    try:
        raw = json.loads(settings_json) if isinstance(settings_json, str) else dict(settings_json)
        settings = EngineSettings.from_dict(raw)
    except (SpecError, ValueError, KeyError, TypeError) as e:
        raise BundleError(f"manifest engine.settings: deferred engine settings are malformed: {e}") from None
    named = segment_paths.items() if isinstance(segment_paths, Mapping) else [(Path(p).stem, p) for p in segment_paths]
    plans: dict[str, bytes] = {}
    for name, path in named:
        plans.update(tensorrt.build_engine(path, settings, timing_cache=timing_cache, segment_name=name).files)
    return plans


def runner_for(artifact: EngineArtifact, *, device: str = "auto", name: str | None = None) -> Runner:
    """A runner over an artifact: the TensorRT plan, else (ONNX Runtime or deferred) the segment ONNX."""
    if artifact.backend == "tensorrt" and not artifact.deferred:
        return tensorrt.TrtEngineRunner(_only(artifact, ".plan"), name=name or f"trt:{artifact.segment_name}")
    return onnxrt.OnnxrtEngineRunner(_only(artifact, ".onnx"), device=device, name=name or f"ort:{artifact.segment_name}")


def _only(artifact: EngineArtifact, suffix: str) -> bytes:
    found = [data for rel, data in artifact.files.items() if rel.endswith(suffix)]
    if len(found) != 1:
        raise BundleError(f"engine '{artifact.segment_name}': expected one {suffix} file, found "
                          f"{sorted(artifact.files)}")
    return found[0]


