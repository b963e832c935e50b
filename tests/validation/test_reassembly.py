"""The reassembly check passes on correct plans and catches wrong wiring and wrong references."""
from __future__ import annotations

import dataclasses
import json

import onnx
from conftest_models import chain_model, tiny_detector, two_cut_model

from deepjit_compiler.surgery.cut import plan_from_model
from deepjit_compiler.surgery.plan import CutRequest, KernelRequest, Plan
from deepjit_compiler.validation.graph import check_reassembly


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


def test_correct_plan_is_bit_identical_over_several_samples():
    report = check_reassembly(two_cut_plan(), two_cut_model(), seed=123, samples=3, batch=3)
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
