"""ONNX external data: a missing weights file is a clear error (exit 2), never a traceback; present,
the weights travel in the bundle beside the model and the model's sha256 covers them."""
from __future__ import annotations

import hashlib
import re

import numpy as np
import onnx
import pytest
from conftest import run_cli
from conftest_models import tiny_detector
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

from deepjit_compiler.errors import ModelError
from deepjit_compiler.model.info import load_model


def external_detector(folder, location="tiny.onnx.data"):
    model = tiny_detector()
    onnx.save(model, folder / "tiny.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location=location, size_threshold=0)
    return folder / "tiny.onnx"


SPEC = ("name: tiny\nmodel: {path: tiny.onnx}\ntarget: {gpu: T4}\n"
        "inputs:\n  images: {shape: [N, 3, 32, 32], profile: {min: [1, 3, 32, 32], opt: [2, 3, 32, 32], max: [2, 3, 32, 32]}}\n"
        "cuts:\n  - {name: nms, add: after, at: output0, kernels: [{contract: nms, params: {max_det: 20}}]}\n"
        "bundle: {path: out/tiny, reference_model: true}\n")


def test_a_missing_weights_file_is_named(tmp_path):
    path = external_detector(tmp_path)
    (tmp_path / "tiny.onnx.data").unlink()
    with pytest.raises(ModelError, match="its weights are stored in 'tiny.onnx.data', which is missing"):
        load_model(path)
    (tmp_path / "spec.yaml").write_text(SPEC)
    for args in (["build", "--dry-run", str(tmp_path / "spec.yaml")], ["inspect", str(path)]):
        r = run_cli(*args)
        assert r.returncode == 2 and "tiny.onnx.data" in r.stderr and "Traceback" not in r.stderr


def test_a_folder_where_the_weights_file_should_be_is_named_as_such(tmp_path):
    """A folder at the weights' location: the message said the file 'is missing', though something is there."""
    path = external_detector(tmp_path)
    (tmp_path / "tiny.onnx.data").unlink()
    (tmp_path / "tiny.onnx.data").mkdir()
    with pytest.raises(ModelError, match=f"its weights are stored in 'tiny.onnx.data', which is not a file in {tmp_path}: "
                                         "copy it beside the model"):
        load_model(path)


@pytest.mark.parametrize("location", ["../../etc/passwd", "/etc/passwd", "..\\..\\w.data", ""])
def test_weights_outside_the_models_folder_are_refused(tmp_path, location):
    (tmp_path / "m").mkdir()
    model = tiny_detector()
    onnx.save(model, tmp_path / "m" / "tiny.onnx", save_as_external_data=True, location="w.data", size_threshold=0)
    header = onnx.load(str(tmp_path / "m" / "tiny.onnx"), load_external_data=False)
    for t in header.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(header, tmp_path / "m" / "tiny.onnx")
    with pytest.raises(ModelError, match=re.escape(f"external data location '{location}' is outside the model's folder")):
        load_model(tmp_path / "m" / "tiny.onnx")


def branch_constant_model(folder, values: np.ndarray):
    """y = If(c) then Constant(values) else x, the constant's bytes in `k.bin` beside the model: external
    data held by a node attribute inside a subgraph, not by an initializer."""
    then_g = helper.make_graph([helper.make_node("Constant", [], ["t"], value=numpy_helper.from_array(values, "k"))],
                               "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, [len(values)])])
    else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, [len(values)])])
    graph = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)], "g",
                              [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                               helper.make_tensor_value_info("x", TensorProto.FLOAT, [len(values)])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [len(values)])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    tensor = branch_constant(model)
    (folder / "k.bin").write_bytes(tensor.raw_data)
    set_external_data(tensor, "k.bin")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    onnx.save(model, folder / "m.onnx")
    return folder / "m.onnx"


def branch_constant(model: onnx.ModelProto) -> onnx.TensorProto:
    then_g = next(a.g for a in model.graph.node[0].attribute if a.name == "then_branch")
    return then_g.node[0].attribute[0].t


def test_external_data_of_a_constant_in_a_subgraph_is_loaded_and_named_when_missing(tmp_path):
    values = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    path = branch_constant_model(tmp_path, values)
    np.testing.assert_array_equal(numpy_helper.to_array(branch_constant(load_model(path))), values)
    (tmp_path / "k.bin").unlink()
    with pytest.raises(ModelError, match="its weights are stored in 'k.bin', which is missing"):
        load_model(path)


def test_the_bundle_carries_the_weights_and_hashes_them(tmp_path):
    from deepjit_compiler.build import build_pipeline
    from deepjit_compiler.bundle.folder import read_bundle

    path = external_detector(tmp_path)
    (tmp_path / "spec.yaml").write_text(SPEC)
    result = build_pipeline(tmp_path / "spec.yaml", publish=False)
    view = read_bundle(result.bundle.path)
    data = (tmp_path / "tiny.onnx.data").read_bytes()
    assert view.file("reference/tiny.onnx.data").read_bytes() == data
    want = hashlib.sha256(path.read_bytes() + b"\0tiny.onnx.data\0" + data).hexdigest()
    assert view.manifest["model"]["sha256"] == want
    reference = view.onnx(view.model_file())  # loads with its weights from inside the bundle
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in reference.graph.initializer}
    np.testing.assert_array_equal(weights["w"], onnx.numpy_helper.to_array(tiny_detector().graph.initializer[0]))
