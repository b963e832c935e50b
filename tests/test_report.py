"""What the CLI prints (report.py): `deepjit inspect BUNDLE` on the built T4 example."""
from __future__ import annotations

import json

from conftest import run_cli

from deepjit_compiler.bundle.folder import read_bundle
from deepjit_compiler.report import describe, print_build


def test_describe_reads_the_steps_their_kernels_and_the_validation_figures(t4_build):
    view = read_bundle(t4_build.bundle.path)
    d = describe(t4_build.bundle.path)
    assert d["name"] == "yolov8s_t4" and d["digest"] == view.digest and d["target"] == {"gpu": "T4", "sm": 75}
    assert d["toolchain"]["deepjit"] == "0.1.0" and d["toolchain"]["nvrtc"] == "13.0"
    assert [(s["name"], s["kind"]) for s in d["steps"]] == [("segment", "segment"), ("decode", "kernel"),
                                                           ("nms", "added")]
    segment, decode, nms = d["steps"]
    assert segment["engine"] == {"backend": "tensorrt", "precision": "fp16", "deferred": True,
                                 "files": ["engines/segment.onnx"], "plans": []}
    assert [k["contract"] for k in decode["kernels"]] == ["yolov8_decode"] and nms["position"] == "after"
    k = decode["kernels"][0]
    assert (k["arch"], k["ptx_arch"]) == ("sm_75", "compute_75") and k["params"]["num_classes"] == 80
    assert k["cubin_size"] == view.files[k["files"]["cubin"]]["size"] > 0
    assert list(d["validation"]) == ["graph", "precision", "kernels", "end_to_end", "engine"]
    assert d["validation"]["precision"]["outputs"]["output0"]["max_abs"] > 0
    assert {f["path"]: f["size"] for f in d["files"]} == {rel: e["size"] for rel, e in view.files.items()}
    assert json.loads(json.dumps(d)) == d


def test_inspect_bundle_prints_tables_and_json(t4_build):
    r = run_cli("inspect", str(t4_build.bundle.path))
    assert r.returncode == 0, r.stderr
    text = r.stdout
    for title in ("steps, in run order", "kernels", "validation", "files ("):
        assert title in text
    assert "sm_75 cubin (" in text and "compute_75 PTX (" in text and "tensorrt fp16: plan deferred" in text
    assert "num_classes=80" in text and "output0: max abs" in text and "engines/segment.onnx" in text
    assert "{'" not in text  # no Python dicts
    r = run_cli("inspect", str(t4_build.bundle.path), "--json")
    assert json.loads(r.stdout) == describe(t4_build.bundle.path)


def test_the_build_table_shows_tensors_the_engine_and_each_outputs_gate(t4_build, capsys):
    print_build(t4_build)
    out = capsys.readouterr().out
    lines = out.splitlines()
    # tensor names whole (a pipe is not cut at 80 columns), with dtype and shape
    assert any("/model.22/cv2.0/cv2.0.2/Conv_output_0 float32 ['batch', 64, 80, 80]" in line for line in lines)
    assert "tensorrt fp16, plan deferred" in out and "(ONNX Runtime here)" in out
    precision = next(line for line in lines if "output0: max abs" in line)
    assert "gate: abs <= 0.05 or rel <= 0.05, on the median" in precision  # the spec's precision_tolerances
    assert "gate: same class, IoU >= 0.9" in out
