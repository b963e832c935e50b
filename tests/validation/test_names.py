"""A range or a tolerance for a tensor the pipeline does not have is a spec error (it used to be
ignored, and the level ran on the defaults the user meant to replace)."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from conftest import YOLOV8N_T4, run_cli

from deepjit_compiler.errors import SpecError
from deepjit_compiler.validation.names import check_names

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
    spec = write_spec({**YOLOV8N_T4, old: new}, model=True)
    r = run_cli("build", str(spec), "--dry-run")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.count(str(spec)) == 1, r.stderr
    assert re.search(message, r.stderr, re.M), r.stderr


def test_dense_outputs_inside_the_pipeline_may_carry_a_tolerance(write_spec):
    """A segment's output (compared by the precision and engine levels) may, like output0 (the decode's)."""
    head = "/model.22/cv2.0/cv2.0.2/Conv_output_0"
    spec = write_spec({**YOLOV8N_T4, OUTPUT0: OUTPUT0 + f"\n      {head}: {{atol: 0.5}}"}, model=True)
    r = run_cli("build", str(spec), "--dry-run")
    assert r.returncode == 0, r.stderr


def test_a_tolerance_for_a_detection_output_is_refused_naming_the_detections_tolerances(write_spec):
    """The nms's outputs are compared as one detection set at every level: atol/rtol would be ignored."""
    spec = write_spec({**YOLOV8N_T4, OUTPUT0: OUTPUT0 + "\n      boxes: {atol: 0.5}"}, model=True)
    r = run_cli("build", str(spec), "--dry-run")
    assert r.returncode == 2, r.stderr
    assert ("validation.tolerances.outputs.boxes: 'boxes' is compared as part of a detection set (num_dets, boxes, "
            "scores, classes), where atol and rtol do not apply; allowed: validation.tolerances.detections") in r.stderr


def test_a_tolerance_for_a_pipeline_input_is_refused(write_spec):
    """images is what the pipeline is given, not what any level compares."""
    spec = write_spec({**YOLOV8N_T4, OUTPUT0: OUTPUT0 + "\n      images: {atol: 0.5}"}, model=True)
    r = run_cli("build", str(spec), "--dry-run")
    assert r.returncode == 2, r.stderr
    assert "validation.tolerances.outputs.images: 'images' is not one of the tensors the levels compare" in r.stderr


def _tensors(*names: str) -> tuple[SimpleNamespace, ...]:
    return tuple(SimpleNamespace(name=n) for n in names)


@pytest.mark.parametrize("ranged, refused", [("images", False), ("head", False), ("feat", True)])
def test_random_data_feeds_every_engine_segments_inputs(ranged, refused):
    """images -> segment_0 -> feat -> kernel -> head -> segment_1 -> y: random data feeds images and, for the
    engine level and calibration, each segment's own input (head), never a kernel's alone (feat)."""
    segments = (SimpleNamespace(inputs=_tensors("images"), outputs=_tensors("feat")),
                SimpleNamespace(inputs=_tensors("head"), outputs=_tensors("y")))
    plan = SimpleNamespace(inputs=_tensors("images"), segments=segments, outputs=_tensors("y"),
                           steps=(segments[0], SimpleNamespace(outputs=_tensors("head")), segments[1]))
    no_outputs = SimpleNamespace(outputs={})
    validation = SimpleNamespace(data=SimpleNamespace(random=SimpleNamespace(ranges={ranged: (0.0, 1.0)})),
                                 tolerances=no_outputs, precision_tolerances=no_outputs)
    loaded = SimpleNamespace(spec=SimpleNamespace(validation=validation), path="spec.yaml")
    if not refused:
        check_names(loaded, plan, ())
        return
    with pytest.raises(SpecError, match=r"^spec.yaml: validation.data.random.ranges.feat: 'feat' is not one of the "
                                        r"tensors random data feeds.*: images, head$"):
        check_names(loaded, plan, ())
