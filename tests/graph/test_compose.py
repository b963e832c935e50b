"""Composing a model with its added stages' reference graphs, checked against the pieces run one by one."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest_models import F32, chain_model, make_model, tiny_detector, to_opset11
from onnx import helper

from deepjit_compiler.graph.compose import compose_reference
from deepjit_compiler.graph.ort import ort_session
from deepjit_compiler.surgery.cut import plan_from_model
from deepjit_compiler.surgery.plan import CutRequest, KernelRequest


def run(model, feed):
    sess = ort_session(model)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feed)))


def test_added_stages_wire_by_name_and_keep_ratio_pad_at_the_larger_opset():
    model = to_opset11(tiny_detector())
    plan = plan_from_model(model, [
        CutRequest("lb", add="before", at="images", kernels=(KernelRequest("letterbox", {"size": 32}),)),
        CutRequest("nms", add="after", at="output0", kernels=(KernelRequest("nms", {"conf_threshold": 0.01}),))])
    lb, nms = plan.step("lb").reference, plan.step("nms").reference
    composed = compose_reference(model, [(s.name, s.position, s.reference) for s in plan.added])
    opsets = [next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) for m in (model, lb, nms, composed)]
    assert opsets[3] == max(opsets[:3]) > 11
    assert [i.name for i in composed.graph.input] == ["raw_images"]
    frame = np.random.default_rng(0).integers(0, 256, (2, 24, 40, 3), dtype=np.uint8)
    boxed = run(lb, {"raw_images": frame})
    dets = run(nms, {"output0": run(model, {"images": boxed["images"]})["output0"]})
    got = run(composed, {"raw_images": frame})
    assert sorted(got) == sorted([*dets, "ratio_pad"])
    assert dets["num_dets"].sum() > 0
    for name, want in {**dets, "ratio_pad": boxed["ratio_pad"]}.items():
        np.testing.assert_array_equal(got[name], want)


def relu_neg(src: str, dst: str, *, opset: int, ir: int) -> onnx.ModelProto:
    """src -> Relu -> t -> Neg -> dst, at `opset` and IR version `ir`."""
    nodes = [helper.make_node("Relu", [src], ["t"], name="relu"), helper.make_node("Neg", ["t"], [dst], name="neg")]
    model = make_model(nodes, [helper.make_tensor_value_info(src, F32, ["N", 8, 8, 8])],
                       [helper.make_tensor_value_info(dst, F32, ["N", 8, 8, 8])], opset=opset)
    model.ir_version = ir
    return model


@pytest.mark.parametrize("opset", [17, 21])
def test_a_stage_after_wires_on_at_the_larger_opset_and_changes_neither_model(opset):
    model, post = chain_model(), relu_neg("y", "z", opset=opset, ir=10)  # the model: opset 17, IR 8
    before = [m.SerializeToString() for m in (model, post)]
    composed = compose_reference(model, [("post", "after", post)])
    assert {o.version for o in composed.opset_import if o.domain == ""} == {opset}
    x = np.random.default_rng(3).uniform(-2, 2, (2, 4, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(run(composed, {"x": x})["z"], -np.maximum(run(model, {"x": x})["y"], 0))
    assert [m.SerializeToString() for m in (model, post)] == before


def test_the_composed_model_has_an_ir_version_onnx_runtime_1_18_reads():
    model, post = chain_model(), relu_neg("y", "z", opset=17, ir=12)
    model.ir_version = 12  # what a newer onnx writes
    assert compose_reference(model, [("post", "after", post)]).ir_version <= 10


def test_a_stage_whose_opset_names_the_default_domain_ai_onnx_composes():
    post = relu_neg("y", "z", opset=17, ir=8)
    post.opset_import[0].domain = "ai.onnx"  # the default domain's other name, which ONNX Runtime reads
    composed = compose_reference(chain_model(), [("post", "after", post)])
    x = np.random.default_rng(4).uniform(-2, 2, (2, 4, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(run(composed, {"x": x})["z"], run(post, run(chain_model(), {"x": x}))["z"])


def test_stages_after_chain_in_plan_order():
    model, first = chain_model(), relu_neg("y", "z", opset=17, ir=8)
    second = make_model([helper.make_node("Sigmoid", ["z"], ["w"], name="sig")],
                        [helper.make_tensor_value_info("z", F32, ["N", 8, 8, 8])],
                        [helper.make_tensor_value_info("w", F32, ["N", 8, 8, 8])])
    composed = compose_reference(model, [("first", "after", first), ("second", "after", second)])
    x = np.random.default_rng(5).uniform(-2, 2, (2, 4, 8, 8)).astype(np.float32)
    want = run(second, run(first, run(model, {"x": x})))["w"]
    np.testing.assert_array_equal(run(composed, {"x": x})["w"], want)
