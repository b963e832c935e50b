"""Composing a model with its added stages' reference graphs, checked against the pieces run one by one."""
from __future__ import annotations

import numpy as np
from conftest_models import tiny_detector, to_opset11

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
