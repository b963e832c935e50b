"""jit/traffic.py: the bytes a kernel reads and writes, from its contract's signature. Expected values
are written out from the tensors' shapes (and the issue's own figures: batch 8's head maps take 121 µs
to read at 320 GB/s in fp32, 60 µs in fp16)."""
from __future__ import annotations

import pytest

from deepjit_compiler.errors import RuntimeInputError
from deepjit_compiler.jit.contracts import load_contract, resolve_params
from deepjit_compiler.jit.traffic import kernel_traffic

FACTS = {"reg_max": 16, "num_classes": 80, "strides": [8, 16, 32], "anchors": 8400,
         "levels": [[80, 80], [40, 40], [20, 20]], "input_dtype": "float32"}
T4 = 320e9  # bytes per second
HEAD_VALUES = 144 * 8400  # (4 * 16 + 80) channels over 80^2 + 40^2 + 20^2 anchors, per image
CANDIDATE_ROW = 4 * 4 + 4 + 4 + 4  # box, score, class, anchor index


def decode(dtype: str, **params):
    contract = load_contract("yolov8_decode")
    return contract, resolve_params(contract, {"mode": "candidates", **params}, {**FACTS, "input_dtype": dtype})


@pytest.mark.parametrize("dtype, size, read_us", [("float32", 4, 121.0), ("float16", 2, 60.5)])
def test_the_decode_reads_the_head_maps_once_in_their_dtype(dtype, size, read_us):
    contract, params = decode(dtype, max_candidates=270)
    t = kernel_traffic(contract, params, {"B": 8})
    assert t.read == 8 * HEAD_VALUES * size
    assert t.read / T4 * 1e6 == pytest.approx(read_us, abs=0.1)
    assert t.written == 8 * (4 + 270 * CANDIDATE_ROW)  # the count and the rows the data fills
    assert t.total == t.read + t.written and t.seconds_at(T4) == t.total / T4
    heads = [x for x in t.tensors if x.role == "input"]
    assert [x.name for x in heads] == ["box_0", "box_1", "box_2", "cls_0", "cls_1", "cls_2"]
    assert heads[0].shape == (8, 64, 80, 80) and {x.dtype for x in heads} == {dtype}


def test_a_capacity_buffer_counts_at_its_params_size_and_output0_at_the_models():
    contract, params = decode("float16")  # max_candidates inferred: every anchor
    assert kernel_traffic(contract, params, {"B": 1}).written == 4 + 8400 * CANDIDATE_ROW
    contract, params = decode("float16", mode="output0")
    t = kernel_traffic(contract, params, {"B": 2})
    assert t.written == 2 * 84 * 8400 * 4 and t.read == 2 * HEAD_VALUES * 2


def test_the_nms_reads_the_candidates_and_writes_max_det_rows():
    contract = load_contract("nms")
    params = resolve_params(contract, {"max_det": 100, "max_candidates": 270}, FACTS)
    t = kernel_traffic(contract, params, {"B": 4})
    assert t.read == 4 * (4 + 270 * CANDIDATE_ROW)
    assert t.written == 4 * (4 + 100 * (16 + 4 + 4))


def test_a_dim_nothing_binds_is_an_error_naming_the_tensor():
    contract = load_contract("nms")
    params = resolve_params(contract, {}, {})  # K: taken from the candidate buffers at run time
    with pytest.raises(RuntimeInputError, match=r"kernel nms: input 'cand_boxes'.*not bound"):
        kernel_traffic(contract, params, {"B": 1})
    assert kernel_traffic(contract, params, {"B": 1, "K": 10}).read == 4 + 10 * CANDIDATE_ROW
