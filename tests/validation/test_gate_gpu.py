"""The accuracy gate on a GPU: a correct build passes the kernels and end_to_end levels; the same
build with a kernel made wrong by more than the tolerance exits 1 and is written only under rejected/."""
import json
import shutil

import pytest
from conftest import REPO, run_cli
from test_build import N

from deepjit_compiler.bundle.folder import read_bundle

pytestmark = pytest.mark.gpu


def _levels(path):
    return read_bundle(path).manifest["validation"]["levels"]


def test_correct_kernels_pass_every_gpu_level(write_spec, tmp_path):
    r = run_cli("build", str(write_spec(N)), "--no-publish", "--json")
    assert r.returncode == 0, r.stderr
    levels = _levels(tmp_path / "out/yolov8n_t4")
    assert {k: v["status"] for k, v in levels.items()} == {
        "graph": "passed", "precision": "passed", "kernels": "passed", "end_to_end": "passed", "engine": "not_run"}
    assert set(levels["kernels"]["outputs"]) == {"decode/output0", "nms/detections"}
    report = tmp_path / "out/yolov8n_t4.report"
    assert (report / "kernels.decode.yolov8_decode.runresults.json").exists()
    assert (report / "end_to_end.runresults.json").exists()


def test_wrong_kernel_fails_the_gate(write_spec, tmp_path):
    mine = tmp_path / "my_kernels"
    mine.mkdir()
    shutil.copy(REPO / "kernels/yolov8_decode.yaml", mine)
    shutil.copy(REPO / "templates/deepjit_common.cuh", mine)
    template = (REPO / "templates/yolov8_decode.cu.j2").read_text()
    wrong = "L.stride = 1.05f * {{ strides[i] | f32 }};"  # every box 5 % off: far past rtol 1e-2
    assert "L.stride = {{ strides[i] | f32 }};" in template
    (mine / "yolov8_decode.cu.j2").write_text(template.replace("L.stride = {{ strides[i] | f32 }};", wrong))
    spec = write_spec({**N, "      - contract: yolov8_decode": "      - contract: my_kernels/yolov8_decode.yaml"})
    r = run_cli("build", str(spec), "--no-publish")
    assert r.returncode == 1, r.stderr
    assert "accuracy gate failed" in r.stderr and "kernels: decode/output0" in r.stderr
    assert not (tmp_path / "out/yolov8n_t4").exists()
    levels = _levels(tmp_path / "out/rejected/yolov8n_t4")
    assert levels["kernels"]["status"] == "failed" and levels["graph"]["status"] == "passed"
    assert levels["kernels"]["outputs"]["decode/output0"]["max_rel"] > 0.04
    assert json.loads((tmp_path / "out/rejected/yolov8n_t4.report/build-report.json").read_text())["gate_failed"]
