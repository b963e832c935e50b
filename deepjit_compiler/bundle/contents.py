"""What goes into a bundle: the files and the manifest fields (bundle.py adds digests and writes)."""
from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

from .. import __version__
from ..engines import deferred_settings
from ..graph.serialize import model_bytes
from ..jit.contracts import load_contract
from ..jit.nvrtc import nvrtc_version

SPEC_FILE = "spec.yaml"
MODEL_FILE = "reference/model.onnx"


def kernel_files(stage: str, kernel) -> dict[str, str]:
    """Bundle paths of one compiled kernel's rendered source, cubin, PTX and contract (its YAML, with
    the template and headers beside it, so a user's own contract runs where it is not installed)."""
    stem = f"kernels/{stage}/{kernel.contract}"
    return {"source": f"{stem}.cu", "cubin": f"{stem}.{kernel.arch}.cubin", "ptx": f"{stem}.{kernel.ptx_arch}.ptx",
            "contract": f"kernels/{stage}/contract/{Path(kernel.contract_path).name}"}


def contract_files(stage: str, kernel) -> dict[str, bytes]:
    contract = load_contract(kernel.contract_path)
    folder = f"kernels/{stage}/contract"
    return {f"{folder}/{p.name}": p.read_bytes() for p in (contract.path, contract.template_path, *contract.header_paths)}


def engine_path(rel: str) -> str:
    return f"engines/{rel}"


def bundle_files(loaded, resolved, plan, kernels, artifacts) -> dict[str, bytes]:
    files: dict[str, bytes | Path] = {SPEC_FILE: loaded.text.encode()}
    if loaded.spec.bundle.reference_model:  # only re-validation elsewhere needs it
        files[MODEL_FILE] = resolved.data
        for loc in resolved.external:  # its weights, beside it as the model's file names them
            files[f"{Path(MODEL_FILE).parent.as_posix()}/{loc}"] = resolved.path.parent / loc
    for step in (*plan.sites, *plan.added):
        files[plan.relpath(step)] = model_bytes(step.onnx)
    for stage, ks in kernels.items():
        for k in ks:
            paths = kernel_files(stage, k)
            files[paths["source"]] = k.source.code.encode()
            files[paths["cubin"]] = k.cubin
            files[paths["ptx"]] = k.ptx.encode()
            files.update(contract_files(stage, k))
    for art in artifacts:
        for rel, data in art.files.items():
            files[engine_path(rel)] = data
    return files


def _jsonable(value: Any) -> Any:
    """Facts and params as plain JSON (tuples become lists, anything else its string)."""
    return json.loads(json.dumps(value, default=str))


def toolchain(artifacts=()) -> dict[str, str]:
    """The versions that made the bundle; with a plan, the library (and version) it needs at run time."""
    versions = {"deepjit": __version__, "nvrtc": ".".join(map(str, nvrtc_version()))}
    for dist in ("onnx", "onnxruntime", "polygraphy", "onnx-graphsurgeon", "cuda-bindings"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    for art in artifacts:
        if art.plan is not None:
            versions[art.plan.library] = art.plan.version
    return versions


def engine_record(decision, settings, artifacts) -> dict[str, Any]:
    """The manifest's `engine`: the decision and why, the settings a deferred (or another) plan is built
    with, each segment's ONNX and its plans (engines.PlanInfo records, paths inside the bundle)."""
    plans = {a.segment_name: [{**a.plan.to_record(), "file": engine_path(a.plan.file)}] for a in artifacts
             if a.plan is not None}
    segments = {a.segment_name: sorted(engine_path(r) for r in a.files if a.plan is None or r != a.plan.file)
                for a in artifacts}
    return {"backend": decision.backend, "deferred": decision.deferred, "reason": decision.reason,
            "precision": settings.precision, "settings": deferred_settings(settings), "segments": segments,
            **({"plans": plans} if plans else {})}


def bundle_manifest(loaded, resolved, plan, kernels, settings, decision, artifacts, report) -> dict[str, Any]:
    spec = loaded.spec
    steps = []
    for step in plan.steps:
        entry = {"name": step.name, "kind": step.kind, "inputs": [t.to_dict() for t in step.inputs],
                 "outputs": [t.to_dict() for t in step.outputs]}
        if step.kind == "segment":
            entry["file"] = engine_path(f"{step.name}.onnx")
        else:
            entry["reference"] = plan.relpath(step)
            entry["kernels"] = [{**k.to_dict(), "contract_sha256": k.source.contract_digest,
                                 "files": kernel_files(step.name, k)} for k in kernels[step.name]]
            entry["facts" if step.kind == "kernel" else "params"] = _jsonable(
                dict(step.facts) if step.kind == "kernel" else dict(step.params))
            if step.kind == "added":
                entry["position"] = step.position
        steps.append(entry)
    return _jsonable({
        "name": spec.name,
        "spec": {"file": SPEC_FILE, "sha256": loaded.sha256, "text": loaded.text},
        # whether this build synthesized the model is not recorded: the same model gives the same bundle
        "model": {"sha256": resolved.sha256, "name": resolved.path.name,
                  **({"file": MODEL_FILE} if spec.bundle.reference_model else {})},
        "toolchain": toolchain(artifacts),
        "target": {"gpu": spec.target.gpu, "sm": spec.target.resolved_sm},
        "inputs": {name: {"dtype": i.dtype, "shape": i.shape, "min": i.min_shape, "opt": i.opt_shape,
                          "max": i.max_shape, "buckets": i.batch_buckets} for name, i in spec.inputs.items()},
        "plan": {"inputs": [t.to_dict() for t in plan.inputs], "outputs": [t.to_dict() for t in plan.outputs],
                 "steps": steps},
        "engine": engine_record(decision, settings, artifacts),
        "validation": report.to_record(),
    })
