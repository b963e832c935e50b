"""Segment -> plan, for either flavour: the plan cache around the build (worker.py), and what the
manifest records about the plan (`PlanInfo`).

Plans are cached by the digest of what builds them (`plan_key`: the segment's bytes, the settings,
the flavour and its version, the build GPU for TensorRT), like the kernels' compile cache, and for
the same reason: a bundle is the same bytes when built again. TensorRT-RTX 1.7 does not build
byte-identical plans: two builds of the YOLOv8s segment for SM75 give plans of the same size that
differ in ~150-190 bytes (Myelin's generated kernel names and a few ids), in a new process or the same
one, whatever `max_threads`, `max_aux_streams`, `builder_optimization_level` or `max_num_tactics`; only
with address-space randomization off (`setarch -R`) are two identical processes identical, so the
order follows heap addresses. It has no deterministic-build switch (and nothing to time: it builds
ahead of time without a GPU). So the cache is what makes a rebuild reproduce a plan; the manifest
records the key, which is the same wherever the same inputs are built.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import polygraphy

from .. import __version__, config
from ..jit.cache import CacheStats, KernelCache, key_of
from ..spec.targets import compute_capability
from .base import EngineArtifact, EngineSettings, PlanInfo, deferred_settings
from .flavours import TENSORRT, Flavour
from .tensorrt import profile_rows, segment_inputs
from .worker import build_in_child

log = logging.getLogger("deepjit.engines")

PLAN_CACHE_FORMAT = 1
stats = CacheStats()  # the plan cache's hits and misses (a test asserts a rebuild builds nothing)


def plan_key(segment: bytes, settings: EngineSettings, flavour: Flavour, version: str,
             build_sm: int | None = None) -> str:
    """What a plan is a function of (Polygraphy sets up the builder config, so its version too). A
    TensorRT plan also depends on the GPU it was built (and timed) on."""
    return key_of({"kind": "plan", "format": PLAN_CACHE_FORMAT, "deepjit": __version__, "flavour": flavour.name,
                   "version": version, "polygraphy": polygraphy.__version__,
                   "segment": hashlib.sha256(segment).hexdigest(),
                   "settings": deferred_settings(settings),
                   "build_sm": None if flavour.ahead_of_time else build_sm})


def build_engine(segment_path: str | Path, settings: EngineSettings, *, flavour: Flavour = TENSORRT,
                 timing_cache: str | Path | None = None, segment_name: str | None = None,
                 cache_dir: Path | None = None, build_sm: int | None = None) -> EngineArtifact:
    """Build one segment's ONNX file into a plan (TensorRT: on this machine's GPU, `build_sm`;
    TensorRT-RTX: for settings.target_sm, anywhere), or take it from the plan cache. The artifact holds
    the plan and the segment's ONNX (what runs where the plan cannot); its `plan` is the record."""
    version = flavour.version()  # MissingDependency without the library
    flavour.check_target(settings.target_sm)
    path = Path(segment_path)
    name = segment_name or path.stem
    data = path.read_bytes()
    key = plan_key(data, settings, flavour, version, build_sm)
    cache = KernelCache(Path(cache_dir) / "plans" if cache_dir is not None else config.plan_cache_dir(), stats)
    hit = cache.get(key)
    if hit is not None:
        meta, blobs = hit
        plan, network, seconds = blobs["plan"], meta["network"], 0.0
    else:
        plan, network, seconds = build_in_child(path, settings, flavour, timing_cache=timing_cache, segment_name=name)
        cache.put(key, {"plan": plan}, {"network": network, "flavour": flavour.name, "version": version})
        cache.prune(config.plan_cache_max_bytes(), keep=key)
    # TensorRT-RTX: the compute capability it was built for; TensorRT: the GPU it was built on (unknown
    # with a hardware compatibility level: the library decides where it loads).
    sm = settings.target_sm if flavour.ahead_of_time else build_sm if settings.hardware_compatibility == "none" else None
    info = PlanInfo(
        file=flavour.plan_file(name), flavour=flavour.name, library=flavour.module_name, version=version,
        compute_capabilities=(compute_capability(sm),) if sm is not None else (),
        network_layers=int(network["layers"]), inputs=tuple(network["inputs"]), outputs=tuple(network["outputs"]),
        profiles={n: {"min": list(lo), "opt": list(mid), "max": list(hi)}
                  for n, lo, mid, hi in profile_rows(settings, segment_inputs(path))},
        key=key, size=len(plan), build_seconds=seconds, from_cache=hit is not None)
    log.info("segment '%s': %s %s plan for %s, %d network layers, %.1f MB%s", name, flavour.title, version,
             ", ".join(info.compute_capabilities) or "this GPU", info.network_layers, len(plan) / 1e6,
             " (plan cache hit)" if hit is not None else f", built in {seconds:.1f} s")
    settings_json = json.dumps({**deferred_settings(settings), "built_with": {flavour.dist: version}}, sort_keys=True)
    return EngineArtifact(flavour.name, name, {f"{name}.onnx": data, info.file: plan}, settings_json, plan=info)
