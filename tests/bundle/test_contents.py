"""What goes into a bundle: each kernel's files beside its contract copy, the engine's files, and the
manifest's record of the plan, engine and toolchain (bundle/contents.py), on the built T4 example."""
from __future__ import annotations

from importlib import metadata

from deepjit_compiler.bundle.contents import MODEL_FILE, SPEC_FILE, kernel_files
from deepjit_compiler.bundle.folder import read_bundle


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
    assert m["engine"]["deferred"] and m["engine"]["segments"] == {"segment": ["engines/segment.onnx"]}
    assert m["engine"]["settings"]["timing_cache"] is None   # the build machine's path stays behind
    decode = next(s for s in m["plan"]["steps"] if s["name"] == "decode")
    assert decode["reference"] == "references/decode.onnx" and decode["facts"]["num_classes"] == 80
    assert decode["kernels"][0]["format"] == 1 and decode["kernels"][0]["contract_sha256"]
    nms = next(s for s in m["plan"]["steps"] if s["name"] == "nms")
    assert nms["position"] == "after" and nms["params"]["max_det"] == 300
