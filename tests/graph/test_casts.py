"""graph/casts.py: boundary tensors stored in another float dtype, on ONNX Runtime's CPU provider."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from conftest_models import chain_model, make_model

from deepjit_compiler.graph.casts import cast_inputs, cast_outputs, round_through
from deepjit_compiler.graph.ort import ort_session

F16 = onnx.TensorProto.FLOAT16
BF16 = onnx.TensorProto.BFLOAT16


def run(model: onnx.ModelProto, feed: dict) -> dict[str, np.ndarray]:
    onnx.checker.check_model(model)  # also checks the node order
    sess = ort_session(model)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))


def x_feed(seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).uniform(-2, 2, (2, 4, 8, 8)).astype(np.float32)}


def test_cast_outputs_stores_the_output_rounded_to_fp16():
    model = chain_model()
    want = run(model, x_feed())["y"]
    m16 = cast_outputs(model, {"y": "float16"})
    assert [o.type.tensor_type.elem_type for o in m16.graph.output] == [F16]
    got = run(m16, x_feed())["y"]
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want.astype(np.float16))
    assert not np.array_equal(got.astype(np.float32), want)  # the rounding is real on these values


def test_cast_inputs_takes_fp16_and_computes_as_before_on_its_values():
    model = chain_model()
    x16 = x_feed(1)["x"].astype(np.float16)
    m16 = cast_inputs(model, {"x": "float16"})
    assert [i.type.tensor_type.elem_type for i in m16.graph.input] == [F16]
    np.testing.assert_array_equal(run(m16, {"x": x16})["y"], run(model, {"x": x16.astype(np.float32)})["y"])


def test_round_through_rounds_an_inner_tensor_where_it_is_made():
    model = chain_model()
    with_a = onnx.ModelProto()
    with_a.CopyFrom(model)
    with_a.graph.output.append(onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, ["N", 8, 8, 8]))
    exact = run(with_a, x_feed(2))
    m = round_through(with_a, {"a": "float16"}, {"a": "float32"})
    got = run(m, x_feed(2))
    assert got["a"].dtype == np.float16  # the tensor under its own name is the stored value
    np.testing.assert_array_equal(got["a"], exact["a"].astype(np.float16))
    # what reads it gets the rounded value back in fp32: the same as the model fed that value
    cut = cast_inputs(onnx.utils.Extractor(onnx.shape_inference.infer_shapes(model)).extract_model(["a"], ["y"]),
                      {"a": "float16"})
    np.testing.assert_array_equal(got["y"], run(cut, {"a": got["a"]})["y"])
    assert not np.array_equal(got["y"], exact["y"])


def test_bad_names_and_dtypes_are_refused():
    model = chain_model()
    with pytest.raises(ValueError, match="no graph output named 'z'; outputs: y"):
        cast_outputs(model, {"z": "float16"})
    with pytest.raises(ValueError, match="no graph input named 'y'; inputs: x"):
        cast_inputs(model, {"y": "float16"})
    with pytest.raises(ValueError, match="cannot store a tensor as 'int8'"):
        cast_outputs(model, {"y": "int8"})
    with pytest.raises(ValueError, match="no node of graph 'test' makes it"):
        round_through(model, {"x": "float16"}, {"x": "float32"})


def read_back(model: onnx.ModelProto, name: str, elem_type: int) -> onnx.ModelProto:
    """`model` with a next model wired on that reads its output `name` (of `elem_type`) and gives it as fp32."""
    nxt = make_model([onnx.helper.make_node("Cast", [name], ["back"], to=onnx.TensorProto.FLOAT)],
                     [onnx.helper.make_tensor_value_info(name, elem_type, ["N", 8, 8, 8])],
                     [onnx.helper.make_tensor_value_info("back", onnx.TensorProto.FLOAT, ["N", 8, 8, 8])])
    return onnx.compose.merge_models(model, nxt, io_map=[(name, name)])


def test_cast_outputs_stores_the_output_in_bfloat16():
    model = chain_model()
    want = run(model, x_feed(4))["y"]
    m = cast_outputs(model, {"y": "bfloat16"})
    assert [o.type.tensor_type.elem_type for o in m.graph.output] == [BF16]
    got = run(read_back(m, "y", BF16), x_feed(4))["back"]
    np.testing.assert_array_equal(got, want.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_a_retyped_output_read_by_a_next_model_keeps_no_stale_type():
    model = onnx.shape_inference.infer_shapes(chain_model())
    model.graph.value_info.append(model.graph.output[0])  # as the extractor lists a piece's outputs
    got = run(read_back(cast_outputs(model, {"y": "float16"}), "y", F16), x_feed(5))["back"]
    np.testing.assert_array_equal(got, run(model, x_feed(5))["y"].astype(np.float16).astype(np.float32))


def test_a_shape_inferred_model_is_retyped_without_stale_value_infos():
    # Plan pieces carry value infos (shape inference, the extractor): the retyped names' are dropped.
    model = onnx.shape_inference.infer_shapes(chain_model())
    model.graph.value_info.append(model.graph.output[0])  # as the extractor lists a piece's outputs
    m16 = cast_outputs(model, {"y": "float16"})
    np.testing.assert_array_equal(run(m16, x_feed(3))["y"], run(model, x_feed(3))["y"].astype(np.float16))
    rounded = run(round_through(model, {"a": "float16"}, {"a": "float32"}), x_feed(3))
    assert rounded["y"].dtype == np.float32 and not np.array_equal(rounded["y"], run(model, x_feed(3))["y"])


def test_retyping_errors_name_the_tensor():
    model = chain_model()
    with pytest.raises(ValueError, match="cannot store a tensor as 'int8'"):
        round_through(model, {"a": "int8"}, {"a": "float32"})
    with pytest.raises(ValueError, match="cannot store a tensor as 'int8'"):
        round_through(model, {"a": "float16"}, {"a": "int8"})
    passthrough = chain_model()
    passthrough.graph.output.append(onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4, 8, 8]))
    with pytest.raises(ValueError, match="cannot retype 'x': no node of graph 'test' makes it"):
        cast_outputs(passthrough, {"x": "float16"})
    taken = chain_model()
    for n in taken.graph.node:  # conv1 makes 'y__float32', the name the retyped 'y' would take inside
        n.input[:] = ["y__float32" if i == "b" else i for i in n.input]
        n.output[:] = ["y__float32" if o == "b" else o for o in n.output]
    with pytest.raises(ValueError, match="cannot retype 'y': the graph already has a tensor named 'y__float32'"):
        cast_outputs(taken, {"y": "float16"})
    unused = chain_model()  # an initializer no node reads takes the name too
    unused.graph.initializer.append(onnx.numpy_helper.from_array(np.ones(2, np.float32), "y__float32"))
    with pytest.raises(ValueError, match="cannot retype 'y': the graph already has a tensor named 'y__float32'"):
        cast_outputs(unused, {"y": "float16"})


def test_round_through_rounds_a_nodes_second_output():
    split = onnx.numpy_helper.from_array(np.array([4, 4], np.int64), "halves")
    model = make_model([onnx.helper.make_node("Split", ["x", "halves"], ["s0", "s1"], axis=1),
                        onnx.helper.make_node("Mul", ["s0", "s1"], ["y"])],
                       [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])],
                       [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])], [split])
    x = {"x": np.random.default_rng(6).uniform(-2, 2, (2, 8)).astype(np.float32)}
    got = run(round_through(model, {"s1": "float16"}, {"s1": "float32"}), x)["y"]
    np.testing.assert_array_equal(got, x["x"][:, :4] * x["x"][:, 4:].astype(np.float16).astype(np.float32))
