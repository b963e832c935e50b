"""Synthetic YOLOv8 detection models whose ONNX graph matches an ultralytics export.

No trained weights can be fetched where DeepJIT is built and tested, so it writes its own: the exact
yolov8.yaml architecture (ultralytics' parameter counts, node names and op types) with seeded weights
scaled so activations stay O(1), class scores are sparse (a few percent of anchors above 0.25) and
boxes stay near their anchors, like a trained model's on random images.

    model = synthesize_yolov8("yolov8n", seed=0)              # symbolic batch, 640x640
    write_synthetic("yolov8s", "models/yolov8s.onnx", dynamic=True)
"""
from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import ModelError, closest
from ..files import atomic_write
from .synth_layers import Calibrator, GraphBuilder, c2f, seeded_rng, sppf

log = logging.getLogger("deepjit.synth")

REG_MAX = 16
STRIDES = (8, 16, 32)
HEAD_LAYOUTS = ("separate", "split")
IR_VERSION = 8  # ONNX Runtime may reject the newest IR version the installed onnx writes

# Weights are calibrated on a batch of seeded uniform [0, 1] images (see synth_layers).
_CALIB_SIZE, _CALIB_BATCH = 640, 2
# Head logits. Class: std 1 per class plus a per-class offset, shifted so that this fraction of the
# calibration images' anchors has a max score above 0.25 (fresh images land at about 1-5 %).
# Box: DFL bins biased toward low distances (bin k gets -slope * k), so boxes span a few strides
# and stay near their anchor.
_CLS_TARGET_FRACTION, _CLS_THRESHOLD, _CLS_OFFSET_STD = 0.02, 0.25, 0.5
_BOX_BIN_SLOPE, _BOX_NOISE_STD = 0.6, 0.1


@dataclass(frozen=True, slots=True)
class Variant:
    """A row of yolov8.yaml's `scales`: depth multiple, width multiple, max channels."""

    depth: float
    width: float
    max_channels: int

    def ch(self, c: int) -> int:
        # ultralytics make_divisible(min(c, max_channels) * width, 8)
        return math.ceil(min(c, self.max_channels) * self.width / 8) * 8

    def n(self, n: int) -> int:
        return max(round(n * self.depth), 1)


VARIANTS = {
    "yolov8n": Variant(0.33, 0.25, 1024),
    "yolov8s": Variant(0.33, 0.50, 1024),
    "yolov8m": Variant(0.67, 0.75, 768),
    "yolov8l": Variant(1.00, 1.00, 512),
    "yolov8x": Variant(1.00, 1.25, 512),
}

# ultralytics writes class names into the export's metadata; COCO's 80, spaces as in coco.yaml.
COCO_NAMES = tuple(s.replace("_", " ") for s in (
    "person bicycle car motorcycle airplane bus train truck boat traffic_light fire_hydrant "
    "stop_sign parking_meter bench bird cat dog horse sheep cow elephant bear zebra giraffe "
    "backpack umbrella handbag tie suitcase frisbee skis snowboard sports_ball kite baseball_bat "
    "baseball_glove skateboard surfboard tennis_racket bottle wine_glass cup fork knife spoon bowl "
    "banana apple sandwich orange broccoli carrot hot_dog pizza donut cake chair couch "
    "potted_plant bed dining_table toilet tv laptop mouse remote keyboard cell_phone microwave "
    "oven toaster sink refrigerator book clock vase scissors teddy_bear hair_drier toothbrush"
).split())


def synthesize_yolov8(variant: str, *, seed: int = 0, dynamic: bool = False, head_layout: str = "separate",
                      imgsz: int = 640, num_classes: int = 80, opset: int = 17,
                      batch: int | None = None) -> onnx.ModelProto:
    """A YOLOv8 detection model as ultralytics exports it: input `images` [B, 3, H, W] float32 in
    [0, 1], output `output0` [B, 4 + num_classes, A] (cx, cy, w, h in pixels, then class scores).

    batch: None -> a symbolic 'batch' dim; an int fixes it. dynamic: False -> spatial size fixed at
    imgsz, anchors and strides folded into initializers; True -> symbolic 'height'/'width' and
    anchors computed in the graph from the feature maps' shapes (any multiple of 32 runs).
    head_layout: "separate" (box and class maps concatenated apart, current ultralytics) or "split"
    (one [B, 64 + nc, A] tensor Split in two, older ultralytics). The weights depend only on
    (variant, seed, num_classes): every layout and size gives the same output0 where both run.
    """
    arch = _variant(variant)
    _check_args(seed=seed, head_layout=head_layout, imgsz=imgsz, num_classes=num_classes, opset=opset,
                batch=batch)
    g = GraphBuilder(_calibrated_params(variant, seed, num_classes))
    feats, chs = _body(g, arch, "images")
    boxes, scores = _head_maps(g, feats, chs, num_classes)
    out = _decode(g, feats, boxes, scores, num_classes, head_layout, None if dynamic else imgsz)

    b = "batch" if batch is None else batch
    hw: list[int | str] = ["height", "width"] if dynamic else [imgsz, imgsz]
    anchors = "anchors" if dynamic else sum((imgsz // s) ** 2 for s in STRIDES)
    graph = helper.make_graph(
        g.nodes, "main_graph",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [b, 3, *hw])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, [b, 4 + num_classes, anchors])],
        initializer=g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="pytorch", producer_version="synthetic")
    model.ir_version = IR_VERSION
    names = COCO_NAMES if num_classes == len(COCO_NAMES) else tuple(f"class{i}" for i in range(num_classes))
    helper.set_model_props(model, {
        "deepjit.synthetic": variant,
        "seed": str(seed),
        "deepjit.head_layout": head_layout,
        "task": "detect",
        "stride": str(max(STRIDES)),
        "batch": str(1 if batch is None else batch),
        "imgsz": f"[{imgsz}, {imgsz}]",
        "names": repr(dict(enumerate(names))),
    })
    log.debug("synthesized %s (seed %d, %s head, dynamic=%s): %d nodes", variant, seed, head_layout,
              dynamic, len(g.nodes))
    return model


def _check_binary_name(path: Path) -> None:
    """ModelError unless onnx.load reads `path` as binary protobuf, which is what is written: it picks a
    text format by the file's extension (.json, .textproto, .onnxtxt), and would refuse the file."""
    fmt = onnx.serialization.registry.get_format_from_file_extension(path.suffix)
    if fmt not in (None, "protobuf"):
        raise ModelError(f"{path}: onnx reads a '{path.suffix}' file as its {fmt} format, and DeepJIT writes the "
                         "binary one: name the file .onnx")


def write_synthetic(variant: str, path: str | os.PathLike, **kw) -> Path:
    """synthesize_yolov8(variant, **kw) saved to path atomically (parents created); returns path."""
    path = Path(path)
    _check_binary_name(path)
    data = synthesize_yolov8(variant, **kw).SerializeToString()
    atomic_write(path, data)
    log.info("wrote synthetic %s to %s (%d bytes)", variant, path, len(data))
    return path


def _variant(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ModelError(f"synthetic model: unknown variant '{name}'{closest(name, VARIANTS)}; "
                         f"allowed: {', '.join(VARIANTS)}") from None


def _check_args(*, seed: int, head_layout: str, imgsz: int, num_classes: int, opset: int,
                batch: int | None) -> None:
    if head_layout not in HEAD_LAYOUTS:
        raise ModelError(f"synthetic model: head_layout must be one of {', '.join(HEAD_LAYOUTS)}, "
                         f"got '{head_layout}'{closest(head_layout, HEAD_LAYOUTS)}")
    if not _is_int(imgsz) or imgsz < max(STRIDES) or imgsz % max(STRIDES):
        raise ModelError(f"synthetic model: imgsz must be a positive multiple of {max(STRIDES)}, "
                         f"got {imgsz!r}")
    if not _is_int(num_classes) or num_classes < 1:
        raise ModelError(f"synthetic model: num_classes must be a positive int, got {num_classes!r}")
    if not _is_int(opset) or not 13 <= opset <= 18:
        # Below 13 Split/Unsqueeze take attributes, not inputs; ir_version 8 stops at opset 18.
        raise ModelError(f"synthetic model: opset must be in 13..18, got {opset!r}")
    if not _is_int(seed) or seed < 0:
        raise ModelError(f"synthetic model: seed must be a non-negative int, got {seed!r}")
    if batch is not None and (not _is_int(batch) or batch < 1):
        raise ModelError(f"synthetic model: batch must be None (symbolic) or a positive int, got {batch!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@functools.lru_cache(maxsize=4)  # a yolov8s set is about 45 MB
def _calibrated_params(variant: str, seed: int, nc: int) -> Mapping[str, tuple[np.ndarray, np.ndarray]]:
    """Every conv's folded (weight, bias), from one numpy calibration pass (cached per process:
    about 1 s for yolov8n, 3 s for yolov8s, longer for m/l/x)."""
    cal = Calibrator(seed)
    image = seeded_rng(seed, "calibration image").random((_CALIB_BATCH, 3, _CALIB_SIZE, _CALIB_SIZE))
    feats, chs = _body(cal, VARIANTS[variant], image)
    _, scores = _head_maps(cal, feats, chs, nc)

    ramp = -_BOX_BIN_SLOPE * np.arange(REG_MAX)
    for i in range(len(STRIDES)):
        prefix = f"model.22.cv2.{i}.2"
        shift = np.tile(ramp, 4) + seeded_rng(seed, f"{prefix}.bias").normal(0.0, _BOX_NOISE_STD, 4 * REG_MAX)
        st = cal.heads[prefix]
        cal.params[prefix] = st.folded(*st.fold(np.ones(4 * REG_MAX), shift))

    # Class logits z + offset_c + base, base chosen from the best class logit of every anchor.
    offsets = seeded_rng(seed, "model.22.cv3.bias").normal(0.0, _CLS_OFFSET_STD, nc)
    best = np.concatenate([(z + offsets[:, None, None]).max(axis=1).ravel() for z in scores])
    threshold = np.log(_CLS_THRESHOLD / (1.0 - _CLS_THRESHOLD))
    # Rounded so that float64 noise from another BLAS cannot change the bytes written.
    base = round(float(threshold - np.quantile(best, 1.0 - _CLS_TARGET_FRACTION)), 2)
    for i in range(len(STRIDES)):
        st = cal.heads[f"model.22.cv3.{i}.2"]
        cal.params[f"model.22.cv3.{i}.2"] = st.folded(*st.fold(np.ones(nc), offsets + base))
    log.debug("calibrated %s seed %d: class logit base %.2f", variant, seed, base)
    return MappingProxyType(cal.params)


def _body(g, v: Variant, x):
    """Backbone and PAN neck of yolov8.yaml (layers 0-21); returns the P3/P4/P5 maps and channels."""
    ch, n = v.ch, v.n
    p1 = g.conv(x, "/model.0", "model.0", 3, ch(64), 3, 2)
    p2 = g.conv(p1, "/model.1", "model.1", ch(64), ch(128), 3, 2)
    p2 = c2f(g, p2, 2, ch(128), ch(128), n(3), True)
    p3 = g.conv(p2, "/model.3", "model.3", ch(128), ch(256), 3, 2)
    p3 = c2f(g, p3, 4, ch(256), ch(256), n(6), True)
    p4 = g.conv(p3, "/model.5", "model.5", ch(256), ch(512), 3, 2)
    p4 = c2f(g, p4, 6, ch(512), ch(512), n(6), True)
    p5 = g.conv(p4, "/model.7", "model.7", ch(512), ch(1024), 3, 2)
    p5 = c2f(g, p5, 8, ch(1024), ch(1024), n(3), True)
    p5 = sppf(g, p5, 9, ch(1024), ch(1024))

    h4 = g.concat("/model.11", [g.upsample("/model.10", p5), p4])
    h4 = c2f(g, h4, 12, ch(1024) + ch(512), ch(512), n(3), False)
    h3 = g.concat("/model.14", [g.upsample("/model.13", h4), p3])
    h3 = c2f(g, h3, 15, ch(512) + ch(256), ch(256), n(3), False)
    d4 = g.conv(h3, "/model.16", "model.16", ch(256), ch(256), 3, 2)
    h4 = c2f(g, g.concat("/model.17", [d4, h4]), 18, ch(256) + ch(512), ch(512), n(3), False)
    d5 = g.conv(h4, "/model.19", "model.19", ch(512), ch(512), 3, 2)
    h5 = c2f(g, g.concat("/model.20", [d5, p5]), 21, ch(512) + ch(1024), ch(1024), n(3), False)
    return [h3, h4, h5], [ch(256), ch(512), ch(1024)]


def _head_maps(g, feats: list, chs: list[int], nc: int) -> tuple[list, list]:
    """Detect's cv2 (box, 64 ch) and cv3 (class, nc ch) branches per level: Conv 3x3, Conv 3x3, 1x1."""
    c2, c3 = max(16, chs[0] // 4, 4 * REG_MAX), max(chs[0], min(nc, 100))

    def branch(x, name: str, c1: int, c: int, c_out: int):
        scope, prefix = f"/model.22/{name}", f"model.22.{name}"
        y = g.conv(x, f"{scope}/{name}.0", f"{prefix}.0", c1, c, 3)
        y = g.conv(y, f"{scope}/{name}.1", f"{prefix}.1", c, c, 3)
        return g.conv2d(y, f"{scope}/{name}.2", f"{prefix}.2", c, c_out)

    boxes = [branch(x, f"cv2.{i}", c, c2, 4 * REG_MAX) for i, (x, c) in enumerate(zip(feats, chs))]
    scores = [branch(x, f"cv3.{i}", c, c3, nc) for i, (x, c) in enumerate(zip(feats, chs))]
    return boxes, scores


def _decode(g: GraphBuilder, feats: list[str], boxes: list[str], scores: list[str], nc: int, layout: str,
            imgsz: int | None) -> str:
    """Detect's inference tail: flatten levels, DFL, dist2bbox (xywh) times stride, class Sigmoid,
    one Concat into `output0`. imgsz None: anchors computed in the graph."""
    scope, no_box = "/model.22", 4 * REG_MAX
    if layout == "split":
        levels = [g.op1(scope, "Concat", [b, s], axis=1) for b, s in zip(boxes, scores)]
        box, cls = g.op(scope, "Split", [_flatten_cat(g, scope, levels, no_box + nc),
                                         g.const(scope, np.array([no_box, nc], np.int64))], outputs=2, axis=1)
    else:
        box, cls = _flatten_cat(g, scope, boxes, no_box), _flatten_cat(g, scope, scores, nc)
    anchors, strides = _anchors_static(g, imgsz) if imgsz else _anchors_dynamic(g, scope, feats)
    dbox = g.op1(scope, "Mul", [_dist2bbox(g, scope, _dfl(g, box), anchors), strides])
    return g.op(scope, "Concat", [dbox, g.op1(scope, "Sigmoid", [cls])], axis=1, out_names=["output0"])[0]


def _flatten_cat(g: GraphBuilder, scope: str, maps: list[str], c: int) -> str:
    """[B, c, H_l, W_l] per level -> [B, c, A]. Shape 0 copies the batch dim, so any batch runs."""
    flat = [g.op1(scope, "Reshape", [m, g.const(scope, np.array([0, c, -1], np.int64))]) for m in maps]
    return g.op1(scope, "Concat", flat, axis=2)


def _dfl(g: GraphBuilder, box: str) -> str:
    """DFL: [B, 64, A] -> [B, 4, 16, A] -> bins first -> Softmax -> 1x1 Conv arange(16) -> [B, 4, A]."""
    scope = "/model.22/dfl"
    x = g.op1(scope, "Reshape", [box, g.const(scope, np.array([0, 4, REG_MAX, -1], np.int64))])
    x = g.op1(scope, "Transpose", [x], perm=[0, 2, 1, 3])
    x = g.op1(scope, "Softmax", [x], axis=1)
    w = np.arange(REG_MAX, dtype=np.float32).reshape(1, REG_MAX, 1, 1)
    x = g.conv_node(x, f"{scope}/conv", "model.22.dfl.conv", w, None)
    return g.op1(scope, "Reshape", [x, g.const(scope, np.array([0, 4, -1], np.int64))])


def _dist2bbox(g: GraphBuilder, scope: str, dist: str, anchors: str) -> str:
    """dist2bbox(xywh=True): (left, top, right, bottom) distances -> (cx, cy, w, h) in cells."""
    i64 = lambda *v: g.const(scope, np.array(v, np.int64))  # noqa: E731
    lt = g.op1(scope, "Slice", [dist, i64(0), i64(2), i64(1)])
    rb = g.op1(scope, "Slice", [dist, i64(2), i64(4), i64(1)])
    x1y1 = g.op1(scope, "Sub", [anchors, lt])
    x2y2 = g.op1(scope, "Add", [anchors, rb])
    c_xy = g.op1(scope, "Div", [g.op1(scope, "Add", [x1y1, x2y2]), g.const(scope, np.array(2.0, np.float32))])
    wh = g.op1(scope, "Sub", [x2y2, x1y1])
    return g.op1(scope, "Concat", [c_xy, wh], axis=1)


def anchor_grid(height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """ultralytics make_anchors for an input of height x width: anchors [1, 2, A] (cell centres
    x + 0.5, y + 0.5, row-major per level, levels by stride 8, 16, 32) and strides [1, A]."""
    points, strides = [], []
    for s in STRIDES:
        sy, sx = np.meshgrid(np.arange(height // s) + 0.5, np.arange(width // s) + 0.5, indexing="ij")
        points.append(np.stack([sx.ravel(), sy.ravel()]))
        strides.append(np.full(sx.size, s))
    return (np.concatenate(points, axis=1)[None].astype(np.float32),
            np.concatenate(strides)[None].astype(np.float32))


def _anchors_static(g: GraphBuilder, imgsz: int) -> tuple[str, str]:
    """Anchors and strides folded into initializers, as ultralytics' static export leaves them."""
    anchors, strides = anchor_grid(imgsz, imgsz)
    return g.param("/model.22/anchors", anchors), g.param("/model.22/strides", strides)


def _anchors_dynamic(g: GraphBuilder, scope: str, feats: list[str]) -> tuple[str, str]:
    """make_anchors in the graph from each level's Shape, so any multiple-of-32 input size runs."""
    i64 = lambda *v: g.const(scope, np.array(v, np.int64))  # noqa: E731
    points, strides = [], []
    for feat, stride in zip(feats, STRIDES):
        shape = g.op1(scope, "Shape", [feat])
        h = g.op1(scope, "Gather", [shape, g.const(scope, np.array(2, np.int64))], axis=0)
        w = g.op1(scope, "Gather", [shape, g.const(scope, np.array(3, np.int64))], axis=0)
        hw = g.op1(scope, "Concat", [g.op1(scope, "Unsqueeze", [h, i64(0)]),
                                     g.op1(scope, "Unsqueeze", [w, i64(0)])], axis=0)
        sy, sx = _centres(g, scope, h), _centres(g, scope, w)
        grid_y = g.op1(scope, "Expand", [g.op1(scope, "Unsqueeze", [sy, i64(1)]), hw])  # [H, W]
        grid_x = g.op1(scope, "Expand", [g.op1(scope, "Unsqueeze", [sx, i64(0)]), hw])
        xy = g.op1(scope, "Concat", [g.op1(scope, "Unsqueeze", [grid_x, i64(0)]),
                                     g.op1(scope, "Unsqueeze", [grid_y, i64(0)])], axis=0)  # [2, H, W]
        points.append(g.op1(scope, "Reshape", [xy, i64(2, -1)]))
        n = g.op1(scope, "Unsqueeze", [g.op1(scope, "Mul", [h, w]), i64(0)])
        strides.append(g.op1(scope, "Expand", [g.const(scope, np.full((1, 1), stride, np.float32)),
                                               g.op1(scope, "Concat", [i64(1), n], axis=0)]))
    anchors = g.op1(scope, "Unsqueeze", [g.op1(scope, "Concat", points, axis=1), i64(0)])
    return anchors, g.op1(scope, "Concat", strides, axis=1)


def _centres(g: GraphBuilder, scope: str, n: str) -> str:
    """arange(n) + 0.5 in float32, n an int64 scalar taken from a Shape."""
    f32 = lambda v: g.const(scope, np.array(v, np.float32))  # noqa: E731
    r = g.op1(scope, "Range", [f32(0.0), g.op1(scope, "Cast", [n], to=TensorProto.FLOAT), f32(1.0)])
    return g.op1(scope, "Add", [r, f32(0.5)])
