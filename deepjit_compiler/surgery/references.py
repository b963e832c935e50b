"""ONNX references for stages the model does not contain: NMS after the detections, letterbox before
`images`. Both are graphs of standard ONNX ops that ONNX Runtime runs, so every JIT kernel has a
reference; docs/semantics.md fixes what they compute. `nms_numpy` and `letterbox_numpy` are plain
numpy versions of the same note: `nms_numpy` a test oracle only; `letterbox_numpy` also the host
letterbox of validation data, calibration and `deepjit run` (its tests check it against the ONNX one).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..config import INT32_MAX  # the kernels take counts and sizes as int32
from ..errors import SurgeryError
from ..graph.serialize import min_ir_version

OPSET = 17
NMS_OUTPUTS = ("num_dets", "boxes", "scores", "classes")  # TensorRT EfficientNMS's
NMS_DEFAULTS: Mapping[str, Any] = {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300, "agnostic": False}
LETTERBOX_INPUT = "raw_images"
LETTERBOX_DEFAULTS: Mapping[str, Any] = {"size": 640, "dtype": "float32", "swap_rb": True, "pad_value": 114}
LETTERBOX_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


class _Graph:
    """Collects nodes and constants with readable, unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def const(self, value, dtype) -> str:
        name = f"const_{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, out: str | None = None, n_out: int = 1, **attrs) -> str | list[str]:
        self._n += 1
        name = f"{op_type}_{self._n}"
        outs = [out] if out else [f"{name}_out{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, **attrs))
        return outs[0] if n_out == 1 else outs

    def model(self, name: str, inputs, outputs, doc: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, initializer=self.inits, doc_string=doc)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="deepjit.references")
        model.ir_version = min_ir_version(model)  # make_model stamps the newest, which ORT may reject
        onnx.checker.check_model(model)
        return model


def _number(value: Any) -> bool:
    """A real number from the spec (YAML gives int or float; a bool, null, string or list is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= INT32_MAX


def nms_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """NMS params with defaults filled in and checked; unknown keys (kernel-only tuning knobs such
    as max_candidates) are left to the kernel."""
    p = {k: params.get(k, v) for k, v in NMS_DEFAULTS.items()}
    if not _number(p["conf_threshold"]) or not 0.0 <= p["conf_threshold"] < 1.0:
        raise SurgeryError(f"nms: conf_threshold must be a number in [0, 1), got {p['conf_threshold']!r}")
    if not _number(p["iou_threshold"]) or not 0.0 <= p["iou_threshold"] <= 1.0:
        raise SurgeryError(f"nms: iou_threshold must be a number in [0, 1], got {p['iou_threshold']!r}")
    if not _count(p["max_det"]):
        raise SurgeryError(f"nms: max_det must be an integer from 1 to {INT32_MAX}, got {p['max_det']!r}")
    if not isinstance(p["agnostic"], bool):
        raise SurgeryError(f"nms: agnostic must be true or false, got {p['agnostic']!r}")
    return p


def letterbox_params(params: Mapping[str, Any]) -> dict[str, Any]:
    p = {k: params.get(k, v) for k, v in LETTERBOX_DEFAULTS.items()}
    if not _count(p["size"]):
        raise SurgeryError(f"letterbox: size must be an integer from 1 to {INT32_MAX}, got {p['size']!r}")
    if p["dtype"] not in LETTERBOX_DTYPES:
        raise SurgeryError(f"letterbox: dtype must be one of {sorted(LETTERBOX_DTYPES)}, got {p['dtype']!r}")
    if not isinstance(p["swap_rb"], bool):
        raise SurgeryError(f"letterbox: swap_rb must be true or false, got {p['swap_rb']!r}")
    if not _number(p["pad_value"]) or not 0 <= p["pad_value"] <= 255:
        raise SurgeryError(f"letterbox: pad_value must be a number in [0, 255], got {p['pad_value']!r}")
    return p


# --- NMS ----------------------------------------------------------------------------------------


def nms_reference(num_classes: int, *, conf_threshold: float = 0.25, iou_threshold: float = 0.45,
                  max_det: int = 300, agnostic: bool = False, input_name: str = "output0") -> onnx.ModelProto:
    """Ultralytics NMS (best class per anchor) on `input_name` [B, 4 + nc, A] as standard ONNX ops,
    with TensorRT EfficientNMS outputs: num_dets [B], boxes [B, max_det, 4], scores, classes."""
    nms_params({"conf_threshold": conf_threshold, "iou_threshold": iou_threshold, "max_det": max_det,
                "agnostic": agnostic})
    g = _Graph()
    i64 = np.int64
    x = g.op("Transpose", input_name, perm=[0, 2, 1])                                # [B, A, 4+nc]
    cxcywh = g.op("Slice", x, g.const([0], i64), g.const([4], i64), g.const([2], i64))
    cls = g.op("Slice", x, g.const([4], i64), g.const([4 + num_classes], i64), g.const([2], i64))
    score = g.op("ReduceMax", cls, axes=[2], keepdims=0)                             # [B, A]
    label = g.op("ArgMax", cls, axis=2, keepdims=0, select_last_index=0)             # lowest index on ties
    # xywh -> xyxy exactly as ultralytics' xywh2xyxy: half extents, then subtract and add.
    c, wh = g.op("Split", cxcywh, g.const([2, 2], i64), axis=2, n_out=2)
    half = g.op("Div", wh, g.const(2.0, np.float32))
    xyxy = g.op("Concat", g.op("Sub", c, half), g.op("Add", c, half), axis=2)       # [B, A, 4]

    # Class-aware NMS over only the best class: a [B, C, A] score map that is -inf off the argmax.
    if agnostic:
        per_class = g.op("Unsqueeze", score, g.const([1], i64))
    else:
        classes = g.op("Reshape", g.op("Range", g.const(0, i64), g.const(num_classes, i64), g.const(1, i64)),
                       g.const([1, num_classes, 1], i64))
        is_best = g.op("Equal", g.op("Unsqueeze", label, g.const([1], i64)), classes)
        per_class = g.op("Where", is_best, g.op("Unsqueeze", score, g.const([1], i64)),
                         g.const(-np.inf, np.float32))
    selected = g.op("NonMaxSuppression", xyxy, per_class, g.const([max_det], i64),
                    g.const([iou_threshold], np.float32), g.const([conf_threshold], np.float32),
                    center_point_box=0)                                            # [K, 3] (b, c, a)
    ba = g.op("Gather", selected, g.const([0, 2], i64), axis=1)                      # [K, 2]

    # Scatter kept scores into a [B, A] map (-1 elsewhere), then TopK per image: descending score,
    # lower anchor first on ties, at most max_det. Scores of kept boxes are > conf_threshold >= 0.
    fill = g.op("Expand", g.const(-1.0, np.float32), g.op("Shape", score))
    kept = g.op("ScatterND", fill, ba, g.op("GatherND", score, ba))
    num_anchors = g.op("Slice", g.op("Shape", score), g.const([1], i64), g.const([2], i64))
    k = g.op("Min", g.const([max_det], i64), num_anchors)
    top, idx = g.op("TopK", kept, k, axis=1, largest=1, sorted=1, n_out=2)           # [B, k]
    valid = g.op("Greater", top, g.const(-0.5, np.float32))
    # Pad the k columns up to max_det (k < max_det only when the model has fewer anchors).
    pad_cols = g.op("Sub", g.const([max_det], i64), k)
    zero = g.const([0], i64)

    def pad(t: str, rank: int, value, dtype) -> str:
        begin = [zero] * rank
        end = [zero, pad_cols] + [zero] * (rank - 2)
        pads = g.op("Concat", *begin, *end, axis=0)
        return g.op("Pad", t, pads, g.const(value, dtype), mode="constant")

    valid_f = g.op("Cast", valid, to=TensorProto.FLOAT)
    boxes = g.op("Mul", g.op("GatherND", xyxy, g.op("Unsqueeze", idx, g.const([2], i64)), batch_dims=1),
                 g.op("Unsqueeze", valid_f, g.const([2], i64)))
    scores = g.op("Where", valid, top, g.const(0.0, np.float32))
    labels = g.op("Where", valid, g.op("GatherElements", label, idx, axis=1), g.const(0, i64))
    g.op("Cast", g.op("ReduceSum", g.op("Cast", valid, to=TensorProto.INT64), g.const([1], i64), keepdims=0),
         to=TensorProto.INT32, out="num_dets")
    g.op("Identity", pad(boxes, 3, 0.0, np.float32), out="boxes")
    g.op("Identity", pad(scores, 2, 0.0, np.float32), out="scores")
    g.op("Cast", pad(labels, 2, 0, i64), to=TensorProto.INT32, out="classes")

    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [helper.make_tensor_value_info(input_name, f32, ["batch", 4 + num_classes, "anchors"])]
    outputs = [helper.make_tensor_value_info("num_dets", i32, ["batch"]),
               helper.make_tensor_value_info("boxes", f32, ["batch", max_det, 4]),
               helper.make_tensor_value_info("scores", f32, ["batch", max_det]),
               helper.make_tensor_value_info("classes", i32, ["batch", max_det])]
    doc = (f"deepjit nms reference: nc={num_classes} conf>{conf_threshold} iou>{iou_threshold} "
           f"max_det={max_det} agnostic={agnostic}")
    return g.model("nms_reference", inputs, outputs, doc)


def nms_numpy(output0: np.ndarray, *, conf_threshold: float = 0.25, iou_threshold: float = 0.45,
              max_det: int = 300, agnostic: bool = False, **_kernel_only) -> dict[str, np.ndarray]:
    """docs/semantics.md's NMS, written out directly (a test oracle, not used by the pipeline)."""
    batch, max_det = output0.shape[0], int(max_det)
    out = {"num_dets": np.zeros(batch, np.int32), "boxes": np.zeros((batch, max_det, 4), np.float32),
           "scores": np.zeros((batch, max_det), np.float32), "classes": np.zeros((batch, max_det), np.int32)}
    for b in range(batch):
        pred = output0[b].T                                         # [A, 4 + nc]
        score, label = pred[:, 4:].max(axis=1), pred[:, 4:].argmax(axis=1)
        keep = np.flatnonzero(score > np.float32(conf_threshold))
        half = pred[keep, 2:4] / np.float32(2)
        xyxy = np.concatenate([pred[keep, :2] - half, pred[keep, :2] + half], axis=1)
        order = np.argsort(-score[keep], kind="stable")
        kept: list[int] = []
        for i in order:
            same = [j for j in kept if agnostic or label[keep[j]] == label[keep[i]]]
            if same and np.any(box_iou(xyxy[i], xyxy[same]) > iou_threshold):
                continue
            kept.append(i)
            if len(kept) == max_det:
                break
        n = len(kept)
        out["num_dets"][b] = n
        out["boxes"][b, :n] = xyxy[kept]
        out["scores"][b, :n] = score[keep[kept]]
        out["classes"][b, :n] = label[keep[kept]]
    return out


def box_iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """IoU of one x1,y1,x2,y2 box with each of `boxes`: inter / (area1 + area2 - inter); 0 for empty unions."""
    x1 = np.maximum(box[0], boxes[:, 0])
    y1 = np.maximum(box[1], boxes[:, 1])
    x2 = np.minimum(box[2], boxes[:, 2])
    y2 = np.minimum(box[3], boxes[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area = lambda b: (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])  # noqa: E731
    return inter / np.maximum(area(box) + area(boxes) - inter, 1e-12)


# --- letterbox ----------------------------------------------------------------------------------


def letterbox_reference(*, size: int = 640, dtype: str = "float32", swap_rb: bool = True,
                        pad_value: float = 114, output_name: str = "images") -> onnx.ModelProto:
    """Letterbox `raw_images` uint8 [B, H, W, 3] into `output_name` [B, 3, size, size] plus
    `ratio_pad` [B, 3] = (r, left, top); the geometry is computed in the graph from H and W."""
    letterbox_params({"size": size, "dtype": dtype, "swap_rb": swap_rb, "pad_value": pad_value})
    g = _Graph()
    i64, f32 = np.int64, np.float32
    x = g.op("Cast", LETTERBOX_INPUT, to=TensorProto.FLOAT)
    x = g.op("Transpose", x, perm=[0, 3, 1, 2])                                      # [B, 3, H, W]
    if swap_rb:
        x = g.op("Gather", x, g.const([2, 1, 0], i64), axis=1)
    shape = g.op("Shape", x)
    hw = g.op("Cast", g.op("Slice", shape, g.const([2], i64), g.const([4], i64)), to=TensorProto.FLOAT)
    # r = min(size / H, size / W) in float32; new = round(hw * r), half to even.
    r = g.op("ReduceMin", g.op("Div", g.const([size, size], f32), hw), keepdims=1)   # [1]
    new_hw_f = g.op("Round", g.op("Mul", hw, r))
    new_hw = g.op("Cast", new_hw_f, to=TensorProto.INT64)
    # top/left = round((size - new) / 2 - 0.1); bottom/right take the rest of the canvas.
    d = g.op("Div", g.op("Sub", g.const([size, size], f32), new_hw_f), g.const(2.0, f32))
    top_left = g.op("Cast", g.op("Round", g.op("Sub", d, g.const(0.1, f32))), to=TensorProto.INT64)
    bottom_right = g.op("Sub", g.op("Sub", g.const([size, size], i64), new_hw), top_left)
    resized = g.op("Resize", x, "", "", g.op("Concat", g.op("Slice", shape, g.const([0], i64), g.const([2], i64)),
                                             new_hw, axis=0),
                   mode="linear", coordinate_transformation_mode="half_pixel")
    zeros2 = g.const([0, 0], i64)
    pads = g.op("Concat", zeros2, top_left, zeros2, bottom_right, axis=0)
    canvas = g.op("Pad", resized, pads, g.const(float(pad_value), f32), mode="constant")
    scaled = g.op("Div", canvas, g.const(255.0, f32))
    g.op("Cast", scaled, to=LETTERBOX_DTYPES[dtype], out=output_name)
    # ratio_pad = (r, left, top) per image.
    left_top = g.op("Cast", g.op("Gather", top_left, g.const([1, 0], i64), axis=0), to=TensorProto.FLOAT)
    row = g.op("Unsqueeze", g.op("Concat", r, left_top, axis=0), g.const([0], i64))  # [1, 3]
    batch = g.op("Slice", shape, g.const([0], i64), g.const([1], i64))
    g.op("Expand", row, g.op("Concat", batch, g.const([3], i64), axis=0), out="ratio_pad")

    inputs = [helper.make_tensor_value_info(LETTERBOX_INPUT, TensorProto.UINT8, ["batch", "height", "width", 3])]
    outputs = [helper.make_tensor_value_info(output_name, LETTERBOX_DTYPES[dtype], ["batch", 3, size, size]),
               helper.make_tensor_value_info("ratio_pad", TensorProto.FLOAT, ["batch", 3])]
    doc = f"deepjit letterbox reference: size={size} dtype={dtype} swap_rb={swap_rb} pad_value={pad_value}"
    return g.model("letterbox_reference", inputs, outputs, doc)


def _bilinear_half_pixel(img: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """[C, H, W] float -> [C, out_h, out_w]: half_pixel source coords clamped to the border."""
    _, h, w = img.shape

    def axis(n_out: int, n_in: int):
        src = np.clip((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0, n_in - 1)
        lo = np.floor(src).astype(int)
        hi = np.minimum(lo + 1, n_in - 1)
        return lo, hi, (src - lo)

    y0, y1, wy = axis(out_h, h)
    x0, x1, wx = axis(out_w, w)
    top = img[:, y0][:, :, x0] * (1 - wx) + img[:, y0][:, :, x1] * wx
    bot = img[:, y1][:, :, x0] * (1 - wx) + img[:, y1][:, :, x1] * wx
    return top * (1 - wy)[:, None] + bot * wy[:, None]


def letterbox_numpy(images: np.ndarray, *, size: int = 640, dtype: str = "float32", swap_rb: bool = True,
                    pad_value: float = 114, **_kernel_only) -> dict[str, np.ndarray]:
    """docs/semantics.md's letterbox, written out directly: the host's letterbox (validation data,
    calibration, `deepjit run` without a letterbox stage), and a test oracle for the kernel."""
    batch, h, w, _ = images.shape
    r = min(np.float32(size) / np.float32(h), np.float32(size) / np.float32(w))
    new_w, new_h = round(float(np.float32(w) * r)), round(float(np.float32(h) * r))
    left = round(float(np.float32((size - new_w) / 2) - np.float32(0.1)))
    top = round(float(np.float32((size - new_h) / 2) - np.float32(0.1)))
    out = np.full((batch, 3, size, size), np.float64(pad_value))
    for b in range(batch):
        chw = images[b].astype(np.float64).transpose(2, 0, 1)
        if swap_rb:
            chw = chw[::-1]
        out[b, :, top:top + new_h, left:left + new_w] = _bilinear_half_pixel(chw, new_h, new_w)
    ratio_pad = np.tile(np.array([r, left, top], np.float32), (batch, 1))
    return {"images": (out / 255.0).astype(dtype), "ratio_pad": ratio_pad}
