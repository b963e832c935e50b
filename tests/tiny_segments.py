"""A tiny seeded engine segment the TensorRT and TensorRT-RTX build tests share."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def conv_relu_conv(seed: int = 0) -> onnx.ModelProto:
    """images [B,3,32,32] -> Conv -> Relu -> Conv -> out [B,8,32,32], weights seeded: 3 nodes, 3 layers."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 3, 3, 3)) * 0.4).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((8, 16, 1, 1)) * 0.3).astype(np.float32), "w2")]
    nodes = [helper.make_node("Conv", ["images", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
             helper.make_node("Conv", ["r1", "w2"], ["out"], name="conv2")]
    graph = helper.make_graph(nodes, "seg",
                              [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["B", 3, 32, 32])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", 8, 32, 32])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model
