"""graph/shapes.py: shape inference, input sizes and strides, symbolic dims named after the inputs."""
from __future__ import annotations

import numpy as np
import onnx
from conftest_models import F32, chain_model, make_model
from onnx import TensorProto, helper, numpy_helper

from deepjit_compiler.graph.shapes import (
    canonical_dims,
    complete_value_info,
    concrete_shapes,
    infer_shapes,
    input_dim_values,
    input_stride,
    shape_skeleton,
)
from deepjit_compiler.graph.tensors import sig_from_value_info, value_info_map


def flatten_model() -> onnx.ModelProto:
    """x [N, 4, 8, 8] -> Reshape to [Shape(x)[0], 256] -> r: its target is computed from x's shape."""
    inits = [numpy_helper.from_array(np.array([0], np.int64), "zero"), numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([256], np.int64), "rest")]
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Slice", ["s", "zero", "one"], ["n"]),
             helper.make_node("Concat", ["n", "rest"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["r"]), helper.make_node("Relu", ["r"], ["y"])]
    return make_model(nodes, [helper.make_tensor_value_info("x", F32, ["N", 4, 8, 8])],
                      [helper.make_tensor_value_info("y", F32, None)], inits)


def test_a_reshape_to_a_target_built_from_shape_ops_gets_its_dims():
    inferred = infer_shapes(flatten_model())
    sigs = {vi.name: sig_from_value_info(vi) for vi in (*inferred.graph.value_info, *inferred.graph.output)}
    assert sigs["r"].shape == ("N", 256) and sigs["y"].shape == ("N", 256)


def test_a_model_local_function_is_inferred_through():
    fn = helper.make_function("local", "Twice", ["i"], ["o"], [helper.make_node("Add", ["i", "i"], ["o"])],
                              [helper.make_opsetid("", 17)])
    model = make_model([helper.make_node("Twice", ["x"], ["a"], domain="local"), helper.make_node("Relu", ["a"], ["y"])],
                       [helper.make_tensor_value_info("x", F32, ["N", 4])], [helper.make_tensor_value_info("y", F32, None)],
                       domains=["local"])
    model.functions.append(fn)
    inferred = infer_shapes(model)
    sigs = {vi.name: sig_from_value_info(vi) for vi in (*inferred.graph.value_info, *inferred.graph.output)}
    assert sigs["a"].shape == ("N", 4) and sigs["y"].shape == ("N", 4)


def test_inferring_again_lists_each_tensor_once():
    twice = infer_shapes(infer_shapes(chain_model()))
    names = [vi.name for vi in twice.graph.value_info]
    assert sorted(names) == ["a", "b", "mid", "r", "sig", "silu", "sm"]


def run_only_model(*tail: onnx.NodeProto) -> onnx.ModelProto:
    """x [N, 1, S, S] -> 3x3 Conv (no padding) -> a -> com.microsoft's Inverse -> b -> `tail` -> y. Inverse is
    unknown to onnx and to ONNX Runtime's symbolic shape inference; its CPU kernel runs (on sides of 3 or more)."""
    w = numpy_helper.from_array(np.random.default_rng(0).uniform(-1, 1, (1, 1, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["a"], kernel_shape=[3, 3]),
             helper.make_node("Inverse", ["a"], ["b"], domain="com.microsoft"), *tail]
    return make_model(nodes, [helper.make_tensor_value_info("x", F32, ["N", 1, "S", "S"])],
                      [helper.make_tensor_value_info("y", F32, None)], [w], domains=["com.microsoft"])


def test_a_tensor_neither_shape_inference_types_is_typed_by_running_the_model():
    model = run_only_model(helper.make_node("Relu", ["b"], ["y"]))
    done, missing = complete_value_info(infer_shapes(model), ["b"])
    b = value_info_map(done)["b"].type.tensor_type
    assert missing == [] and b.elem_type == TensorProto.FLOAT
    assert [d.dim_param or d.dim_value for d in b.shape.dim] == ["b:0", 1, "b:2", "b:3"]  # changed between the runs


def test_a_tensor_whose_rank_changes_with_the_input_size_stays_untyped():
    # Squeeze without axes drops the batch axis at batch 1 only
    model = run_only_model(helper.make_node("Squeeze", ["b"], ["c"]), helper.make_node("Relu", ["c"], ["y"]))
    assert complete_value_info(infer_shapes(model), ["c"])[1] == ["c"]


def test_an_initializer_also_listed_as_an_input_keeps_its_value_in_the_runs():
    # IR < 4 models list every initializer among the graph inputs: the reshape target [0, -1] is not random data
    model = run_only_model(helper.make_node("Reshape", ["b", "target"], ["c"]), helper.make_node("Relu", ["c"], ["y"]))
    model.graph.initializer.append(numpy_helper.from_array(np.array([0, -1], np.int64), "target"))
    model.graph.input.append(helper.make_tensor_value_info("target", TensorProto.INT64, [2]))
    done, missing = complete_value_info(infer_shapes(model), ["c"])
    c = value_info_map(done)["c"].type.tensor_type
    assert missing == [] and [d.dim_param or d.dim_value for d in c.shape.dim] == ["c:0", "c:1"]


def test_each_symbolic_input_dim_gets_its_own_size_and_none_below_32():
    x = helper.make_tensor_value_info("x", F32, ["N", 3, "H", "W"])
    y = helper.make_tensor_value_info("y", F32, ["N", "H", "D1", "D2", "D3"])  # H shared with x
    model = make_model([], [x, y], [])
    values = input_dim_values(model, batch=2, size=96)
    assert set(values) == {"N", "H", "W", "D1", "D2", "D3"} and values["N"] == 2
    sides = [values[k] for k in ("H", "W", "D1", "D2", "D3")]
    assert len(set(sides[:2])) == 2 and all(32 <= v <= 96 and v % 32 == 0 for v in sides)


def test_concrete_shapes_cover_the_weights_and_what_the_batch_makes():
    shapes = concrete_shapes(chain_model(), batch=3)  # x: [N, 4, 8, 8]
    assert shapes["w0"] == (8, 4, 3, 3) and shapes["flat"] == (3,)
    assert shapes["x"] == (3, 4, 8, 8) and shapes["r"] == (3, 8, 64) and shapes["y"] == (3, 8, 8, 8)


def test_boundary_dims_are_named_after_the_input_dims_they_follow():
    # x [N, 3, H, W] -> stride-2 Conv -> a [N, 8, H/2, W/2] -> mean over H and W -> m [N, 8, 1, 1]
    w = numpy_helper.from_array(np.random.default_rng(1).uniform(-1, 1, (8, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["a"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("ReduceMean", ["a"], ["m"], axes=[2, 3], keepdims=1)]
    model = make_model(nodes, [helper.make_tensor_value_info("x", F32, ["N", 3, "H", "W"])],
                       [helper.make_tensor_value_info("m", F32, ["N", "c", "m2", "m3"])], [w], opset=17)
    model.graph.value_info.append(helper.make_tensor_value_info("a", F32, ["unk0", 8, "unk2", "unk3"]))
    named = value_info_map(canonical_dims(model, ["a", "m"]))
    dims = {n: [d.dim_param or d.dim_value for d in named[n].type.tensor_type.shape.dim] for n in ("a", "m")}
    # the 1s of m and its 8 channels follow no input dim by one fixed factor: they keep their names
    assert dims == {"a": ["N", 8, "H/2", "W/2"], "m": ["N", "c", "m2", "m3"]}


def test_an_empty_dim_keeps_its_name():
    # x [N, 4, H] -> Slice 0:0 along H -> e [N, 4, 0], which an exporter left symbolic
    inits = [numpy_helper.from_array(np.array([0], np.int64), n) for n in ("start", "end")]
    inits.append(numpy_helper.from_array(np.array([2], np.int64), "axis"))
    model = make_model([helper.make_node("Slice", ["x", "start", "end", "axis"], ["e"])],
                       [helper.make_tensor_value_info("x", F32, ["N", 4, "H"])],
                       [helper.make_tensor_value_info("e", F32, ["N", 4, "empty"])], inits)
    e = value_info_map(canonical_dims(model, ["e"]))["e"].type.tensor_type
    assert [d.dim_param or d.dim_value for d in e.shape.dim] == ["N", 4, "empty"]


def test_the_stride_counts_a_map_that_is_a_graph_output():
    # x [N, 4, H, W] -> MaxPool /2 -> p -> MaxPool /2 -> q, the output: the coarsest map is 1/4
    pool = {"kernel_shape": [2, 2], "strides": [2, 2]}
    nodes = [helper.make_node("MaxPool", ["x"], ["p"], **pool), helper.make_node("MaxPool", ["p"], ["q"], **pool)]
    model = make_model(nodes, [helper.make_tensor_value_info("x", F32, ["N", 4, "H", "W"])],
                       [helper.make_tensor_value_info("q", F32, None)])
    assert input_stride(shape_skeleton(model), ["x"]) == 4


def test_the_stride_of_one_input_is_not_the_other_inputs():
    # x [N, 4, H, W] -> MaxPool /2 -> p; z [N, 4, S, S] -> MaxPool /4 -> q
    nodes = [helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("MaxPool", ["z"], ["q"], kernel_shape=[4, 4], strides=[4, 4])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", F32, ["N", 4, "H", "W"]),
                               helper.make_tensor_value_info("z", F32, ["N", 4, "S", "S"])],
                       [helper.make_tensor_value_info(n, F32, None) for n in ("p", "q")])
    assert [input_stride(shape_skeleton(model), [n]) for n in ("x", "z")] == [2, 4]


def test_a_map_resized_by_a_factor_that_does_not_divide_the_size_sets_no_stride():
    # x [N, 4, H, W] -> MaxPool /2 -> p; x -> Resize x0.3 -> r (307 at 1024, 614 at 2048: doubles, divides nothing)
    scales = numpy_helper.from_array(np.array([1, 1, 0.3, 0.3], np.float32), "scales")
    nodes = [helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Resize", ["x", "", "scales"], ["r"], mode="nearest")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", F32, ["N", 4, "H", "W"])],
                       [helper.make_tensor_value_info(n, F32, None) for n in ("p", "r")], [scales])
    assert input_stride(shape_skeleton(model), ["x"]) == 2
