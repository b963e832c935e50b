"""What goes into a bundle: each kernel's files beside its contract copy, the engine's files, and the
manifest's record of the plan, engine and toolchain (bundle/contents.py), on the built T4 example."""
from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

import pytest
from conftest import REPO

from deepjit_compiler.bundle.contents import MODEL_FILE, SPEC_FILE, kernel_files
from deepjit_compiler.bundle.folder import read_bundle
from deepjit_compiler.engines import rtx_sms


def test_each_kernel_travels_with_its_contract_template_and_headers(t4_build):
    view = read_bundle(t4_build.bundle.path)
    for stage, kernels in t4_build.kernels.items():
        for k in kernels:
            paths = kernel_files(stage, k)
            assert paths == {"source": f"kernels/{stage}/{k.contract}.cu", "cubin": f"kernels/{stage}/{k.contract}.sm_75.cubin",
                             "ptx": f"kernels/{stage}/{k.contract}.compute_75.ptx",
                             "contract": f"kernels/{stage}/contract/{k.contract}.yaml"}
            assert view.file(paths["cubin"]).read_bytes() == k.cubin
            assert view.file(paths["source"]).read_text() == k.source.code
            template = k.source.filename + ".j2"
            assert {f"kernels/{stage}/contract/{n}" for n in (f"{k.contract}.yaml", template, "deepjit_common.cuh")} \
                <= set(view.files)


def test_the_manifest_records_plan_engine_and_toolchain(t4_build):
    view = read_bundle(t4_build.bundle.path)
    m = view.manifest
    assert view.file(SPEC_FILE).read_text() == t4_build.spec.text
    # the fp32 model is not deployed (bundle.reference_model: false): only its digest is recorded
    assert MODEL_FILE not in view.files and view.reference_model is None
    assert m["model"] == {"name": "yolov8n.onnx", "sha256": t4_build.model.sha256}
    assert m["toolchain"]["onnxruntime"] == metadata.version("onnxruntime") and m["toolchain"]["deepjit"] == "0.1.0"
    assert m["engine"]["segments"] == {"segment": ["engines/segment.onnx"]}
    assert m["engine"]["settings"]["timing_cache"] is None   # the build machine's path stays behind
    decode = next(s for s in m["plan"]["steps"] if s["name"] == "decode")
    assert decode["reference"] == "references/decode.onnx" and decode["facts"]["num_classes"] == 80
    assert decode["kernels"][0]["format"] == 1
    # the contract's digest: its YAML, then its template and headers by name (kernels/yolov8_decode.yaml)
    h = hashlib.sha256((REPO / "kernels" / "yolov8_decode.yaml").read_bytes())
    for name in ("yolov8_decode.cu.j2", "deepjit_common.cuh", "deepjit_nms.cuh"):
        h.update(name.encode() + b"\0" + (REPO / "templates" / name).read_bytes())
    assert decode["kernels"][0]["contract_sha256"] == h.hexdigest()
    assert m["spec"]["sha256"] == hashlib.sha256(t4_build.spec.text.encode()).hexdigest()
    nms = next(s for s in m["plan"]["steps"] if s["name"] == "nms")
    assert nms["position"] == "after" and nms["params"]["max_det"] == 300


@pytest.mark.skipif(rtx_sms() is not None, reason="TensorRT-RTX is installed here: the T4 build makes a plan")
def test_without_tensorrt_rtx_the_t4_plan_is_deferred(t4_build):
    m = read_bundle(t4_build.bundle.path).manifest
    assert m["engine"]["deferred"] and "plans" not in m["engine"] and "tensorrt_rtx" not in m["toolchain"]
    assert "TensorRT-RTX is not importable here" in m["engine"]["reason"]


def test_the_t4_bundle_carries_a_tensorrt_rtx_plan_for_7_5(t4_build):
    trt_rtx = pytest.importorskip("tensorrt_rtx", reason="needs TensorRT-RTX (pip install deepjit[tensorrt-rtx])")
    view = read_bundle(t4_build.bundle.path)
    m = view.manifest
    assert (m["engine"]["backend"], m["engine"]["deferred"]) == ("tensorrt-rtx", False)
    assert m["toolchain"]["tensorrt_rtx"] == trt_rtx.__version__
    (record,) = m["engine"]["plans"]["segment"]
    assert {k: record[k] for k in ("file", "flavour", "library", "version", "compute_capabilities")} == {
        "file": "engines/segment.rtx.plan", "flavour": "tensorrt-rtx", "library": "tensorrt_rtx",
        "version": trt_rtx.__version__, "compute_capabilities": ["7.5"]}
    segment = next(s for s in view.steps if s.kind == "segment")
    assert record["inputs"] == [{"name": "images", "dtype": "float32", "shape": [-1, 3, 640, 640]}]
    assert [t["name"] for t in record["outputs"]] == [t.name for t in segment.outputs]
    assert record["profiles"] == {"images": {"min": [1, 3, 640, 640], "opt": [4, 3, 640, 640], "max": [8, 3, 640, 640]}}
    # the layer count is what TensorRT-RTX's own parser makes of the bundle's segment (no Polygraphy here)
    logger = trt_rtx.Logger(trt_rtx.Logger.ERROR)
    network = trt_rtx.Builder(logger).create_network(1 << int(trt_rtx.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    assert trt_rtx.OnnxParser(network, logger).parse(view.file(segment.file).read_bytes())
    assert record["network_layers"] == network.num_layers > 100
    assert view.files["engines/segment.rtx.plan"]["size"] > 1_000_000
    level = m["validation"]["levels"]["engine"]
    assert level["status"] == "not_run" and "segment.rtx.plan: tensorrt-rtx" in level["reason"]
    assert "compute capability 7.5" in level["reason"]
    assert f"{record['network_layers']} network layers" in level["reason"]
    # timings go to the build report, never into the manifest
    text = json.dumps(m)
    assert "build_seconds" not in text and "seconds" not in text
    report = json.loads((Path(f"{t4_build.bundle.path}.report") / "build-report.json").read_text())
    (built,) = report["engine"]["plans"]
    assert built["segment"] == "segment" and built["network_layers"] == record["network_layers"]
    assert built["build_seconds"] > 0 or built["from_cache"]
