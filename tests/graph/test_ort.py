"""graph/ort.py: exact ONNX Runtime sessions and seeded random data."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest_models import chain_model

from deepjit_compiler.graph import ort as graph_ort
from deepjit_compiler.graph.ort import ort_session, random_array


def test_a_session_reads_the_model_at_an_ir_version_onnx_runtime_1_18_takes_and_leaves_it_as_it_was(monkeypatch):
    seen = []
    real = graph_ort.ort.InferenceSession

    def session(data, *args, **kwargs):
        seen.append(onnx.load_from_string(data).ir_version)
        return real(data, *args, **kwargs)

    monkeypatch.setattr(graph_ort.ort, "InferenceSession", session)
    model = chain_model()
    model.ir_version = 12  # what a newer onnx writes
    before = model.SerializeToString()
    x = np.random.default_rng(0).uniform(-2, 2, (2, 4, 8, 8)).astype(np.float32)
    assert ort_session(model).run(None, {"x": x})[0].shape == (2, 8, 8, 8)
    assert seen and seen[0] <= 10
    assert model.SerializeToString() == before


@pytest.mark.parametrize("dtype, low, high, lo, hi", [
    ("float32", None, None, 0.0, 1.0), ("float16", -3.0, -2.0, -3.0, -2.0), ("float64", 5.0, 7.0, 5.0, 7.0),
    ("uint8", None, None, 0, 255), ("uint8", 10, 20, 10, 19),
    ("int64", None, None, 0, 9), ("int32", -5, 5, -5, 4)])
def test_random_array_spans_its_range_in_its_dtype(dtype, low, high, lo, hi):
    a = random_array(np.random.default_rng(0), dtype, (4, 1000), low, high)
    assert a.dtype == np.dtype(dtype) and a.shape == (4, 1000)
    assert lo <= a.min() and a.max() <= hi
    if a.dtype.kind != "f":  # every value of a small integer range turns up in 4000 draws
        assert (a.min(), a.max()) == (lo, hi)
    else:
        assert a.max() - a.min() > 0.9 * (hi - lo)


def test_random_bools_are_both_values():
    a = random_array(np.random.default_rng(1), "bool", (100,))
    assert a.dtype == bool and 20 < a.sum() < 80
