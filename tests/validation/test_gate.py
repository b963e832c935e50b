"""The accuracy gate: Polygraphy's Comparator, tolerances per output, detections as sets."""
import logging

import numpy as np
import pytest
from onnx import TensorProto, helper
from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

from deepjit_compiler.errors import OutputError
from deepjit_compiler.graph.ort import ort_session
from deepjit_compiler.jit.contract_models import Detections
from deepjit_compiler.jit.contracts import DetectionOutputs
from deepjit_compiler.model.synth import synthesize_yolov8
from deepjit_compiler.spec.models import LEVELS, DetectionTolerance, Tolerance, Tolerances
from deepjit_compiler.surgery.references import nms_reference
from deepjit_compiler.validation.gate import (
    FunctionRunner,
    GateReport,
    LevelResult,
    check_report_folder,
    compare_runs,
    not_run,
    report_file,
)
from deepjit_compiler.validation.kernels import _report_name


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
    assert (failed[0].max_abs, failed[0].median_abs, failed[0].mean_abs) == pytest.approx((3e-3,) * 3, rel=1e-3)
    report = GateReport().with_levels(result, not_run("engine", "no TensorRT"))
    (failure,) = report.failures()  # z passed: only y is a failure
    assert not report.passed and failure.startswith("kernels: y: max abs 3.000e-03")
    assert failure.endswith("; allowed: atol 1e-05 or rtol 1e-05 on the elemwise error")
    record = report.to_record()["levels"]
    assert list(record) == list(LEVELS) and record["engine"]["status"] == "not_run"
    assert [record[lv]["reason"] for lv in ("graph", "precision", "end_to_end")] == ["not attempted"] * 3
    # a level that failed without outputs is a failure by its reason
    graph = LevelResult("graph", "failed", "the reassembled graph does not load")
    assert report.with_levels(graph).failures()[1:] == ["graph: the reassembled graph does not load"]


def test_every_feed_is_judged():
    """The candidate is off on the second of three feeds only: the level fails on it, by its error."""
    calls = []

    def fn(feeds):
        calls.append(1)
        return _candidate(3e-3 if len(calls) == 2 else 0.0)(feeds)
    tol = Tolerances(default=Tolerance(atol=1e-5, rtol=1e-5))
    result = compare_runs("kernels", _reference(), FunctionRunner(fn, "deepjit"), _feeds(5), tol)
    assert len(calls) == 3 and result.status == "failed"
    (y,) = [o for o in result.outputs if not o.passed]
    assert y.name == "y" and y.max_abs == pytest.approx(3e-3, rel=1e-3)


def test_the_default_rtol_and_a_per_output_error_stat_are_applied():
    feeds = _feeds(7)
    y = 1 / (1 + np.exp(-np.concatenate([f["x"] for f in feeds]).astype(np.float64)))
    assert 3e-3 / y.min() < 0.05  # so an error of 3e-3 is within rtol 0.1 of every y
    rel_only = Tolerances(default=Tolerance(atol=0, rtol=0.1))
    assert compare_runs("kernels", _reference(), FunctionRunner(_candidate(3e-3), "deepjit"), feeds,
                        rel_only).status == "passed"

    def one_off(f):  # one element of y off by 1: its median error is 0, its largest 1
        out = _candidate(0.0)(f)
        out["y"][0, 0] += 1
        return out
    median = Tolerances(default=Tolerance(atol=1e-5, rtol=1e-5), outputs={"y": Tolerance(check_error_stat="median")})
    assert compare_runs("kernels", _reference(), FunctionRunner(one_off, "deepjit"), feeds, median).status == "passed"
    assert compare_runs("kernels", _reference(), FunctionRunner(one_off, "deepjit"), feeds,
                        Tolerances(default=median.default)).status == "failed"


def test_feeds_of_different_batches_are_compared():
    """A folder of images runs in batches of the buckets: the candidate's input metadata has a dynamic batch."""
    rng = np.random.default_rng(8)
    feeds = [{"x": rng.normal(size=(n, 8)).astype(np.float32)} for n in (1, 2, 4)]
    result = compare_runs("kernels", _reference(), FunctionRunner(_candidate(0.0), "deepjit"), feeds,
                          Tolerances(default=Tolerance(atol=1e-5, rtol=1e-5)))
    assert result.status == "passed", result


def test_an_output_missing_from_the_candidate_fails_the_level():
    tol = Tolerances(default=Tolerance(atol=1e-5, rtol=1e-5))
    only_y = FunctionRunner(lambda f: {"y": _candidate(0.0)(f)["y"]}, "deepjit")
    result = compare_runs("kernels", _reference(), only_y, _feeds(), tol)
    assert result.status == "failed"
    assert [(o.name, o.passed, o.detail) for o in result.outputs if not o.passed] == [
        ("z", False, "missing from the candidate's outputs")]
    # a detection output missing: the set is not scored, the output is named
    ref = _dets(np.random.default_rng(9), 4)
    no_scores = {k: v for k, v in ref.items() if k != "scores"}
    level = _compare_sets([ref], [no_scores])
    assert level.status == "failed"
    assert [o.name for o in level.outputs if not o.passed] == ["scores"]


def test_per_output_tolerance_loosens_only_that_output():
    tol = Tolerances(default=Tolerance(atol=1e-5, rtol=1e-5), outputs={"y": Tolerance(atol=1e-2, rtol=0)})
    result = compare_runs("kernels", _reference(), FunctionRunner(_candidate(3e-3), "deepjit"), _feeds(2), tol)
    assert result.status == "passed"
    # each output records the tolerance it was judged by: its own, or the level's default
    assert {o.name: o.tolerance for o in result.outputs} == {
        "y": {"atol": 1e-2, "rtol": 0.0, "check_error_stat": "elemwise"},
        "z": {"atol": 1e-5, "rtol": 1e-5, "check_error_stat": "elemwise"}}
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


NMS_OUTPUTS = DetectionOutputs(Detections(), threshold=0.25)


def _compare_sets(ref_batches, test_batches, tolerances=Tolerances()):
    """compare_runs on detection sets: the reference replays `ref_batches`, the candidate `test_batches`."""
    feeds = [{"k": np.full((len(b["num_dets"]),), k, np.int32)} for k, b in enumerate(ref_batches)]
    ref = FunctionRunner(lambda f: ref_batches[int(f["k"][0])], "reference")
    test = FunctionRunner(lambda f: test_batches[int(f["k"][0])], "deepjit")
    return compare_runs("end_to_end", ref, test, feeds, tolerances, detections=[NMS_OUTPUTS])


def test_detections_match_regardless_of_order():
    rng = np.random.default_rng(3)
    ref = _dets(rng, 6)
    perm = rng.permutation(6)
    test = {k: v.copy() for k, v in ref.items()}
    for k in ("boxes", "scores", "classes"):
        test[k][0, :6] = ref[k][0, perm]
    (out,) = _compare_sets([ref], [test]).outputs
    assert out.name == "detections" and out.passed, out.detail
    assert out.metrics["map50_95"] == 1.0 and out.metrics["matched"] == 6


def test_detections_fail_on_class_or_count_change_and_name_the_worst_image():
    rng = np.random.default_rng(4)
    ref = _dets(rng, 5)
    wrong_class = {k: v.copy() for k, v in ref.items()}
    wrong_class["classes"][0, 2] = (ref["classes"][0, 2] + 1) % 80
    (out,) = _compare_sets([ref], [wrong_class]).outputs
    assert not out.passed and out.metrics["missed"] == 1 and out.metrics["extra"] == 1
    fewer = {k: v.copy() for k, v in ref.items()}
    fewer["num_dets"][0] = 4  # the lowest-scored one (> 0.3: far from the 0.25 threshold) is lost
    (out,) = _compare_sets([ref, ref], [ref, fewer]).outputs
    assert not out.passed
    assert out.metrics["reference"] == 10 and out.metrics["matched"] == 9 and out.metrics["recall"] == 0.9
    assert "recall 0.900 < min_recall 0.99" in out.detail
    assert "in total over 2 images: 9/10 matched" in out.detail
    assert "worst image batch 1 row 0: 4/5 matched" in out.detail
    failures = GateReport().with_levels(_compare_sets([ref, ref], [ref, fewer])).failures()
    assert failures[0].startswith("end_to_end: detections: failed on mAP50-95")
    assert "recall 0.900 < min_recall 0.99" in failures[0]
    loose = Tolerances(detections=DetectionTolerance(min_map=0.8, min_map50=0.8, min_recall=0.8))
    (out,) = _compare_sets([ref, ref], [ref, fewer], loose).outputs
    assert out.passed, out.detail
    assert out.tolerance == {**loose.detections.model_dump(), "threshold": 0.25}  # what it was judged by


def test_detections_neither_side_finds_pass_but_say_it_proves_nothing(caplog):
    """A trained detector on random inputs detects nothing on either side: mAP is 1 by definition, so the
    level passes, and its detail and a warning say the comparison proves nothing, naming the way out."""
    rng = np.random.default_rng(6)
    empty = _dets(rng, 0)
    with caplog.at_level(logging.WARNING, logger="deepjit.gate"):
        (out,) = _compare_sets([empty, empty], [empty, empty]).outputs
    assert out.passed and out.detail.startswith("passed (on no detections at all: this proves nothing) | ")
    assert "in total over 2 images: 0/0 matched (0 produced" in out.detail
    assert "end_to_end: detections: neither side detected anything on the validation data (2 images)" in caplog.text
    assert "validation.data: {folder: ...}" in caplog.text
    some = _dets(rng, 3)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deepjit.gate"):
        (one_side,) = _compare_sets([empty], [some]).outputs  # the candidate alone detects: a real failure
    assert not one_side.passed and "proves nothing" not in one_side.detail and not caplog.text


def test_two_detection_groups_are_scored_and_recorded_each_by_its_count():
    rng = np.random.default_rng(5)
    first, second = _dets(rng, 4), _dets(rng, 3)
    two = DetectionOutputs(Detections(count="n2", boxes="b2", scores="s2", classes="c2"), threshold=0.25)
    ref = {**first, **dict(zip(two.names, second.values()))}
    wrong = {k: v.copy() for k, v in ref.items()}
    wrong["c2"][0, 1] = (ref["c2"][0, 1] + 1) % 80  # the second group's class changes
    feeds = [{"k": rng.integers(0, 8, size=(1,), dtype=np.int32)}]  # unread: both sides are fixed
    level = compare_runs("end_to_end", FunctionRunner(lambda f: ref, "reference"),
                         FunctionRunner(lambda f: wrong, "deepjit"), feeds, Tolerances(), detections=[NMS_OUTPUTS, two])
    record = level.to_dict()["outputs"]
    assert {k: v["passed"] for k, v in record.items()} == {"detections (num_dets)": True, "detections (n2)": False}
    assert record["detections (n2)"]["metrics"]["missed"] == 1


def test_a_report_folder_holds_only_what_deepjit_writes(tmp_path):
    folder = tmp_path / "b.report"
    check_report_folder(folder)  # absent: fine
    folder.mkdir()
    (folder / "build-report.json").write_text("{}")
    (folder / "kernels.runresults.json").write_text("{}")
    check_report_folder(folder)
    (tmp_path / "elsewhere.json").write_text("{}")  # a link to a file: no file DeepJIT wrote either
    (folder / "x.runresults.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(OutputError, match=r"b.report: holds files DeepJIT did not write \(x.runresults.json\)"):
        check_report_folder(folder)
    (folder / "x.runresults.json").unlink()
    (folder / "y.runresults.json").mkdir()
    with pytest.raises(OutputError, match=r"b.report: holds files DeepJIT did not write \(y.runresults.json\)"):
        check_report_folder(folder)
    dangling = tmp_path / "c.report"
    dangling.symlink_to(tmp_path / "gone")
    with pytest.raises(OutputError, match="c.report: exists and is not a report folder"):
        check_report_folder(dangling)


def test_detection_tolerances_are_recorded_and_read_back():
    rng = np.random.default_rng(6)
    ref = _dets(rng, 3)
    level = _compare_sets([ref], [ref])
    record = GateReport().with_levels(level).to_record()["levels"]["end_to_end"]["outputs"]["detections"]
    assert record["tolerance"]["min_map"] == Tolerances().detections.min_map and record["metrics"]["matched"] == 3
    again = GateReport.from_record({"end_to_end": GateReport().with_levels(level).to_record()["levels"]["end_to_end"]})
    assert again.levels["end_to_end"].outputs[0].metrics == level.outputs[0].metrics


def test_the_borderline_band_keeps_fp16_sized_noise_from_flapping():
    """A synthetic YOLOv8n's random-weight scores crowd the 0.25 threshold (about 1000 detections on four
    random images, one image full at max_det 300). Noise of fp16's size on its class logits (Gaussian,
    sigma 0.01: the fp16 rewrite moves a synthetic YOLOv8s's logits by 0.008 at the median) flips
    detections across the threshold and across a full image's cut, so a gate at the exact levels' bar
    (mAP50-95, recall and precision >= 0.99) fails on some noise draws; with the band, on none."""
    model = synthesize_yolov8("yolov8n", seed=0, batch=None)
    x = np.random.default_rng(0).uniform(0, 1, (4, 3, 640, 640)).astype(np.float32)
    output0 = ort_session(model).run(["output0"], {"images": x})[0]
    nms = nms_reference(80)  # the NMS stage's reference graph: conf 0.25, iou 0.45, max_det 300
    session, names = ort_session(nms), [o.name for o in nms.graph.output]
    feeds = [{"output0": output0[:2]}, {"output0": output0[2:]}]

    def noisy(seed):
        rng = np.random.default_rng(seed)

        def run(feed):
            o = feed["output0"].copy()
            p = np.clip(o[:, 4:], 1e-7, 1 - 1e-7)
            o[:, 4:] = 1 / (1 + np.exp(-(np.log(p / (1 - p)) + rng.normal(0, 0.01, p.shape))))
            return dict(zip(names, session.run(names, {"output0": o})))
        return run

    def gate(seed, margin):
        tol = Tolerances(detections=DetectionTolerance(score_atol=0.01, margin=margin))  # the noise moves scores
        reference = OnnxrtRunner(SessionFromOnnx(nms.SerializeToString()), name="reference")
        (out,) = compare_runs("end_to_end", reference, FunctionRunner(noisy(seed), "fp16-noise"), feeds, tol,
                              detections=[NMS_OUTPUTS]).outputs
        assert out.metrics["reference"] > 900 and out.metrics["images"] == 4
        return out

    plain = [gate(seed, 0.0) for seed in range(4)]
    banded = [gate(seed, Tolerances().detections.margin) for seed in range(4)]
    assert not all(o.passed for o in plain), [o.detail for o in plain]
    assert all(o.passed for o in banded), [o.detail for o in banded]
    assert all(o.metrics["borderline"] > o.metrics["missed"] + o.metrics["extra"] for o in banded)


@pytest.mark.parametrize("name", ["kernels.x/../../escaped", "../escaped", "/tmp/escaped", ".hidden", "a\\b"])
def test_a_report_name_is_one_plain_file_name_in_the_report_folder(tmp_path, name):
    """Report names are made of step names, a pulled bundle's among them: never a path out of the folder."""
    tol = Tolerances(default=Tolerance(atol=1e-5, rtol=1e-5))
    with pytest.raises(OutputError, match="cannot name a report .*: a report's name is letters, digits"):
        compare_runs("kernels", _reference(), FunctionRunner(_candidate(1.0), "deepjit"), _feeds(), tol,
                     report_dir=tmp_path / "r" / "report", report_name=name)
    assert not list(tmp_path.rglob("*.runresults.json"))


def test_a_long_kernel_chain_still_names_one_report_file(tmp_path):
    short, long = _report_name("decode+nms"), _report_name("+".join(["s" * 128] * 3))
    assert short == "kernels.decode+nms" and len(long) == 200 and long != _report_name("+".join(["s" * 128] * 4))
    assert report_file(tmp_path, long).parent == tmp_path
