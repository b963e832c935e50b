"""The yolov8_decode preset on synthetic ultralytics exports: both head layouts, static and dynamic,
opsets 11/17/19, fixed batch. The site's inputs are checked against a numpy decode written from
docs/semantics.md, i.e. exactly what the yolov8_decode kernel must compute from them."""
from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from conftest_models import to_opset11
from onnx import TensorProto, helper, numpy_helper, version_converter

from deepjit_compiler.errors import SurgeryError
from deepjit_compiler.graph.ort import ort_session
from deepjit_compiler.model.synth import synthesize_yolov8
from deepjit_compiler.precision.rewrite import apply_precision
from deepjit_compiler.surgery.cut import plan_from_model
from deepjit_compiler.surgery.plan import CutRequest, KernelRequest
from deepjit_compiler.surgery.presets import yolov8_decode
from deepjit_compiler.surgery.ultralytics import check_detect_decode
from deepjit_compiler.validation.graph import check_reassembly

IMGSZ = 320
STRIDES = [8, 16, 32]


def synth(**kw):
    return synthesize_yolov8("yolov8n", seed=0, imgsz=kw.pop("imgsz", IMGSZ), **kw)


def head_names(nl: int = 3) -> list[str]:
    """What ultralytics' exporter calls the last convs of the box (cv2) and class (cv3) branches."""
    return [f"/model.22/{b}.{i}/{b}.{i}.2/Conv_output_0" for i in range(nl) for b in ("cv2", "cv3")]


def decode_numpy(maps: list[np.ndarray], reg_max: int = 16) -> np.ndarray:
    """docs/semantics.md: DFL expectation, dist2bbox against (x + 0.5, y + 0.5), times stride; sigmoid."""
    boxes, scores = [], []
    for level, stride in enumerate(STRIDES):
        box, cls = maps[2 * level].astype(np.float64), maps[2 * level + 1].astype(np.float64)
        b, _, h, w = box.shape
        logits = box.reshape(b, 4, reg_max, h * w)
        p = np.exp(logits - logits.max(axis=2, keepdims=True))
        dist = (p / p.sum(axis=2, keepdims=True) * np.arange(reg_max)[:, None]).sum(axis=2)  # [b, 4, hw]
        ys, xs = np.meshgrid(np.arange(h) + 0.5, np.arange(w) + 0.5, indexing="ij")
        anchor = np.stack([xs.ravel(), ys.ravel()])[None]                                       # [1, 2, hw]
        x1y1, x2y2 = anchor - dist[:, :2], anchor + dist[:, 2:]
        boxes.append(np.concatenate([(x1y1 + x2y2) / 2, x2y2 - x1y1], axis=1) * stride)
        scores.append(1 / (1 + np.exp(-cls.reshape(b, cls.shape[1], h * w))))
    return np.concatenate([np.concatenate(boxes, axis=2), np.concatenate(scores, axis=2)], axis=1)


def decode_plan(model, *, nms: bool = False):
    cuts = [CutRequest("decode", preset="yolov8_decode", kernels=(KernelRequest("yolov8_decode"),))]
    if nms:
        cuts.append(CutRequest("nms", add="after", at="output0", kernels=(KernelRequest("nms"),)))
    return plan_from_model(model, cuts)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("layout", ["separate", "split"])
def test_preset_finds_the_decode(layout, dynamic):
    model = synth(head_layout=layout, dynamic=dynamic)
    match = yolov8_decode(model)
    assert match.inputs == tuple(head_names()) and match.outputs == ("output0",)
    f = match.facts
    assert (f["reg_max"], f["num_classes"], f["strides"], f["head_layout"]) == (16, 80, STRIDES, layout)
    assert f["anchors_source"] == ("computed" if dynamic else "constant")
    assert [h["role"] for h in f["head_inputs"]] == ["box", "cls"] * 3
    assert [h["channels"] for h in f["head_inputs"]] == [64, 80] * 3
    if dynamic:
        assert [(lv["height"], lv["width"]) for lv in f["levels"]] == [(f"height/{s}", f"width/{s}") for s in STRIDES]
        assert f["anchors"] == "anchors" and f["input_size"] == ["height", "width"]
    else:
        assert [(lv["height"], lv["width"]) for lv in f["levels"]] == [(IMGSZ // s, IMGSZ // s) for s in STRIDES]
        assert f["anchors"] == sum((IMGSZ // s) ** 2 for s in STRIDES) and f["input_size"] == [IMGSZ, IMGSZ]


def test_preset_logs_the_anchors_shortly(nudenet_320n, caplog):
    """nudenet's export names its anchor dimension by a ~400-character symbolic expression: the log says the
    levels' map sizes instead; a fixed input size gives the count."""
    with caplog.at_level("INFO", logger="deepjit.surgery"):
        yolov8_decode(onnx.load(nudenet_320n))
        yolov8_decode(synth())
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("yolov8_decode:")]
    assert said == ["yolov8_decode: reg_max 16, 18 classes, strides [8, 16, 32], split head, "
                    "height/8*width/8 + height/16*width/16 + height/32*width/32 anchors",
                    "yolov8_decode: reg_max 16, 80 classes, strides [8, 16, 32], separate head, 2100 anchors"]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("layout", ["separate", "split"])
def test_preset_cut_reassembles_and_its_inputs_decode_as_documented(layout, dynamic):
    model = synth(head_layout=layout, dynamic=dynamic)
    plan = decode_plan(model, nms=True)
    assert [s.kind for s in plan.steps] == ["segment", "kernel", "added"]
    segment, site, _ = plan.steps
    # The cut absorbed the anchors (constants, or the Shape/Range/Expand subgraph): the segment
    # keeps no Range, Expand or Shape, the reference reads nothing but the six head maps.
    decode_ops = {n.op_type for n in segment.model.graph.node if n.name.startswith("/model.22/") and "/cv" not in n.name}
    assert decode_ops == set()
    assert not {"Range", "Expand", "Shape", "Softmax"} & {n.op_type for n in segment.model.graph.node}
    assert [i.name for i in site.reference.graph.input] == head_names()
    hw = [f"height/{s}" for s in STRIDES] if dynamic else [IMGSZ // s for s in STRIDES]
    assert [s.shape for s in site.inputs] == [("batch", c, h, w) for h, w in zip(hw, [f"width/{s}" for s in STRIDES]
                                                                                  if dynamic else hw) for c in (64, 80)]
    assert site.outputs[0].shape == ("batch", 84, "anchors" if dynamic else 2100)

    report = check_reassembly(plan, model, seed=7, samples=1, batch=2, dims={"height": 256, "width": 320})
    assert report.passed, report.describe()

    x = np.random.default_rng(1).random((2, 3, 256, 320) if dynamic else (2, 3, IMGSZ, IMGSZ), dtype=np.float32)
    sess = ort_session(segment.model)
    maps = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"images": x})))
    ref = ort_session(site.reference).run(None, {n: maps[n] for n in head_names()})[0]
    np.testing.assert_allclose(ref, decode_numpy([maps[n] for n in head_names()]), rtol=1e-5, atol=2e-4)
    assert (ref[:, 4:].max(axis=1) > 0.25).any()  # the synthetic head does detect something


@pytest.mark.parametrize("opset", [11, 19])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_preset_across_opsets(opset, dynamic):
    base = synth(head_layout="separate" if dynamic else "split", dynamic=dynamic)
    model = to_opset11(base) if opset == 11 else version_converter.convert_version(base, opset)
    assert model.opset_import[0].version == opset
    if opset == 11:  # torch's opset-11 DFL: Transpose -> Softmax(last axis) -> Transpose
        assert any(n.op_type == "Softmax" and n.attribute[0].i == 3 for n in model.graph.node)
    match = yolov8_decode(model)
    assert match.inputs == tuple(head_names()) and match.facts["strides"] == STRIDES
    plan = decode_plan(model)
    assert check_reassembly(plan, model, seed=2, samples=1, dims={"height": 320, "width": 256}).passed


@pytest.mark.parametrize("batch", [1, 2])
def test_preset_with_fixed_batch(batch):
    model = synth(batch=batch)
    plan = decode_plan(model)
    site = plan.step("decode")
    assert site.inputs[0].shape == (batch, 64, 40, 40) and site.outputs[0].shape == (batch, 84, 2100)
    assert check_reassembly(plan, model, seed=0, samples=1, batch=batch).passed


@pytest.mark.slow
def test_preset_when_class_and_box_maps_have_the_same_width():
    # 64 classes == 4 * reg_max channels: roles come from where each map flows, not its width.
    for layout in ("separate", "split"):
        match = yolov8_decode(synth(head_layout=layout, num_classes=64))
        assert match.inputs == tuple(head_names())
        assert match.facts["num_classes"] == 64 and [h["role"] for h in match.facts["head_inputs"]] == ["box", "cls"] * 3


def test_preset_facts_reach_the_kernel_site():
    site = decode_plan(synth()).step("decode")
    assert site.facts["preset"] == "yolov8_decode"
    assert site.facts["dtypes"] == {"head": "float32", "output": "float32"}
    assert [h["name"] for h in site.facts["head_inputs"]] == [s.name for s in site.inputs]
    assert site.facts["ops"]["Softmax"] == 1 and site.facts["ops"]["Conv"] == 1


def _no_dfl(m):  # DFL weights 2 * arange(16): a 1x1 conv to one channel, but no expectation
    conv = next(n for n in m.graph.node if n.op_type == "Conv" and "/dfl/" in n.name)
    w = next(t for t in m.graph.initializer if t.name == conv.input[1])
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * 2, w.name))


def _identity_last(m):  # output0 made by an Identity after the Concat
    last = next(n for n in m.graph.node if "output0" in n.output)
    last.output[:] = ["pre_output0"]
    m.graph.node.append(helper.make_node("Identity", ["pre_output0"], ["output0"], name="last"))


def _no_sigmoid(m):  # the class scores through a Relu instead
    next(n for n in m.graph.node if n.name == "/model.22/Sigmoid").op_type = "Relu"


def _two_dfls(m):  # a second arange conv on the DFL Softmax
    conv = next(n for n in m.graph.node if n.op_type == "Conv" and "/dfl/" in n.name)
    m.graph.node.append(helper.make_node("Conv", list(conv.input), ["extra_dfl"], name="extra_dfl"))


def _two_outputs(m):  # the box distances are a model output too
    m.graph.output.append(helper.make_tensor_value_info("/model.22/Sub_1_output_0", TensorProto.FLOAT, None))


def _no_softmax(m):  # the DFL distribution through a Relu instead
    sm = next(n for n in m.graph.node if n.op_type == "Softmax")
    sm.op_type = "Relu"
    del sm.attribute[:]


def _no_stride_mul(m):  # the boxes divided by the strides instead of multiplied
    next(n for n in m.graph.node if n.name == "/model.22/Mul").op_type = "Div"


def _no_dist2bbox(m):  # the distances multiplied by the anchors, never added to or subtracted from them
    for n in m.graph.node:
        if n.op_type in ("Sub", "Add") and n.name.startswith("/model.22/") and "/cv" not in n.name:
            n.op_type = "Mul"


@pytest.mark.parametrize("edit, message", [
    (_no_dfl, "preset 'yolov8_decode' found no DFL"),
    (_two_dfls, "preset 'yolov8_decode' found 2 DFL convs"),
    (_two_outputs, "preset 'yolov8_decode': the DFL conv '/model.22/dfl/conv/Conv' feeds 2 model outputs "
                   "['output0', '/model.22/Sub_1_output_0']; expected exactly one detections output"),
    (_no_softmax, "preset 'yolov8_decode': no DFL Softmax before the DFL conv"),
    (_no_dist2bbox, "preset 'yolov8_decode': no dist2bbox (Sub/Add against the anchor points)"),
    (_identity_last, "detections output 'output0' is not made by a Concat (boxes, class scores); it comes from a Identity"),
    (_no_sigmoid, "preset 'yolov8_decode': no class Sigmoid between the head convs and 'output0'"),
    (_no_stride_mul, "preset 'yolov8_decode': no stride Mul between the head convs and 'output0'"),
])
def test_preset_refuses_what_is_not_a_yolov8_decode(edit, message):
    model = synth()
    edit(model)
    with pytest.raises(SurgeryError) as e:
        yolov8_decode(model)
    assert message in str(e.value)


def test_preset_takes_a_shape_read_of_the_dfl_as_no_second_detections_output():
    model = synth()
    model.graph.node.append(helper.make_node("Shape", ["/model.22/dfl/conv/Conv_output_0"], ["dfl_shape"], name="dfl_shape"))
    model.graph.output.append(helper.make_tensor_value_info("dfl_shape", TensorProto.INT64, [4]))
    match = yolov8_decode(model)
    assert match.inputs == tuple(head_names()) and match.outputs == ("output0",)


def test_preset_takes_a_one_channel_conv_of_weight_zero_for_no_dfl():
    # Its weight is arange(1), but one bin is no distribution: the DFL is still the one conv.
    model = synth()
    model.graph.initializer.append(numpy_helper.from_array(np.zeros((1, 1, 1, 1), np.float32), "w_one"))
    model.graph.node.append(helper.make_node("Conv", ["/model.22/dfl/conv/Conv_output_0", "w_one"], ["one"], name="one"))
    match = yolov8_decode(model)
    assert match.inputs == tuple(head_names()) and match.facts["reg_max"] == 16


def test_preset_without_a_known_image_input_leaves_the_strides_unknown():
    # Two 4-D inputs are blended into the stem: neither is the image, so no level's stride is known
    # and there is no decode to check the cut against.
    model = synth()
    model.graph.node[0].input[0] = "blend"
    model.graph.node.insert(0, helper.make_node("Add", ["images", "overlay"], ["blend"], name="blend"))
    model.graph.input.append(helper.make_tensor_value_info("overlay", TensorProto.FLOAT, ["batch", 3, IMGSZ, IMGSZ]))
    site = decode_plan(model).step("decode")
    assert site.facts["strides"] == [None, None, None] and site.facts["input"] is None
    assert [i.name for i in site.reference.graph.input] == head_names()


def test_preset_takes_the_image_input_beside_an_input_of_another_rank():
    # A gain [1] multiplied into the images feeds the head too, but only a 4-D input is the image.
    model = synth()
    model.graph.node[0].input[0] = "gained"
    model.graph.node.insert(0, helper.make_node("Mul", ["images", "gain"], ["gained"], name="gain"))
    model.graph.input.append(helper.make_tensor_value_info("gain", TensorProto.FLOAT, [1]))
    facts = yolov8_decode(model).facts
    assert (facts["strides"], facts["input"]) == (STRIDES, "images")


def test_preset_names_the_level_sizes_after_the_image_dims():
    model = synth(dynamic=True)
    for dim, name in zip(model.graph.input[0].type.tensor_type.shape.dim[2:], ("H", "W")):
        dim.dim_param = name
    facts = yolov8_decode(model).facts
    assert [(lv["height"], lv["width"]) for lv in facts["levels"]] == [(f"H/{s}", f"W/{s}") for s in STRIDES]
    assert facts["input_size"] == ["H", "W"]


def test_preset_dtype_facts_name_the_head_and_the_output_apart():
    model = synth()  # output0 made in float16 from float32 head maps
    concat = next(n for n in model.graph.node if "output0" in n.output)
    for i, name in enumerate(list(concat.input)):
        model.graph.node.append(helper.make_node("Cast", [name], [f"{name}_fp16"], name=f"cast_{i}", to=TensorProto.FLOAT16))
        concat.input[i] = f"{name}_fp16"
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    assert decode_plan(model).step("decode").facts["dtypes"] == {"head": "float32", "output": "float16"}


def _anchor_concats(m):  # the box then the class maps' level flattening (Concat along axis 2)
    return [n for n in m.graph.node if n.op_type == "Concat" and n.attribute[0].i == 2]


def test_preset_takes_a_level_flattening_along_axis_minus_one():
    model = synth()
    for cat in _anchor_concats(model):  # [B, C, H*W] maps: axis -1 is axis 2
        cat.attribute[0].i = -1
    match = yolov8_decode(model)
    assert match.inputs == tuple(head_names()) and match.facts["strides"] == STRIDES


def _class_levels_swapped(m):  # box maps in level order, class maps of levels 0 and 1 swapped
    cat = _anchor_concats(m)[-1]
    cat.input[0], cat.input[1] = cat.input[1], cat.input[0]


def _levels_swapped(m):  # levels 0 and 1 swapped in every flattening: stride 16 first, the anchors stride 8 first
    for cat in _anchor_concats(m):
        cat.input[0], cat.input[1] = cat.input[1], cat.input[0]


def _class_first_in_level(m):  # split layout: Concat(cls_0, box_0), so the Split hands the DFL class logits
    cat = next(n for n in m.graph.node if n.op_type == "Concat" and n.attribute[0].i == 1 and "cv2.0" in n.input[0])
    cat.input[0], cat.input[1] = cat.input[1], cat.input[0]


def _scores_first(m):  # output0 = Concat(scores, boxes)
    last = next(n for n in m.graph.node if "output0" in n.output)
    last.input[0], last.input[1] = last.input[1], last.input[0]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("layout, edit, message", [
    ("separate", _class_levels_swapped, "box map '{box0}' {hw0} and class map '{cls1}' {hw1} sit at one level but "
                                        "differ in size: the graph pairs maps of different levels"),
    ("separate", _levels_swapped, "the levels are not in ascending stride order (sizes [{hw1}, {hw0}, {hw2}] of "
                                  "['{box1}', '{box0}', '{box2}']), as the anchors are"),
    ("split", _levels_swapped, "the levels are not in ascending stride order"),
    ("split", _class_first_in_level, "the per-level Concat '/model.22/Concat' takes class map '{cls0}' before box "
                                     "map '{box0}'; the box channels come first"),
    ("separate", _scores_first, "detections output 'output0' concatenates ['/model.22/Sigmoid_output_0', "
                                "'/model.22/Mul_{mul}output_0']; the kernel writes the boxes (the DFL's path) first"),
])
def test_preset_refuses_maps_the_graph_pairs_or_orders_unlike_the_kernel(layout, edit, message, dynamic):
    """Each edit leaves a valid model that ONNX Runtime runs, but whose output0 is not the kernel's decode
    of the maps in the preset's order (taken before, off by hundreds of pixels or out of bounds): a
    level's box and class maps of two sizes, levels out of the anchors' order, class channels where the
    Split takes box ones, scores before boxes."""
    model = synth(head_layout=layout, dynamic=dynamic)
    edit(model)
    x = np.random.default_rng(3).random((1, 3, IMGSZ, IMGSZ), dtype=np.float32)
    assert ort_session(model).run(None, {"images": x})[0].shape == (1, 84, 2100)  # still runs
    box, cls = head_names()[0::2], head_names()[1::2]
    hw = ([[76, 72], [38, 36], [19, 18]] if dynamic else [[40, 40], [20, 20], [10, 10]])  # at the first shape probe
    names = {f"{k}{i}": v for k, vs in (("box", box), ("cls", cls), ("hw", hw)) for i, v in enumerate(vs)}
    with pytest.raises(SurgeryError) as e:
        yolov8_decode(model)
    assert message.format(**names, mul="3_" if dynamic else "") in str(e.value)


def _nested_class_levels(m):  # Concat(Concat(cls_0, cls_1), cls_2): the same anchors, but cls_2 second in its Concat
    cat = _anchor_concats(m)[-1]
    m.graph.node.append(helper.make_node("Concat", list(cat.input[:2]), ["cls_01"], name="cls_01", axis=2))
    cat.input[:] = ["cls_01", cat.input[2]]


def _level_gap(m, box_at: int, cls_at: int):  # an empty tensor put in each flattening, before or after the levels
    for cat, c, at in zip(_anchor_concats(m), (64, 80), (box_at, cls_at)):
        m.graph.initializer.append(numpy_helper.from_array(np.zeros((1, c, 0), np.float32), f"empty_{c}"))
        cat.input.insert(at, f"empty_{c}")


@pytest.mark.parametrize("edit, message", [
    (_nested_class_levels, "two cls maps at one level: '{cls1}' and '{cls2}'"),
    (lambda m: _level_gap(m, 0, 0), "head maps do not pair up as one box and one class map per level: "
                                    "{{1: {{'box': '{box0}', 'cls': '{cls0}'}}, 2: {{'box': '{box1}', 'cls': '{cls1}'}}, "
                                    "3: {{'box': '{box2}', 'cls': '{cls2}'}}}}"),
    (lambda m: _level_gap(m, 0, 3), "head maps do not pair up as one box and one class map per level: "
                                    "{{0: {{'cls': '{cls0}'}}, 1: {{'box': '{box0}', 'cls': '{cls1}'}}"),
], ids=["two_at_one_level", "no_level_0", "unpaired"])
def test_preset_refuses_head_maps_it_cannot_pair_by_level(edit, message):
    """Levels are the maps' places in their flattening Concat: a map second in a nested Concat, or an
    extra tensor before or after the levels, leaves maps it cannot pair; it names them, not a KeyError."""
    model = synth(batch=1)
    edit(model)
    x = np.random.default_rng(4).random((1, 3, IMGSZ, IMGSZ), dtype=np.float32)
    assert ort_session(model).run(None, {"images": x})[0].shape == (1, 84, 2100)  # still runs
    names = {f"{k}{i}": v for k, vs in (("box", head_names()[0::2]), ("cls", head_names()[1::2])) for i, v in enumerate(vs)}
    with pytest.raises(SurgeryError) as e:
        yolov8_decode(model)
    assert message.format(**names) in str(e.value)


def test_preset_takes_a_dfl_softmax_written_as_exp_reducesum_div():
    model = synth()
    sm = next(n for n in model.graph.node if n.op_type == "Softmax")  # over the bins, axis 1
    x, y = sm.input[0], sm.output[0]
    model.graph.initializer.append(numpy_helper.from_array(np.array([1], np.int64), "bins_axis"))
    at = list(model.graph.node).index(sm)
    model.graph.node.remove(sm)
    for k, node in enumerate([helper.make_node("Exp", [x], ["dfl_exp"], name="dfl_exp"),
                              helper.make_node("ReduceSum", ["dfl_exp", "bins_axis"], ["dfl_sum"], name="dfl_sum"),
                              helper.make_node("Div", ["dfl_exp", "dfl_sum"], [y], name="dfl_div")]):
        model.graph.node.insert(at + k, node)
    images = np.random.default_rng(5).random((1, 3, IMGSZ, IMGSZ), dtype=np.float32)
    expected = ort_session(synth()).run(None, {"images": images})[0]
    np.testing.assert_allclose(ort_session(model).run(None, {"images": images})[0], expected, rtol=1e-5, atol=1e-3)
    match = yolov8_decode(model)
    assert match.inputs == tuple(head_names()) and match.facts["strides"] == STRIDES
    assert check_reassembly(decode_plan(model), model, seed=3, samples=1).passed


@pytest.mark.parametrize("first", [False, True], ids=["after", "before"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_the_image_input_is_the_one_the_head_is_computed_from(first, dynamic):
    """A second 4-D input that nothing of the head reads (a mask, say) left every stride unknown: the
    kernel got strides [None, None, None]. 320 / 40, 20, 10 (the head maps' sides) are 8, 16, 32."""
    model = synth(dynamic=dynamic)
    mask = helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 1, 16, 16])
    model.graph.input.insert(0, mask) if first else model.graph.input.append(mask)
    facts = yolov8_decode(model).facts
    assert (facts["strides"], facts["input"]) == (STRIDES, "images")
    assert [(lv["stride"], lv["height"]) for lv in facts["levels"]] == (
        [(8, "height/8"), (16, "height/16"), (32, "height/32")] if dynamic else [(8, 40), (16, 20), (32, 10)])


def _scale_initializers(m, wanted, factor: float, *, add: float = 0.0):  # each initializer `wanted(value)` picks
    for t in m.graph.initializer:
        v = numpy_helper.to_array(t)
        if v.dtype == np.float32 and wanted(t.name, v):
            t.CopyFrom(numpy_helper.from_array((v * factor + add).astype(np.float32), t.name))


def _anchors_at_corners(m):  # x, y instead of x + 0.5, y + 0.5: baked anchors, or the Range's + 0.5
    _scale_initializers(m, lambda name, v: name == "/model.22/anchors" or (v.size == 1 and v.item() == 0.5), 1.0,
                        add=-0.5)


def _strides_doubled(m):  # 16, 32, 64 where the maps are 8, 16, 32 pixels a cell
    _scale_initializers(m, lambda name, v: name == "/model.22/strides" or (v.shape == (1, 1) and v.item() in STRIDES), 2)


def _boxes_xyxy(m):  # dist2bbox(xywh=False): x1, y1, x2, y2 where the kernel writes cx, cy, w, h
    cat = next(n for n in m.graph.node if n.op_type == "Concat" and n.input[1].startswith("/model.22/Sub_"))
    div, wh = (next(n for n in m.graph.node if t in n.output) for t in cat.input)
    centre_sum = next(n for n in m.graph.node if div.input[0] in n.output)
    cat.input[:] = [wh.input[1], wh.input[0]]
    for dead in (div, centre_sum, wh):
        m.graph.node.remove(dead)


def _scores_tempered(m):  # sigmoid(logits / 2)
    sig = next(n for n in m.graph.node if n.name == "/model.22/Sigmoid")
    m.graph.initializer.append(numpy_helper.from_array(np.array(2.0, np.float32), "temperature"))
    m.graph.node.insert(list(m.graph.node).index(sig),
                        helper.make_node("Div", [sig.input[0], "temperature"], ["tempered"], name="tempered"))
    sig.input[0] = "tempered"


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("edit, rows", [
    (_anchors_at_corners, {"cx", "cy"}),
    (_strides_doubled, {"cx", "cy", "w", "h"}),
    (_boxes_xyxy, {"cx", "cy", "w", "h"}),
    (_scores_tempered, {f"class {k} score" for k in range(80)}),
])
def test_preset_refuses_a_decode_that_computes_other_boxes_or_scores(edit, rows, dynamic):
    """The structure of each edit is ultralytics' (DFL, Sub/Add against anchors, stride Mul, Sigmoid), and
    ONNX Runtime runs it, but its output0 is not what the kernel computes: the cut's reference is run on
    seeded head maps against ultralytics' decode, so a build without a GPU (which never runs the kernel)
    refuses it too, naming a value that differs."""
    model = synth(dynamic=dynamic)
    edit(model)
    x = np.random.default_rng(6).random((1, 3, IMGSZ, IMGSZ), dtype=np.float32)
    before = ort_session(synth(dynamic=dynamic)).run(None, {"images": x})[0]
    after = ort_session(model).run(None, {"images": x})[0]
    assert after.shape == before.shape and not np.allclose(after, before, atol=0.01)  # runs, decodes otherwise
    with pytest.raises(SurgeryError) as e:
        decode_plan(model)
    msg = str(e.value)
    assert msg.startswith("cut 'decode': preset 'yolov8_decode': the cut computes another decode than "
                          "ultralytics' (DFL expectation, dist2bbox against the cell centres x + 0.5, y + 0.5, "
                          "times strides [8, 16, 32], sigmoid scores)"), msg
    found = re.search(r"its (.+) at anchor (\d+) of image ([01]) is (\S+), ultralytics' (\S+)\. ", msg)
    assert found and found[1] in rows, msg
    if edit is _anchors_at_corners:  # half a cell of the anchor's level, toward the origin
        ends = np.cumsum([76 * 72, 38 * 36] if dynamic else [40 * 40, 20 * 20])  # at the first shape probe
        stride = STRIDES[int(np.searchsorted(ends, int(found[2]), side="right"))]
        assert float(found[4]) - float(found[5]) == pytest.approx(-0.5 * stride, abs=0.01)


def test_the_decode_check_takes_the_rounding_of_an_fp16_decode():
    """An fp16 decode (boxes rounded to ~0.06 of a cell, scores to ~1e-3) is ultralytics' decode: the check's
    tolerance is in cells of each level, and half a cell (the corner anchors above) stays beyond it."""
    site = decode_plan(synth()).step("decode")
    fp16 = apply_precision(site.reference, "fp16")
    assert {i.type.tensor_type.elem_type for i in fp16.graph.input} == {TensorProto.FLOAT}  # the rewrite is inside
    assert any(t.type.tensor_type.elem_type == TensorProto.FLOAT16 for t in fp16.graph.value_info)
    shapes = [(2, 64 if k % 2 == 0 else 80, IMGSZ // s, IMGSZ // s) for s in STRIDES for k in range(2)]
    check_detect_decode(fp16, shapes, STRIDES, 16)
    with pytest.raises(SurgeryError, match="the cut computes another decode"):
        check_detect_decode(fp16, shapes, [s * 1.0625 for s in STRIDES], 16)


def _scores_of_the_first_image(m):  # every image's class logits are image 0's, broadcast over the batch
    sig = next(n for n in m.graph.node if n.name == "/model.22/Sigmoid")
    logits = sig.input[0]
    m.graph.initializer.extend([numpy_helper.from_array(np.array([0], np.int64), "image_0"),
                                numpy_helper.from_array(np.array(0.0, np.float32), "nought")])
    at = list(m.graph.node).index(sig)
    for k, node in enumerate([helper.make_node("Gather", [logits, "image_0"], ["first"], name="first", axis=0),
                              helper.make_node("Mul", [logits, "nought"], ["none"], name="none"),
                              helper.make_node("Add", ["first", "none"], ["mixed"], name="mixed")]):
        m.graph.node.insert(at + k, node)
    sig.input[0] = "mixed"


def test_preset_refuses_a_decode_that_mixes_the_images_of_a_batch():
    """At batch 1 this is ultralytics' decode; the check decodes two images, and image 1's scores are not its own."""
    model = synth()
    _scores_of_the_first_image(model)
    x = np.random.default_rng(8).random((2, 3, IMGSZ, IMGSZ), dtype=np.float32)
    out = ort_session(model).run(None, {"images": x})[0]
    np.testing.assert_array_equal(out[1, 4:], out[0, 4:])  # it runs, and image 1 has image 0's scores
    with pytest.raises(SurgeryError, match=r"the cut computes another decode .* its class \d+ score at anchor \d+ "
                                           r"of image 1 is"):
        decode_plan(model)


def _anchors_shifted(m, dx: float, dy: float):  # the static anchors moved by (dx, dy) cells
    t = next(t for t in m.graph.initializer if t.name == "/model.22/anchors")
    v = numpy_helper.to_array(t) + np.array([dx, dy], np.float32)[None, :, None]
    t.CopyFrom(numpy_helper.from_array(v.astype(np.float32), t.name))


def _class_7_biased(m):  # 0.15 added to class 7's logits: its scores off by up to 0.04
    sig = next(n for n in m.graph.node if n.name == "/model.22/Sigmoid")
    bias = np.zeros((1, 80, 1), np.float32)
    bias[0, 7] = 0.15
    m.graph.initializer.append(numpy_helper.from_array(bias, "class_bias"))
    m.graph.node.insert(list(m.graph.node).index(sig), helper.make_node("Add", [sig.input[0], "class_bias"], ["biased"]))
    sig.input[0] = "biased"


def _scores_nan_below_half(m):  # score + 0 * log(score - 0.5): the same scores above 0.5, NaN below
    sig = next(n for n in m.graph.node if n.name == "/model.22/Sigmoid")
    cat = next(n for n in m.graph.node if "output0" in n.output)
    m.graph.initializer.extend([numpy_helper.from_array(np.array(0.5, np.float32), "half"),
                                numpy_helper.from_array(np.array(0.0, np.float32), "nil")])
    m.graph.node.extend([helper.make_node("Sub", [sig.output[0], "half"], ["centred"]),
                         helper.make_node("Log", ["centred"], ["log"]),
                         helper.make_node("Mul", ["log", "nil"], ["nought_or_nan"]),
                         helper.make_node("Add", [sig.output[0], "nought_or_nan"], ["scores_or_nan"])])
    cat.input[1] = "scores_or_nan"


def _dfl_logits_clipped(m):  # the DFL logits clipped to [-3, 3]: the same decode while they stay inside
    sm = next(n for n in m.graph.node if n.op_type == "Softmax")
    m.graph.initializer.extend([numpy_helper.from_array(np.array(v, np.float32), n) for v, n in ((-3, "lo"), (3, "hi"))])
    m.graph.node.insert(list(m.graph.node).index(sm), helper.make_node("Clip", [sm.input[0], "lo", "hi"], ["clipped"]))
    sm.input[0] = "clipped"


@pytest.mark.parametrize("edit, rows", [
    (lambda m: _anchors_shifted(m, -0.5, 0.0), {"cx"}),
    (lambda m: _anchors_shifted(m, 0.3, 0.3), {"cx", "cy"}),
    (_class_7_biased, {"class 7 score"}),
    (_scores_nan_below_half, {f"class {k} score" for k in range(80)}),
    (_dfl_logits_clipped, {"cx", "cy", "w", "h"}),
], ids=["x_at_corners", "three_tenths_of_a_cell", "class_7_biased", "nan_scores", "dfl_clipped"])
def test_the_decode_check_names_what_differs_past_its_tolerance(edit, rows):
    """Each decode is off by a third of a cell or more, by 0.04 in one class's scores, NaN in some, or only
    where a head map's logits are large: the check refuses it and names the row that differs."""
    model = synth()
    edit(model)
    with pytest.raises(SurgeryError, match="the cut computes another decode") as e:
        decode_plan(model)
    found = re.search(r"its (.+) at anchor \d+ of image [01] is", str(e.value))
    assert found and found[1] in rows, str(e.value)


def test_the_decode_check_refuses_an_output_of_another_shape():
    site = decode_plan(synth()).step("decode")
    shapes = [(2, 64 if k % 2 == 0 else 80, IMGSZ // s, IMGSZ // s) for s in STRIDES for k in range(2)]
    with pytest.raises(SurgeryError, match=r"the cut's output is \[2, 84, 2100\] on head maps \[\[2, 64, 40, 40\], .*; "
                                           r"ultralytics' decode gives \[2, 84, 2000\]"):
        check_detect_decode(site.reference, shapes, STRIDES[:2], 16)
