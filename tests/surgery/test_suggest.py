"""Suggested cuts: the small-kernel wall of the synthetic YOLOv8 is the decode the preset finds, and
every suggestion is a cut surgery accepts as it stands."""
from __future__ import annotations

import numpy as np
import pytest
import yaml
from conftest_models import chain_model, make_model, two_cut_model
from onnx import TensorProto, helper, numpy_helper

from deepjit_compiler.model.synth import synthesize_yolov8
from deepjit_compiler.surgery.cut import plan_from_model
from deepjit_compiler.surgery.plan import CutRequest, KernelRequest
from deepjit_compiler.surgery.presets import yolov8_decode
from deepjit_compiler.surgery.suggest import format_suggestions, suggest_cuts
from deepjit_compiler.validation.graph import check_reassembly


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("layout", ["separate", "split"])
def test_top_suggestion_on_yolov8_is_the_decode(layout, dynamic):
    model = synthesize_yolov8("yolov8n", head_layout=layout, dynamic=dynamic, imgsz=320)
    found = suggest_cuts(model)
    match = yolov8_decode(model)
    top = found[0]
    assert (top.inputs, top.outputs) == (match.inputs, match.outputs)
    assert top.preset == "yolov8_decode" and top.position == "tail"
    assert top.nodes > 20 and top.ops["Reshape"] >= 4 and top.ops["Softmax"] == 1 and top.ops["Conv"] == 1
    assert top.nodes > 4 * found[1].nodes  # the wall stands out from the SiLU/C2f crumbs
    assert [s.nodes for s in found] == sorted((s.nodes for s in found), reverse=True)
    spec = yaml.safe_load(top.yaml_snippet(name="decode"))
    assert spec == {"cuts": [{"name": "decode", "preset": "yolov8_decode", "kernels": [{"contract": "yolov8_decode"}]}]}
    assert top.yaml_snippet().startswith("# preset 'yolov8_decode' finds this boundary: 6 inputs -> output0\n")
    mine = yaml.safe_load(top.yaml_snippet(contract="my_decode"))["cuts"][0]["kernels"]
    assert mine == [{"contract": "my_decode"}]  # a contract given wins over the preset's


def test_suggestion_round_trips_through_surgery():
    # The snippet's boundary cuts cleanly and reassembles bit for bit.
    top = suggest_cuts(chain_model())[0]
    assert (top.inputs, top.outputs, top.nodes, top.position) == (("a",), ("mid",), 5, "middle")
    assert top.ops == {"Sigmoid": 1, "Mul": 1, "Reshape": 2, "Softmax": 1}
    cut = yaml.safe_load(top.yaml_snippet(name="wall", contract="my_kernel"))["cuts"][0]
    assert cut == {"name": "wall", "inputs": ["a"], "outputs": ["mid"], "kernels": [{"contract": "my_kernel"}]}
    plan = plan_from_model(chain_model(), [CutRequest(cut["name"], inputs=cut["inputs"], outputs=cut["outputs"],
                                                      kernels=(KernelRequest("my_kernel"),))])
    assert check_reassembly(plan, chain_model(), seed=0, samples=1).passed


def test_regions_between_heavy_ops_are_found_and_ranked():
    found = suggest_cuts(two_cut_model())  # as many nodes: the one nearer the outputs first
    assert [(s.inputs, s.outputs, s.nodes) for s in found] == [(("b",), ("m2",), 2), (("a",), ("m1",), 2)]
    # The lone Add after the last conv is a single launch: not worth a kernel by default.
    assert all(s.nodes >= 2 for s in found)
    assert len(suggest_cuts(two_cut_model(), min_nodes=1)) == 3


def c2f_model():
    """A C2f-like block: Split -> conv -> Concat(split outputs, conv output). {Split, Concat} is a
    connected cheap region, but not convex (a path leaves through the conv and comes back)."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 4, 3, 3)).astype(np.float32), "w")
    sizes = numpy_helper.from_array(np.array([4, 4], np.int64), "sizes")
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Split", ["r", "sizes"], ["s0", "s1"], name="split", axis=1),
             helper.make_node("Conv", ["s1", "w"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["cs"], name="sigmoid"),
             helper.make_node("Concat", ["s0", "s1", "cs"], ["y"], name="concat", axis=1)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, 6, 6])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 12, 6, 6])], [w, sizes])


def test_non_convex_regions_are_split_into_cuttable_pieces():
    found = suggest_cuts(c2f_model(), min_nodes=1)
    assert {(s.inputs, s.outputs) for s in found} == {(("x",), ("s0", "s1")), (("c", "s0", "s1"), ("y",))}
    by_out = {s.outputs: s for s in found}
    assert by_out[("s0", "s1")].position == "head" and by_out[("y",)].position == "tail"
    for s in found:  # each one cuts as it stands
        plan = plan_from_model(c2f_model(), [CutRequest("w", inputs=s.inputs, outputs=s.outputs,
                                                        kernels=(KernelRequest("k"),))])
        assert check_reassembly(plan, c2f_model(), seed=0, samples=1).passed


def test_a_region_that_reads_a_model_input_and_makes_a_model_output_is_at_the_tail():
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"], name="sigmoid"), helper.make_node("Mul", ["x", "s"], ["y"], name="mul")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    [only] = suggest_cuts(model)
    assert (only.inputs, only.outputs, only.position) == (("x",), ("y",), "tail")
    assert only.to_dict() == {"inputs": ["x"], "outputs": ["y"], "nodes": 2, "ops": {"Sigmoid": 1, "Mul": 1},
                              "position": "tail", "preset": None, "yaml": only.yaml_snippet()}


def test_a_shape_read_no_input_can_stand_in_for_becomes_an_input():
    # Shape(a)[1] reads a's 8 channels; g has 2, so the suggestion lists 'a' too, and cuts as it stands.
    rng = np.random.default_rng(9)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 4, 1, 1)).astype(np.float32), "w0"),
             numpy_helper.from_array(rng.standard_normal((2, 8, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(np.array([1], np.int64), "channel")]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["a"], name="conv0"), helper.make_node("Conv", ["a", "w1"], ["g"], name="conv1", pads=[1] * 4),
             helper.make_node("Shape", ["a"], ["shape_a"], name="shape"),
             helper.make_node("Gather", ["shape_a", "channel"], ["c"], name="gather", axis=0),
             helper.make_node("Cast", ["c"], ["cf"], name="cast", to=TensorProto.FLOAT),
             helper.make_node("Sigmoid", ["g"], ["sg"], name="sigmoid"), helper.make_node("Mul", ["sg", "cf"], ["y"], name="mul")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 6])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 6, 6])], inits)
    top = suggest_cuts(model)[0]
    assert (top.inputs, top.outputs) == (("g", "a"), ("y",))
    plan = plan_from_model(model, [CutRequest("w", inputs=top.inputs, outputs=top.outputs, kernels=(KernelRequest("k"),))])
    assert check_reassembly(plan, model, seed=0, samples=1).passed


def test_pieces_of_a_non_convex_region_are_connected():
    # y = Tanh(x) + Relu(x) * Sigmoid(conv(Relu(x))): Relu and Tanh share a depth but no edge, so each is
    # a piece of its own (one node: not suggested), not one kernel of two unrelated ops.
    w = numpy_helper.from_array(np.random.default_rng(10).standard_normal((4, 4, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Relu", ["x"], ["p"], name="relu"), helper.make_node("Tanh", ["x"], ["q"], name="tanh"),
             helper.make_node("Conv", ["p", "w"], ["c"], name="conv", pads=[1] * 4), helper.make_node("Sigmoid", ["c"], ["cs"], name="sigmoid"),
             helper.make_node("Mul", ["p", "cs"], ["m"], name="mul"), helper.make_node("Add", ["q", "m"], ["y"], name="add")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 6])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 6, 6])], [w])
    assert [(s.inputs, s.outputs) for s in suggest_cuts(model)] == [(("c", "p", "q"), ("y",))]
    assert {(s.inputs, s.outputs) for s in suggest_cuts(model, min_nodes=1)} >= {(("x",), ("p",)), (("x",), ("q",))}


@pytest.mark.parametrize("c_in, c_out, group, cheap", [(64, 4, 1, True), (65, 4, 1, False), (64, 5, 1, False),
                                                       (64, 4, 2, False)])
def test_a_narrow_1x1_conv_is_a_cheap_op(c_in, c_out, group, cheap):
    # Relu -> 1x1 Conv -> Sigmoid is one region of three when the conv is cheap, two single nodes when it is not.
    w = numpy_helper.from_array(np.random.default_rng(11).standard_normal((c_out, c_in // group, 1, 1)).astype(np.float32), "w")
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Conv", ["r", "w"], ["c"], name="conv", group=group),
             helper.make_node("Sigmoid", ["c"], ["y"], name="sigmoid")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c_in, 6, 6])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", c_out, 6, 6])], [w])
    assert [s.nodes for s in suggest_cuts(model)] == ([3] if cheap else [])


def test_format_suggestions_prints_boundary_mix_and_yaml():
    text = format_suggestions(suggest_cuts(chain_model()))
    assert text.startswith("1. 5 nodes at the middle")
    assert "ops: Reshape x2, Sigmoid x1, Mul x1, Softmax x1" in text  # most common first
    assert "inputs:  a" in text and "outputs: mid" in text and "- name: wall_1" in text
    assert format_suggestions([]) == "no region of cheap ops worth a kernel was found"
    two = suggest_cuts(two_cut_model())
    assert [line[:3] for line in format_suggestions(two, top=1).splitlines() if line[:1].isdigit()] == ["1. "]


def test_format_suggestions_prints_each_note_under_its_suggestion():
    found = suggest_cuts(two_cut_model())
    lines = format_suggestions(found, notes=["removes 2 layers", "removes 3 layers"]).splitlines()
    assert lines[2] == "   removes 2 layers" and lines[0].startswith("1. ")
    second = lines.index(next(line for line in lines if line.startswith("2. ")))
    assert lines[second + 2] == "   removes 3 layers"
