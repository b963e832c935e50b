"""Building blocks of a synthetic YOLOv8: two backends that run the same layer code, and the layers.

A layer function (conv, c2f, sppf, ...) is written once against a small backend interface and runs
twice. `Calibrator` first runs it in float64 numpy on a few seeded images and folds a BatchNorm with
the batch's statistics into every conv, as a trained model's folded BN would, so activations stay
O(1) through the whole network (a fixed init gain cannot: it either dies out or blows up within 20
layers). `GraphBuilder` then emits the ONNX nodes with those folded weights.

Names follow what `torch.onnx.export` writes for an ultralytics model: a node is `{scope}/{Op}` with
`_1`, `_2`, ... for repeats inside one scope, its outputs are `{node}_output_{i}`, folded constants
are `{scope}/Constant_output_0`, and weights keep their PyTorch names (`model.0.conv.weight`).
"""
from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

# Folded BN targets: pre-activations ~ N(beta, gamma^2) per channel, spread like trained BN params.
_GAMMA_LOG_STD, _BETA_STD = 0.25, 0.5
# SPPF's chained MaxPools see nearly the whole P5 map, so on noise images their outputs are per-image
# constants; at full weight they swing every image's scores together (2 % to 20 % of anchors above
# 0.25 between two random images). Damping their share of SPPF.cv2 keeps the head local and stable.
SPPF_POOL_DAMP = 0.1
_MANTISSA_BITS = 12


def seeded_rng(seed: int, name: str) -> np.random.Generator:
    """One stream per (seed, tensor name): values never depend on the order layers are built in."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def round_mantissa(v: np.ndarray) -> np.ndarray:
    """Round to 12 significant bits. Calibration stats carry float64 rounding noise that differs
    between BLAS builds; rounding them keeps same-seed models byte-identical across machines."""
    m, e = np.frexp(np.asarray(v, np.float64))
    return np.ldexp(np.round(m * 2.0**_MANTISSA_BITS) / 2.0**_MANTISSA_BITS, e)


@dataclass(frozen=True, slots=True)
class Standardized:
    """A conv's raw weight and its output's per-channel mean and std on the calibration batch."""

    weight: np.ndarray  # float32 [c2, c1, k, k], no bias
    mean: np.ndarray
    std: np.ndarray

    def fold(self, scale: np.ndarray, shift: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel a, b with raw * a + b == (raw - mean) / std * scale + shift."""
        a = round_mantissa(scale / self.std)
        return a, round_mantissa(shift - self.mean * a)

    def folded(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The float32 weight and bias of that conv."""
        return (self.weight * a[:, None, None, None]).astype(np.float32), b.astype(np.float32)


@dataclass
class Calibrator:
    """Numpy float64 backend: runs layers on a batch of images and folds a BatchNorm with the batch's
    statistics into each conv. `params` maps a conv's weight prefix to (weight, bias)."""

    seed: int
    params: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    heads: dict[str, Standardized] = field(default_factory=dict)

    def _standardize(self, x: np.ndarray, prefix: str, c1: int, c2: int, k: int, s: int,
                     in_scale: np.ndarray | None = None) -> tuple[Standardized, np.ndarray]:
        rng = seeded_rng(self.seed, prefix)
        w = rng.standard_normal((c2, c1, k, k), dtype=np.float32) / np.float32(np.sqrt(c1 * k * k))
        if in_scale is not None:
            w *= in_scale.astype(np.float32)[None, :, None, None]
        y = _conv_f64(x, w.astype(np.float64), s)
        mean, std = y.mean(axis=(0, 2, 3)), y.std(axis=(0, 2, 3)) + 1e-6
        return Standardized(w, round_mantissa(mean), round_mantissa(std)), y

    def conv(self, x: np.ndarray, scope: str, prefix: str, c1: int, c2: int, k: int = 1, s: int = 1,
             in_scale: np.ndarray | None = None) -> np.ndarray:
        """Conv + SiLU; in_scale weights the raw kernel's input channels before normalizing."""
        st, y = self._standardize(x, f"{prefix}.conv", c1, c2, k, s, in_scale)
        rng = seeded_rng(self.seed, f"{prefix}.bn")
        a, b = st.fold(np.exp(rng.normal(0.0, _GAMMA_LOG_STD, c2)), rng.normal(0.0, _BETA_STD, c2))
        self.params[f"{prefix}.conv"] = st.folded(a, b)
        y = y * a[None, :, None, None] + b[None, :, None, None]
        return y / (1.0 + np.exp(-y))  # SiLU

    def conv2d(self, x: np.ndarray, scope: str, prefix: str, c1: int, c2: int) -> np.ndarray:
        """A Detect head's last 1x1 conv: records its stats and returns standardized outputs; the
        caller picks the logits' scale and shift and stores the folded params."""
        st, y = self._standardize(x, prefix, c1, c2, 1, 1)
        self.heads[prefix] = st
        return (y - st.mean[None, :, None, None]) / st.std[None, :, None, None]

    def split(self, x: np.ndarray, scope: str, sizes: list[int]) -> list[np.ndarray]:
        return np.split(x, np.cumsum(sizes)[:-1], axis=1)

    def add(self, scope: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def concat(self, scope: str, xs: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(xs, axis=1)

    def maxpool(self, scope: str, x: np.ndarray, k: int) -> np.ndarray:
        p = k // 2
        xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)), constant_values=-np.inf)
        return np.lib.stride_tricks.sliding_window_view(xp, (k, k), axis=(2, 3)).max(axis=(-2, -1))

    def upsample(self, scope: str, x: np.ndarray) -> np.ndarray:
        return x.repeat(2, axis=2).repeat(2, axis=3)


def _conv_f64(x: np.ndarray, w: np.ndarray, s: int) -> np.ndarray:
    """Conv2d with padding k//2, as k*k shifted matmuls over the whole batch (no im2col copy). Each tap's
    [c2, c1] weights are made contiguous: a strided w[:, :, dy, dx] is not one BLAS can take, and numpy's
    own loop in its place made a 3x3 conv ~15x slower."""
    c2, c1, k, _ = w.shape
    p, n = k // 2, x.shape[0]
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p))).transpose(1, 0, 2, 3)  # [c1, B, H, W]
    h, wd = (x.shape[2] + 2 * p - k) // s + 1, (x.shape[3] + 2 * p - k) // s + 1
    out = np.zeros((c2, n * h * wd))
    for dy in range(k):
        for dx in range(k):
            patch = xp[:, :, dy:dy + s * (h - 1) + 1:s, dx:dx + s * (wd - 1) + 1:s]
            out += np.ascontiguousarray(w[:, :, dy, dx]) @ np.ascontiguousarray(patch).reshape(c1, -1)
    return out.reshape(c2, n, h, wd).transpose(1, 0, 2, 3)


@dataclass
class GraphBuilder:
    """ONNX backend: emits nodes with the calibrated params and torch-exporter style names."""

    params: Mapping[str, tuple[np.ndarray, np.ndarray]]
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    _counts: Counter = field(default_factory=Counter)

    def _name(self, scope: str, op_type: str) -> str:
        key = f"{scope}/{op_type}"
        n = self._counts[key]
        self._counts[key] += 1
        return key if n == 0 else f"{key}_{n}"

    def op(self, scope: str, op_type: str, inputs: list[str], *, outputs: int = 1,
           out_names: list[str] | None = None, **attrs) -> list[str]:
        """Append one node; returns its output tensor names."""
        name = self._name(scope, op_type)
        outs = out_names or [f"{name}_output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, **attrs))
        return outs

    def op1(self, scope: str, op_type: str, inputs: list[str], **attrs) -> str:
        return self.op(scope, op_type, inputs, **attrs)[0]

    def const(self, scope: str, value: np.ndarray) -> str:
        """A folded constant, named like the Constant node torch would have emitted."""
        return self.param(f"{self._name(scope, 'Constant')}_output_0", value)

    def param(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(value, order="C"), name))
        return name

    def conv_node(self, x: str, scope: str, prefix: str, w: np.ndarray, b: np.ndarray | None,
                  s: int = 1) -> str:
        """One Conv node (padding k//2) with initializers `{prefix}.weight` / `{prefix}.bias`."""
        inputs = [x, self.param(f"{prefix}.weight", w)]
        if b is not None:
            inputs.append(self.param(f"{prefix}.bias", b))
        k = w.shape[-1]
        return self.op1(scope, "Conv", inputs, dilations=[1, 1], group=1, kernel_shape=[k, k],
                        pads=[k // 2] * 4, strides=[s, s])

    def conv(self, x: str, scope: str, prefix: str, c1: int, c2: int, k: int = 1, s: int = 1,
             in_scale: np.ndarray | None = None) -> str:
        """ultralytics Conv: Conv2d with BN folded (so with a bias), SiLU exported as Sigmoid, Mul.
        in_scale is already part of the calibrated weights."""
        w, b = self._params(f"{prefix}.conv", (c2, c1, k, k))
        y = self.conv_node(x, f"{scope}/conv", f"{prefix}.conv", w, b, s)
        return self.op1(f"{scope}/act", "Mul", [y, self.op1(f"{scope}/act", "Sigmoid", [y])])

    def conv2d(self, x: str, scope: str, prefix: str, c1: int, c2: int) -> str:
        """A plain 1x1 nn.Conv2d with bias (the Detect head's last layer of each branch)."""
        w, b = self._params(prefix, (c2, c1, 1, 1))
        return self.conv_node(x, scope, prefix, w, b)

    def _params(self, prefix: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        w, b = self.params[prefix]
        assert w.shape == shape, (prefix, w.shape, shape)  # both passes run the same layer code
        return w, b

    def split(self, x: str, scope: str, sizes: list[int]) -> list[str]:
        return self.op(scope, "Split", [x, self.const(scope, np.array(sizes, np.int64))],
                       outputs=len(sizes), axis=1)

    def add(self, scope: str, a: str, b: str) -> str:
        return self.op1(scope, "Add", [a, b])

    def concat(self, scope: str, xs: list[str]) -> str:
        return self.op1(scope, "Concat", xs, axis=1)

    def maxpool(self, scope: str, x: str, k: int) -> str:
        return self.op1(scope, "MaxPool", [x], ceil_mode=0, dilations=[1, 1], kernel_shape=[k, k],
                        pads=[k // 2] * 4, strides=[1, 1])

    def upsample(self, scope: str, x: str) -> str:
        """nn.Upsample(scale_factor=2, mode='nearest') as torch exports it at opset 17."""
        scales = self.const(scope, np.array([1.0, 1.0, 2.0, 2.0], np.float32))
        return self.op1(scope, "Resize", [x, "", scales], coordinate_transformation_mode="asymmetric",
                        cubic_coeff_a=-0.75, mode="nearest", nearest_mode="floor")


# Layers of ultralytics/nn/modules, written once for both backends (`g`).

def c2f(g, x, i: int, c1: int, c2: int, n: int, shortcut: bool):
    """C2f (e=0.5): cv1, Split in two, n Bottlenecks on the last chunk, Concat of all, cv2."""
    scope, prefix, c = f"/model.{i}", f"model.{i}", c2 // 2
    chunks = g.split(g.conv(x, f"{scope}/cv1", f"{prefix}.cv1", c1, 2 * c), scope, [c, c])
    for j in range(n):
        chunks.append(bottleneck(g, chunks[-1], f"{scope}/m.{j}", f"{prefix}.m.{j}", c, shortcut))
    return g.conv(g.concat(scope, chunks), f"{scope}/cv2", f"{prefix}.cv2", (2 + n) * c, c2)


def bottleneck(g, x, scope: str, prefix: str, c: int, shortcut: bool):
    """Bottleneck(c, c, k=(3, 3), e=1.0): two 3x3 Convs, residual Add when shortcut."""
    y = g.conv(x, f"{scope}/cv1", f"{prefix}.cv1", c, c, 3)
    y = g.conv(y, f"{scope}/cv2", f"{prefix}.cv2", c, c, 3)
    return g.add(scope, x, y) if shortcut else y


def sppf(g, x, i: int, c1: int, c2: int, k: int = 5):
    """SPPF: cv1, three chained MaxPool k5 s1, Concat of all four, cv2."""
    scope, prefix, c = f"/model.{i}", f"model.{i}", c1 // 2
    ys = [g.conv(x, f"{scope}/cv1", f"{prefix}.cv1", c1, c)]
    for j in range(3):
        # torch names the repeated calls of one module m, m_1, m_2.
        ys.append(g.maxpool(f"{scope}/m" if j == 0 else f"{scope}/m_{j}", ys[-1], k))
    damp = np.repeat([1.0, SPPF_POOL_DAMP, SPPF_POOL_DAMP, SPPF_POOL_DAMP], c)
    return g.conv(g.concat(scope, ys), f"{scope}/cv2", f"{prefix}.cv2", 4 * c, c2, in_scale=damp)
