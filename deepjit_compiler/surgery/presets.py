"""Presets: cut boundaries found by a pattern instead of tensor names.

`yolov8_decode` finds the Detect head's decode of an ultralytics YOLOv8 export by structure, never by
node names: the DFL (a 1x1 Conv whose weights are arange(reg_max), after a Softmax), dist2bbox against
the anchor points, the stride Mul, the class Sigmoid and the final Concat into the detections output.

Its boundary: inputs are the raw per-level head maps, the outputs of the last Conv of each box branch
(cv2, [B, 4*reg_max, H_l, W_l]) and class branch (cv3, [B, nc, H_l, W_l]), ordered level by level
(stride 8 first), box before class: [box_0, cls_0, box_1, cls_1, box_2, cls_2]. That boundary is the
same for every head layout (one concatenated tensor Split in two, or two Concats) and absorbs
everything after the convs: the level flattening, anchors and strides (constants or the in-graph
Shape/Range/Expand subgraph). The output is the detections tensor [B, 4 + nc, A].
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import onnx

from ..errors import SurgeryError
from ..graph.index import GraphIndex, constant_value
from .ultralytics import check_detect_decode

log = logging.getLogger("deepjit.surgery")


@dataclass(frozen=True, slots=True)
class PresetMatch:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    facts: Mapping[str, Any]
    # Checks the cut's extracted subgraph computes what the preset says it does (raises SurgeryError)
    verify: Callable[[onnx.ModelProto], None] | None = None


def _index(model: onnx.ModelProto | GraphIndex) -> GraphIndex:
    return model if isinstance(model, GraphIndex) else GraphIndex(model)


def _weight_shape(idx: GraphIndex, conv: int) -> tuple[int, ...] | None:
    node = idx.nodes[conv]
    if len(node.inputs) < 2:
        return None
    w = node.inputs[1]
    shape = getattr(w, "shape", None)
    if shape is None or any(not isinstance(d, int) for d in shape):
        v = constant_value(w)
        return None if v is None else tuple(v.shape)
    return tuple(shape)


def _dfl_convs(idx: GraphIndex) -> list[tuple[int, int]]:
    """(position, reg_max) of each 1x1 Conv with weights arange(reg_max) shaped [1, reg_max, 1, 1]."""
    found = []
    for i, n in enumerate(idx.nodes):
        if n.op != "Conv" or len(n.inputs) < 2:
            continue
        shape = _weight_shape(idx, i)
        if shape is None or len(shape) != 4 or shape[0] != 1 or shape[2:] != (1, 1) or shape[1] < 2:
            continue
        w = constant_value(n.inputs[1])
        if w is not None and np.array_equal(w.reshape(-1), np.arange(shape[1], dtype=w.dtype)):
            found.append((i, shape[1]))
    return found


def _forward(idx: GraphIndex, starts: list[str], within: set[int] | None = None) -> set[int]:
    """Nodes reachable from tensors `starts` (data edges only: Shape reads are not followed)."""
    seen: set[int] = set()
    stack = list(starts)
    while stack:
        for c in idx.consumers(stack.pop()):
            if c in seen or idx.nodes[c].op == "Shape" or (within is not None and c not in within):
                continue
            seen.add(c)
            stack.extend(idx.outs(c))
    return seen


def _walk_back(idx: GraphIndex, output: str, dfl: int) -> tuple[set[int], list[str]]:
    """Nodes from `output` back to the head convs (any Conv but the DFL's); returns them and the
    head maps in the order met. Shape nodes are kept but not walked through: anchors only need
    the feature maps' shapes, which surgery takes from the head maps."""
    nodes: set[int] = set()
    maps: list[str] = []
    stack = [output]
    while stack:
        name = stack.pop()
        if name in idx.const or name in maps:
            continue
        p = idx.producer(name)
        if p is None:
            raise SurgeryError(f"preset 'yolov8_decode': walking back from '{output}' reached the model input "
                               f"'{name}' without meeting the head convs; is this a YOLOv8 detect export?")
        if idx.nodes[p].op == "Conv" and p != dfl:
            maps.append(name)
            continue
        if p not in nodes:
            nodes.add(p)
            if idx.nodes[p].op != "Shape":
                stack.extend(reversed(idx.ins(p)))
    return nodes, maps


def _level_of(idx: GraphIndex, name: str, region: set[int]) -> int:
    """Index of the level: the map's position in the Concat along the anchor axis it flows into."""
    cur = name
    for _ in range(8):
        cons = [c for c in idx.consumers(cur) if c in region and idx.nodes[c].op != "Shape"]
        if len(cons) != 1:
            break
        node = idx.nodes[cons[0]]
        if node.op == "Concat" and node.attrs.get("axis") in (2, -1):
            return [t.name for t in node.inputs].index(cur)
        cur = idx.outs(cons[0])[0]
    raise SurgeryError(f"preset 'yolov8_decode': head map '{name}' does not flow into a Concat along the "
                       "anchor axis (axis 2) as ultralytics' level flattening does")


def yolov8_decode(model: onnx.ModelProto | GraphIndex) -> PresetMatch:
    """Find the YOLOv8 Detect-head decode; see the module docstring for the boundary it picks."""
    idx = _index(model)
    dfls = _dfl_convs(idx)
    if len(dfls) != 1:
        what = "no DFL" if not dfls else f"{len(dfls)} DFL convs"
        raise SurgeryError(f"preset 'yolov8_decode' found {what} (a 1x1 Conv with weights arange(reg_max) after "
                           "a Softmax); it needs one ultralytics Detect head")
    dfl, reg_max = dfls[0]
    reach = _forward(idx, idx.outs(dfl))
    dets = [o for o in idx.outputs if idx.producer(o) in reach]
    if len(dets) != 1:
        raise SurgeryError(f"preset 'yolov8_decode': the DFL conv '{idx.label(dfl)}' feeds {len(dets)} model outputs "
                           f"{dets}; expected exactly one detections output")
    det = dets[0]
    if idx.nodes[idx.producer(det)].op != "Concat":
        raise SurgeryError(f"preset 'yolov8_decode': detections output '{det}' is not made by a Concat "
                           f"(boxes, class scores); it comes from a {idx.nodes[idx.producer(det)].op}")
    _check_output_order(idx, det, reach)
    region, maps = _walk_back(idx, det, dfl)
    ops = {idx.nodes[i].op for i in region}
    for need, what in (("Sigmoid", "class Sigmoid"), ("Mul", "stride Mul")):
        if need not in ops:
            raise SurgeryError(f"preset 'yolov8_decode': no {what} between the head convs and '{det}'")
    if not ops & {"Softmax", "Exp"}:
        raise SurgeryError("preset 'yolov8_decode': no DFL Softmax before the DFL conv")
    if not ops & {"Sub", "Add"}:
        raise SurgeryError("preset 'yolov8_decode': no dist2bbox (Sub/Add against the anchor points)")

    det_sig = idx.sig(det)
    nc = det_sig.shape[1] - 4 if det_sig is not None and isinstance(det_sig.shape[1], int) else None
    roles = _roles(idx, maps, region, reg_max, nc, dfl)
    if nc is None:
        nc = next(_weight_shape(idx, idx.producer(m))[0] for m in maps if roles[m] == "cls")
    levels = _levels(idx, maps, roles, region)
    inputs = tuple(m for lv in levels for m in (lv["box"], lv["cls"]))
    facts = _facts(idx, det, region, levels, roles, reg_max, nc)
    log.info("yolov8_decode: reg_max %d, %d classes, strides %s, %s head, %s anchors", reg_max, nc,
             facts["strides"], facts["head_layout"], _anchors_said(facts))
    return PresetMatch(inputs, (det,), facts, _decode_check(idx, inputs, facts["strides"], reg_max))


def _anchors_said(facts: dict[str, Any]) -> str:
    """The anchors for a log line: their count, or with a free input size the sum of the levels' map sizes
    (an export names that dimension by ONNX Runtime's symbolic expression, ~400 characters of floors)."""
    if isinstance(facts["anchors"], int):
        return str(facts["anchors"])
    return " + ".join(f"{lv['height']}*{lv['width']}" for lv in facts["levels"])


def _decode_check(idx: GraphIndex, inputs: tuple[str, ...], strides: list, reg_max: int):
    """The check of the cut against ultralytics' decode, at the first probe's map sizes (batch 2 where the
    batch is free, so images are told apart); None where a stride or a map size is unknown."""
    shapes = idx.concrete_shapes()[0]
    if None in strides or any(m not in shapes for m in inputs):
        return None
    free = [not isinstance(getattr(idx.sig(m), "shape", (None,))[0], int) for m in inputs]
    dims = [(2 if f else shapes[m][0], *shapes[m][1:]) for m, f in zip(inputs, free)]
    return partial(check_detect_decode, shapes=dims, strides=strides, reg_max=reg_max)


def _check_output_order(idx: GraphIndex, det: str, reach: set[int]) -> None:
    """The kernel writes boxes then class scores: the detections Concat must take the DFL's path first."""
    parts = idx.ins(idx.producer(det))
    if idx.producer(parts[0]) not in reach or idx.producer(parts[-1]) in reach:
        raise SurgeryError(f"preset 'yolov8_decode': detections output '{det}' concatenates {parts}; the kernel "
                           "writes the boxes (the DFL's path) first and the class scores last")


def _roles(idx: GraphIndex, maps: list[str], region: set[int], reg_max: int, nc: int | None, dfl: int) -> dict[str, str]:
    """'box' or 'cls' per head map: by channel count, else by which of DFL/Sigmoid it alone reaches,
    else (split layout with nc == 4*reg_max) by its place in the per-level Concat."""
    roles = {}
    for m in maps:
        ch = (_weight_shape(idx, idx.producer(m)) or (None,))[0]
        if ch == 4 * reg_max and ch != nc:
            roles[m] = "box"
        elif nc is not None and ch == nc and ch != 4 * reg_max:
            roles[m] = "cls"
        elif nc is None and ch != 4 * reg_max:
            roles[m] = "cls"
        else:
            roles[m] = _role_by_path(idx, m, region, dfl)
        if roles[m] is None:
            raise SurgeryError(f"preset 'yolov8_decode': head map '{m}' ({ch} channels) is neither a box map "
                               f"({4 * reg_max} channels) nor a class map ({nc}); segmentation and pose heads "
                               "are not supported")
    return roles


def _role_by_path(idx: GraphIndex, m: str, region: set[int], dfl: int) -> str | None:
    reach = _forward(idx, [m], region)
    sig = any(idx.nodes[i].op == "Sigmoid" for i in reach)
    if (dfl in reach) != sig:
        return "box" if dfl in reach else "cls"
    first = idx.nodes[min(idx.consumers(m))]
    if first.op == "Concat" and first.attrs.get("axis") == 1:
        return "box" if first.inputs[0].name == m else "cls"
    return None


def _levels(idx: GraphIndex, maps: list[str], roles: dict[str, str], region: set[int]) -> list[dict[str, str]]:
    levels: dict[int, dict[str, str]] = {}
    for m in maps:
        slot = levels.setdefault(_level_of(idx, m, region), {})
        if roles[m] in slot:
            raise SurgeryError(f"preset 'yolov8_decode': two {roles[m]} maps at one level: "
                               f"'{slot[roles[m]]}' and '{m}'")
        slot[roles[m]] = m
    if sorted(levels) != list(range(len(levels))) or any(len(v) != 2 for v in levels.values()):
        raise SurgeryError(f"preset 'yolov8_decode': head maps do not pair up as one box and one class map per "
                           f"level: {dict(sorted(levels.items()))}")
    ordered = [levels[i] for i in range(len(levels))]
    _check_level_maps(idx, ordered)
    return ordered


def _check_level_maps(idx: GraphIndex, levels: list[dict[str, str]]) -> None:
    """The kernel decodes level i from box_i and cls_i on one H_i x W_i grid, levels by ascending stride
    (the anchors' order): refuse maps the graph pairs or orders otherwise, or a split layout's per-level
    Concat that puts the class map first (its Split would hand the DFL class logits)."""
    for shapes in idx.concrete_shapes():
        hw = [(shapes.get(lv["box"], (None,) * 4)[2:], shapes.get(lv["cls"], (None,) * 4)[2:]) for lv in levels]
        for lv, (box, cls) in zip(levels, hw):
            if None not in (*box, *cls) and box != cls:
                raise SurgeryError(f"preset 'yolov8_decode': box map '{lv['box']}' {list(box)} and class map "
                                   f"'{lv['cls']}' {list(cls)} sit at one level but differ in size: the graph "
                                   "pairs maps of different levels")
        sizes = [box[0] * box[1] for box, _ in hw if None not in box]
        if len(sizes) == len(levels) and any(a <= b for a, b in zip(sizes, sizes[1:])):
            raise SurgeryError(f"preset 'yolov8_decode': the levels are not in ascending stride order (sizes "
                               f"{[list(box) for box, _ in hw]} of {[lv['box'] for lv in levels]}), as the "
                               "anchors are")
    for lv in levels:
        for c in _level_concats(idx, lv):
            names = idx.ins(c)
            if names.index(lv["cls"]) < names.index(lv["box"]):
                raise SurgeryError(f"preset 'yolov8_decode': the per-level Concat '{idx.label(c)}' takes class map "
                                   f"'{lv['cls']}' before box map '{lv['box']}'; the box channels come first")


def _level_concats(idx: GraphIndex, lv: dict[str, str]) -> list[int]:
    """The channel Concats of a level's box and class maps (the split layout's, which a Split undoes)."""
    return [c for c in idx.consumers(lv["box"])
            if idx.nodes[c].op == "Concat" and idx.nodes[c].attrs.get("axis") == 1 and lv["cls"] in idx.ins(c)]


def _image_input(idx: GraphIndex, head_map: str):
    """The model's 4-D input that the head maps are computed from (another 4-D input, a mask say, is not the
    image: taking it, or none of two, left every level's stride unknown). None when no one input is."""
    sigs = [s for s in (idx.sig(n) for n in idx.inputs) if s is not None and len(s.shape) == 4]
    feeding = [s for s in sigs if idx.producer(head_map) in _forward(idx, [s.name])]
    return feeding[0] if len(feeding) == 1 else None


def _facts(idx: GraphIndex, det: str, region: set[int], levels, roles, reg_max: int, nc: int) -> dict[str, Any]:
    image = _image_input(idx, levels[0]["box"])
    # Spatial sizes at a fixed input size (the model's own when static) give each level's stride.
    static = image is not None and all(isinstance(d, int) for d in image.shape[2:])
    shapes = idx.concrete_shapes()[0]
    in_hw = shapes.get(image.name, (0,) * 4)[2:] if image is not None else None
    rows, strides = [], []
    for i, lv in enumerate(levels):
        h, w = shapes.get(lv["box"], (None,) * 4)[2:]
        stride = in_hw[0] // h if in_hw and h else None
        strides.append(stride)
        if static:
            rows.append({"level": i, "stride": stride, "height": h, "width": w})
        else:
            names = image.shape[2:] if image is not None else ("height", "width")
            rows.append({"level": i, "stride": stride, "height": f"{names[0]}/{stride}", "width": f"{names[1]}/{stride}"})
    det_sig = idx.sig(det)
    anchors = det_sig.shape[2] if det_sig is not None else None
    if static and all(isinstance(r["height"], int) for r in rows):
        anchors = sum(r["height"] * r["width"] for r in rows)
    layout = "split" if any(_level_concats(idx, lv) for lv in levels) else "separate"
    computed = any(idx.nodes[i].op in ("Shape", "Range") for i in region)
    head_inputs = [{"name": lv[role], "role": role, "level": i, "stride": strides[i],
                    "channels": 4 * reg_max if role == "box" else nc}
                   for i, lv in enumerate(levels) for role in ("box", "cls")]
    return {
        "preset": "yolov8_decode",
        "reg_max": reg_max,
        "num_classes": nc,
        "strides": strides,
        "levels": rows,
        "anchors": anchors,
        "head_layout": layout,
        "anchors_source": "computed" if computed else "constant",
        "input": image.name if image else None,
        "input_size": list(image.shape[2:]) if image else None,
        "head_inputs": head_inputs,
        "head_inputs_layout": "per level in anchor order (see strides): box [B, 4*reg_max, H, W] then class [B, nc, H, W], NCHW",
        "output": det,
        "output_layout": "[B, 4 + nc, A]: cx, cy, w, h in input pixels, then sigmoid class scores",
        "dtypes": {"head": _dtype(idx, levels[0]["box"]), "output": _dtype(idx, det)},
    }


def _dtype(idx: GraphIndex, name: str) -> str | None:
    s = idx.sig(name)
    return s.dtype if s is not None else None


PRESETS: Mapping[str, Callable[[onnx.ModelProto | GraphIndex], PresetMatch]] = {"yolov8_decode": yolov8_decode}
