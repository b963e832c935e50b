"""The accuracy gate: Polygraphy's Comparator, tolerances per output, detections as sets."""
import numpy as np
import pytest
from onnx import TensorProto, helper
from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

from deepjit_compiler.spec.models import Tolerance, Tolerances
from deepjit_compiler.validation.detections import match_detections
from deepjit_compiler.validation.gate import FunctionRunner, GateReport, compare_runs, not_run


def _sigmoid_model() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 8])
    graph = helper.make_graph([helper.make_node("Sigmoid", ["x"], ["y"]), helper.make_node("Relu", ["x"], ["z"])],
                              "g", [x], [y, z])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _feeds(seed=0, n=3):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(4, 8)).astype(np.float32)} for _ in range(n)]


def _candidate(error: float, z_error: float = 0.0):
    def fn(feeds):
        x = feeds["x"]
        return {"y": 1 / (1 + np.exp(-x)) + error, "z": np.maximum(x, 0) + z_error}
    return fn


def _reference():
    return OnnxrtRunner(SessionFromOnnx(_sigmoid_model()), name="onnxruntime")


def test_gate_passes_within_tolerance(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPJIT_KEEP_RUN_RESULTS", "1")  # asked for: a passing comparison's RunResults too
    tol = Tolerances(default=Tolerance(atol=1e-5, rtol=1e-5))
    result = compare_runs("kernels", _reference(), FunctionRunner(_candidate(0.0), "deepjit"), _feeds(), tol,
                          report_dir=tmp_path)
    assert result.status == "passed", result
    assert {o.name for o in result.outputs} == {"y", "z"}
    assert all(o.passed and o.max_abs < 1e-5 for o in result.outputs), result.outputs
    assert (tmp_path / "kernels.runresults.json").stat().st_size > 0


def test_run_results_are_kept_for_failed_comparisons_only(tmp_path, monkeypatch):
    monkeypatch.delenv("DEEPJIT_KEEP_RUN_RESULTS", raising=False)
    tol = Tolerances(default=Tolerance(atol=1e-5, rtol=1e-5))
    for error, name in ((0.0, "good"), (3e-3, "bad")):
        compare_runs("kernels", _reference(), FunctionRunner(_candidate(error), "deepjit"), _feeds(1), tol,
                     report_dir=tmp_path, report_name=name)
    assert [p.name for p in tmp_path.iterdir()] == ["bad.runresults.json"]


def test_gate_fails_past_tolerance_and_names_output():
    tol = Tolerances(default=Tolerance(atol=1e-5, rtol=1e-5))
    result = compare_runs("kernels", _reference(), FunctionRunner(_candidate(3e-3), "deepjit"), _feeds(1), tol)
    assert result.status == "failed"
    failed = [o for o in result.outputs if not o.passed]
    assert [o.name for o in failed] == ["y"]
    assert failed[0].max_abs == pytest.approx(3e-3, rel=1e-3)
    report = GateReport().with_levels(result, not_run("engine", "no TensorRT"))
    assert not report.passed and "kernels: y: max abs 3.000e-03" in report.failures()[0]
    assert report.to_record()["levels"]["engine"]["status"] == "not_run"


def test_per_output_tolerance_loosens_only_that_output():
    tol = Tolerances(default=Tolerance(atol=1e-5, rtol=1e-5), outputs={"y": Tolerance(atol=1e-2, rtol=0)})
    result = compare_runs("kernels", _reference(), FunctionRunner(_candidate(3e-3), "deepjit"), _feeds(2), tol)
    assert result.status == "passed"
    # the same error on z is still held to the default tolerance
    both = compare_runs("kernels", _reference(), FunctionRunner(_candidate(3e-3, z_error=3e-3), "deepjit"),
                        _feeds(2), tol)
    assert both.status == "failed"
    assert [o.name for o in both.outputs if not o.passed] == ["z"]


def _dets(rng, n, max_det=10):
    boxes = np.zeros((1, max_det, 4), np.float32)
    xy = rng.uniform(0, 500, size=(n, 2))
    wh = rng.uniform(10, 100, size=(n, 2))
    boxes[0, :n] = np.concatenate([xy, xy + wh], axis=1)
    scores = np.zeros((1, max_det), np.float32)
    scores[0, :n] = np.sort(rng.uniform(0.3, 1, n))[::-1]
    classes = np.zeros((1, max_det), np.int32)
    classes[0, :n] = rng.integers(0, 80, n)
    return {"num_dets": np.array([n], np.int32), "boxes": boxes, "scores": scores, "classes": classes}


def test_detections_match_regardless_of_order():
    rng = np.random.default_rng(3)
    ref = _dets(rng, 6)
    perm = rng.permutation(6)
    test = {k: v.copy() for k, v in ref.items()}
    for k in ("boxes", "scores", "classes"):
        test[k][0, :6] = ref[k][0, perm]
    assert match_detections(ref, test).passed


def test_detections_fail_on_class_or_count_change():
    rng = np.random.default_rng(4)
    ref = _dets(rng, 5)
    wrong_class = {k: v.copy() for k, v in ref.items()}
    wrong_class["classes"][0, 2] = (ref["classes"][0, 2] + 1) % 80
    assert not match_detections(ref, wrong_class).passed
    fewer = {k: v.copy() for k, v in ref.items()}
    fewer["num_dets"][0] = 4
    m = match_detections(ref, fewer)
    assert not m.passed and m.matched == 4
    assert match_detections(ref, fewer, count_tolerance=1).passed
    assert not match_detections(ref, fewer, unmatched_fraction=0.1).passed  # 10 % of 5 rounds down to 0
    assert match_detections(ref, fewer, unmatched_fraction=0.2).passed
