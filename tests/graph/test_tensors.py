"""graph/tensors.py: tensor signatures from value infos, and the subgraphs of a graph."""
from __future__ import annotations

import onnx
import pytest
from conftest_models import F32, make_model
from onnx import TensorProto, helper

from deepjit_compiler.graph.tensors import TensorSig, all_graphs, sig_from_value_info, value_info_map


@pytest.mark.parametrize("shape", [(2, 3, 640, 640), ("batch", 3, "height", "width"), (), None])
def test_a_signature_comes_back_from_its_dict(shape):
    sig = TensorSig("images", "float16", shape)
    assert TensorSig.from_dict(sig.to_dict()) == sig


def test_an_empty_dim_stays_zero():
    vi = helper.make_tensor_value_info("boxes", F32, [0, "n", 4])
    assert sig_from_value_info(vi) == TensorSig("boxes", "float32", (0, "n", 4))


def test_the_graph_inputs_and_outputs_say_more_than_their_value_infos():
    model = make_model([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2])],
                       [helper.make_tensor_value_info("y", F32, [2])])
    # stale entries, as a retyped model can carry
    model.graph.value_info.extend([helper.make_tensor_value_info("x", F32, [2]),
                                   helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2])])
    infos = value_info_map(model)
    assert [infos[n].type.tensor_type.elem_type for n in ("x", "y")] == [TensorProto.FLOAT16, F32]


def body(name: str, nodes=()) -> onnx.GraphProto:
    return helper.make_graph(list(nodes), name, [], [helper.make_tensor_value_info(f"{name}_out", F32, [1])])


def test_all_graphs_walks_nested_subgraphs_depth_first():
    inner = helper.make_node("If", ["c"], ["t_out"], then_branch=body("inner_then"), else_branch=body("inner_else"))
    outer = helper.make_node("If", ["c"], ["y"], then_branch=body("then", [inner]), else_branch=body("else"))
    many = helper.make_node("Multi", ["c"], ["z"], domain="test.graphs")  # an attribute holding several graphs
    many.attribute.append(helper.make_attribute("bodies", [body("first"), body("second")]))
    model = make_model([outer, many], [helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                       [helper.make_tensor_value_info(n, F32, [1]) for n in ("y", "z")], domains=["test.graphs"])
    # make_node sorts attributes by name: else_branch before then_branch
    assert [g.name for g in all_graphs(model.graph)] == ["test", "else", "then", "inner_else", "inner_then",
                                                         "first", "second"]
