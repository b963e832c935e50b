"""graph/index.py: constants, producers and consumers of a GraphSurgeon graph."""
from __future__ import annotations

import numpy as np
import onnx
from conftest_models import F32, chain_model, make_model
from onnx import TensorProto, helper, numpy_helper

from deepjit_compiler.graph.index import GraphIndex, constant_tensors, constant_value, import_graph


def test_constants_give_their_values_in_onnx_dtypes_and_shapes():
    rng = np.random.default_rng(0)
    f, i = float(rng.uniform(-3, 3)), int(rng.integers(1, 100))
    fs, is_ = rng.uniform(-3, 3, 4).astype(np.float32), rng.integers(1, 100, 3)
    nodes = [helper.make_node("Constant", [], ["cf"], value_float=f),
             helper.make_node("Constant", [], ["ci"], value_int=i),
             helper.make_node("Constant", [], ["cfs"], value_floats=fs.tolist()),
             helper.make_node("Constant", [], ["cis"], value_ints=is_.tolist()),
             helper.make_node("Constant", [], ["ct"], value=numpy_helper.from_array(fs, "ct_value")),
             helper.make_node("Identity", ["w"], ["wi"])]
    outputs = [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None)
               for n in ("cf", "ci", "cfs", "cis", "ct", "wi")]
    weight = rng.uniform(-1, 1, (2, 3, 1, 1)).astype(np.float32)
    tensors = import_graph(make_model(nodes, [], outputs, [numpy_helper.from_array(weight, "w")])).tensors()
    want = {"cf": np.float32(f), "ci": np.int64(i), "cfs": fs, "cis": is_.astype(np.int64), "ct": fs, "w": weight}
    for name, value in want.items():
        got = constant_value(tensors[name])
        assert got is not None and got.dtype == value.dtype and got.shape == np.shape(value), name
        np.testing.assert_array_equal(got, value)


def test_an_if_whose_branches_read_a_graph_input_is_not_constant():
    # its only input (the condition) is an initializer; its branches read x from the outer graph
    then = helper.make_graph([helper.make_node("Relu", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", F32, [2])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", F32, [2])])
    model = make_model([helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
                       [helper.make_tensor_value_info("x", F32, [2])], [helper.make_tensor_value_info("y", F32, [2])],
                       [numpy_helper.from_array(np.array(True), "cond")])
    onnx.checker.check_model(model)
    const = constant_tensors(import_graph(model))
    assert "cond" in const and "y" not in const


def resize_model() -> onnx.ModelProto:
    """x -> Resize(x, '', scales) -> y, and a Resize of a weight, grid -> Resize(grid, '', scales) -> g."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
             numpy_helper.from_array(rng.uniform(-1, 1, (1, 3, 4, 4)).astype(np.float32), "grid")]
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["y"], name="up"),
             helper.make_node("Resize", ["grid", "", "scales"], ["g"], name="up_grid")]
    return make_model(nodes, [helper.make_tensor_value_info("x", F32, [1, 3, 4, 4])],
                      [helper.make_tensor_value_info(n, F32, [1, 3, 8, 8]) for n in ("y", "g")], inits)


def test_node_inputs_leave_out_omitted_optional_inputs():
    idx = GraphIndex(resize_model())
    assert idx.ins(0) == ["x", "scales"] and idx.outs(0) == ["y"]
    assert idx.producer("y") == 0 and idx.consumers("scales") == [0, 1] and idx.producer("x") is None


def test_node_outputs_leave_out_omitted_optional_outputs():
    model = make_model([helper.make_node("Dropout", ["x"], ["y", ""], name="drop")],
                       [helper.make_tensor_value_info("x", F32, [2, 3])], [helper.make_tensor_value_info("y", F32, [2, 3])])
    assert GraphIndex(model).outs(0) == ["y"]


def test_a_node_of_constants_and_omitted_inputs_is_constant():
    const = constant_tensors(import_graph(resize_model()))
    assert "g" in const and "y" not in const


def test_constants_are_found_whatever_the_node_order():
    # c -> Neg -> d -> Relu -> e, listed last node first
    value = np.random.default_rng(2).uniform(-1, 1, 3).astype(np.float32)
    nodes = [helper.make_node("Relu", ["d"], ["e"]), helper.make_node("Neg", ["c"], ["d"]),
             helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(value, "c_value"))]
    model = make_model(nodes, [], [helper.make_tensor_value_info("e", F32, [3])])
    assert {"c", "d", "e"} <= constant_tensors(import_graph(model))


def test_one_symbolic_input_among_static_ones_is_probed_at_each_batch():
    model = chain_model()  # x: [N, 4, 8, 8]
    model.graph.input.append(helper.make_tensor_value_info("k", F32, [1]))  # static, read by nothing
    idx = GraphIndex(model)
    assert [s["y"] for s in idx.concrete_shapes()] == [(1, 8, 8, 8), (2, 8, 8, 8)]  # batches 1 and 2
    assert idx.odd_shapes()["y"] == (3, 8, 8, 8)  # the odd probe's batch 3
