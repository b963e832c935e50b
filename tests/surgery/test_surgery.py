"""Graph surgery on tiny models: segments and kernel sites, their order and wiring, every error."""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import onnx
import pytest
from conftest_models import (
    batch_read_model,
    chain_model,
    make_model,
    mystery_model,
    parallel_model,
    shape_model,
    stride_read_model,
    tiny_detector,
    two_cut_model,
    two_input_model,
)
from onnx import TensorProto, helper

from deepjit_compiler.errors import DeepJITError, SurgeryError
from deepjit_compiler.graph.casts import cast_outputs
from deepjit_compiler.graph.ort import ort_session
from deepjit_compiler.graph.serialize import MAX_IR_VERSION, pin_ir_version
from deepjit_compiler.graph.shapes import _ort_run_infos as ort_run_infos
from deepjit_compiler.graph.shapes import complete_value_info, infer_shapes
from deepjit_compiler.graph.tensors import TensorSig, is_complete, sig_from_value_info, value_info_map
from deepjit_compiler.surgery.cut import plan_from_model
from deepjit_compiler.surgery.plan import AddedStage, CutRequest, KernelRequest, KernelSite, Plan, Segment
from deepjit_compiler.validation.executor import plan_runner
from deepjit_compiler.validation.graph import check_reassembly


def cut(name, inputs=None, outputs=None, **kw):
    return CutRequest(name, inputs=inputs, outputs=outputs, kernels=(KernelRequest(kw.pop("contract", name)),), **kw)


def run(model: onnx.ModelProto, **feed) -> dict[str, np.ndarray]:
    sess = ort_session(model)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feed)))


def kinds(plan):
    return [(s.kind, s.name) for s in plan.steps]


def names(sigs):
    return [s.name for s in sigs]


# --- cuts and segments --------------------------------------------------------------------------


def test_mid_cut_splits_the_model_in_two_segments():
    plan = plan_from_model(chain_model(), [cut("soft", ["a"], ["mid"])])
    assert kinds(plan) == [("segment", "segment_0"), ("kernel", "soft"), ("segment", "segment_1")]
    seg0, site, seg1 = plan.steps
    assert isinstance(seg0, Segment) and isinstance(site, KernelSite) and isinstance(seg1, Segment)
    assert names(seg0.inputs) == ["x"] and names(seg0.outputs) == ["a"]
    assert names(site.inputs) == ["a"] and names(site.outputs) == ["mid"]
    assert names(seg1.inputs) == ["mid"] and names(seg1.outputs) == ["y"]
    assert site.inputs[0] == TensorSig("a", "float32", ("N", 8, 8, 8))  # symbolic batch kept
    assert sorted(n.op_type for n in site.reference.graph.node) == ["Mul", "Reshape", "Reshape", "Sigmoid", "Softmax"]
    assert [n.op_type for n in seg0.model.graph.node] == ["Conv"]
    assert [n.op_type for n in seg1.model.graph.node] == ["Conv", "Relu"]
    for s in plan.steps:
        onnx.checker.check_model(s.onnx, full_check=True)
        assert s.onnx.ir_version <= MAX_IR_VERSION


def test_kernel_site_reference_computes_the_cut_region():
    plan = plan_from_model(chain_model(), [cut("soft", ["a"], ["mid"])])
    a = np.random.default_rng(0).standard_normal((3, 8, 8, 8)).astype(np.float32)
    got = run(plan.step("soft").reference, a=a)["mid"]
    silu = (a / (1 + np.exp(-a.astype(np.float64)))).reshape(3, 8, 64)
    e = np.exp(silu - silu.max(axis=2, keepdims=True))
    np.testing.assert_allclose(got, (e / e.sum(axis=2, keepdims=True)).reshape(3, 8, 8, 8), rtol=1e-5, atol=1e-7)


def test_manual_cut_facts_name_the_boundary():
    site = plan_from_model(chain_model(), [cut("soft", ["a"], ["mid"])]).step("soft")
    assert site.facts["inputs"] == [{"name": "a", "dtype": "float32", "shape": ["N", 8, 8, 8]}]
    assert site.facts["outputs"] == [{"name": "mid", "dtype": "float32", "shape": ["N", 8, 8, 8]}]
    assert site.facts["nodes"] == 5 and site.facts["ops"]["Reshape"] == 2
    assert [k.contract for k in site.kernels] == ["soft"]


def test_cut_at_the_tail_leaves_one_segment():
    plan = plan_from_model(chain_model(), [cut("tail", ["b"], ["y"])])
    assert kinds(plan) == [("segment", "segment"), ("kernel", "tail")]
    assert names(plan.outputs) == ["y"] and names(plan.inputs) == ["x"]


def test_cut_at_the_head_reads_the_model_input():
    plan = plan_from_model(chain_model(), [cut("head", ["x"], ["a"])])
    assert kinds(plan) == [("kernel", "head"), ("segment", "segment")]
    assert [n.op_type for n in plan.step("head").reference.graph.node] == ["Conv"]


def test_two_cuts_give_three_segments_and_carry_the_skip_tensor():
    plan = plan_from_model(two_cut_model(), [cut("silu", ["a"], ["m1"]), cut("soft", ["b"], ["m2"])])
    assert kinds(plan) == [("segment", "segment_0"), ("kernel", "silu"), ("segment", "segment_1"),
                           ("kernel", "soft"), ("segment", "segment_2")]
    last = plan.step("segment_2")
    assert names(last.inputs) == ["m2", "a"]  # 'a' comes from segment_0, past both cuts
    assert names(plan.step("segment_0").outputs) == ["a"]
    assert check_reassembly(plan, two_cut_model(), seed=0, samples=2, batch=2).passed


def test_independent_cuts_run_one_after_the_other():
    plan = plan_from_model(parallel_model(), [cut("left", ["a"], ["p1"]), cut("right", ["a"], ["p2"])])
    assert kinds(plan) == [("segment", "segment_0"), ("kernel", "left"), ("kernel", "right"), ("segment", "segment_1")]
    assert names(plan.step("segment_1").inputs) == ["p1", "p2"]
    assert check_reassembly(plan, parallel_model(), seed=0, samples=1).passed



def test_three_independent_cuts_each_run():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Sigmoid", ["a"], ["p1"], name="sigmoid"),
             helper.make_node("Tanh", ["a"], ["p2"], name="tanh"),
             helper.make_node("Neg", ["a"], ["p3"], name="neg"),
             helper.make_node("Sum", ["p1", "p2", "p3"], ["y"], name="join")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    plan = plan_from_model(model, [cut(f"c{k}", ["a"], [f"p{k}"]) for k in (1, 2, 3)])
    assert sorted(s.name for s in plan.sites) == ["c1", "c2", "c3"]
    assert kinds(plan)[0] == ("segment", "segment_0") and kinds(plan)[-1] == ("segment", "segment_1")
    assert check_reassembly(plan, model, seed=0, samples=1, batch=2).passed


def test_segments_list_tensors_in_the_models_input_and_output_order():
    # conv0 reads 'images' before relu reads 'scale'; 'z' is made after 'a' and 'rs'.
    plan = plan_from_model(two_input_model(), [cut("silu", ["a"], ["m"])])
    assert names(plan.inputs) == ["scale", "images"] and names(plan.outputs) == ["y", "z"]
    seg0, seg1 = plan.step("segment_0"), plan.step("segment_1")
    assert names(seg0.inputs) == ["scale", "images"] and [i.name for i in seg0.model.graph.input] == ["scale", "images"]
    assert names(seg0.outputs) == ["z", "a", "rs"]  # model outputs first, then in the order they are made
    assert names(seg1.inputs) == ["m", "rs"] and names(seg1.outputs) == ["y"]
    assert check_reassembly(plan, two_input_model(), seed=1, samples=1, batch=2).passed


def test_nodes_whose_outputs_nothing_reads_make_no_segment():
    model = chain_model()
    model.graph.node.append(helper.make_node("Neg", ["y"], ["unused"], name="dead"))
    plan = plan_from_model(model, [cut("tail", ["b"], ["y"])])
    assert kinds(plan) == [("segment", "segment"), ("kernel", "tail")]


def test_constant_nodes_are_not_counted_as_ops_or_nodes():
    model = chain_model()
    for name in ("unflat", "w1"):  # used inside the cut, and by the segment after it
        t = next(t for t in model.graph.initializer if t.name == name)
        model.graph.node.insert(0, helper.make_node("Constant", [], [name], name=f"{name}_const", value=t))
        model.graph.initializer.remove(t)
    plan = plan_from_model(model, [cut("soft", ["a"], ["mid"])])
    site, seg1 = plan.step("soft"), plan.step("segment_1")
    assert all("Constant" in [n.op_type for n in m.graph.node] for m in (site.reference, seg1.model))
    assert site.facts["nodes"] == 5 and site.facts["ops"] == {"Mul": 1, "Reshape": 2, "Sigmoid": 1, "Softmax": 1}
    assert seg1.summary() == {"nodes": 2, "ops": {"Conv": 1, "Relu": 1}}


def test_constants_are_copied_into_every_piece_that_needs_them():
    # 'flat'/'unflat' are initializers used inside the cut only; conv weights stay in the segments.
    plan = plan_from_model(chain_model(), [cut("soft", ["a"], ["mid"])])
    ref_inits = {t.name for t in plan.step("soft").reference.graph.initializer}
    assert ref_inits == {"flat", "unflat"}
    assert {t.name for t in plan.step("segment_0").model.graph.initializer} == {"w0"}



def test_pieces_keep_the_models_ir_version_and_are_named_after_their_step():
    plan = plan_from_model(chain_model(), [cut("soft", ["a"], ["mid"])])  # chain_model is IR 8
    assert [(s.onnx.graph.name, s.onnx.ir_version, s.onnx.producer_name) for s in plan.steps] == [
        ("segment_0", 8, "deepjit"), ("soft", 8, "deepjit"), ("segment_1", 8, "deepjit")]


def test_shape_read_outside_the_cut_is_taken_from_an_input_with_the_same_dims():
    model = shape_model()
    plan = plan_from_model(model, [cut("head", ["g"], ["y"])])
    site = plan.step("head")
    assert [i.name for i in site.reference.graph.input] == ["g"]
    assert site.facts["shape_reads"] == {"a": "g"}
    assert names(plan.step("segment").outputs) == ["g"]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 6, 10)).astype(np.float32)
    g = run(plan.step("segment").model, x=x)["g"]
    np.testing.assert_array_equal(run(site.reference, g=g)["y"], run(model, x=x)["y"])
    assert check_reassembly(plan, model, seed=3, samples=2, dims={"H": 6, "W": 10}).passed



def test_shape_read_of_a_tensor_made_inside_the_cut_needs_no_substitute():
    # Shape(r) with r made inside the cut: no cut input has r's rank, and none needs to.
    flat = onnx.numpy_helper.from_array(np.array([0, -1], np.int64), "flat")
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Reshape", ["a", "flat"], ["r"], name="flatten"),
             helper.make_node("Softmax", ["r"], ["sm"], name="softmax", axis=1),
             helper.make_node("Shape", ["r"], ["shape_r"], name="shape"),
             helper.make_node("Reshape", ["sm", "shape_r"], ["y"], name="reshape")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, "L"])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", None])], [flat])
    plan = plan_from_model(model, [cut("tail", ["a"], ["y"])])
    assert "shape_reads" not in plan.step("tail").facts
    assert check_reassembly(plan, model, seed=1, samples=1, batch=2, dims={"L": 6}).passed


def test_shape_read_may_take_a_cut_input_that_is_read_for_its_shape_only():
    # 'ya' = Relu(a) has a's shape at every size; listed first, it stands in for a and is read for nothing else.
    model = stride_read_model()
    plan = plan_from_model(model, [cut("head", ["ya", "g"], ["y"])])
    assert plan.step("head").facts["shape_reads"] == {"a": "ya"}
    assert names(plan.step("head").inputs) == ["ya", "g"]
    assert check_reassembly(plan, model, seed=3, samples=1, batch=2, dims={"H": 7, "W": 9}).passed


def test_shape_read_takes_an_input_whose_dims_match_at_every_batch():
    # 'k' (batch 1) has a's batch at N = 1 only; listed first, it must still not be taken. The model
    # takes even sizes only, so only the two even probe sizes can tell.
    model = batch_read_model()
    plan = plan_from_model(model, [cut("head", ["k", "g"], ["y"])])
    assert plan.step("head").facts["shape_reads"] == {"a": "g"}
    g = np.random.default_rng(2).standard_normal((3, 2, 5, 7)).astype(np.float32)
    k = g.mean(axis=0, keepdims=True)
    got = run(plan.step("head").reference, k=k, g=g)["y"]
    np.testing.assert_allclose(got, (g - k).reshape(3, 70), rtol=1e-6)
    assert check_reassembly(plan, model, seed=3, samples=1, batch=2, dims={"H": 6, "W": 10}).passed


def test_shape_read_refuses_an_input_whose_dims_match_at_even_sizes_only():
    # g is floor(H/2) high, a ceil(H/2): the same at every even H, one apart at H = 7 (W is 8 in both).
    model = stride_read_model(width=8)
    with pytest.raises(SurgeryError, match="cut 'head': node 'shape' reads the shape of 'a', which is outside the "
                                           "cut, and no cut input has the same dims"):
        plan_from_model(model, [cut("head", ["g"], ["y"])])
    plan = plan_from_model(model, [cut("head", ["g", "a"], ["y"])])
    assert "shape_reads" not in plan.step("head").facts
    assert check_reassembly(plan, model, seed=3, samples=1, batch=2, dims={"H": 7}).passed



@pytest.mark.parametrize("even_only", ["a", "g"])
def test_shape_read_takes_an_input_matching_at_even_sizes_where_one_side_has_no_odd_shape(even_only):
    # a or g adds a ceil(H/2) and a floor(H/2) map: the model runs at even sizes only, so the odd probe
    # knows one of the two and cannot tell them apart.
    model = stride_read_model(even_only=even_only)
    plan = plan_from_model(model, [cut("head", ["g"], ["y"])])
    assert plan.step("head").facts["shape_reads"] == {"a": "g"}
    g = np.random.default_rng(4).standard_normal((2, 2, 5, 6)).astype(np.float32)
    np.testing.assert_allclose(run(plan.step("head").reference, g=g)["y"], 30 / (1 + np.exp(-g)), rtol=1e-5)
    assert check_reassembly(plan, model, seed=3, samples=1, batch=2, dims={"H": 10, "W": 12}).passed

def test_plan_write_is_atomic_deterministic_and_loadable(tmp_path):
    cuts = [cut("silu", ["a"], ["m1"]), cut("soft", ["b"], ["m2"])]
    paths = plan_from_model(two_cut_model(), cuts).write(tmp_path / "one")
    again = plan_from_model(two_cut_model(), cuts).write(tmp_path / "two")
    assert paths == again == {"segment_0": "segments/segment_0.onnx", "silu": "references/silu.onnx",
                              "segment_1": "segments/segment_1.onnx", "soft": "references/soft.onnx",
                              "segment_2": "segments/segment_2.onnx"}
    for rel in paths.values():
        assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "two" / rel).read_bytes()
        onnx.checker.check_model(onnx.load(tmp_path / "one" / rel), full_check=True)
    assert not [p for p in (tmp_path / "one").rglob(".*")]  # no temp files left behind


def test_a_plan_write_that_fails_leaves_the_files_before_it_whole(tmp_path, monkeypatch):
    """Atomic: a write that fails before its rename (a full disk, a kill) leaves what was there."""
    plan = plan_from_model(two_cut_model(), [cut("silu", ["a"], ["m1"])])
    before = {rel: f"an earlier {rel}".encode() for rel in (plan.relpath(s) for s in plan.steps)}
    for rel, data in before.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(DeepJITError, match="No space left on device"):
        plan.write(tmp_path)
    assert {rel: (tmp_path / rel).read_bytes() for rel in before} == before
    assert not [p for p in tmp_path.rglob(".*")]


def test_plan_summary_is_plain_data():
    plan = plan_from_model(chain_model(), [cut("soft", ["a"], ["mid"])])
    summary = json.loads(json.dumps(plan.summary()))
    assert [s["kind"] for s in summary] == ["segment", "kernel", "segment"]
    assert summary[1]["facts"]["inputs"][0]["shape"] == ["N", 8, 8, 8]
    assert summary[0]["ops"] == {"Conv": 1}
    assert [(s["inputs"][0]["name"], s["outputs"][0]["name"]) for s in summary] == [("x", "a"), ("a", "mid"), ("mid", "y")]
    assert summary[1]["kernels"] == ["soft"]
    nms = plan_from_model(tiny_detector(), [CutRequest("n", add="after", at="output0",
                                                       kernels=(KernelRequest("nms", {"max_det": 7}),))]).summary()[-1]
    assert (nms["kind"], nms["position"], nms["params"]["max_det"], nms["kernels"]) == ("added", "after", 7, ["nms"])


# --- added stages -------------------------------------------------------------------------------


def detector_cuts(**params):
    return [CutRequest("nms", add="after", at="output0", kernels=(KernelRequest("nms", params.get("nms", {})),)),
            CutRequest("lb", add="before", at="images",
                       kernels=(KernelRequest("letterbox", params.get("letterbox", {"size": 32})),))]


def test_added_stages_wrap_the_model_and_replace_its_inputs_and_outputs():
    # conf_threshold 0.01: tiny_detector's scores stay below the default 0.25, and a reassembly check
    # over NMS outputs with no detection in them would compare nothing but zeros.
    plan = plan_from_model(tiny_detector(), detector_cuts(nms={"max_det": 5, "iou_threshold": 0.5,
                                                               "conf_threshold": 0.01}))
    assert kinds(plan) == [("added", "lb"), ("segment", "segment"), ("added", "nms")]
    lb, _, nms = plan.steps
    assert isinstance(lb, AddedStage) and lb.position == "before" and nms.position == "after"
    assert plan.inputs == (TensorSig("raw_images", "uint8", ("batch", "height", "width", 3)),)
    assert names(plan.outputs) == ["num_dets", "boxes", "scores", "classes", "ratio_pad"]
    assert plan.step("nms").outputs[1] == TensorSig("boxes", "float32", ("batch", 5, 4))
    assert nms.params == {"conf_threshold": 0.01, "iou_threshold": 0.5, "max_det": 5, "agnostic": False, "num_classes": 3}
    assert plan_from_model(tiny_detector(), detector_cuts()).step("nms").params == {
        "conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300, "agnostic": False, "num_classes": 3}  # defaults
    assert names(nms.inputs) == ["output0"] and lb.outputs[0] == TensorSig("images", "float32", ("N", 3, 32, 32))
    report = check_reassembly(plan, tiny_detector(), seed=0, samples=2, batch=2, dims={"height": 40, "width": 24})
    assert report.passed, report.describe()


def test_letterbox_on_the_second_model_input_keeps_the_first():
    lb = CutRequest("lb", add="before", at="images", kernels=(KernelRequest("letterbox", {"size": 8}),))
    plan = plan_from_model(two_input_model(), [lb])
    assert names(plan.inputs) == ["scale", "raw_images"] and names(plan.outputs) == ["y", "z", "ratio_pad"]
    assert plan.step("lb").outputs[0] == TensorSig("images", "float32", ("N", 3, 8, 8))
    report = check_reassembly(plan, two_input_model(), seed=1, samples=1, batch=2, dims={"height": 12, "width": 20})
    assert report.passed, report.describe()


def test_an_added_stages_params_override_the_sites_facts():
    # A site fact named like an nms param (max_det, num_classes) does not change the stage's; other
    # facts (the site's node count) reach it, the site's own input dtype does not.
    plan = plan_from_model(tiny_detector(), [cut("act", ["flat_out"], ["output0"]),
                                             CutRequest("n", add="after", at="output0",
                                                        kernels=(KernelRequest("nms", {"max_det": 5}),))])
    site = plan.step("act")
    extra = dataclasses.replace(site, facts={**site.facts, "max_det": 1000, "num_classes": 99, "input_dtype": "float16"})
    plan = Plan(tuple(extra if s is site else s for s in plan.steps), plan.inputs, plan.outputs)
    facts = plan.kernel_facts(plan.step("n"))
    assert (facts["max_det"], facts["num_classes"], facts["nodes"]) == (5, 3, 4) and "input_dtype" not in facts
    assert plan.kernel_facts(extra)["max_det"] == 1000


@pytest.mark.parametrize("channels", [4, 5])
def test_nms_needs_at_least_one_class(channels):
    model = make_model([helper.make_node("Relu", ["x"], ["output0"], name="relu")],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", channels, 16])],
                       [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["N", channels, 16])])
    nms = CutRequest("n", add="after", at="output0", kernels=(KernelRequest("nms"),))
    if channels == 4:
        with pytest.raises(SurgeryError, match=r"added stage 'n': nms needs detections float32 \[B, 4 \+ nc, anchors\] "
                                               r"with a fixed 4 \+ nc, but 'output0' is float32 \['N', 4, 16\]"):
            plan_from_model(model, [nms])
    else:
        assert plan_from_model(model, [nms]).step("n").params["num_classes"] == 1


def test_added_stage_and_cut_together():
    # conf_threshold 0.01, as above: with no detection, a wrong decode piece would go unseen behind the NMS.
    cuts = [CutRequest("decode", inputs=["flat_out"], outputs=["output0"], kernels=(KernelRequest("decode"),)),
            *detector_cuts(nms={"conf_threshold": 0.01})]
    plan = plan_from_model(tiny_detector(), cuts)
    assert kinds(plan) == [("added", "lb"), ("segment", "segment"), ("kernel", "decode"), ("added", "nms")]
    feed = {"raw_images": np.random.default_rng(1).integers(0, 256, (2, 40, 24, 3), dtype=np.uint8)}
    report = check_reassembly(plan, tiny_detector(), [feed])
    assert report.passed and report.first_mismatch is None, report.describe()
    assert (plan_runner(plan).tensors(feed)["num_dets"] > 0).all()  # the NMS outputs hold detections


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("cuts, message", [
    ([cut("soft", ["a"], ["mdi"])], "cut 'soft': tensor 'mdi' is not in the model (did you mean 'mid'?)"),
    ([cut("soft", ["sig"], ["silu"])], "cut 'soft' contains the model input 'x' (used by node 'conv0')"),
    ([cut("soft", ["a", "x"], ["mid"])], "cut 'soft': input 'x' does not lead to any of the cut's outputs"),
    ([cut("soft", ["a"], ["a"])], "cut 'soft': tensor 'a' is both an input and an output"),
    ([cut("soft", ["w0"], ["mid"])], "cut 'soft': input 'w0' is a constant"),
    ([cut("soft", [], ["mid"])], "cut 'soft': `inputs` is empty"),
    ([cut("soft", ["a", "a"], ["mid"])], "cut 'soft': tensor 'a' is listed twice in `inputs`"),
    ([cut("one", ["a"], ["mid"]), cut("two", ["silu"], ["sm"])], "cuts 'one' and 'two' overlap: both contain node 'flatten'"),
    ([cut("one", ["a"], ["mid"]), cut("one", ["b"], ["y"])], "two cuts are named 'one'"),
    ([cut("segment_0", ["a"], ["mid"])], "cut name 'segment_0' is reserved"),
    ([CutRequest("p", preset="yolov8_decod", kernels=(KernelRequest("x"),))],
     "cut 'p': unknown preset 'yolov8_decod' (did you mean 'yolov8_decode'?)"),
    ([CutRequest("p", preset="yolov8_decode", kernels=(KernelRequest("x"),))], "cut 'p': preset 'yolov8_decode' found no DFL"),
])
def test_cut_errors(cuts, message):
    with pytest.raises(SurgeryError) as e:
        plan_from_model(chain_model(), cuts)
    assert message in str(e.value)
    assert e.value.exit_code == 2


def test_cut_not_closed_names_the_consumer_outside():
    with pytest.raises(SurgeryError, match="cut 'soft' is not closed: 'silu' is removed but used by node 'aux_mean' "
                                           "outside the cut"):
        plan_from_model(chain_model(aux=True), [cut("soft", ["a"], ["mid"])])


def test_cut_not_closed_when_it_removes_a_model_output():
    model = chain_model()
    model.graph.output.append(onnx.helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, ["N", 8, 64]))
    with pytest.raises(SurgeryError, match="cut 'soft' is not closed: 'r' is removed but is a model output"):
        plan_from_model(model, [cut("soft", ["a"], ["mid"])])
    plan = plan_from_model(model, [cut("soft", ["a"], ["r", "mid"])])
    assert names(plan.outputs) == ["y", "r"] and names(plan.step("soft").outputs) == ["r", "mid"]


def test_cut_that_is_not_convex():
    # inputs a and c = conv1(m1) where m1 is an output: m1 leaves the cut and comes back through conv1.
    model = two_cut_model()
    with pytest.raises(SurgeryError, match="cut 'loop' is not convex: its outputs flow through node 'conv1'"):
        plan_from_model(model, [cut("loop", ["a", "b"], ["m1", "m2"])])


def test_boundary_whose_type_cannot_be_inferred(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SurgeryError, match="cut 'tail': cannot infer the dtype and shape of tensor 'm'"):
        plan_from_model(mystery_model(), [cut("tail", ["m"], ["y"])])
    assert list(tmp_path.iterdir()) == []  # ONNX Runtime's failed attempt leaves no file behind


def test_shape_read_without_a_matching_input():
    with pytest.raises(SurgeryError, match="cut 'head': node 'shape' reads the shape of 'a', which is outside the "
                                           "cut, and no cut input has the same dims; add 'a' to the cut's inputs"):
        plan_from_model(shape_model(read_channels=True), [cut("head", ["g"], ["y"])])
    # Listing it as an input works (the reference then reads it).
    plan = plan_from_model(shape_model(read_channels=True), [cut("head", ["g", "a"], ["y"])])
    assert names(plan.step("head").inputs) == ["g", "a"]



def test_shape_read_used_whole_reads_every_dim():
    # Besides the Gather of H and W, the shape is also summed whole: a's channels count, which g lacks.
    model = shape_model()
    model.graph.node.extend([
        helper.make_node("Cast", ["shape_a"], ["shape_f"], name="shape_f", to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["shape_f"], ["total"], name="total", keepdims=0),
        helper.make_node("Mul", ["sg", "total"], ["sgt"], name="scale")])
    flatten = next(n for n in model.graph.node if n.name == "flatten")
    flatten.input[0] = "sgt"
    with pytest.raises(SurgeryError, match="cut 'head': node 'shape' reads the shape of 'a', which is outside the "
                                           "cut, and no cut input has the same dims"):
        plan_from_model(model, [cut("head", ["g"], ["y"])])


@pytest.mark.parametrize("cuts, message", [
    ([CutRequest("lb", add="before", at="image", kernels=(KernelRequest("letterbox", {"size": 32}),))],
     "added stage 'lb': `at: image` is not a model input (did you mean 'images'?)"),
    ([CutRequest("lb", add="before", at="images", kernels=(KernelRequest("letterbox"),))],
     "letterbox makes [B, 3, 640, 640] but model input 'images' is ['N', 3, 32, 32]"),
    ([CutRequest("lb", add="before", at="images", kernels=(KernelRequest("letterbox", {"size": 32, "dtype": "float16"}),))],
     "letterbox dtype 'float16' does not match model input 'images' (float32)"),
    ([CutRequest("lb", add="before", at="images", kernels=(KernelRequest("nms"),))],
     "added stage 'lb': kernel 'nms' is a nms stage, which goes after the model, not before"),
    ([CutRequest("n", add="after", at="output", kernels=(KernelRequest("nms"),))],
     "added stage 'n': `at: output` is not a model output (did you mean 'output0'?)"),
    ([CutRequest("n", add="after", at="output0", kernels=(KernelRequest("topk"),))],
     "added stage 'n': unknown kernel contract 'topk'"),
    ([CutRequest("n", add="after", at="output0", kernels=(KernelRequest("yolov8_decode"),))],
     "added stage 'n': kernel contract 'yolov8_decode' ("),
    ([CutRequest("n", add="after", at="output0", kernels=(KernelRequest("nms", {"max_det": -1}),))],
     "added stage 'n': nms: max_det must be an integer from 1 to 2147483647, got -1"),
    ([CutRequest("n", add="after", at="output0", kernels=(KernelRequest("nms", {"max_det": 10**30}),))],
     "added stage 'n': nms: max_det must be an integer from 1 to 2147483647, got 10000"),
    ([CutRequest("n", add="after", at="output0", kernels=(KernelRequest("nms", {"iou_threshold": None}),))],
     "added stage 'n': nms: iou_threshold must be a number in [0, 1], got None"),
    ([CutRequest("n", add="after", at="output0", kernels=(KernelRequest("nms", {"conf_threshold": "x"}),))],
     "added stage 'n': nms: conf_threshold must be a number in [0, 1), got 'x'"),
    ([CutRequest("n", add="after", at="output0", kernels=(KernelRequest("nms", {"iou_threshold": [0.5]}),))],
     "added stage 'n': nms: iou_threshold must be a number in [0, 1], got [0.5]"),
    ([CutRequest("lb", add="before", at="images", kernels=(KernelRequest("letterbox", {"size": 2**40}),))],
     "letterbox: size must be an integer from 1 to 2147483647"),
    ([CutRequest("lb", add="before", at="images", kernels=(KernelRequest("letterbox", {"size": 32, "pad_value": "grey"}),))],
     "added stage 'lb': letterbox: pad_value must be a number in [0, 255], got 'grey'"),
    ([CutRequest("n", add="after", at="output0", kernels=())], "added stage 'n' needs a kernel"),
    ([CutRequest("n", add="after", at="output0", kernels=(KernelRequest("nms"),)),
      CutRequest("m", add="after", at="output0", kernels=(KernelRequest("nms"),))], "both attach at 'output0'"),
    ([CutRequest("n", add="sideways", at="output0", kernels=(KernelRequest("nms"),))], "add must be 'before' or 'after'"),
])
def test_added_stage_errors(cuts, message):
    with pytest.raises(SurgeryError) as e:
        plan_from_model(tiny_detector(), cuts)
    assert message in str(e.value)


def test_added_stage_refuses_to_shadow_a_model_tensor():
    model = tiny_detector()
    for n in model.graph.node:
        n.output[:] = ["boxes" if o == "box" else o for o in n.output]
        n.input[:] = ["boxes" if i == "box" else i for i in n.input]
    with pytest.raises(SurgeryError, match="produces tensor 'boxes', but the model already has one"):
        plan_from_model(model, [CutRequest("n", add="after", at="output0", kernels=(KernelRequest("nms"),))])



def test_added_stages_refuse_to_shadow_another_model_input_or_output():
    model = tiny_detector()
    model.graph.node.append(helper.make_node("Identity", ["cls"], ["scores"], name="scores"))
    model.graph.output.append(helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 3, 16]))
    with pytest.raises(SurgeryError, match="added stage 'n' produces tensor 'scores', but the model already has one"):
        plan_from_model(model, [CutRequest("n", add="after", at="output0", kernels=(KernelRequest("nms"),))])
    model = tiny_detector()
    model.graph.node.append(helper.make_node("Identity", ["cls"], ["ratio_pad"], name="ratio_pad"))
    model.graph.output.append(helper.make_tensor_value_info("ratio_pad", TensorProto.FLOAT, ["N", 3, 16]))
    with pytest.raises(SurgeryError, match="added stage 'lb' produces tensor 'ratio_pad', but the model already has one"):
        plan_from_model(model, [CutRequest("lb", add="before", at="images",
                                           kernels=(KernelRequest("letterbox", {"size": 32}),))])


def test_two_stages_of_one_kind_are_refused_for_the_tensors_both_make():
    def vi(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    two_images = make_model([helper.make_node("Add", ["left", "right"], ["y"], name="add")],
                            [vi("left", ["N", 3, 8, 8]), vi("right", ["N", 3, 8, 8])], [vi("y", ["N", 3, 8, 8])])
    with pytest.raises(SurgeryError, match="added stages 'left' and 'right' both make tensor 'raw_images': a pipeline "
                                           "takes one letterbox stage") as e:
        plan_from_model(two_images, [CutRequest(n, add="before", at=n, kernels=(KernelRequest("letterbox", {"size": 8}),))
                                     for n in ("left", "right")])
    assert e.value.exit_code == 2
    two_outputs = tiny_detector()
    two_outputs.graph.node.append(helper.make_node("Identity", ["output0"], ["output1"], name="copy"))
    two_outputs.graph.output.append(vi("output1", ["N", 7, 16]))
    with pytest.raises(SurgeryError, match="added stages 'n0' and 'n1' both make tensor 'num_dets'"):
        plan_from_model(two_outputs, [CutRequest(f"n{k}", add="after", at=f"output{k}", kernels=(KernelRequest("nms"),))
                                      for k in (0, 1)])


def test_nms_needs_a_detections_shaped_output():
    with pytest.raises(SurgeryError, match=r"nms needs detections float32 \[B, 4 \+ nc, anchors\]"):
        plan_from_model(chain_model(), [CutRequest("n", add="after", at="y", kernels=(KernelRequest("nms"),))])



def test_nms_needs_a_fixed_number_of_classes():
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "C", 16])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "C", 16])])
    with pytest.raises(SurgeryError, match=r"nms needs detections float32 \[B, 4 \+ nc, anchors\] with a fixed 4 \+ nc, "
                                           r"but 'y' is float32 \['N', 'C', 16\]"):
        plan_from_model(model, [CutRequest("n", add="after", at="y", kernels=(KernelRequest("nms"),))])


def test_nms_on_the_second_model_output_keeps_the_first():
    model = tiny_detector()
    model.graph.output.insert(0, helper.make_tensor_value_info("feat", TensorProto.FLOAT, ["N", 7, 4, 4]))
    plan = plan_from_model(model, [CutRequest("n", add="after", at="output0", kernels=(KernelRequest("nms"),))])
    assert names(plan.outputs) == ["feat", "num_dets", "boxes", "scores", "classes"]
    assert plan.step("n").inputs == (TensorSig("output0", "float32", ("N", 7, 16)),)


# --- onnx helpers -------------------------------------------------------------------------------


def test_pin_ir_version_caps_at_what_onnxruntime_reads():
    m = chain_model()
    m.ir_version = onnx.IR_VERSION
    assert pin_ir_version(m).ir_version == min(onnx.IR_VERSION, MAX_IR_VERSION)
    m.ir_version = 7
    assert pin_ir_version(m).ir_version == 8  # opset 17 needs IR 8


def test_onnxruntime_fills_what_onnx_shape_inference_misses():
    # com.microsoft ops are unknown to onnx, known to ONNX Runtime's symbolic shape inference.
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("QuickGelu", ["a"], ["b"], domain="com.microsoft"),
             helper.make_node("Relu", ["b"], ["y"])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], domains=["com.microsoft"])
    inferred = infer_shapes(model)
    assert "b" not in value_info_map(inferred)
    done, missing = complete_value_info(inferred, ["b"])
    assert missing == []
    assert [d.dim_param or d.dim_value for d in value_info_map(done)["b"].type.tensor_type.shape.dim] == ["N", 4]
    # The last resort runs the model twice: dims that change with the input size stay symbolic.
    infos = ort_run_infos(model, ["b"])
    assert [d.dim_param or d.dim_value for d in infos["b"].type.tensor_type.shape.dim] == ["b:0", 4]



def test_a_value_info_signature_names_anonymous_dims_and_knows_no_shape_from_a_scalar():
    anonymous = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [None, 3, None])
    assert sig_from_value_info(anonymous) == TensorSig("x", "float16", ("x:0", 3, "x:2"))
    assert sig_from_value_info(helper.make_tensor_value_info("s", TensorProto.INT64, [])) == TensorSig("s", "int64", ())
    no_shape = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    no_dtype = helper.make_tensor_value_info("z", TensorProto.UNDEFINED, [2, 3])
    assert sig_from_value_info(no_shape) is None and sig_from_value_info(no_dtype) is None
    assert [is_complete(vi) for vi in (helper.make_tensor_value_info("n", TensorProto.FLOAT, ["N", 4]), anonymous,
                                       no_shape, no_dtype, None)] == [True, False, False, False, False]


@pytest.mark.parametrize("partial", [
    helper.make_tensor_value_info("b", TensorProto.FLOAT, None),             # no shape: not a scalar
    helper.make_tensor_value_info("b", TensorProto.UNDEFINED, ["N", 4]),     # no dtype
    helper.make_tensor_value_info("b", TensorProto.FLOAT, [None, 4]),        # an anonymous dim
], ids=["no_shape", "no_dtype", "anonymous_dim"])
def test_a_boundary_with_a_partial_value_info_is_completed(partial):
    # The custom op's output as an exporter may leave it typed: ONNX Runtime fills what is missing.
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("QuickGelu", ["a"], ["b"], domain="com.microsoft"),
             helper.make_node("Relu", ["b"], ["y"])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], domains=["com.microsoft"])
    inferred = infer_shapes(model)
    inferred.graph.value_info.append(partial)
    done, missing = complete_value_info(inferred, ["b"])
    assert missing == []
    b = value_info_map(done)["b"].type.tensor_type
    assert b.elem_type == TensorProto.FLOAT and [d.dim_param or d.dim_value for d in b.shape.dim] == ["N", 4]

def test_a_cut_that_reads_the_cut_before_it_runs_right_after_it():
    plan = plan_from_model(chain_model(), [cut("silu", ["a"], ["silu"]), cut("soft", ["silu"], ["mid"])])
    assert kinds(plan) == [("segment", "segment_0"), ("kernel", "silu"), ("kernel", "soft"), ("segment", "segment_1")]
    assert check_reassembly(plan, chain_model(), seed=0, samples=1, batch=2).passed


def test_plan_step_names_a_missing_step():
    plan = plan_from_model(chain_model(), [cut("soft", ["a"], ["mid"])])
    with pytest.raises(KeyError, match="no step 'sfot' \\(did you mean 'soft'\\?\\)"):
        plan.step("sfot")
    with pytest.raises(KeyError, match="no step 'segment'"):  # a prefix of 'segment_0' names no step
        plan.step("segment")


def test_plan_digest_covers_the_step_names():
    def digest(name):
        return plan_from_model(tiny_detector(), [CutRequest(name, add="after", at="output0",
                                                            kernels=(KernelRequest("nms"),))]).digest()
    assert digest("nms") == digest("nms") != digest("nms_2")
    soft = [cut("soft", ["a"], ["mid"])]  # and the graphs: other weights, another digest
    assert plan_from_model(chain_model(seed=0), soft).digest() != plan_from_model(chain_model(seed=1), soft).digest()


def test_a_boundary_typed_only_by_the_models_value_info_is_cut():
    # Nothing infers the custom op's output, but the exporter wrote its type into value_info.
    model = mystery_model()
    model.graph.value_info.append(onnx.helper.make_tensor_value_info("m", onnx.TensorProto.FLOAT, ["N", 4]))
    site = plan_from_model(model, [cut("tail", ["m"], ["y"])]).step("tail")
    assert site.inputs == (TensorSig("m", "float32", ("N", 4)),)


def test_shape_read_through_shape_start_takes_the_dims_it_reads():
    # Shape(a, start=2) then Gather [0, 1] reads a's H and W (axes 2, 3), which 'g' shares; not N and C.
    model = shape_model()
    shape = next(n for n in model.graph.node if n.op_type == "Shape")
    shape.attribute.append(onnx.helper.make_attribute("start", 2))
    dims = next(t for t in model.graph.initializer if t.name == "dims")
    dims.CopyFrom(onnx.numpy_helper.from_array(np.array([0, 1], np.int64), "dims"))
    plan = plan_from_model(model, [cut("head", ["g"], ["y"])])
    assert plan.step("head").facts["shape_reads"] == {"a": "g"}
    assert check_reassembly(plan, model, seed=3, samples=1, dims={"H": 6, "W": 10}).passed


def test_stages_refuse_a_model_tensor_they_cannot_take():
    with pytest.raises(SurgeryError, match=r"letterbox makes \[B, 3, 8, 8\] but model input 'x' is \['N', 4, 8, 8\]"):
        plan_from_model(chain_model(), [CutRequest("lb", add="before", at="x",
                                                   kernels=(KernelRequest("letterbox", {"size": 8}),))])
    fp16 = cast_outputs(tiny_detector(), {"output0": "float16"})
    with pytest.raises(SurgeryError, match=r"nms needs detections float32 .* but 'output0' is float16"):
        plan_from_model(fp16, [CutRequest("n", add="after", at="output0", kernels=(KernelRequest("nms"),))])


def test_shape_read_through_a_constant_node_takes_the_dims_it_reads():
    # torch exports the Gather indices as a Constant node, not an initializer.
    model = shape_model()
    dims = next(t for t in model.graph.initializer if t.name == "dims")
    model.graph.node.insert(0, onnx.helper.make_node("Constant", [], ["dims"], name="dims_const", value=dims))
    model.graph.initializer.remove(dims)
    plan = plan_from_model(model, [cut("head", ["g"], ["y"])])
    assert plan.step("head").facts["shape_reads"] == {"a": "g"}


def test_a_random_op_output_is_computed_not_a_constant():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("RandomNormal", [], ["noise"], name="noise", shape=[1, 4], seed=1.0),
             helper.make_node("Add", ["a", "noise"], ["b"], name="add"),
             helper.make_node("Sigmoid", ["b"], ["y"], name="sigmoid")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    plan = plan_from_model(model, [cut("tail", ["a", "noise"], ["y"])])  # not refused as 'a constant'
    assert names(plan.step("tail").inputs) == ["a", "noise"]
    assert [n.op_type for n in plan.step("tail").reference.graph.node] == ["Add", "Sigmoid"]  # no second draw
