"""What ultralytics' Detect head computes from its raw maps, in NumPy, and the check of a cut against it.

The yolov8_decode preset finds the decode by structure; the decode kernel does not run the graph, it
recomputes ultralytics' decode (docs/semantics.md): the DFL expectation, dist2bbox against the cell
centres (x + 0.5, y + 0.5), times the level's stride, then the class sigmoid. A graph of the same
structure can compute something else (anchors at the cell corners, baked for another grid, boxes as
x1y1x2y2, another stride): the structure passes, and only the kernels level on a GPU would see the
kernel's boxes disagree. `check_detect_decode` runs the cut's reference on seeded head maps instead,
so a build without a GPU refuses it too.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper

from ..errors import SurgeryError
from ..graph.ort import ort_session

# A box may differ by this many cells of its level (fp16 graphs round coordinates to ~0.06 of a cell);
# the smallest wrong decode worth refusing, anchors at the cell corners, is off by half a cell.
BOX_CELLS = 0.25
SCORE_ATOL = 0.01
ROWS = ("cx", "cy", "w", "h")


def detect_decode(maps: Sequence[np.ndarray], strides: Sequence[int], reg_max: int) -> np.ndarray:
    """output0 [B, 4 + nc, A] in float64 from maps [box_0, cls_0, box_1, cls_1, ...] (NCHW)."""
    boxes, scores = [], []
    for level, stride in enumerate(strides):
        box, cls = (np.asarray(m, np.float64) for m in maps[2 * level:2 * level + 2])
        b, _, h, w = box.shape
        logits = box.reshape(b, 4, reg_max, h * w)
        p = np.exp(logits - logits.max(axis=2, keepdims=True))
        dist = (p / p.sum(axis=2, keepdims=True) * np.arange(reg_max)[:, None]).sum(axis=2)  # [b, 4, hw]
        ys, xs = np.meshgrid(np.arange(h) + 0.5, np.arange(w) + 0.5, indexing="ij")
        centres = np.stack([xs.ravel(), ys.ravel()])[None]
        x1y1, x2y2 = centres - dist[:, :2], centres + dist[:, 2:]
        boxes.append(np.concatenate([(x1y1 + x2y2) / 2, x2y2 - x1y1], axis=1) * stride)
        scores.append(1 / (1 + np.exp(-cls.reshape(b, -1, h * w))))
    return np.concatenate([np.concatenate(boxes, axis=2), np.concatenate(scores, axis=2)], axis=1)


def check_detect_decode(reference: onnx.ModelProto, shapes: Sequence[Sequence[int]], strides: Sequence[int],
                        reg_max: int, *, seed: int = 0) -> None:
    """Raise SurgeryError unless `reference` (inputs box_0, cls_0, ...; output output0) computes
    `detect_decode` on seeded logits of `shapes` (concrete, one per input)."""
    rng = np.random.default_rng(seed)
    feeds = {i.name: rng.normal(0.0, 2.0, size=tuple(s)).astype(helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
             for i, s in zip(reference.graph.input, shapes)}
    got = ort_session(reference).run(None, feeds)[0].astype(np.float64)
    want = detect_decode(list(feeds.values()), strides, reg_max)
    if got.shape != want.shape:
        raise SurgeryError(f"preset 'yolov8_decode': the cut's output is {list(got.shape)} on head maps "
                           f"{[list(s) for s in shapes]}; ultralytics' decode gives {list(want.shape)}")
    cell = np.concatenate([np.full(s[2] * s[3], float(st)) for s, st in zip(shapes[::2], strides)])
    # Each value's error over its tolerance (NaN, from a NaN or an inf, counts as beyond it).
    ratio = np.nan_to_num(np.concatenate([np.abs(got[:, :4] - want[:, :4]) / cell / BOX_CELLS,
                                          np.abs(got[:, 4:] - want[:, 4:]) / SCORE_ATOL], axis=1), nan=np.inf)
    if ratio.max() <= 1:
        return
    b, row, a = np.unravel_index(np.argmax(ratio), ratio.shape)
    what = ROWS[row] if row < 4 else f"class {row - 4} score"
    raise SurgeryError(
        f"preset 'yolov8_decode': the cut computes another decode than ultralytics' (DFL expectation, "
        f"dist2bbox against the cell centres x + 0.5, y + 0.5, times strides {list(strides)}, sigmoid scores), "
        f"which the yolov8_decode kernel computes: on seeded head maps its {what} at anchor {a} of image {b} is "
        f"{got[b, row, a]:.4g}, ultralytics' {want[b, row, a]:.4g}. Cut this decode by its tensor names "
        "(inputs/outputs) with a kernel of your own that computes it")
