"""`deepjit materialize BUNDLE`: build a bundle's deferred TensorRT plans on the target GPU, check
them against ONNX Runtime on the same segments (the `engine` level), and record them with digests."""
from __future__ import annotations

import logging
from pathlib import Path

from .bundle.folder import BundleInfo, read_bundle, update_bundle
from .engines import materialize
from .errors import BundleError
from .validation.engine import plans_level
from .validation.gate import GateReport

log = logging.getLogger("deepjit.materialize")


def materialize_bundle(bundle_path: Path, *, timing_cache: Path | None = None) -> tuple[BundleInfo, GateReport]:
    view = read_bundle(bundle_path)
    engine = view.engine
    if not engine.deferred:
        raise BundleError(f"{bundle_path}: its engines are not deferred ({engine.backend}): nothing to materialize")
    segments = {name: view.file(next(f for f in files if f.endswith(".onnx"))) for name, files in engine.segments.items()}
    plans = materialize(segments, engine.settings, timing_cache=timing_cache)
    report = GateReport.from_record(view.levels).with_levels(plans_level(view, view.spec(), plans))
    files = {f"engines/{rel}": data for rel, data in plans.items()}
    record = {**view.manifest["engine"], "deferred": False,
              "plans": {name: [f"engines/{name}.plan"] for name in engine.segments}}
    info = update_bundle(Path(bundle_path), files, {"engine": record, "validation": report.to_record()})
    return info, report
