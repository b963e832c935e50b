"""`deepjit materialize BUNDLE`: build a bundle's deferred TensorRT plans on the target GPU, check
them against ONNX Runtime on the same segments (the `engine` level), and record them with digests."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

from .bundle.folder import read_bundle, update_bundle
from .engines import EngineArtifact, materialize, runner_for
from .errors import BundleError
from .validation.gate import GateReport, LevelResult, compare_runs, from_outputs

log = logging.getLogger("deepjit.materialize")


def materialize_bundle(bundle_path: Path, *, timing_cache: Path | None = None):
    bundle = read_bundle(bundle_path)
    engine = bundle.manifest["engine"]
    if not engine.get("deferred"):
        raise BundleError(f"{bundle_path}: its engines are not deferred ({engine['backend']}): nothing to materialize")
    segments = {name: bundle.file(next(f for f in files if f.endswith(".onnx")))
                for name, files in engine["segments"].items()}
    plans = materialize(segments, json.dumps(engine["settings"]), timing_cache=timing_cache)
    level = engine_level(bundle, segments, plans)
    record = bundle.manifest["validation"]
    report = GateReport({n: LevelResult(n, lv["status"], lv.get("reason", "")) for n, lv in record["levels"].items()})
    files = {f"engines/{rel}": data for rel, data in plans.items()}
    updated = {**engine, "deferred": False, "plans": sorted(files)}
    validation = {"levels": {**record["levels"], "engine": level.to_dict()}}
    info = update_bundle(Path(bundle_path), files, {"engine": updated, "validation": validation})
    report = report.with_levels(level)
    return info, report


def engine_level(bundle, segments: dict[str, Path], plans: dict[str, bytes]) -> LevelResult:
    """Each TensorRT plan against ONNX Runtime on its segment, on the spec's validation data."""
    from .graph.tensors import TensorSig
    from .validation.data import feeds_for
    from .validation.gpu import spec_of

    spec = spec_of(bundle)
    outputs = []
    for step in bundle.manifest["plan"]["steps"]:
        if step["kind"] != "segment":
            continue
        name = step["name"]
        plan = SimpleNamespace(inputs=tuple(TensorSig.from_dict(t) for t in step["inputs"]))
        feeds = feeds_for(spec, plan)
        trt = runner_for(EngineArtifact("tensorrt", name, {f"{name}.plan": plans[f"{name}.plan"]}), name="tensorrt")
        ort = runner_for(EngineArtifact("onnxruntime", name, {f"{name}.onnx": segments[name].read_bytes()}),
                         name="onnxruntime")
        result = compare_runs("engine", ort, trt, feeds, spec.validation.tolerances)
        outputs += list(result.outputs)
    return from_outputs("engine", outputs, "TensorRT plans against ONNX Runtime on the same segments")

