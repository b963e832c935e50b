"""`deepjit materialize BUNDLE`: build TensorRT (10/11) plans of a bundle's segments on the target GPU,
check them against ONNX Runtime on the same segments (the `engine` level), and record them with
digests. For a deferred bundle these are its first plans; a bundle that carries TensorRT-RTX plans
gets TensorRT plans beside them (the runtime prefers TensorRT where it imports)."""
from __future__ import annotations

import logging
from pathlib import Path

from .bundle.contents import engine_path
from .bundle.folder import BundleInfo, read_bundle, update_bundle
from .bundle.view import BundleView
from .engines import TENSORRT, materialize
from .errors import BundleError, OutputError
from .validation.engine import plans_level
from .validation.gate import GateReport

log = logging.getLogger("deepjit.materialize")


def _settings(view: BundleView) -> dict:
    """The bundle's engine settings without a timing-cache path: TensorRT writes its cache there, and a
    pulled bundle never picks a file on this machine to write (the user's `--timing-cache` only).
    DeepJIT's own bundles carry none (engines.deferred_settings); one that does was made by hand."""
    settings = dict(view.engine.settings)
    if settings.get("timing_cache"):
        log.warning("%s: ignoring its engine.settings.timing_cache %r: a bundle does not choose where files "
                    "are written (pass --timing-cache to use one)", view.source, settings["timing_cache"])
    return {**settings, "timing_cache": None}


def _check_timing_cache(path: Path | None) -> None:
    """TensorRT reads the timing cache and it is replaced whole after the build: a path there that is no
    file (a folder, a FIFO the read would wait on) is refused before minutes of building."""
    if path is not None and (path.exists() or path.is_symlink()) and not path.is_file():
        raise OutputError(f"--timing-cache {path}: is not a file; give TensorRT's timing cache file (it is "
                          "created if missing)")


def materialize_bundle(bundle_path: Path, *, timing_cache: Path | None = None,
                       data: Path | None = None) -> tuple[BundleInfo, GateReport]:
    _check_timing_cache(timing_cache)
    view = read_bundle(bundle_path)
    spec = view.spec(data)  # its validation data is refused or named before minutes of plan building
    engine = view.engine
    has_trt = {name for name, plans in engine.plans.items() if any(p.flavour == TENSORRT.name for p in plans)}
    todo = {name: files for name, files in engine.segments.items() if name not in has_trt}
    if not (engine.deferred or engine.plans):
        raise BundleError(f"{bundle_path}: nothing to materialize: its segments run on {engine.backend} "
                          f"(engine.backend {engine.backend})")
    if not todo:
        raise BundleError(f"{bundle_path}: nothing to materialize: every segment already has a TensorRT plan")
    segments = {}
    for name, files in todo.items():
        onnx_files = [f for f in files if f.endswith(".onnx")]
        if not onnx_files:
            raise BundleError(f"{bundle_path}: segment '{name}' carries no ONNX to build a plan from")
        segments[name] = view.file(onnx_files[0])
    artifacts = materialize(segments, _settings(view), timing_cache=timing_cache)
    report = GateReport.from_record(view.levels).with_levels(plans_level(view, spec, artifacts))
    files = {engine_path(a.plan.file): a.files[a.plan.file] for a in artifacts.values()}
    plans = {name: [*(view.manifest["engine"].get("plans") or {}).get(name, ()),
                    {**a.plan.to_record(), "file": engine_path(a.plan.file)}] for name, a in artifacts.items()}
    record = {**view.manifest["engine"], "deferred": False,
              "plans": {**(view.manifest["engine"].get("plans") or {}), **plans}}
    versions = {a.plan.library: a.plan.version for a in artifacts.values()}
    info = update_bundle(Path(bundle_path), files, {"engine": record, "validation": report.to_record(),
                                                    "toolchain": {**(view.manifest.get("toolchain") or {}), **versions}})
    return info, report
