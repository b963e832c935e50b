"""NMS and letterbox references (ONNX graphs run by ONNX Runtime) against the numpy oracles written
from docs/semantics.md, plus hand-worked cases for the rules the oracles could get wrong too."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from deepjit_compiler.errors import SurgeryError
from deepjit_compiler.graph.ort import ort_session
from deepjit_compiler.graph.serialize import MAX_IR_VERSION
from deepjit_compiler.surgery.references import (
    NMS_OUTPUTS,
    letterbox_numpy,
    letterbox_reference,
    nms_numpy,
    nms_reference,
)


def run(model: onnx.ModelProto, **feed) -> dict[str, np.ndarray]:
    sess = ort_session(model)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feed)))


def detections(rng: np.random.Generator, batch: int, nc: int, anchors: int, logit_mean: float = -6.5) -> np.ndarray:
    """Like a trained detector's output0: boxes clustered around a few objects (so NMS has work),
    a few percent of anchors scoring above 0.25."""
    centres = rng.uniform(20, 300, size=(batch, 2, 12))
    pick = rng.integers(0, 12, size=(batch, anchors))
    cxcy = np.take_along_axis(centres, pick[:, None, :].repeat(2, 1), axis=2) + rng.normal(0, 4, (batch, 2, anchors))
    wh = rng.uniform(10, 60, size=(batch, 2, anchors))
    logits = rng.normal(logit_mean, 1.5, size=(batch, nc, anchors))
    return np.concatenate([cxcy, wh, 1 / (1 + np.exp(-logits))], axis=1).astype(np.float32)


def as_output0(rows: list[tuple]) -> np.ndarray:
    """[(cx, cy, w, h, score_0, score_1, ...)] -> [1, 4 + nc, A]."""
    return np.array(rows, np.float32).T[None]


# --- NMS ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("agnostic", [False, True])
@pytest.mark.parametrize("max_det", [300, 7])
def test_nms_matches_oracle(agnostic, max_det):
    rng = np.random.default_rng(11)
    x = detections(rng, batch=2, nc=80, anchors=2100)
    assert 0.005 < (x[:, 4:].max(axis=1) > 0.25).mean() < 0.2  # realistic sparsity
    params = {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": max_det, "agnostic": agnostic}
    got = run(nms_reference(80, **params), output0=x)
    want = nms_numpy(x, **params)
    assert list(got) == list(NMS_OUTPUTS)
    assert (want["num_dets"] > 3).all()
    for name in NMS_OUTPUTS:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_nms_suppresses_within_a_class_only_unless_agnostic():
    # Two identical boxes, best classes 0 and 1; a third box of class 0 overlapping the first.
    x = as_output0([(50, 50, 20, 20, 0.9, 0.1), (50, 50, 20, 20, 0.2, 0.8), (52, 50, 20, 20, 0.7, 0.0)])
    aware = run(nms_reference(2, max_det=10), output0=x)
    assert aware["num_dets"].tolist() == [2]
    np.testing.assert_array_equal(aware["scores"][0, :2], np.float32([0.9, 0.8]))
    assert aware["classes"][0, :2].tolist() == [0, 1]
    np.testing.assert_array_equal(aware["boxes"][0, 0], [40, 40, 60, 60])
    agnostic = run(nms_reference(2, max_det=10, agnostic=True), output0=x)
    assert agnostic["num_dets"].tolist() == [1]
    assert agnostic["classes"][0, 0] == 0
    assert nms_numpy(x, max_det=10)["num_dets"].tolist() == [2]  # the oracle agrees
    assert nms_numpy(x, max_det=10, agnostic=True)["num_dets"].tolist() == [1]


def test_nms_thresholds_are_strict():
    # Score exactly at conf_threshold is dropped. IoU exactly 0.5 (inter 2, union 4) is kept at 0.5.
    x = as_output0([(1, 1, 2, 2, 0.9), (1, 0.5, 2, 1, 0.8), (30, 30, 4, 4, 0.25)])
    out = run(nms_reference(1, conf_threshold=0.25, iou_threshold=0.5, max_det=5), output0=x)
    assert out["num_dets"].tolist() == [2]
    assert nms_numpy(x, conf_threshold=0.25, iou_threshold=0.5, max_det=5)["num_dets"].tolist() == [2]
    np.testing.assert_array_equal(out["boxes"][0, :2], [[0, 0, 2, 2], [0, 0, 2, 1]])
    out = run(nms_reference(1, conf_threshold=0.25, iou_threshold=0.49, max_det=5), output0=x)
    assert out["num_dets"].tolist() == [1]


def test_nms_ties_keep_the_lower_anchor_first():
    # 100 boxes apart from one another on a 10 x 10 grid, every one scoring 0.5: kept in anchor order by both.
    x = as_output0([(10 + 20 * (k % 10), 10 + 20 * (k // 10), 8, 8, 0.5) for k in range(100)])
    for out in (run(nms_reference(1), output0=x), nms_numpy(x)):
        assert out["num_dets"].tolist() == [100]
        np.testing.assert_array_equal(out["boxes"][0, :100, :2], [[6 + 20 * (k % 10), 6 + 20 * (k // 10)]
                                                                  for k in range(100)])


def test_nms_ties_take_the_lowest_class():
    x = as_output0([(10, 10, 4, 4, 0.6, 0.6, 0.6)])
    assert run(nms_reference(3), output0=x)["classes"][0, 0] == 0


def test_nms_pads_rows_past_num_dets_with_zeros_when_anchors_are_fewer_than_max_det():
    rng = np.random.default_rng(5)
    x = detections(rng, batch=3, nc=4, anchors=40, logit_mean=-1.0)
    x[1, 4:] = 0.01  # image 1: nothing above the threshold
    got = run(nms_reference(4, max_det=300), output0=x)
    want = nms_numpy(x, max_det=300)
    assert got["boxes"].shape == (3, 300, 4) and got["scores"].shape == (3, 300)
    assert got["num_dets"][1] == 0 and got["num_dets"][0] > 3 and got["num_dets"][2] > 3
    for name in NMS_OUTPUTS:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for b, n in enumerate(got["num_dets"]):
        assert not got["boxes"][b, n:].any() and not got["scores"][b, n:].any() and not got["classes"][b, n:].any()


def test_nms_reference_is_a_valid_model_with_symbolic_batch_and_anchors():
    m = nms_reference(80, input_name="det")
    onnx.checker.check_model(m, full_check=True)
    assert m.ir_version <= MAX_IR_VERSION
    inp = m.graph.input[0]
    assert inp.name == "det"
    assert [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim] == ["batch", 84, "anchors"]
    assert {n.op_type for n in m.graph.node} >= {"NonMaxSuppression", "TopK"}


@pytest.mark.parametrize("bad, match", [({"conf_threshold": 1.5}, "conf_threshold"), ({"max_det": 0}, "max_det"),
                                        ({"iou_threshold": -0.1}, "iou_threshold"), ({"agnostic": "yes"}, "agnostic"),
                                        ({"conf_threshold": 1.0}, r"conf_threshold must be a number in \[0, 1\)"),
                                        ({"iou_threshold": True}, "iou_threshold"), ({"max_det": True}, "max_det")])
def test_nms_rejects_bad_params(bad, match):
    with pytest.raises(SurgeryError, match=match):
        nms_reference(80, **bad)


def test_nms_takes_the_ends_of_its_ranges():
    # docs/semantics.md: iou_threshold in [0, 1] (1.0 suppresses nothing), conf_threshold from 0.
    for ok in ({"iou_threshold": 1.0}, {"iou_threshold": 0.0}, {"conf_threshold": 0.0}, {"max_det": 1},
               {"max_det": 2**31 - 1}):  # the largest int32 count
        onnx.checker.check_model(nms_reference(3, **ok))


# --- letterbox ----------------------------------------------------------------------------------


@pytest.mark.parametrize("h, w", [(48, 80), (100, 37), (64, 64), (17, 200), (20, 30), (31, 33), (64, 37),
                                  (3, 200)])  # dw 27: odd; 3 rows resized to 1
@pytest.mark.parametrize("swap_rb", [True, False])
def test_letterbox_matches_oracle(h, w, swap_rb):
    rng = np.random.default_rng(h * 1000 + w)
    images = rng.integers(0, 256, size=(2, h, w, 3), dtype=np.uint8)
    params = {"size": 64, "swap_rb": swap_rb, "pad_value": 114, "dtype": "float32"}
    got = run(letterbox_reference(**params), raw_images=images)
    want = letterbox_numpy(images, **params)
    assert got["images"].shape == (2, 3, 64, 64) and got["images"].dtype == np.float32
    np.testing.assert_allclose(got["images"], want["images"], atol=2e-5, rtol=0)
    np.testing.assert_array_equal(got["ratio_pad"], want["ratio_pad"])


def test_letterbox_geometry_by_hand():
    # 480x640 into 640: r = 1, no resize, 80 rows of padding above and below.
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(1, 480, 640, 3), dtype=np.uint8)
    out = run(letterbox_reference(size=640, swap_rb=False), raw_images=images)
    np.testing.assert_array_equal(out["ratio_pad"], [[1.0, 0.0, 80.0]])
    canvas = out["images"][0]
    assert np.all(canvas[:, :80] == np.float32(114) / np.float32(255))
    assert np.all(canvas[:, 560:] == np.float32(114) / np.float32(255))
    np.testing.assert_array_equal(canvas[:, 80:560], images[0].transpose(2, 0, 1).astype(np.float32) / np.float32(255))
    # 100x50 into 64: r = 0.64, new 64x32, dw = 16 -> left = round(15.9) = 16; BGR -> RGB swaps channel 0 and 2.
    # One colour per channel (a resize keeps a flat colour), so a channel taken from the wrong place shows.
    bgr = (200, 90, 30)
    img = np.empty((1, 100, 50, 3), np.uint8)
    img[...] = bgr
    out = run(letterbox_reference(size=64, swap_rb=True), raw_images=img)
    np.testing.assert_allclose(out["ratio_pad"], [[0.64, 16.0, 0.0]], rtol=1e-7)
    content, pad = out["images"][0, :, :, 16:48], out["images"][0, :, :, :16]
    for channel, value in enumerate(bgr[::-1]):
        assert np.all(content[channel] == np.float32(value) / np.float32(255)), f"channel {channel}"
    assert np.all(pad == np.float32(114) / np.float32(255))


def test_letterbox_float16_and_pad_value():
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, size=(1, 30, 50, 3), dtype=np.uint8)
    got = run(letterbox_reference(size=32, dtype="float16", pad_value=0), raw_images=images)
    want = letterbox_numpy(images, size=32, dtype="float16", pad_value=0)
    assert got["images"].dtype == np.float16
    np.testing.assert_allclose(got["images"].astype(np.float32), want["images"].astype(np.float32), atol=1e-3)
    top = int(got["ratio_pad"][0, 2])
    assert top > 0 and not got["images"][0, :, :top].any()


def test_letterbox_reference_has_symbolic_batch_and_size():
    m = letterbox_reference(size=320, output_name="pixels")
    onnx.checker.check_model(m, full_check=True)
    dims = [d.dim_param or d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "height", "width", 3]
    assert [o.name for o in m.graph.output] == ["pixels", "ratio_pad"]
    assert {"Resize", "Pad", "Cast", "Div", "Transpose"} <= {n.op_type for n in m.graph.node}


@pytest.mark.parametrize("bad, match", [({"size": 0}, "size"), ({"dtype": "int8"}, "dtype"),
                                        ({"pad_value": 300}, "pad_value"), ({"swap_rb": 1}, "swap_rb"),
                                        ({"size": True}, "size"), ({"pad_value": -1}, "pad_value"),
                                        ({"pad_value": "abc"}, r"pad_value must be a number in \[0, 255\], got 'abc'"),
                                        ({"pad_value": None}, r"pad_value must be a number in \[0, 255\], got None"),
                                        ({"pad_value": "100"}, "pad_value"), ({"pad_value": True}, "pad_value")])
def test_letterbox_rejects_bad_params(bad, match):
    with pytest.raises(SurgeryError, match=match):
        letterbox_reference(**bad)


def test_letterbox_pads_with_the_ends_of_its_range():
    # pad_value in [0, 255]: a white (255) or black (0) border; the canvas shows it over 255.
    raw = np.random.default_rng(5).integers(0, 256, (1, 16, 32, 3), dtype=np.uint8)
    for pad in (0, 255):
        got = run(letterbox_reference(size=32, pad_value=pad), raw_images=raw)["images"]
        assert got[0, :, 0, 0].tolist() == [pad / 255.0] * 3  # the top rows are border (16 of 32 filled)
