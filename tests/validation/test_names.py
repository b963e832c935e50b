"""A range or a tolerance for a tensor the pipeline does not have is a spec error (it used to be
ignored, and the level ran on the defaults the user meant to replace)."""
from __future__ import annotations

import re

import pytest
from conftest import YOLOV8N_T4, run_cli

RANGES = "ranges: {images: [0.0, 1.0]}"
OUTPUT0 = "      output0: {atol: 2.0e-2, rtol: 1.0e-2}"


@pytest.mark.parametrize("old, new, message", [
    (RANGES, "ranges: {image: [0.0, 1.0]}",
     r"validation\.data\.random\.ranges\.image: 'image' is not one of the tensors random data feeds \(did you mean "
     r"'images'\?\): images$"),
    (OUTPUT0, "      output_0: {atol: 2.0e-2, rtol: 1.0e-2}",
     r"validation\.tolerances\.outputs\.output_0: 'output_0' is not one of the tensors the levels "
     r"compare \(did you mean 'output0'\?\): .*Conv_output_0, output0, num_dets, boxes, scores, classes"),
    ("  gate: true", "  precision_tolerances:\n    outputs: {nms_boxes: {atol: 1.0}}\n  gate: true",
     r"validation\.precision_tolerances\.outputs\.nms_boxes: 'nms_boxes' is not one of the tensors the levels "
     r"compare \(did you mean 'boxes'\?\)"),
    (RANGES, "ranges: {images: [0.0, 1.0], /model.22/cv2.0/cv2.0.2/Conv_output_0: [-4.0, 4.0]}",
     r"ranges\./model\.22/cv2\.0/cv2\.0\.2/Conv_output_0: '.*' is not one of the tensors random data feeds: "
     r"images$"),
], ids=["range", "tolerance", "precision-tolerance", "kernel-input"])
def test_a_name_the_pipeline_does_not_have_is_exit_2_at_dry_run(write_spec, old, new, message):
    spec = write_spec({**YOLOV8N_T4, old: new})
    r = run_cli("build", str(spec), "--dry-run")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.count(str(spec)) == 1, r.stderr
    assert re.search(message, r.stderr, re.M), r.stderr


def test_dense_outputs_inside_the_pipeline_may_carry_a_tolerance(write_spec):
    """A segment's output (compared by the precision and engine levels) may, like output0 (the decode's)."""
    head = "/model.22/cv2.0/cv2.0.2/Conv_output_0"
    spec = write_spec({**YOLOV8N_T4, OUTPUT0: OUTPUT0 + f"\n      {head}: {{atol: 0.5}}"})
    r = run_cli("build", str(spec), "--dry-run")
    assert r.returncode == 0, r.stderr


def test_a_tolerance_for_a_detection_output_is_refused_naming_the_detections_tolerances(write_spec):
    """The nms's outputs are compared as one detection set at every level: atol/rtol would be ignored."""
    spec = write_spec({**YOLOV8N_T4, OUTPUT0: OUTPUT0 + "\n      boxes: {atol: 0.5}"})
    r = run_cli("build", str(spec), "--dry-run")
    assert r.returncode == 2, r.stderr
    assert ("validation.tolerances.outputs.boxes: 'boxes' is compared as part of a detection set (num_dets, boxes, "
            "scores, classes), where atol and rtol do not apply; allowed: validation.tolerances.detections") in r.stderr


def test_a_tolerance_for_a_pipeline_input_is_refused(write_spec):
    """images is what the pipeline is given, not what any level compares."""
    spec = write_spec({**YOLOV8N_T4, OUTPUT0: OUTPUT0 + "\n      images: {atol: 0.5}"})
    r = run_cli("build", str(spec), "--dry-run")
    assert r.returncode == 2, r.stderr
    assert "validation.tolerances.outputs.images: 'images' is not one of the tensors the levels compare" in r.stderr
