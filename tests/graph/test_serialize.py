"""graph/serialize.py: the IR version models are saved and run at."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest_models import chain_model
from onnx import helper

from deepjit_compiler.graph.ort import ort_session
from deepjit_compiler.graph.serialize import pin_ir_version, save_model


# IR versions by the ONNX release that brought each opset: opset 17 came with IR 8, opset 21 with IR 10;
# 10 is the newest ONNX Runtime 1.18 reads.
@pytest.mark.parametrize("opset, domain, ir, want", [
    (17, "", 12, 10), (17, "", 9, 9), (17, "", 3, 8), (17, "", 0, 10),
    (21, "", 8, 10), (21, "ai.onnx", 4, 10), (None, "", 5, 5)])
def test_the_ir_version_is_the_models_within_its_opsets_minimum_and_10(opset, domain, ir, want):
    model = chain_model()
    del model.opset_import[:]
    if opset is not None:
        model.opset_import.append(helper.make_opsetid(domain, opset))
    model.ir_version = ir
    assert pin_ir_version(model).ir_version == want


def test_a_saved_model_loads_at_ir_10_and_runs_as_before(tmp_path):
    model = chain_model()
    model.ir_version = 12  # what a newer onnx writes
    x = np.random.default_rng(0).uniform(-2, 2, (2, 4, 8, 8)).astype(np.float32)
    want = ort_session(model).run(None, {"x": x})[0]
    loaded = onnx.load(save_model(model, tmp_path / "m.onnx"))
    assert loaded.ir_version == 10
    np.testing.assert_array_equal(ort_session(loaded).run(None, {"x": x})[0], want)
