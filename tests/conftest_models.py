"""Tiny ONNX models for the surgery, reassembly and suggest tests (seeded weights, built in memory).

    chain_model      x -> Conv -> a -> [SiLU, Reshape, Softmax, Reshape] -> mid -> Conv -> Relu -> y
    two_cut_model    two cheap regions between convs, and a skip tensor 'a' that crosses both
    parallel_model   two cheap branches off one tensor, joined by an Add
    shape_model      a region that reads the Shape of a tensor outside it
    batch_read_model a region that reads the batch of a tensor outside it; one input has batch 1
    stride_read_model a region that reads ceil(H/2) outside it; its input is floor(H/2)
    mystery_model    a custom-domain op nobody can type or run
    two_input_model  inputs (scale, images), read images first; outputs (y, z), made z last
    tiny_detector    images [N, 3, 32, 32] -> output0 [N, 4 + 3, 16], for the added stages
    to_opset11       an opset-17 model rewritten the way torch exports at opset 11
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F32 = TensorProto.FLOAT


def _w(rng: np.random.Generator, *shape: int) -> np.ndarray:
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


def make_model(nodes, inputs, outputs, inits=(), *, opset: int = 17, domains=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs, initializer=list(inits))
    ops = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    model = helper.make_model(graph, opset_imports=ops, producer_name="tests")
    model.ir_version = 8
    return model


def _conv(name: str, x: str, y: str, w: str, k: int) -> onnx.NodeProto:
    return helper.make_node("Conv", [x, w], [y], name=name, kernel_shape=[k, k], pads=[k // 2] * 4)


def chain_model(*, aux: bool = False, batch: str | int = "N", seed: int = 0) -> onnx.ModelProto:
    """aux: also output ReduceMean(silu), which makes a cut [a] -> [mid] not closed."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(_w(rng, 8, 4, 3, 3), "w0"), numpy_helper.from_array(_w(rng, 8, 8, 1, 1), "w1"),
             numpy_helper.from_array(np.array([0, 8, 64], np.int64), "flat"),
             numpy_helper.from_array(np.array([0, 8, 8, 8], np.int64), "unflat")]
    nodes = [
        _conv("conv0", "x", "a", "w0", 3),
        helper.make_node("Sigmoid", ["a"], ["sig"], name="sigmoid"),
        helper.make_node("Mul", ["a", "sig"], ["silu"], name="silu_mul"),
        helper.make_node("Reshape", ["silu", "flat"], ["r"], name="flatten"),
        helper.make_node("Softmax", ["r"], ["sm"], name="softmax", axis=2),
        helper.make_node("Reshape", ["sm", "unflat"], ["mid"], name="unflatten"),
        _conv("conv1", "mid", "b", "w1", 1),
        helper.make_node("Relu", ["b"], ["y"], name="relu"),
    ]
    outputs = [helper.make_tensor_value_info("y", F32, [batch, 8, 8, 8])]
    if aux:
        nodes.append(helper.make_node("ReduceMean", ["silu"], ["aux"], name="aux_mean", axes=[2, 3], keepdims=0))
        outputs.append(helper.make_tensor_value_info("aux", F32, [batch, 8]))
    return make_model(nodes, [helper.make_tensor_value_info("x", F32, [batch, 4, 8, 8])], outputs, inits)


def two_cut_model(seed: int = 1) -> onnx.ModelProto:
    """x -> conv0 -> a -> (SiLU) -> m1 -> conv1 -> b -> (Transpose, Softmax) -> m2 -> conv2 -> c; y = c + a."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(_w(rng, 8, 4, 3, 3), "w0"), numpy_helper.from_array(_w(rng, 8, 8, 3, 3), "w1"),
             numpy_helper.from_array(_w(rng, 8, 8, 1, 1), "w2")]
    nodes = [
        _conv("conv0", "x", "a", "w0", 3),
        helper.make_node("Sigmoid", ["a"], ["s1"], name="sigmoid"),
        helper.make_node("Mul", ["a", "s1"], ["m1"], name="silu_mul"),
        _conv("conv1", "m1", "b", "w1", 3),
        helper.make_node("Transpose", ["b"], ["t"], name="transpose", perm=[0, 1, 3, 2]),
        helper.make_node("Softmax", ["t"], ["m2"], name="softmax", axis=3),
        _conv("conv2", "m2", "c", "w2", 1),
        helper.make_node("Add", ["c", "a"], ["y"], name="skip_add"),
    ]
    return make_model(nodes, [helper.make_tensor_value_info("x", F32, ["N", 4, 8, 8])],
                      [helper.make_tensor_value_info("y", F32, ["N", 8, 8, 8])], inits)


def parallel_model(seed: int = 2) -> onnx.ModelProto:
    """x -> conv0 -> a; p1 = Sigmoid(a) * 2; p2 = Tanh(a) + 1; y = conv1(p1 + p2)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(_w(rng, 8, 4, 3, 3), "w0"), numpy_helper.from_array(_w(rng, 8, 8, 1, 1), "w1"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one")]
    nodes = [
        _conv("conv0", "x", "a", "w0", 3),
        helper.make_node("Sigmoid", ["a"], ["s"], name="sigmoid"),
        helper.make_node("Mul", ["s", "two"], ["p1"], name="scale"),
        helper.make_node("Tanh", ["a"], ["th"], name="tanh"),
        helper.make_node("Add", ["th", "one"], ["p2"], name="shift"),
        helper.make_node("Add", ["p1", "p2"], ["q"], name="join"),
        _conv("conv1", "q", "y", "w1", 1),
    ]
    return make_model(nodes, [helper.make_tensor_value_info("x", F32, ["N", 4, 8, 8])],
                      [helper.make_tensor_value_info("y", F32, ["N", 8, 8, 8])], inits)


def shape_model(*, read_channels: bool = False, seed: int = 3) -> onnx.ModelProto:
    """a = conv0(x) [N, 8, H, W]; g = conv1(a) [N, 2, H, W]; y = Reshape(Sigmoid(g), [0, 2, H*W]) where
    H, W come from Shape(a): a region [g] -> [y] reads the shape of 'a', outside it. read_channels:
    read a's channel dim too, which no input of that region shares."""
    rng = np.random.default_rng(seed)
    idx = [1, 2, 3] if read_channels else [2, 3]
    inits = [numpy_helper.from_array(_w(rng, 8, 4, 3, 3), "w0"), numpy_helper.from_array(_w(rng, 2, 8, 1, 1), "w1"),
             numpy_helper.from_array(np.array(idx, np.int64), "dims"),
             numpy_helper.from_array(np.array([0, 2], np.int64), "head")]
    nodes = [
        _conv("conv0", "x", "a", "w0", 3),
        _conv("conv1", "a", "g", "w1", 1),
        helper.make_node("Shape", ["a"], ["shape_a"], name="shape"),
        helper.make_node("Gather", ["shape_a", "dims"], ["hw"], name="gather_hw", axis=0),
        helper.make_node("ReduceProd", ["hw"], ["n"], name="area", keepdims=1),
        helper.make_node("Concat", ["head", "n"], ["target"], name="target", axis=0),
        helper.make_node("Sigmoid", ["g"], ["sg"], name="sigmoid"),
        helper.make_node("Reshape", ["sg", "target"], ["y"], name="flatten"),
    ]
    return make_model(nodes, [helper.make_tensor_value_info("x", F32, ["N", 4, "H", "W"])],
                      [helper.make_tensor_value_info("y", F32, ["N", 2, None])], inits)


def batch_read_model(seed: int = 5) -> onnx.ModelProto:
    """a = Conv(x, stride 2) + conv(MaxPool(x)) [N, 8, H/2, W/2] (even H and W only); g = conv1(a);
    k = mean of g over the batch [1, 2, H/2, W/2]; y = Reshape(g - k, [N, -1]) where N comes from
    Shape(a)[0]: k's batch is a's only at N = 1."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(_w(rng, 8, 4, 3, 3), "w0"), numpy_helper.from_array(_w(rng, 2, 8, 1, 1), "w1"),
             numpy_helper.from_array(_w(rng, 8, 4, 1, 1), "wp"),
             numpy_helper.from_array(np.array([0], np.int64), "dims"),
             numpy_helper.from_array(np.array([-1], np.int64), "rest")]
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["s"], name="conv0", kernel_shape=[3, 3], pads=[1] * 4, strides=[2, 2]),
        helper.make_node("MaxPool", ["x"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        _conv("conv_p", "p", "q", "wp", 1),
        helper.make_node("Add", ["s", "q"], ["a"], name="join"),
        _conv("conv1", "a", "g", "w1", 1),
        helper.make_node("ReduceMean", ["g"], ["k"], name="batch_mean", axes=[0], keepdims=1),
        helper.make_node("Shape", ["a"], ["shape_a"], name="shape"),
        helper.make_node("Gather", ["shape_a", "dims"], ["n"], name="gather_n", axis=0),
        helper.make_node("Concat", ["n", "rest"], ["target"], name="target", axis=0),
        helper.make_node("Sub", ["g", "k"], ["d"], name="center"),
        helper.make_node("Reshape", ["d", "target"], ["y"], name="flatten"),
    ]
    return make_model(nodes, [helper.make_tensor_value_info("x", F32, ["N", 4, "H", "W"])],
                      [helper.make_tensor_value_info("y", F32, ["N", None])], inits)


def stride_read_model(*, width: str | int = "W", even_only: str | None = None, seed: int = 6) -> onnx.ModelProto:
    """a = Conv(x, stride 2, pad 1) [N, 8, ceil(H/2), ceil(W/2)] (also output 'ya' = Relu(a));
    g = conv1(MaxPool 2x2 (x)) [N, 2, floor(H/2), floor(W/2)]; y = Sigmoid(g) * (a's H * W):
    g's H and W are a's at even input sizes only. `width`: the input's width. `even_only` 'a' or 'g':
    that tensor also adds a map of the other's size, so it has no shape at odd sizes (nor does the model)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(_w(rng, 8, 4, 3, 3), "w0"), numpy_helper.from_array(_w(rng, 2, 4, 1, 1), "w1"),
             numpy_helper.from_array(np.array([2, 3], np.int64), "dims")]
    a, g = ("a0" if even_only == "a" else "a"), ("g0" if even_only == "g" else "g")
    nodes = [
        helper.make_node("Conv", ["x", "w0"], [a], name="conv0", kernel_shape=[3, 3], pads=[1] * 4, strides=[2, 2]),
        helper.make_node("Relu", ["a"], ["ya"], name="relu"),
        helper.make_node("MaxPool", ["x"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        _conv("conv1", "p", g, "w1", 1),
        helper.make_node("Shape", ["a"], ["shape_a"], name="shape"),
        helper.make_node("Gather", ["shape_a", "dims"], ["hw"], name="gather_hw", axis=0),
        helper.make_node("ReduceProd", ["hw"], ["area"], name="area", keepdims=1),
        helper.make_node("Cast", ["area"], ["area_f"], name="cast", to=F32),
        helper.make_node("Sigmoid", ["g"], ["sg"], name="sigmoid"),
        helper.make_node("Mul", ["sg", "area_f"], ["y"], name="scale"),
    ]
    if even_only == "a":  # + a floor(H/2) map
        inits.append(numpy_helper.from_array(_w(rng, 8, 4, 1, 1), "w_even"))
        nodes += [_conv("conv_even", "p", "a1", "w_even", 1), helper.make_node("Add", ["a0", "a1"], ["a"], name="even")]
    elif even_only == "g":  # + a ceil(H/2) map
        inits.append(numpy_helper.from_array(_w(rng, 2, 8, 1, 1), "w_even"))
        nodes += [_conv("conv_even", "a", "g1", "w_even", 1), helper.make_node("Add", ["g0", "g1"], ["g"], name="even")]
    return make_model(nodes, [helper.make_tensor_value_info("x", F32, ["N", 4, "H", width])],
                      [helper.make_tensor_value_info("y", F32, ["N", 2, None, None]),
                       helper.make_tensor_value_info("ya", F32, ["N", 8, None, None])], inits)


def two_input_model(seed: int = 7) -> onnx.ModelProto:
    """Inputs scale [N, 3, 1, 1] and images [N, 3, 8, 8], the first node reading images; a = conv0(images);
    m = SiLU(a); y = conv1(m) * Relu(scale); z = Tanh(a) is the second output, made by the last node."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(_w(rng, 8, 3, 3, 3), "w0"), numpy_helper.from_array(_w(rng, 3, 8, 1, 1), "w1")]
    nodes = [
        _conv("conv0", "images", "a", "w0", 3),
        helper.make_node("Relu", ["scale"], ["rs"], name="relu"),
        helper.make_node("Sigmoid", ["a"], ["s"], name="sigmoid"),
        helper.make_node("Mul", ["a", "s"], ["m"], name="silu_mul"),
        _conv("conv1", "m", "c", "w1", 1),
        helper.make_node("Mul", ["c", "rs"], ["y"], name="scale_mul"),
        helper.make_node("Tanh", ["a"], ["z"], name="tanh"),
    ]
    return make_model(nodes, [helper.make_tensor_value_info("scale", F32, ["N", 3, 1, 1]),
                              helper.make_tensor_value_info("images", F32, ["N", 3, 8, 8])],
                      [helper.make_tensor_value_info("y", F32, ["N", 3, 8, 8]),
                       helper.make_tensor_value_info("z", F32, ["N", 8, 8, 8])], inits)


def mystery_model() -> onnx.ModelProto:
    """x -> Relu -> a -> test.mystery::Mystery -> m -> Relu -> y: nothing can type 'm'."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu0"),
             helper.make_node("Mystery", ["a"], ["m"], name="mystery", domain="test.mystery"),
             helper.make_node("Relu", ["m"], ["y"], name="relu1")]
    return make_model(nodes, [helper.make_tensor_value_info("x", F32, ["N", 4])],
                      [helper.make_tensor_value_info("y", F32, None)], domains=["test.mystery"])


def tiny_detector(*, num_classes: int = 3, size: int = 32, seed: int = 4) -> onnx.ModelProto:
    """images [N, 3, size, size] -> Conv stride 8 -> [N, 4 + nc, A] as output0: boxes a few pixels
    wide around the image, sparse class scores (logits biased down)."""
    rng = np.random.default_rng(seed)
    c = 4 + num_classes
    w = _w(rng, c, 3, 8, 8)
    bias = np.concatenate([[size / 2, size / 2, size / 4, size / 4], np.full(num_classes, -3.0)]).astype(np.float32)
    w[:4] *= size / 8
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "bias"),
             numpy_helper.from_array(np.array([0, c, -1], np.int64), "flat"),
             numpy_helper.from_array(np.array([4, num_classes], np.int64), "split")]
    nodes = [
        helper.make_node("Conv", ["images", "w", "bias"], ["feat"], name="conv", kernel_shape=[8, 8], strides=[8, 8]),
        helper.make_node("Reshape", ["feat", "flat"], ["flat_out"], name="flatten"),
        helper.make_node("Split", ["flat_out", "split"], ["box", "logit"], name="split", axis=1),
        helper.make_node("Abs", ["box"], ["box_pos"], name="abs"),
        helper.make_node("Sigmoid", ["logit"], ["cls"], name="sigmoid"),
        helper.make_node("Concat", ["box_pos", "cls"], ["output0"], name="concat", axis=1),
    ]
    a = (size // 8) ** 2
    return make_model(nodes, [helper.make_tensor_value_info("images", F32, ["N", 3, size, size])],
                      [helper.make_tensor_value_info("output0", F32, ["N", c, a])], inits)


def to_opset11(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite an opset-13..17 model as torch.onnx exports at opset 11: Split/Unsqueeze/Squeeze take
    attributes, Resize gets an explicit empty roi, and a Softmax over a non-last axis becomes
    Transpose -> Softmax(last) -> Transpose (opset < 13 Softmax flattens to 2-D). onnx's own
    version converter cannot go below 14 for these models (no Mul 14 -> 13 adapter)."""
    m = onnx.shape_inference.infer_shapes(model)
    rank = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in (*m.graph.value_info, *m.graph.input)}
    consts = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    nodes: list[onnx.NodeProto] = []
    extra: list[onnx.TensorProto] = [numpy_helper.from_array(np.zeros(0, np.float32), "opset11_empty_roi")]
    for n in m.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "Split" and len(n.input) == 2:
            nodes.append(helper.make_node("Split", [n.input[0]], list(n.output), name=n.name,
                                          split=[int(v) for v in consts[n.input[1]]], **attrs))
        elif n.op_type in ("Unsqueeze", "Squeeze") and len(n.input) == 2:
            nodes.append(helper.make_node(n.op_type, [n.input[0]], list(n.output), name=n.name,
                                          axes=[int(v) for v in np.ravel(consts[n.input[1]])]))
        elif n.op_type == "Resize":
            ins = list(n.input) + [""] * (4 - len(n.input))
            ins[1] = ins[1] or "opset11_empty_roi"
            nodes.append(helper.make_node("Resize", [i for i in ins[:3]] + ([ins[3]] if ins[3] else []),
                                          list(n.output), name=n.name, **attrs))
        elif n.op_type == "Softmax" and attrs.get("axis", -1) not in (-1, rank[n.input[0]] - 1):
            r, axis = rank[n.input[0]], attrs["axis"] % rank[n.input[0]]
            perm = list(range(r))
            perm[axis], perm[-1] = perm[-1], perm[axis]
            nodes += [helper.make_node("Transpose", [n.input[0]], [f"{n.name}_in_t"], name=f"{n.name}/Transpose_in", perm=perm),
                      helper.make_node("Softmax", [f"{n.name}_in_t"], [f"{n.name}_sm"], name=n.name, axis=r - 1),
                      helper.make_node("Transpose", [f"{n.name}_sm"], list(n.output), name=f"{n.name}/Transpose_out", perm=perm)]
        else:
            nodes.append(n)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(extra)
    del out.opset_import[:]
    out.opset_import.append(helper.make_opsetid("", 11))
    out.ir_version = 6
    onnx.checker.check_model(out, full_check=True)
    return out
