"""describe_model / load_model on small hand-built graphs and on a synthetic YOLOv8."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from deepjit_compiler.errors import ModelError
from deepjit_compiler.graph.tensors import TensorSig
from deepjit_compiler.model.info import ModelInfo, describe_model, load_model


@pytest.fixture
def tiny() -> onnx.ModelProto:
    """x [N, 3, 8, 8] float32 -> Conv(w 4x3x3x3, b 4) -> Relu -> Add(c) -> y, plus a float16 side
    output and an If whose branches carry one more initializer and node each."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    c = numpy_helper.from_array(rng.standard_normal((1, 4, 1, 1)).astype(np.float32), "c")
    then_g = helper.make_graph(
        [helper.make_node("Identity", ["k1"], ["t_out"])], "then",
        [], [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, [5])],
        [numpy_helper.from_array(np.arange(5, dtype=np.float32), "k1")])
    else_g = helper.make_graph(
        [helper.make_node("Identity", ["k2"], ["e_out"])], "else",
        [], [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, [5])],
        [numpy_helper.from_array(np.ones(5, dtype=np.float32), "k2")])
    cond = numpy_helper.from_array(np.array(True), "cond")
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["h"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Add", ["r", "c"], ["y"], name="add"),
        helper.make_node("Cast", ["y"], ["y16"], name="cast", to=TensorProto.FLOAT16),
        helper.make_node("If", ["cond"], ["z"], name="if", then_branch=then_g, else_branch=else_g),
    ]
    graph = helper.make_graph(
        nodes, "tiny",
        # "w" listed as an input too, as IR < 4 exporters did: it must not show up as a model input.
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 3, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, None]),
         helper.make_tensor_value_info("y16", TensorProto.FLOAT16, None),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [5])],
        [w, b, c, cond])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.x", 1)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="unit", producer_version="1.0")
    model.ir_version = 8
    helper.set_model_props(model, {"k": "v"})
    return model


def test_describe_in_memory(tiny):
    info = describe_model(tiny)
    assert info.path is None
    assert info.producer == "unit 1.0"
    assert (info.ir_version, info.opset) == (8, 17)
    assert dict(info.opsets) == {"": 17, "com.x": 1}
    assert info.inputs == (TensorSig("x", "float32", ("N", 3, 8, 8)),)
    assert info.outputs[0] == TensorSig("y", "float32", ("N", 4, 8, "?"))
    assert info.outputs[1] == TensorSig("y16", "float16", None)
    # 108 + 4 + 4 + 1 at the top, 5 + 5 in the If branches.
    assert info.parameter_count == 4 * 3 * 3 * 3 + 4 + 4 + 1 + 5 + 5
    assert info.node_count == 5 + 2
    assert info.op_histogram() == Counter({"Identity": 2, "Conv": 1, "Relu": 1, "Add": 1, "Cast": 1, "If": 1})
    assert info.ops[0] == ("Identity", 2)
    assert [op for op, _ in info.ops[1:]] == ["Add", "Cast", "Conv", "If", "Relu"]  # ties by name
    assert info.metadata == (("k", "v"),)


def test_info_is_frozen_and_hashable(tiny):
    info = describe_model(tiny)
    with pytest.raises(AttributeError):
        info.node_count = 1
    assert hash(info) == hash(describe_model(tiny))


def test_to_dict_is_json(tiny, tmp_path):
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny, path)
    info = describe_model(path)
    d = json.loads(json.dumps(info.to_dict()))
    assert d["path"] == str(path)
    assert d["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["N", 3, 8, 8]}]
    assert d["outputs"][1] == {"name": "y16", "dtype": "float16", "shape": None}
    assert d["ops"] == {"Identity": 2, "Add": 1, "Cast": 1, "Conv": 1, "If": 1, "Relu": 1}
    assert list(d["ops"]) == [op for op, _ in info.ops]
    assert d["parameter_count"] == info.parameter_count and d["node_count"] == 7
    assert d["metadata"] == {"k": "v"}
    text = info.to_text()
    assert "x float32['N', 3, 8, 8]" in text and "parameters: 127" in text


def test_describe_file_equals_in_memory(tiny, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(tiny, path)
    from_file = describe_model(str(path))
    assert from_file.path == str(path)
    assert from_file.to_dict() | {"path": None} == describe_model(tiny).to_dict()


def test_load_model_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.onnx"
    with pytest.raises(ModelError, match=r"nope\.onnx: no such ONNX model file"):
        load_model(missing)
    with pytest.raises(ModelError, match="is not a file"):
        load_model(tmp_path)
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(ModelError, match=r"empty\.onnx: not an ONNX model"):
        load_model(empty)
    text = tmp_path / "spec.yaml"
    text.write_text("model: yolov8n.onnx\ncuts: []\n")
    with pytest.raises(ModelError, match=r"spec\.yaml: not (a readable )?(an )?ONNX model"):
        describe_model(text)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelError, match=r"junk\.onnx"):
        load_model(junk)


def test_describe_synthetic_yolov8n(tmp_path):
    from deepjit_compiler.model.synth import write_synthetic

    path = write_synthetic("yolov8n", tmp_path / "yolov8n.onnx", seed=0)
    model = onnx.load(path)  # the expectations come from onnx itself, not from modelinfo
    info = describe_model(path)
    assert isinstance(info, ModelInfo)
    assert load_model(path) == model
    assert info.inputs == (TensorSig("images", "float32", ("batch", 3, 640, 640)),)
    assert info.outputs == (TensorSig("output0", "float32", ("batch", 84, 8400)),)
    assert info.opset == 17 and info.ir_version == 8
    assert info.op_histogram() == Counter(n.op_type for n in model.graph.node)
    assert info.node_count == len(model.graph.node)
    sizes = [numpy_helper.to_array(t).size for t in model.graph.initializer]
    assert info.parameter_count == sum(sizes)
    # 3,151,904 weights as ultralytics counts them, plus folded anchors/strides and shape constants.
    assert 3_151_904 + 8400 * 3 <= info.parameter_count < 3_151_904 + 8400 * 3 + 1000
    assert dict(info.metadata)["deepjit.synthetic"] == "yolov8n"
    print(info.to_text())


def relu_model(opset: onnx.OperatorSetIdProto) -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(graph, opset_imports=[opset])
    model.ir_version = 8
    return model


NEWEST = onnx.defs.onnx_opset_version()


@pytest.mark.parametrize("domain, version", [("", 99), ("ai.onnx", NEWEST + 1)])
def test_an_opset_newer_than_onnx_knows_is_named(tmp_path, domain, version):
    """ONNX Runtime refused it inside a stage (exit 3); the model's own load says so (exit 2)."""
    (tmp_path / "m.onnx").write_bytes(relu_model(helper.make_opsetid(domain, version)).SerializeToString())
    with pytest.raises(ModelError, match=rf"m\.onnx: opset {version} is newer than this onnx knows \(up to {NEWEST}\)"):
        load_model(tmp_path / "m.onnx")


def test_the_newest_opset_onnx_knows_loads_and_ai_onnx_is_the_default_domain(tmp_path):
    (tmp_path / "m.onnx").write_bytes(relu_model(helper.make_opsetid("ai.onnx", NEWEST)).SerializeToString())
    info = describe_model(tmp_path / "m.onnx")
    assert (info.opset, info.opsets) == (NEWEST, (("ai.onnx", NEWEST),))


def test_sparse_initializers_count_as_parameters(tiny):
    values = numpy_helper.from_array(np.random.default_rng(2).standard_normal(3).astype(np.float32), "s")
    indices = numpy_helper.from_array(np.array([0, 4, 9], np.int64), "s_idx")
    tiny.graph.sparse_initializer.append(helper.make_sparse_tensor(values, indices, [10]))
    assert describe_model(tiny).parameter_count == 127 + 10


def test_an_input_that_is_not_a_tensor_is_shown_by_its_kind(tiny):
    tiny.graph.input.append(helper.make_tensor_sequence_value_info("frames", TensorProto.FLOAT, None))
    tiny.graph.input.append(helper.make_tensor_value_info("raw", TensorProto.UNDEFINED, [2]))
    assert describe_model(tiny).inputs[1:] == (TensorSig("frames", "sequence_type", None),
                                               TensorSig("raw", "undefined", (2,)))
