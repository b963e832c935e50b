"""Synthetic YOLOv8 models: ultralytics' graph, sane outputs, byte-stable."""
from __future__ import annotations

import ast
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from deepjit_compiler.errors import ModelError
from deepjit_compiler.model import synth
from deepjit_compiler.model.synth import synthesize_yolov8, write_synthetic

# "YOLOv8n summary (fused): 168 layers, 3151904 parameters" and friends, as ultralytics prints them.
FUSED_PARAMS = {"yolov8n": 3_151_904, "yolov8s": 11_156_544, "yolov8m": 25_886_080,
                "yolov8l": 43_668_288, "yolov8x": 68_200_608}
NC = 80


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def run(model: onnx.ModelProto, images: np.ndarray) -> np.ndarray:
    return session(model).run(["output0"], {"images": images})[0]


def images(seed: int, batch: int, h: int = 640, w: int = 640) -> np.ndarray:
    return np.random.default_rng(seed).random((batch, 3, h, w), dtype=np.float32)


def num_anchors(h: int, w: int) -> int:
    return sum((h // s) * (w // s) for s in (8, 16, 32))


def weight_count(model: onnx.ModelProto) -> int:
    """Elements of the PyTorch parameters (initializers keep their `model.*` names)."""
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer if t.name.startswith("model."))


def check_detections(y: np.ndarray, h: int, w: int, *, margin: float = 32.0) -> None:
    """What a trained YOLOv8 gives on noise: boxes near the image, scores sparse and in [0, 1]."""
    assert y.shape[1:] == (4 + NC, num_anchors(h, w))
    assert np.isfinite(y).all()
    cx, cy, bw, bh = y[:, 0], y[:, 1], y[:, 2], y[:, 3]
    assert (bw > 0).all() and (bh > 0).all()
    x1, y1, x2, y2 = cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2
    inside = (x1 >= -margin) & (y1 >= -margin) & (x2 <= w + margin) & (y2 <= h + margin)
    assert inside.mean() >= 0.95, f"only {inside.mean():.1%} of boxes inside the image"
    scores = y[:, 4:]
    assert scores.min() >= 0.0 and scores.max() <= 1.0
    hot = (scores.max(axis=1) > 0.25).mean()
    assert 0.005 <= hot <= 0.10, f"{hot:.2%} of anchors score above 0.25"


@pytest.fixture(scope="module")
def yolov8n() -> onnx.ModelProto:
    return synthesize_yolov8("yolov8n", seed=0)


def test_yolov8n_passes_full_check(yolov8n):
    onnx.checker.check_model(yolov8n, full_check=True)
    assert yolov8n.ir_version == 8
    assert [(o.domain, o.version) for o in yolov8n.opset_import] == [("", 17)]
    props = {p.key: p.value for p in yolov8n.metadata_props}
    assert props["deepjit.synthetic"] == "yolov8n" and props["seed"] == "0"
    names = ast.literal_eval(props["names"])
    assert names[0] == "person" and names[79] == "toothbrush" and len(names) == NC


def test_yolov8n_weights_match_ultralytics_count(yolov8n):
    n = weight_count(yolov8n)
    print(f"yolov8n parameters: {n:,}")
    assert n == FUSED_PARAMS["yolov8n"]


class _CountingBackend:
    """Runs the layer code counting fused conv parameters instead of computing anything."""

    def __init__(self):
        self.params = 16  # the DFL conv's arange(16) weight

    def conv(self, x, scope, prefix, c1, c2, k=1, s=1, in_scale=None):
        self.params += c1 * c2 * k * k + c2

    def conv2d(self, x, scope, prefix, c1, c2):
        self.params += c1 * c2 + c2

    def split(self, x, scope, sizes):
        return [None] * len(sizes)

    def add(self, scope, a, b):
        return None

    def concat(self, scope, xs):
        return None

    def maxpool(self, scope, x, k):
        return None

    def upsample(self, scope, x):
        return None


@pytest.mark.parametrize("variant", sorted(FUSED_PARAMS))
def test_architecture_of_every_scale_matches_ultralytics_count(variant):
    # m/l/x take too long to calibrate in a unit test; their architecture is checked this way.
    g = _CountingBackend()
    feats, chs = synth._body(g, synth.VARIANTS[variant], None)
    synth._head_maps(g, feats, chs, NC)
    assert g.params == FUSED_PARAMS[variant]


@pytest.mark.parametrize("batch", [1, 4])
def test_yolov8n_runs_with_sane_detections(yolov8n, batch):
    x = images(100 + batch, batch)
    y = run(yolov8n, x)
    assert y.shape == (batch, 4 + NC, 8400)
    check_detections(y, 640, 640)


def test_batch_items_are_independent(yolov8n):
    x = images(7, 4)
    together = run(yolov8n, x)
    alone = run(yolov8n, x[2:3])
    np.testing.assert_allclose(together[2:3], alone, rtol=1e-4, atol=1e-3)


def _head_outputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """The model with each level's raw box and class maps (the 1x1 convs) as extra outputs."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    names = [f"/model.22/{b}.{i}/{b}.{i}.2/Conv_output_0" for b in ("cv2", "cv3") for i in range(3)]
    for name in names:
        m.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return m, names


def test_decode_matches_ultralytics_semantics(yolov8n):
    """output0 against a numpy DFL + dist2bbox written from docs/semantics.md, on the raw maps."""
    m, names = _head_outputs(yolov8n)
    x = images(11, 2)
    y, *maps = session(m).run(["output0", *names], {"images": x})
    boxes, scores, anchors_xy, strides = [], [], [], []
    for i, stride in enumerate((8, 16, 32)):
        box, cls = maps[i], maps[3 + i]
        b, _, h, w = box.shape
        logits = box.reshape(b, 4, 16, h * w).astype(np.float64)
        p = np.exp(logits - logits.max(axis=2, keepdims=True))
        dist = (p / p.sum(axis=2, keepdims=True) * np.arange(16)[:, None]).sum(axis=2)  # [B, 4, HW]
        ax, ay = np.tile(np.arange(w) + 0.5, h), np.repeat(np.arange(h) + 0.5, w)
        x1, y1, x2, y2 = ax - dist[:, 0], ay - dist[:, 1], ax + dist[:, 2], ay + dist[:, 3]
        boxes.append(np.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], axis=1) * stride)
        scores.append(1 / (1 + np.exp(-cls.reshape(b, NC, h * w).astype(np.float64))))
        anchors_xy.append(np.stack([ax, ay]) * stride)
        strides.append(np.full(h * w, stride))
    expected = np.concatenate([np.concatenate(boxes, axis=2), np.concatenate(scores, axis=2)], axis=1)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-3)
    # Box centres lie within 15 strides of their anchor (the DFL expectation is in [0, 15]).
    offset = np.abs(y[:, :2] - np.concatenate(anchors_xy, axis=1))
    assert (offset <= 15 * np.concatenate(strides) / 2 + 1e-3).all()


def test_head_layouts_give_the_same_output(yolov8n):
    split = synthesize_yolov8("yolov8n", seed=0, head_layout="split")
    onnx.checker.check_model(split, full_check=True)
    x = images(3, 2)
    np.testing.assert_allclose(run(split, x), run(yolov8n, x), rtol=0, atol=1e-5)

    def head_splits(m):
        return [n for n in m.graph.node if n.op_type == "Split" and n.name.startswith("/model.22/")]

    (node,) = head_splits(split)
    inits = {t.name: numpy_helper.to_array(t) for t in split.graph.initializer}
    assert inits[node.input[1]].tolist() == [64, NC]
    assert head_splits(yolov8n) == []


def test_dynamic_model_runs_at_any_multiple_of_32(yolov8n):
    dyn = synthesize_yolov8("yolov8n", seed=0, dynamic=True)
    onnx.checker.check_model(dyn, full_check=True)

    def dims(v):
        return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]

    assert dims(dyn.graph.input[0]) == ["batch", 3, "height", "width"]
    assert dims(dyn.graph.output[0]) == ["batch", 4 + NC, "anchors"]
    assert not any(t.name in ("/model.22/anchors", "/model.22/strides") for t in dyn.graph.initializer)

    x = images(5, 2)
    np.testing.assert_allclose(run(dyn, x), run(yolov8n, x), rtol=0, atol=1e-5)
    x = images(6, 2, 320, 480)
    y = run(dyn, x)
    assert y.shape == (2, 4 + NC, num_anchors(320, 480)) == (2, 84, 3150)
    # Anchor order: row-major per level, so the last anchor of P3 sits at the bottom-right cell.
    assert abs(y[0, 0, 2399] - 476) < 15 * 8 and abs(y[0, 1, 2399] - 316) < 15 * 8
    check_detections(y, 320, 480)


def test_fixed_batch_is_fully_static():
    m = synthesize_yolov8("yolov8n", seed=0, batch=2)
    assert [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim] == [2, 3, 640, 640]
    assert [d.dim_value for d in m.graph.output[0].type.tensor_type.shape.dim] == [2, 84, 8400]
    inits = {t.name: t for t in m.graph.initializer}
    assert list(inits["/model.22/anchors"].dims) == [1, 2, 8400]
    assert list(inits["/model.22/strides"].dims) == [1, 8400]
    assert run(m, images(8, 2)).shape == (2, 84, 8400)


def test_other_size_and_class_count():
    m = synthesize_yolov8("yolov8n", seed=3, imgsz=320, num_classes=3, batch=1)
    onnx.checker.check_model(m, full_check=True)
    y = run(m, images(9, 1, 320, 320))
    assert y.shape == (1, 7, 2100)
    assert (y[:, 4:] >= 0).all() and (y[:, 4:] <= 1).all()


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, yolov8n):
    synth._calibrated_params.cache_clear()  # recompute the weights from scratch
    again = write_synthetic("yolov8n", tmp_path / "sub" / "dir" / "a.onnx", seed=0)
    assert again.read_bytes() == yolov8n.SerializeToString()
    assert sorted(p.name for p in again.parent.iterdir()) == ["a.onnx"]  # no temp file left
    assert os.access(again, os.R_OK) and (again.stat().st_mode & 0o644) == 0o644
    other = synthesize_yolov8("yolov8n", seed=1)
    assert other.SerializeToString() != yolov8n.SerializeToString()
    assert weight_count(other) == weight_count(yolov8n)


def test_ultralytics_node_names_and_ops(yolov8n):
    nodes = {n.name: n for n in yolov8n.graph.node}
    for name in ["/model.0/conv/Conv", "/model.0/act/Sigmoid", "/model.0/act/Mul", "/model.2/Split",
                 "/model.2/m.0/cv1/conv/Conv", "/model.2/m.0/Add", "/model.9/m/MaxPool",
                 "/model.9/m_1/MaxPool", "/model.9/m_2/MaxPool", "/model.10/Resize", "/model.13/Resize",
                 "/model.22/cv2.0/cv2.0.0/conv/Conv", "/model.22/cv3.2/cv3.2.2/Conv",
                 "/model.22/dfl/Reshape", "/model.22/dfl/Transpose", "/model.22/dfl/Softmax",
                 "/model.22/dfl/conv/Conv", "/model.22/dfl/Reshape_1", "/model.22/Sigmoid"]:
        assert name in nodes, name
    assert nodes["/model.0/act/Mul"].output == ["/model.0/act/Mul_output_0"]
    assert [i.name for i in yolov8n.graph.input] == ["images"]
    assert [o.name for o in yolov8n.graph.output] == ["output0"]

    def attrs(node):
        return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}

    by_op = {}
    for n in yolov8n.graph.node:
        by_op.setdefault(n.op_type, []).append(n)
    # C2f: one Split per block (8 blocks), SPPF: three MaxPool k5 s1, nearest Resize x2.
    assert sorted(n.name for n in by_op["Split"]) == sorted(
        f"/model.{i}/Split" for i in (2, 4, 6, 8, 12, 15, 18, 21))
    assert len(by_op["MaxPool"]) == 3
    assert all(attrs(n)["kernel_shape"] == [5, 5] and attrs(n)["strides"] == [1, 1] for n in by_op["MaxPool"])
    assert len(by_op["Resize"]) == 2 and all(attrs(n)["mode"] == b"nearest" for n in by_op["Resize"])
    assert attrs(nodes["/model.22/dfl/Softmax"])["axis"] == 1
    assert attrs(nodes["/model.22/dfl/Transpose"])["perm"] == [0, 2, 1, 3]
    inits = {t.name: numpy_helper.to_array(t) for t in yolov8n.graph.initializer}
    dfl = nodes["/model.22/dfl/conv/Conv"]
    assert len(dfl.input) == 2 and inits[dfl.input[1]].ravel().tolist() == list(range(16))
    # SiLU as ultralytics exports it: x * Sigmoid(x) after every folded Conv.
    for sig in (n for n in by_op["Sigmoid"] if n.name.endswith("/act/Sigmoid")):
        mul = nodes[sig.name.replace("Sigmoid", "Mul")]
        assert sorted(mul.input) == sorted([sig.input[0], sig.output[0]])
    assert sum(n.name.endswith("/act/Sigmoid") for n in by_op["Sigmoid"]) == 57
    # Detect decode: Sub/Add/Add/Div/Sub of dist2bbox, the stride Mul, the final Concat.
    for name in ["/model.22/Slice", "/model.22/Slice_1", "/model.22/Sub", "/model.22/Add",
                 "/model.22/Add_1", "/model.22/Div", "/model.22/Sub_1", "/model.22/Mul"]:
        assert name in nodes, name
    final = next(n for n in yolov8n.graph.node if "output0" in n.output)
    assert final.op_type == "Concat" and attrs(final)["axis"] == 1


@pytest.mark.parametrize("kw, match", [
    ({"variant": "yolov8"}, r"unknown variant 'yolov8'.*did you mean 'yolov8\w'"),
    ({"variant": "yolov8n", "head_layout": "splt"}, r"head_layout.*did you mean 'split'"),
    ({"variant": "yolov8n", "imgsz": 100}, r"imgsz must be a positive multiple of 32, got 100"),
    ({"variant": "yolov8n", "batch": 0}, r"batch must be None"),
    ({"variant": "yolov8n", "num_classes": 0}, r"num_classes"),
    ({"variant": "yolov8n", "opset": 11}, r"opset must be in 13..18"),
    ({"variant": "yolov8n", "seed": -1}, r"seed must be a non-negative int"),
])
def test_bad_arguments_raise_model_error(kw, match):
    variant = kw.pop("variant")
    with pytest.raises(ModelError, match=match):
        synthesize_yolov8(variant, **kw)


@pytest.mark.slow  # yolov8s: 3x yolov8n's calibration and inference
def test_yolov8s_count_check_and_run():
    m = synthesize_yolov8("yolov8s", seed=0)
    n = weight_count(m)
    print(f"yolov8s parameters: {n:,}")
    assert n == FUSED_PARAMS["yolov8s"]
    onnx.checker.check_model(m, full_check=True)
    y = run(m, images(12, 2))
    assert y.shape == (2, 84, 8400)
    check_detections(y, 640, 640)
