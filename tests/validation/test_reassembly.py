"""The reassembly check passes on correct plans and catches wrong wiring and wrong references."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest
from conftest_models import chain_model, make_model, tiny_detector, two_cut_model
from onnx import TensorProto, helper, numpy_helper

from deepjit_compiler.surgery.cut import plan_from_model
from deepjit_compiler.surgery.plan import CutRequest, KernelRequest, Plan
from deepjit_compiler.validation.graph import check_reassembly, graph_level


def cut(name, inputs, outputs):
    return CutRequest(name, inputs=inputs, outputs=outputs, kernels=(KernelRequest(name),))


def two_cut_plan() -> Plan:
    return plan_from_model(two_cut_model(), [cut("silu", ["a"], ["m1"]), cut("soft", ["b"], ["m2"])])


def rewire(model: onnx.ModelProto, old: str, new: str) -> onnx.ModelProto:
    """The same model reading tensor `new` where it read `old`."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for vi in m.graph.input:
        if vi.name == old:
            vi.name = new
    for n in m.graph.node:
        n.input[:] = [new if i == old else i for i in n.input]
    return m


def replace_step(plan: Plan, name: str, **changes) -> Plan:
    steps = tuple(dataclasses.replace(s, **changes) if s.name == name else s for s in plan.steps)
    return dataclasses.replace(plan, steps=steps)


def test_correct_plan_is_bit_identical_over_several_samples(caplog):
    with caplog.at_level("INFO", logger="deepjit.reassembly"):
        report = check_reassembly(two_cut_plan(), two_cut_model(), seed=123, samples=3, batch=3)
    counts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("graph level:")]
    assert counts == [f"graph level: {k} of 3 samples ({k * 100 // 3}%)" for k in (1, 2, 3)]  # piped: a line each
    assert report.passed
    assert [(o.name, o.bit_identical, o.max_abs_diff, o.shape) for o in report.outputs] == [("y", True, 0.0, (3, 8, 8, 8))]
    assert report.first_mismatch is None and report.error is None
    data = json.loads(json.dumps(report.to_dict()))
    assert data["passed"] is True and data["batches"] == 3 and data["rows"] == 9 and data["outputs"][0]["bit_identical"] is True


def test_misswired_segment_fails_and_names_the_step():
    # segment_1 reads 'a' (same shape as its real input 'm1', different values).
    plan = two_cut_plan()
    seg = plan.step("segment_1")
    bad = replace_step(plan, "segment_1", model=rewire(seg.model, "m1", "a"))
    report = check_reassembly(bad, two_cut_model(), seed=0, samples=1)
    assert not report.passed
    assert not report.outputs[0].bit_identical and report.outputs[0].max_abs_diff > 1e-3
    assert report.first_mismatch == "step 'segment_1' output 'b'"
    assert "'y'" in report.describe() and "segment_1" in report.describe()


def test_wrong_reference_fails():
    # A reference that is not the cut subgraph (LogSoftmax for Softmax) is caught at its own output.
    plan = plan_from_model(chain_model(), [cut("soft", ["a"], ["mid"])])
    ref = onnx.ModelProto()
    ref.CopyFrom(plan.step("soft").reference)
    softmax = next(n for n in ref.graph.node if n.op_type == "Softmax")
    softmax.op_type = "LogSoftmax"
    report = check_reassembly(replace_step(plan, "soft", reference=ref), chain_model(), seed=0, samples=1)
    assert not report.passed and report.first_mismatch == "step 'soft' output 'mid'"


def test_missing_tensor_is_a_wiring_error():
    plan = two_cut_plan()
    seg = plan.step("segment_2")
    bad = replace_step(plan, "segment_2", model=rewire(seg.model, "m2", "nowhere"))
    report = check_reassembly(bad, two_cut_model(), seed=0, samples=1)
    assert not report.passed
    assert report.error == "step 'segment_2' reads 'nowhere', which no earlier step produces"


def test_steps_out_of_order_are_a_wiring_error():
    plan = two_cut_plan()
    swapped = dataclasses.replace(plan, steps=(plan.steps[0], plan.steps[2], plan.steps[1], *plan.steps[3:]))
    report = check_reassembly(swapped, two_cut_model(), seed=0, samples=1)
    assert not report.passed and "step 'segment_1' reads 'm1'" in report.error


def test_added_stages_run_on_both_sides():
    # Both sides run the plan's added-stage references (their own accuracy is test_references' and the
    # gate's business): the check compares the pipeline's real outputs, after NMS and letterbox.
    cuts = [CutRequest("nms", add="after", at="output0", kernels=(KernelRequest("nms", {"conf_threshold": 0.01}),)),
            CutRequest("lb", add="before", at="images", kernels=(KernelRequest("letterbox", {"size": 32}),))]
    plan = plan_from_model(tiny_detector(), cuts)
    report = check_reassembly(plan, tiny_detector(), seed=5, samples=2, batch=2)
    assert report.passed, report.describe()
    assert {o.name for o in report.outputs} == {"num_dets", "boxes", "scores", "classes", "ratio_pad"}


def pick_model() -> onnx.ModelProto:
    """x [N, 6] -> Relu -> a -> Softmax -> p (float32 output); idx = ArgMax(p) (int64 output)."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Softmax", ["a"], ["p"], axis=1),
             helper.make_node("ArgMax", ["p"], ["idx"], axis=1, keepdims=0)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
                      [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["N", 6]),
                       helper.make_tensor_value_info("idx", TensorProto.INT64, ["N"])])


def head_reference(last: str = "ArgMax", p_extra: tuple = ()) -> onnx.ModelProto:
    """A stand-in for the cut [a] -> [p, idx]: Softmax, then `p_extra` nodes (reading 'sm', writing 'p'),
    then `last` over p."""
    nodes = [helper.make_node("Softmax", ["a"], ["sm" if p_extra else "p"], axis=1), *p_extra,
             helper.make_node(last, ["p"], ["idx"], axis=1, keepdims=0)]
    inits = [numpy_helper.from_array(np.array([1e-7], np.float32), "tiny")]
    return make_model(nodes, [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 6])],
                      [helper.make_empty_tensor_value_info("p"),
                       helper.make_tensor_value_info("idx", TensorProto.INT64, ["N"])], inits)


def pick_plan(reference: onnx.ModelProto) -> Plan:
    plan = plan_from_model(pick_model(), [cut("head", ["a"], ["p", "idx"])])
    return replace_step(plan, "head", reference=reference)


def feeds(rows: int = 4) -> list[dict[str, np.ndarray]]:
    """Two batches of positive rows (no ties for ArgMax or ArgMin)."""
    rng = np.random.default_rng(17)
    return [{"x": rng.uniform(0.1, 1.0, (rows, 6)).astype(np.float32)} for _ in range(2)]


@pytest.mark.parametrize("reference, differ", [
    (head_reference(), set()),
    (head_reference(p_extra=(helper.make_node("Add", ["sm", "tiny"], ["p"]),)), {"p"}),  # ~3 ulp: within allclose
    (head_reference(last="ArgMin"), {"idx"}),
    (head_reference(p_extra=(helper.make_node("Cast", ["sm"], ["p"], to=TensorProto.DOUBLE),)), {"p"}),
], ids=["same", "a-few-ulp", "integer", "dtype"])
def test_every_output_must_be_bit_identical(reference, differ):
    """Bit for bit means bit for bit: a float off by a few ulp, an integer output, or the same values
    in another dtype all fail the level, each output judged on its own."""
    level = graph_level(pick_plan(reference), pick_model(), feeds())
    assert {o.name: o.passed for o in level.outputs} == {"p": "p" not in differ, "idx": "idx" not in differ}
    assert level.status == ("failed" if differ else "passed")


def test_a_difference_in_one_batch_fails_even_when_a_later_one_agrees():
    """The first batch's rows differ (ArgMin for ArgMax); the second's rows are constant, where both pick 0."""
    first, second = feeds()
    second = {"x": np.full_like(second["x"], 0.5)}
    report = check_reassembly(pick_plan(head_reference(last="ArgMin")), pick_model(), [first, second])
    worst = float(np.max(np.abs(np.argmax(first["x"], 1) - np.argmin(first["x"], 1))))
    (idx,) = [o for o in report.outputs if o.name == "idx"]
    assert not report.passed and not idx.bit_identical and idx.max_abs_diff == worst > 0
    assert report.first_mismatch == "step 'head' output 'idx'"


def test_a_plan_that_cannot_run_fails_the_graph_level_naming_why():
    plan = two_cut_plan()
    headless = dataclasses.replace(plan, steps=plan.steps[:-1])  # nothing makes the pipeline output
    report = check_reassembly(headless, two_cut_model(), seed=0, samples=1)
    assert not report.passed and report.error == "pipeline output 'y' is produced by no step"
    level = graph_level(headless, two_cut_model(), feeds=[{"x": np.random.default_rng(2).random((1, 4, 8, 8),
                                                                                              dtype=np.float32)}])
    assert (level.status, level.reason) == ("failed", "pipeline output 'y' is produced by no step")
