"""A pipeline's kernels checked together before any work: thresholds along the chain (jit/thresholds.py) and
one writer per tensor, with a fused mode's other half done by the kernel before it (jit/fused.py)."""
from __future__ import annotations

import pytest

from deepjit_compiler.errors import KernelError
from deepjit_compiler.jit.contracts import load_contract, resolve_params
from deepjit_compiler.jit.fused import check_writers
from deepjit_compiler.jit.thresholds import check_thresholds

FACTS = {"reg_max": 16, "num_classes": 80, "strides": [8, 16, 32], "anchors": 8400,
         "levels": [[80, 80], [40, 40], [20, 20]], "input_dtype": "float32"}
NMS_PARAMS = {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300, "agnostic": False}


def kernel(label: str, contract: str, **params):
    c = load_contract(contract)
    return label, c, resolve_params(c, params, FACTS if contract == "yolov8_decode" else {})


def test_equal_thresholds_along_a_chain_pass_silently():
    assert check_thresholds([kernel("decode", "yolov8_decode", conf_threshold=0.25),
                             kernel("nms", "nms", conf_threshold=0.25)]) == []


def test_a_threshold_above_a_later_readers_is_refused_past_a_kernel_between():
    """The nms reads the decode's candidates although the letterbox comes between them in the list."""
    with pytest.raises(KernelError, match=r"decode's conf_threshold 0\.3 and nms's conf_threshold 0\.25: decode drops "
                                          r"the scores in \(0\.25, 0\.3\] that nms would keep"):
        check_thresholds([kernel("decode", "yolov8_decode", conf_threshold=0.3), kernel("letterbox", "letterbox"),
                          kernel("nms", "nms", conf_threshold=0.25)])


def test_thresholds_of_kernels_that_share_no_tensor_are_not_compared():
    """Two decodes read the head maps and neither reads what the other writes."""
    assert check_thresholds([kernel("a", "yolov8_decode", conf_threshold=0.3),
                             kernel("b", "yolov8_decode", conf_threshold=0.25)]) == []


def test_a_fused_stage_first_in_its_chain_is_refused():
    with pytest.raises(KernelError, match=r"^nms has fused: true, but no kernel comes before it to do its work$"):
        check_writers([kernel("nms", "nms", fused=True, **NMS_PARAMS)])


def test_a_fused_decode_then_its_nms_stage_have_one_writer_each():
    check_writers([kernel("decode", "yolov8_decode", mode="nms", **NMS_PARAMS),
                   kernel("nms", "nms", fused=True, **NMS_PARAMS)])
    with pytest.raises(KernelError, match=r"^nms's max_det is 100 and decode's is 300: with fused: true, decode does "
                                          r"its work, so give both the same max_det$"):
        check_writers([kernel("decode", "yolov8_decode", mode="nms", **NMS_PARAMS),
                       kernel("nms", "nms", fused=True, **{**NMS_PARAMS, "max_det": 100})])
