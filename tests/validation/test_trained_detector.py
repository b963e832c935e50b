"""The accuracy gate on a real trained detector (nudenet's YOLOv8n, 18 classes, trained at 320) and real
photos (scikit-image's samples, letterboxed on the host): every level sees the photos, fp16 passes the
default gate, an int8 calibrated on the same photos fails it naming its mAP (with the stem kept in fp32
it passes the detection bars, not output0's), and a spec that does not fit the model is refused before
any work (tests/trained.py fetches the model)."""
from __future__ import annotations

import os
import re

import pytest
from conftest import run_cli, table_text

from deepjit_compiler.bundle.folder import read_bundle
from deepjit_compiler.spec.models import LOSSY_TOLERANCES

SPEC = """name: nudenet_320n
model: {{path: {model}}}
target: {{gpu: {gpu}}}
inputs:
  images:
    shape: [batch, 3, height, width]
    profile: {{min: [1, 3, 320, 320], opt: [2, 3, 320, 320], max: [4, 3, 320, 320]}}
    buckets: [1, 2, 4]
engine: {engine}
cuts:
  - name: decode
    preset: yolov8_decode
    kernels: [{{contract: yolov8_decode, params: {{mode: candidates, conf_threshold: {decode_conf}{decode}}}}}]
  - name: nms
    add: after
    at: output0
    kernels: [{{contract: nms, params: {{conf_threshold: 0.25, iou_threshold: 0.45, max_det: 100}}}}]
validation:
  data: {{folder: {photos}}}
bundle: {{path: out/nudenet}}
"""
WIDE = {**os.environ, "COLUMNS": "400"}  # rich wraps the validation table at the terminal's width


def nudenet_spec(tmp_path, model, photos, *, engine="{precision: fp16}", gpu="T4", decode_conf=0.25, decode=""):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC.format(model=model, photos=photos, engine=engine, gpu=gpu, decode_conf=decode_conf,
                                decode=decode))
    return path


@pytest.mark.slow  # a full build
def test_fp16_passes_the_default_gate_on_the_photos(tmp_path, nudenet_320n, sample_photos):
    r = run_cli("build", str(nudenet_spec(tmp_path, nudenet_320n, sample_photos)), "--no-publish", env=WIDE)
    assert r.returncode == 0, r.stderr
    levels = read_bundle(tmp_path / "out/nudenet").levels
    # The graph level ran on the 17 photos, batched by the buckets 1, 2, 4 (1+2+4+1+2+4+1+2), not on
    # random inputs where this model detects nothing
    assert levels["graph"]["status"] == "passed" and "8 batches (17 rows)" in levels["graph"]["reason"]
    precision = levels["precision"]
    assert precision["status"] == "passed"
    dets = precision["outputs"]["detections"]
    assert dets["metrics"]["images"] == 17 and dets["metrics"]["reference"] >= 4  # it judged real detections
    assert dets["metrics"]["map50_95"] >= 0.99 and dets["metrics"]["recall"] == dets["metrics"]["precision"] == 1.0
    # the tolerances in force are recorded with each output, and printed
    assert dets["tolerance"] == {**LOSSY_TOLERANCES.detections.model_dump(), "threshold": 0.25}
    assert precision["outputs"]["output0"]["tolerance"] == {"atol": 0.05, "rtol": 0.05, "check_error_stat": "mean"}
    printed = table_text(r.stdout)
    assert "gate: abs <= 0.05 or rel <= 0.05, on the mean" in printed
    assert "min_map 0.9, min_map50 0.95, min_precision 0.9" in printed and "score_atol 0.1, threshold 0.25" in printed
    assert "in total over 17 images" in printed


@pytest.mark.slow  # a full build, with calibration
def test_int8_calibrated_on_the_photos_fails_the_gate_naming_its_map(tmp_path, nudenet_320n, sample_photos):
    engine = "{precision: int8, calibration: {data: %s, cache: calib}}" % sample_photos
    r = run_cli("build", str(nudenet_spec(tmp_path, nudenet_320n, sample_photos, engine=engine)), "--no-publish")
    assert r.returncode == 1, r.stderr
    got = re.search(r"precision: detections: failed on mAP50-95 (\d\.\d+) < min_map 0\.9", r.stderr)
    assert got and float(got.group(1)) < 0.9, r.stderr
    assert re.search(r"worst image \w+\.png: ", r.stderr)
    levels = read_bundle(tmp_path / "out/rejected/nudenet").levels
    assert levels["graph"]["status"] == "passed" and levels["precision"]["status"] == "failed"
    # calibrated on the images themselves (at most `samples`, 16 by default), and it says so
    assert f"int8 segments (calibrated on 16 of 17 images in {sample_photos.name})" in levels["precision"]["reason"]
    assert not (tmp_path / "out/nudenet").exists()


@pytest.mark.slow  # a full build, with calibration
def test_int8_with_the_stem_in_fp32_passes_the_detection_bars_but_not_output0(tmp_path, nudenet_320n, sample_photos):
    """Min-max int8 with the first two convs (the stem) kept in fp32 passes the default detection bars
    on the photos (mAP50-95 0.956, recall and precision 1.0; plain min-max 0.826 and 0.8, the test
    above); the precision level still fails, on output0's mean error alone (0.57 > 0.05). Measured in
    docs/design.md, "Accuracy gate defaults": 5 reference detections, so one detection decides."""
    engine = ("{precision: int8, keep_fp32: ['/model.0/*', '/model.1/*'], calibration: {data: %s, cache: calib}}"
              % sample_photos)
    r = run_cli("build", str(nudenet_spec(tmp_path, nudenet_320n, sample_photos, engine=engine)), "--no-publish")
    assert r.returncode == 1, r.stderr
    assert "precision: output0: " in r.stderr and "precision: detections: " not in r.stderr, r.stderr
    precision = read_bundle(tmp_path / "out/rejected/nudenet").levels["precision"]
    assert precision["status"] == "failed"
    dets, bars = precision["outputs"]["detections"], LOSSY_TOLERANCES.detections
    assert dets["passed"], dets["detail"]
    m = dets["metrics"]
    assert m["images"] == 17 and m["reference"] >= 4 and m["missed"] == m["extra"] == 0, m
    assert m["map50_95"] >= bars.min_map and m["map50"] >= bars.min_map50, m
    assert m["recall"] >= bars.min_recall and m["precision"] >= bars.min_precision, m
    output0 = precision["outputs"]["output0"]
    assert not output0["passed"] and output0["mean_abs"] > LOSSY_TOLERANCES.default.atol

def test_a_decode_for_another_class_count_is_refused_before_any_work(tmp_path, nudenet_320n, sample_photos):
    spec = nudenet_spec(tmp_path, nudenet_320n, sample_photos, decode=", num_classes: 80")
    r = run_cli("build", str(spec), "--dry-run")
    assert r.returncode == 2, r.stderr
    assert f"{spec}: cut 'decode' kernels[0] (yolov8_decode)" in r.stderr
    assert "param 'num_classes' is given as 80, but the kernel site has 18" in r.stderr
