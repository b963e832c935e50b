"""precision.py and calibration.py: the graph rewrites, their measured cost, the calibration cache."""
from __future__ import annotations

import importlib
import json
import logging

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest_models import chain_model, two_input_model
from onnx import TensorProto, helper, numpy_helper

from deepjit_compiler.errors import MissingDependency, ModelError, RuntimeInputError, SpecError
from deepjit_compiler.precision.calibration import CalibrationSettings, cache_key, reader_for
from deepjit_compiler.precision.emulate import emulate_in_fp32, measure_cost
from deepjit_compiler.precision.rewrite import DEFAULT_KEEP_FP32, KEEP_FP32_REASONS, apply_precision, check_keep_fp32
from deepjit_compiler.validation.data import folder_feeds

FLOAT, F16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
# the module, not the `quantize` function the package re-exports under the same name
ort_quantize = importlib.import_module("onnxruntime.quantization.quantize")


def conv_softmax_model(seed: int = 0) -> onnx.ModelProto:
    """x [N,3,16,16] -> Conv -> Relu -> Conv -> Softmax(axis=1) -> y, weights seeded."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((8, 3, 3, 3)) * 0.5).astype(np.float32)
    b1 = rng.standard_normal(8).astype(np.float32)
    w2 = (rng.standard_normal((16, 8, 3, 3)) * 0.3).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
             helper.make_node("Softmax", ["c2"], ["y"], axis=1, name="softmax")]
    graph = helper.make_graph(
        nodes, "conv_softmax", [helper.make_tensor_value_info("x", FLOAT, ["N", 3, 16, 16])],
        [helper.make_tensor_value_info("y", FLOAT, ["N", 16, 16, 16])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def feeds(n: int, shape, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.uniform(-1, 1, size=shape).astype(np.float32)} for _ in range(n)]


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    g = onnx.shape_inference.infer_shapes(model).graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in (*g.input, *g.output, *g.value_info)}
    types.update({t.name: t.data_type for t in g.initializer})
    return types


def node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name == name)


def random_calibration(tmp_path, seed: int = 0, samples: int = 4, **kw) -> CalibrationSettings:
    kw = {"ranges": {"x": (-1.0, 1.0)}, "shapes": {"x": (1, 3, 16, 16)}, **kw}
    return CalibrationSettings(data="random", cache=tmp_path / "calib", samples=samples, seed=seed, **kw)


# -- fp16 -----------------------------------------------------------------------------------------

def test_fp16_keeps_io_types_and_softmax_in_fp32():
    m16 = apply_precision(conv_softmax_model(), "fp16")
    onnx.checker.check_model(m16)  # also checks topological order
    types = tensor_types(m16)
    assert [i.type.tensor_type.elem_type for i in m16.graph.input] == [FLOAT]
    assert [o.type.tensor_type.elem_type for o in m16.graph.output] == [FLOAT]
    sm = node(m16, "softmax")
    assert types[sm.input[0]] == FLOAT and types[sm.output[0]] == FLOAT
    assert types[node(m16, "conv2").output[0]] == F16
    assert types["w1"] == F16 and types["w2"] == F16
    # the fp32 Softmax output reaches the graph output without an fp16 round trip
    assert not any(n.op_type == "Cast" and types.get(n.input[0]) == FLOAT and
                   any(a.name == "to" and a.i == F16 for a in n.attribute) and sm.output[0] in n.input
                   for n in m16.graph.node)
    assert {p.key: p.value for p in m16.metadata_props}["deepjit.precision"] == "fp16"


def test_fp16_cost_is_small_but_nonzero():
    model = conv_softmax_model()
    cost = measure_cost(model, apply_precision(model, "fp16"), feeds(3, (2, 3, 16, 16), seed=1))
    y = cost["y"]
    assert cost.precision == "fp16" and cost.samples == 3
    # Softmax outputs lie in [0, 1]; fp16 keeps ~3 decimal digits through two convs
    assert 0 < y.max_abs < 2e-2
    assert 0 < y.median_abs < 1e-3
    assert y.ref_max_abs <= 1.0


def test_measure_cost_of_an_unchanged_model_is_zero():
    model = conv_softmax_model()
    cost = measure_cost(model, apply_precision(model, "fp32"), feeds(2, (1, 3, 16, 16), seed=2))
    assert cost["y"].max_abs == 0 and cost["y"].max_rel == 0


def _offset_model(dtype: int) -> onnx.ModelProto:
    """y = Conv(Conv(x, I, +1000), I, -1000): exact in fp32, lossy where the middle tensor is stored
    in a low type (fp16 spacing at 1000 is 0.5, bf16's is 4)."""
    eye = np.eye(4, dtype=np.float32).reshape(4, 4, 1, 1)
    nodes = [helper.make_node("Cast", ["x"], ["xl"], to=dtype, name="in_cast"),
             helper.make_node("Conv", ["xl", "w", "bp"], ["a"], name="c1"),
             helper.make_node("Conv", ["a", "w", "bm"], ["yl"], name="c2"),
             helper.make_node("Cast", ["yl"], ["y"], to=FLOAT, name="out_cast")]
    low = ml_dtypes.bfloat16 if dtype == BF16 else np.float16
    inits = [numpy_helper.from_array(eye.astype(low), "w"),
             numpy_helper.from_array(np.full(4, 1000, np.float32).astype(low), "bp"),
             numpy_helper.from_array(np.full(4, -1000, np.float32).astype(low), "bm")]
    graph = helper.make_graph(nodes, "offset", [helper.make_tensor_value_info("x", FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", FLOAT, [1, 4, 8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])


@pytest.mark.parametrize("dtype,low", [(F16, np.float16), (BF16, ml_dtypes.bfloat16)])
def test_emulation_rounds_every_low_precision_tensor(dtype, low):
    x = np.random.default_rng(3).uniform(0, 0.4, size=(1, 4, 8, 8)).astype(np.float32)
    # Expected by hand: round the input, the +1000 intermediate and the result to the low type.
    a = (x.astype(low).astype(np.float64) + 1000).astype(low)
    expected = (a.astype(np.float64) - 1000).astype(low).astype(np.float32)
    got = ort.InferenceSession(emulate_in_fp32(_offset_model(dtype)).SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, expected)
    assert np.abs(got - x).max() > 0.1  # the rounding at 1000 really happened


def test_fp16_cost_sees_intermediate_rounding_that_ort_cpu_hides():
    # ORT's CPU provider runs fp16 Convs in fp32 and skips the rounding between them; the measured
    # cost must not: identity model vs. its fp16 version through a +1000/-1000 detour.
    x_feeds = [{"x": np.random.default_rng(4).uniform(0, 0.4, size=(1, 4, 8, 8)).astype(np.float32)}]
    fp16 = _offset_model(F16)
    ident = helper.make_model(helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "ident",
        [helper.make_tensor_value_info("x", FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", FLOAT, [1, 4, 8, 8])]),
        opset_imports=[helper.make_opsetid("", 22)])
    native = ort.InferenceSession(fp16.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x_feeds[0])[0]
    assert np.abs(native - x_feeds[0]["x"]).max() < 0.01  # what running the fp16 graph directly would report
    assert measure_cost(ident, fp16, x_feeds)["y"].max_abs > 0.1


def test_fp16_keeps_ort_block_list_and_the_models_metadata():
    """keep_fp32 adds to ONNX Runtime's own list of ops without fp16 support (Max is one), and the
    rewrite adds its key to the model's metadata rather than replacing it."""
    model = chain_model()
    model.graph.node[2].op_type = "Max"  # silu_mul: Max(a, sigmoid(a))
    helper.set_model_props(model, {"exported_by": "tests"})
    m16 = apply_precision(model, "fp16", keep_fp32=["Softmax"])
    types = tensor_types(m16)
    assert types[node(m16, "silu_mul").output[0]] == FLOAT and types[node(m16, "sigmoid").output[0]] == F16
    assert {p.key: p.value for p in m16.metadata_props} == {"exported_by": "tests", "deepjit.precision": "fp16"}


def _casts_model() -> onnx.ModelProto:
    """Casts the fp16 pass leaves next to fp32 ones: an int32 input cast to float before a Softmax,
    a truncation (Cast to int32 and back) between kept nodes, and no-op Casts to float of a tensor
    another node also reads and of a graph output."""
    f, i32 = lambda n, s: helper.make_tensor_value_info(n, FLOAT, s), TensorProto.INT32
    nodes = [helper.make_node("Cast", ["n"], ["nf"], to=FLOAT, name="to_float"),
             helper.make_node("Softmax", ["nf"], ["p"], axis=1, name="softmax"),
             helper.make_node("Cast", ["x"], ["xi"], to=i32, name="trunc"),
             helper.make_node("Cast", ["xi"], ["xt"], to=FLOAT, name="back"),
             helper.make_node("Relu", ["xt"], ["t"], name="relu_t"),
             helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Cast", ["r"], ["rc"], to=FLOAT, name="noop"),
             helper.make_node("Sigmoid", ["rc"], ["a"], name="sigmoid"),
             helper.make_node("Neg", ["r"], ["b"], name="neg"),
             helper.make_node("Add", ["a", "b"], ["s"], name="add"),
             helper.make_node("Cast", ["p"], ["pc"], to=FLOAT, name="noop_out"),
             helper.make_node("Neg", ["pc"], ["q"], name="neg_p")]
    graph = helper.make_graph(nodes, "casts", [helper.make_tensor_value_info("n", i32, [2, 5]), f("x", [2, 5])],
                              [f("p", [2, 5]), f("t", [2, 5]), f("s", [2, 5]), f("q", [2, 5])])
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_fp16_folds_only_float_round_trips_and_no_op_casts_nothing_else_reads():
    model = _casts_model()
    m16 = apply_precision(model, "fp16", keep_fp32=["Softmax", "trunc", "back", "noop_out"])
    onnx.checker.check_model(m16, full_check=True)
    rng = np.random.default_rng(16)
    feed = {"n": rng.integers(-3000, 3000, size=(2, 5)).astype(np.int32),
            "x": rng.uniform(-5, 5, size=(2, 5)).astype(np.float32)}
    p, t, s, q = ort.InferenceSession(emulate_in_fp32(m16).SerializeToString(),
                                      providers=["CPUExecutionProvider"]).run(["p", "t", "s", "q"], feed)
    nf = feed["n"].astype(np.float16).astype(np.float64)  # the Cast to float now makes float16
    e = np.exp(nf - nf.max(axis=1, keepdims=True))
    np.testing.assert_allclose(p, e / e.sum(axis=1, keepdims=True), rtol=1e-6, atol=1e-30)
    np.testing.assert_array_equal(t, np.maximum(np.trunc(feed["x"]), 0))  # the truncation is kept
    r = np.maximum(feed["x"], 0)
    np.testing.assert_allclose(s, 1 / (1 + np.exp(-r)) - r, atol=4e-3)
    np.testing.assert_allclose(q, -p)


def test_fp16_keeps_integer_casts_and_a_no_op_cast_of_a_graph_output():
    """x -> Cast(int32) -> xi (an output) -> Cast(int32) -> Cast(float) -> y: the truncation reads the
    fp16 copy of x, and the no-op Cast of the output xi stays (dropping it would orphan xi)."""
    nodes = [helper.make_node("Cast", ["x"], ["xi"], to=TensorProto.INT32, name="trunc"),
             helper.make_node("Cast", ["xi"], ["xj"], to=TensorProto.INT32, name="noop_int"),
             helper.make_node("Cast", ["xj"], ["y"], to=FLOAT, name="back")]
    graph = helper.make_graph(nodes, "trunc", [helper.make_tensor_value_info("x", FLOAT, [2, 5])],
                              [helper.make_tensor_value_info("xi", TensorProto.INT32, [2, 5]),
                               helper.make_tensor_value_info("y", FLOAT, [2, 5])])
    m16 = apply_precision(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), "fp16")
    onnx.checker.check_model(m16, full_check=True)
    x = np.random.default_rng(22).uniform(-50, 50, size=(2, 5)).astype(np.float32)
    xi, y = ort.InferenceSession(m16.SerializeToString(), providers=["CPUExecutionProvider"]).run(["xi", "y"], {"x": x})
    expected = np.trunc(x.astype(np.float16).astype(np.float64))
    np.testing.assert_array_equal(xi, expected.astype(np.int32))
    np.testing.assert_array_equal(y, expected.astype(np.float32))


def test_fp16_keeps_a_no_op_cast_of_an_integer_graph_input():
    graph = helper.make_graph([helper.make_node("Cast", ["n"], ["nc"], to=TensorProto.INT32, name="noop_in"),
                               helper.make_node("Cast", ["nc"], ["y"], to=FLOAT, name="to_float")], "noop_in",
                              [helper.make_tensor_value_info("n", TensorProto.INT32, [2, 5])],
                              [helper.make_tensor_value_info("y", FLOAT, [2, 5])])
    m16 = apply_precision(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), "fp16")
    onnx.checker.check_model(m16, full_check=True)
    n = np.random.default_rng(23).integers(-3000, 3000, size=(2, 5)).astype(np.int32)
    (y,) = ort.InferenceSession(m16.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"n": n})
    np.testing.assert_array_equal(y, n.astype(np.float16).astype(np.float32))  # the Cast to float makes float16


def test_fp16_keeps_a_cast_to_double_of_a_tensor_onnx_cannot_type():
    """Gelu (com.microsoft) converted to fp16 has no inferred output type: the Cast to double after it is
    no no-op to drop, and the double output stays double."""
    graph = helper.make_graph([helper.make_node("Gelu", ["x"], ["g"], domain="com.microsoft", name="gelu"),
                               helper.make_node("Cast", ["g"], ["y"], to=TensorProto.DOUBLE, name="to_double")], "ms",
                              [helper.make_tensor_value_info("x", FLOAT, [2, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    x = np.random.default_rng(32).uniform(-2, 2, size=(2, 5)).astype(np.float32)
    fp32, fp16 = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
                  for m in (model, apply_precision(model, "fp16")))
    assert fp16.dtype == np.float64
    np.testing.assert_allclose(fp16, fp32, rtol=2 ** -9, atol=2 ** -9)


def _identity(dtype: int = FLOAT, name: str = "ident") -> onnx.ModelProto:
    """x [1, 4, 8, 8] of `dtype` -> Cast to float -> y."""
    return helper.make_model(helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], to=FLOAT)], name,
        [helper.make_tensor_value_info("x", dtype, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", FLOAT, [1, 4, 8, 8])]), opset_imports=[helper.make_opsetid("", 22)])


def test_measure_cost_statistics_over_all_feeds_by_hand():
    """The +1000/-1000 detour in fp16 against the identity, over two feeds of different scales: every
    statistic from the hand-rounded values, the output scale the larger feed's."""
    rng = np.random.default_rng(17)
    xs = [rng.uniform(0.5, 4, size=(1, 4, 8, 8)).astype(np.float32),
          rng.uniform(0.01, 0.4, size=(1, 4, 8, 8)).astype(np.float32)]
    cost = measure_cost(_identity(), _offset_model(F16), [{"x": x} for x in xs])["y"]
    x = np.concatenate([a.ravel() for a in xs]).astype(np.float64)
    a = (x.astype(np.float16).astype(np.float64) + 1000).astype(np.float16)
    err = np.abs((a.astype(np.float64) - 1000).astype(np.float16).astype(np.float64) - x)
    assert (cost.max_abs, cost.median_abs) == pytest.approx((err.max(), np.median(err)), rel=1e-6)
    assert (cost.max_rel, cost.median_rel) == pytest.approx(((err / x).max(), np.median(err / x)), rel=1e-6)
    assert cost.ref_max_abs == pytest.approx(float(xs[0].max()))


@pytest.mark.parametrize("dtype,low", [(F16, np.float16), (BF16, ml_dtypes.bfloat16)])
def test_emulation_rounds_a_low_precision_graph_input(dtype, low):
    x = np.random.default_rng(18).uniform(-1, 1, size=(1, 4, 8, 8)).astype(np.float32)
    got = ort.InferenceSession(emulate_in_fp32(_identity(dtype)).SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, x.astype(low).astype(np.float32))
    assert not np.array_equal(got, x)


def test_measure_cost_feeds_an_fp16_input_and_names_a_missing_output():
    x = np.random.default_rng(19).uniform(-1, 1, size=(1, 4, 8, 8)).astype(np.float16)
    assert measure_cost(_identity(F16), _identity(F16), [{"x": x}])["y"].max_abs == 0
    renamed = _identity()
    renamed.graph.node[0].output[0] = renamed.graph.output[0].name = "z"
    with pytest.raises(ModelError, match=r"segment 'ident': the rewritten segment lacks outputs \['y'\]"):
        measure_cost(_identity(), renamed, [{"x": x.astype(np.float32)}])


def _plus(c: float) -> onnx.ModelProto:
    """y = x + c, x [1, 4, 8, 8] float."""
    graph = helper.make_graph([helper.make_node("Add", ["x", "c"], ["y"])], "plus",
                              [helper.make_tensor_value_info("x", FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", FLOAT, [1, 4, 8, 8])],
                              [numpy_helper.from_array(np.float32(c), "c")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])


def test_measure_cost_relative_error_of_negative_and_zero_references():
    """Against a negative reference the relative error is |a - b| / |ref| and the scale its magnitude;
    where the reference is 0 it divides by float64's epsilon, as Polygraphy does."""
    x = np.random.default_rng(25).uniform(-4, -1, size=(1, 4, 8, 8)).astype(np.float32)
    x[0, 2, 3, 4] = 0.0
    cost = measure_cost(_identity(), _plus(1e-3), [{"x": x}])["y"]
    err = np.abs((x + np.float32(1e-3)).astype(np.float64) - x)
    rel = err / np.where(x == 0, np.finfo(np.float64).eps, np.abs(x))
    assert (cost.max_rel, cost.median_rel) == pytest.approx((rel.max(), np.median(rel)), rel=1e-6)
    assert cost.max_rel > 1e12 and cost.ref_max_abs == pytest.approx(float(np.abs(x).max()))


def test_measure_cost_needs_a_feed_and_hands_the_rewritten_segment_only_its_inputs():
    with pytest.raises(ValueError, match="measure_cost needs at least one feed"):
        measure_cost(_identity(), _identity(), [])
    both = helper.make_model(helper.make_graph(  # an extra input `z` the rewritten segment dropped
        [helper.make_node("Identity", ["x"], ["y"])], "ident",
        [helper.make_tensor_value_info("x", FLOAT, [1, 4, 8, 8]), helper.make_tensor_value_info("z", FLOAT, [2])],
        [helper.make_tensor_value_info("y", FLOAT, [1, 4, 8, 8])]), opset_imports=[helper.make_opsetid("", 22)])
    rng = np.random.default_rng(26)
    feed = {"x": rng.uniform(-1, 1, size=(1, 4, 8, 8)).astype(np.float32), "z": rng.uniform(-1, 1, 2).astype(np.float32)}
    assert measure_cost(both, _identity(), [feed])["y"].max_abs == 0


def test_measure_cost_reports_a_nan_output_as_an_infinite_error():
    """A NaN would compare false against every gate tolerance: it counts as infinite instead."""
    x = np.random.default_rng(27).uniform(-1, 1, size=(1, 4, 8, 8)).astype(np.float32)
    cost = measure_cost(_identity(), _plus(float("nan")), [{"x": x}])["y"]
    assert (cost.max_abs, cost.median_abs, cost.max_rel, cost.median_rel) == (np.inf,) * 4
def test_precision_cost_as_a_dict_and_by_output_name():
    x = np.random.default_rng(31).uniform(-1, 1, size=(1, 4, 8, 8)).astype(np.float32)
    cost = measure_cost(_identity(), _plus(0.5), [{"x": x}, {"x": -x}])
    err = np.abs(np.concatenate([(x + np.float32(0.5)) - x, (-x + np.float32(0.5)) + x]).astype(np.float64)).ravel()
    rel = err / np.abs(np.concatenate([x, -x]).ravel())
    assert cost.to_dict() == {"precision": "rewritten", "samples": 2, "outputs": [{
        "name": "y", "max_abs": pytest.approx(err.max()), "median_abs": pytest.approx(np.median(err)),
        "max_rel": pytest.approx(rel.max()), "median_rel": pytest.approx(np.median(rel)),
        "ref_max_abs": pytest.approx(float(np.abs(x).max()))}]}
    with pytest.raises(KeyError, match="no output 'z'"):
        cost["z"]


def test_emulation_rounds_a_low_precision_graph_input_an_if_body_reads():
    """The branches cast the main graph's float16 input to float: they must read its rounded twin."""
    def branch(name: str, *ops: str) -> onnx.GraphProto:
        nodes = [helper.make_node("Cast", ["x"], [f"{name}_0"], to=FLOAT)]
        nodes += [helper.make_node(op, [f"{name}_{k}"], [f"{name}_{k + 1}"]) for k, op in enumerate(ops)]
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(nodes[-1].output[0], FLOAT, [1, 4, 8, 8])])

    graph = helper.make_graph([helper.make_node("If", ["cond"], ["y"], then_branch=branch("then"),
                                                else_branch=branch("else", "Neg"))], "if_input",
                              [helper.make_tensor_value_info("x", F16, [1, 4, 8, 8]),
                               helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", FLOAT, [1, 4, 8, 8])])
    run = ort.InferenceSession(emulate_in_fp32(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)]))
                               .SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(30).uniform(-1, 1, size=(1, 4, 8, 8)).astype(np.float32)
    rounded = x.astype(np.float16).astype(np.float32)
    for cond, expected in ((True, rounded), (False, -rounded)):
        np.testing.assert_array_equal(run.run(None, {"x": x, "cond": np.array(cond)})[0], expected)


# -- bf16 -----------------------------------------------------------------------------------------

def test_bf16_keeps_io_types_softmax_fp32_and_rounds_weights_from_fp32():
    model = conv_softmax_model()
    mb = apply_precision(model, "bf16")
    onnx.checker.check_model(mb)
    assert max(o.version for o in mb.opset_import if o.domain in ("", "ai.onnx")) >= 22  # Conv takes bf16 there
    assert mb.ir_version >= 10  # what opset 22 needs
    types = tensor_types(mb)
    assert [i.type.tensor_type.elem_type for i in mb.graph.input] == [FLOAT]
    assert [o.type.tensor_type.elem_type for o in mb.graph.output] == [FLOAT]
    sm = node(mb, "softmax")
    assert types[sm.input[0]] == FLOAT and types[sm.output[0]] == FLOAT
    assert types[node(mb, "conv1").output[0]] == BF16
    assert not any(t == F16 for t in types.values())
    w2 = numpy_helper.to_array(next(t for t in mb.graph.initializer if t.name == "w2"))
    original = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w2"))
    np.testing.assert_array_equal(w2.astype(np.float32), original.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_bf16_costs_more_than_fp16():
    model, data = conv_softmax_model(), feeds(2, (2, 3, 16, 16), seed=5)
    c16 = measure_cost(model, apply_precision(model, "fp16"), data)["y"]
    cb16 = measure_cost(model, apply_precision(model, "bf16"), data)["y"]
    assert cb16.median_abs > 2 * c16.median_abs > 0  # 8 mantissa bits against 11


def test_bf16_keeps_ops_without_a_bf16_schema_in_fp32():
    """At opset 22 Einsum takes no bfloat16, and Resize takes none for its scales: both stay fp32."""
    w = np.random.default_rng(13).standard_normal((4, 4, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Resize", ["c", "", "scales"], ["r"], mode="nearest", name="resize"),
             helper.make_node("Einsum", ["r"], ["e"], equation="nchw->nhwc", name="einsum"),
             helper.make_node("Relu", ["e"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "resize_einsum", [helper.make_tensor_value_info("x", FLOAT, [1, 4, 4, 4])],
                              [helper.make_tensor_value_info("y", FLOAT, [1, 8, 8, 4])],
                              [numpy_helper.from_array(w, "w"),
                               numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")])
    mb = apply_precision(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), "bf16")
    onnx.checker.check_model(mb, full_check=True)
    types = tensor_types(mb)
    assert [types[t] for t in (*node(mb, "resize").input[:1], *node(mb, "einsum").output)] == [FLOAT, FLOAT]
    assert types[node(mb, "conv").output[0]] == types[node(mb, "relu").output[0]] == BF16


def if_model(seed: int) -> onnx.ModelProto:
    """Conv, then an If whose branches read the Conv's output from the main graph and pass it through an
    op that takes no float16 (Max, in ORT's fp16 block list) or, at opset 22, no bfloat16 (Einsum)."""
    w = np.random.default_rng(seed).standard_normal((4, 4, 1, 1)).astype(np.float32)

    def branch(name: str, op: onnx.NodeProto) -> onnx.GraphProto:
        relu = helper.make_node("Relu", [op.output[0]], [f"{name}_y"], name=f"{name}_relu")
        return helper.make_graph([op, relu], name, [], [helper.make_tensor_value_info(f"{name}_y", FLOAT, [1, 4, 4, 4])])

    then = branch("then", helper.make_node("Max", ["c", "floor"], ["then_out"], name="then_max"))
    other = branch("else", helper.make_node("Einsum", ["c"], ["else_out"], equation="nchw->ncwh", name="else_einsum"))
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then, else_branch=other)]
    graph = helper.make_graph(nodes, "if_bodies", [helper.make_tensor_value_info("x", FLOAT, [1, 4, 4, 4]),
                                                   helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", FLOAT, [1, 4, 4, 4])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.float32(-0.25), "floor")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_ops_an_if_body_keeps_in_fp32_leave_a_valid_model(precision):
    """ORT's fp16 pass put the Casts around a body's blocked op in the main graph, where the body's tensor
    they read does not exist: the rewritten model failed ONNX's checker. They go into the body; both
    branches compute the fp32 model's result within the low type's rounding."""
    model = if_model(seed=16)
    low = apply_precision(model, precision)
    onnx.checker.check_model(low, full_check=True)
    x = np.random.default_rng(17).uniform(-1, 1, size=(1, 4, 4, 4)).astype(np.float32)
    fp32 = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    run = ort.InferenceSession((low if precision == "fp16" else emulate_in_fp32(low)).SerializeToString(),
                               providers=["CPUExecutionProvider"])
    for cond in (True, False):
        feed = {"x": x, "cond": np.array(cond)}
        expected = fp32.run(None, feed)[0]
        assert expected.std() > 0.1
        np.testing.assert_allclose(run.run(None, feed)[0], expected, rtol=2 ** -7, atol=2 ** -7)


def test_keep_fp32_names_a_node_of_an_if_body():
    """A body's node is the user's to keep in fp32 by name (ORT's fp16 pass blocks body nodes by name too):
    it is not refused as a name no segment has, and its output stays float32 while the Conv's is float16."""
    model = if_model(seed=18)
    check_keep_fp32([model], ["then_relu"])
    low = apply_precision(model, "fp16", keep_fp32=["then_relu"])
    onnx.checker.check_model(low, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(low)
    body = next(a.g for a in node(inferred, "if").attribute if a.name == "then_branch")
    body_types = {vi.name: vi.type.tensor_type.elem_type for vi in (*body.value_info, *body.output)}
    relu = next(n for n in body.node if n.name == "then_relu")
    assert body_types[relu.input[0]] == body_types[relu.output[0]] == FLOAT
    assert tensor_types(inferred)[node(low, "conv").output[0]] == F16
    with pytest.raises(SpecError, match="'then_rely' is neither an ONNX op type nor a node name"):
        check_keep_fp32([model], ["then_rely"])


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_round_trip_between_two_kept_ops_of_an_if_body_is_folded(precision):
    """Max (blocked) then Relu (kept by name) in the then-branch: the fp32 -> low -> fp32 Casts the pass puts
    between them round for nothing, and go as they do in the main graph; the model stays valid."""
    low = apply_precision(if_model(seed=19), precision, keep_fp32=["then_relu"])
    onnx.checker.check_model(low, full_check=True)
    body = next(a.g for a in node(low, "if").attribute if a.name == "then_branch")
    makers = {o: n for n in body.node for o in n.output}
    relu = next(n for n in body.node if n.name == "then_relu")
    chain = [makers[relu.input[0]]]
    while chain[-1].op_type in ("Identity", "Cast") and chain[-1].input[0] in makers:
        chain.append(makers[chain[-1].input[0]])
    assert [n.op_type for n in chain] == ["Identity", "Max"]


def test_bf16_constants_are_rounded_from_fp32_and_dtype_attributes_retyped():
    """A Constant of 70000 (past fp16's 65504, which the fp16 pass clamps to) is bf16's 70144, and an
    EyeLike made in float16 by the fp16 pass makes bfloat16; the emulated graph computes with them."""
    w = np.random.default_rng(14).standard_normal((4, 4, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Constant", [], ["k"], name="big", value=numpy_helper.from_array(np.float32(70000.0))),
             helper.make_node("Mul", ["c", "k"], ["m"], name="mul"),
             helper.make_node("EyeLike", ["sq"], ["eye"], name="eye", dtype=FLOAT),
             helper.make_node("Add", ["m", "eye"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "constants", [helper.make_tensor_value_info("x", FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", FLOAT, [1, 4, 8, 8])],
                              [numpy_helper.from_array(w, "w"),
                               numpy_helper.from_array(np.ones((8, 8), np.float32), "sq")])
    mb = apply_precision(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)]), "bf16")
    onnx.checker.check_model(mb, full_check=True)
    k = node(mb, "big").attribute[0].t
    assert k.data_type == BF16 and float(numpy_helper.to_array(k).astype(np.float32)) == 70144.0
    assert tensor_types(mb)["eye"] == BF16
    x = np.random.default_rng(15).uniform(-1, 1, size=(1, 4, 8, 8)).astype(np.float32)
    bf = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
    c = bf(np.einsum("oi,nihw->nohw", bf(w[:, :, 0, 0]), bf(x)))
    expected = bf(bf(c * 70144.0) + np.eye(8))
    got = ort.InferenceSession(emulate_in_fp32(mb).SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, expected, rtol=2 ** -7)


def test_bf16_of_a_segment_onnx_cannot_upgrade_to_opset_22_is_a_model_error():
    graph = helper.make_graph([helper.make_node("Frobnicate", ["x"], ["y"], name="frob")], "odd",
                              [helper.make_tensor_value_info("x", FLOAT, [2, 5])],
                              [helper.make_tensor_value_info("y", FLOAT, [2, 5])])
    with pytest.raises(ModelError, match=r"segment 'odd': bf16 needs ONNX opset 22 .*upgrading the segment from "
                                         r"opset 17 failed: .*Frobnicate"):
        apply_precision(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), "bf16")


def test_bf16_rounds_each_unnamed_constant_from_its_own_fp32_value():
    """Constants without node names (as some exporters leave them) each keep their own value: 3 and 70000
    (past fp16's 65504) become bf16's 3 and 70144."""
    w = np.random.default_rng(24).standard_normal((4, 4, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.float32(3.0))),
             helper.make_node("Mul", ["c", "k"], ["m"], name="mul"),
             helper.make_node("Constant", [], ["big"], value=numpy_helper.from_array(np.float32(70000.0))),
             helper.make_node("Add", ["m", "big"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "unnamed", [helper.make_tensor_value_info("x", FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", FLOAT, [1, 4, 8, 8])], [numpy_helper.from_array(w, "w")])
    mb = apply_precision(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)]), "bf16")
    constants = {n.output[0]: float(numpy_helper.to_array(n.attribute[0].t).astype(np.float32))
                 for n in mb.graph.node if n.op_type == "Constant"}
    assert constants == {"k": 3.0, "big": 70144.0}


def _gelu_model() -> onnx.ModelProto:
    """x -> Conv -> com.microsoft Gelu (an op ONNX has no schema for) -> Relu -> y."""
    w = np.random.default_rng(28).standard_normal((4, 4, 1, 1)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
                               helper.make_node("Gelu", ["c"], ["g"], domain="com.microsoft", name="gelu"),
                               helper.make_node("Relu", ["g"], ["y"], name="relu")], "ms",
                              [helper.make_tensor_value_info("x", FLOAT, [1, 4, 4, 4])],
                              [helper.make_tensor_value_info("y", FLOAT, [1, 4, 4, 4])], [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("precision, keep", [("bf16", []), ("fp16", ["gelu"])])
def test_an_op_without_an_onnx_schema_kept_in_fp32_gets_its_output_type_from_onnx_runtime(precision, keep):
    """ONNX infers no output type for com.microsoft's Gelu, and the fp16 pass then handed its fp32 output to
    the low-precision Relu (ONNX Runtime refused the model). ONNX Runtime types it float: cast for the Relu."""
    low = {"fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}[precision]
    rewritten = apply_precision(_gelu_model(), precision, keep_fp32=keep)
    makers = {o: n for n in rewritten.graph.node for o in n.output}
    gelu = next(n for n in rewritten.graph.node if n.op_type == "Gelu")
    assert makers[gelu.input[0]].op_type == "Cast"  # the Gelu stays fp32
    relu_in = makers[next(n for n in rewritten.graph.node if n.op_type == "Relu").input[0]]
    assert relu_in.op_type == "Cast" and relu_in.attribute[0].i == low and relu_in.input[0] == gelu.output[0]
    if precision == "fp16":  # ONNX Runtime's CPU provider has no bf16 Relu to run the other
        x = np.random.default_rng(29).uniform(-1, 1, size=(1, 4, 4, 4)).astype(np.float32)
        fp32, fp16 = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
                      for m in (_gelu_model(), rewritten))
        np.testing.assert_allclose(fp16, fp32, rtol=2 ** -8, atol=2 ** -8)


def test_an_untyped_integer_output_of_a_kept_op_is_left_uncast():
    """com.microsoft's Range, kept fp32, makes the int64 indices a converted Gather reads: ONNX infers no type
    for them, ONNX Runtime says int64, so nothing is cast (this was refused as if it were fp32)."""
    w = np.random.default_rng(39).standard_normal((4, 4, 1, 1)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.int64(1), "start"),
             numpy_helper.from_array(np.int64(4), "limit"), numpy_helper.from_array(np.int64(2), "delta")]
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
                               helper.make_node("Range", ["start", "limit", "delta"], ["idx"], domain="com.microsoft",
                                                name="range"),
                               helper.make_node("Gather", ["c", "idx"], ["y"], axis=1, name="gather")], "ms",
                              [helper.make_tensor_value_info("x", FLOAT, [1, 4, 4, 4])],
                              [helper.make_tensor_value_info("y", FLOAT, [1, 2, 4, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m16 = apply_precision(model, "fp16", keep_fp32=["range"])
    gather = next(n for n in m16.graph.node if n.op_type == "Gather")
    assert gather.input[1] == "idx"  # read as Range made it
    x = np.random.default_rng(40).uniform(-1, 1, size=(1, 4, 4, 4)).astype(np.float32)
    fp32, fp16 = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
                  for m in (model, m16))
    np.testing.assert_allclose(fp16, fp32, rtol=2 ** -8, atol=2 ** -8)


def test_an_untyped_output_onnx_runtime_cannot_type_either_is_a_model_error():
    """An op of a domain neither knows: the error names the node, its output, its readers and why."""
    model = _gelu_model()
    model.graph.node[1].domain = "acme.ops"
    model.opset_import.append(helper.make_opsetid("acme.ops", 1))
    with pytest.raises(ModelError, match=r"segment 'ms': node 'gelu' \(acme.ops.Gelu\) stays fp32, but neither ONNX "
                                         r"nor ONNX Runtime gives a type for its output 'g' \(ONNX Runtime cannot load "
                                         r"it: .*Gelu.*\).*\(relu\)"):
        apply_precision(model, "fp16", keep_fp32=["gelu"])


def test_an_untyped_output_inside_an_if_body_is_a_model_error():
    """ONNX Runtime is asked about main-graph tensors only: a body's untyped output is still refused."""
    then = helper.make_graph([helper.make_node("Gelu", ["x"], ["g"], domain="com.microsoft", name="gelu"),
                              helper.make_node("Relu", ["g"], ["t"], name="relu")], "then", [],
                             [helper.make_tensor_value_info("t", FLOAT, [1, 4])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"], name="neg")], "else", [],
                              [helper.make_tensor_value_info("e", FLOAT, [1, 4])])
    graph = helper.make_graph([helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other, name="if")],
                              "ms", [helper.make_tensor_value_info("x", FLOAT, [1, 4]),
                                     helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", FLOAT, [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    with pytest.raises(ModelError, match=r"node 'gelu' \(com.microsoft.Gelu\) stays fp32.*output 'g' \(it is inside "
                                         r"an If/Loop body.*\(relu\)"):
        apply_precision(model, "fp16", keep_fp32=["gelu"])


def test_keeping_the_readers_of_an_untyped_fp32_output_in_fp32_too_gives_a_valid_model():
    """What the errors above advise; an untyped output nothing reads needs nothing."""
    x = np.random.default_rng(37).uniform(-1, 1, size=(1, 4, 4, 4)).astype(np.float32)
    fp32 = ort.InferenceSession(_gelu_model().SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    m16 = apply_precision(_gelu_model(), "fp16", keep_fp32=["gelu", "relu"])
    got = ort.InferenceSession(m16.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, fp32, rtol=2 ** -9, atol=2 ** -9)
    dangling = _gelu_model()
    dangling.graph.node[1].output.append("unused")  # a second output no node reads
    onnx.checker.check_model(apply_precision(dangling, "fp16", keep_fp32=["gelu", "relu"]))


def test_an_untyped_fp32_output_read_only_for_its_shape_needs_no_cast():
    """Shape reads any dtype, so a kept op's untyped output that only a Shape reads is no error."""
    model = _gelu_model()
    model.graph.node.append(helper.make_node("Shape", ["g"], ["s"], name="shape"))
    model.graph.output.append(helper.make_tensor_value_info("s", onnx.TensorProto.INT64, [4]))
    m16 = apply_precision(model, "fp16", keep_fp32=["gelu", "relu"])
    x = np.random.default_rng(38).uniform(-1, 1, size=(1, 4, 4, 4)).astype(np.float32)
    _, shape = ort.InferenceSession(m16.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert shape.tolist() == [1, 4, 4, 4]


# -- keep_fp32 ------------------------------------------------------------------------------------

def test_keep_fp32_by_node_name_and_pattern():
    model = conv_softmax_model()
    for entry in ("conv2", "conv[2]", "*2"):
        types = tensor_types(apply_precision(model, "fp16", keep_fp32=["Softmax", entry]))
        assert types["w2"] == FLOAT and types["w1"] == F16, entry


def test_default_keep_fp32_has_a_reason_for_each_entry():
    assert "Softmax" in DEFAULT_KEEP_FP32
    assert all(KEEP_FP32_REASONS[e].strip() for e in DEFAULT_KEEP_FP32)


def test_check_keep_fp32_names_the_bad_entry():
    model = conv_softmax_model()
    check_keep_fp32([model], ["Softmax", "conv1", "conv*"])
    with pytest.raises(SpecError, match=r"keep_fp32\[1\]: 'relu_1'.*did you mean 'relu1'"):
        check_keep_fp32([model], ["Softmax", "relu_1"])


def test_keep_fp32_of_an_op_no_segment_has_is_a_warning(caplog):
    """keep_fp32: [Softmax] where the Softmax is inside a cut (its kernel replaced it) keeps nothing: say so."""
    model = conv_softmax_model()
    with caplog.at_level("WARNING", logger="deepjit.precision"):
        check_keep_fp32([model], ["Softmax", "TopK"])
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "keep_fp32[1]: no engine segment has a TopK node" in warned[0]
    assert "keeps nothing in fp32" in warned[0]


def test_unknown_precision_and_int8_without_calibration_are_spec_errors():
    with pytest.raises(SpecError, match="engine.precision.*did you mean 'fp16'"):
        apply_precision(conv_softmax_model(), "fp61")
    with pytest.raises(SpecError, match="engine.calibration"):
        apply_precision(conv_softmax_model(), "int8")


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean"])
def test_default_keep_fp32_keeps_normalisation_statistics_in_fp32(op):
    graph = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["sq"], name="square"),
                               helper.make_node(op, ["sq"], ["s"], name="stat"),
                               helper.make_node("Sqrt", ["s"], ["y"], name="root")], "stats",
                              [helper.make_tensor_value_info("x", FLOAT, [2, 5])],
                              [helper.make_tensor_value_info("y", FLOAT, [1, 1])])
    m16 = apply_precision(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), "fp16")
    types, stat = tensor_types(m16), node(m16, "stat")
    assert (types[node(m16, "square").output[0]], types[stat.input[0]], types[stat.output[0]]) == (F16, FLOAT, FLOAT)


# -- int8 -----------------------------------------------------------------------------------------

def test_int8_is_symmetric_per_channel_qdq_and_skips_kept_ops(tmp_path):
    model = conv_softmax_model()
    q = apply_precision(model, "int8", calibration=random_calibration(tmp_path))
    onnx.checker.check_model(q)
    ops = [n.op_type for n in q.graph.node]
    assert ops.count("QuantizeLinear") >= 2 and ops.count("DequantizeLinear") >= 4
    inits = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    zero_points = {k: v for k, v in inits.items() if k.endswith("zero_point")}
    assert zero_points and all(v.dtype == np.int8 and not v.any() for v in zero_points.values())
    w2_scale = next(v for k, v in inits.items() if k.startswith("w2") and k.endswith("scale"))
    assert w2_scale.shape == (16,)  # one scale per output channel
    assert q.graph.initializer and {"b1"} <= {t.name for t in q.graph.initializer if t.data_type == FLOAT}  # fp32 bias
    producers = {o: n for n in q.graph.node for o in n.output}
    sm = node(q, "softmax")
    assert producers[sm.input[0]].op_type != "DequantizeLinear"  # Softmax sees fp32, not int8
    assert [o.type.tensor_type.elem_type for o in q.graph.output] == [FLOAT]


def test_int8_keeps_an_op_type_named_in_keep_fp32_unquantized(tmp_path):
    q = apply_precision(conv_softmax_model(), "int8", keep_fp32=["Conv"], calibration=random_calibration(tmp_path))
    assert not {"QuantizeLinear", "DequantizeLinear"} & {n.op_type for n in q.graph.node}
    assert {t.name for t in q.graph.initializer if t.data_type == FLOAT} == {"w1", "b1", "w2"}


def test_int8_quantizes_a_per_tensor_weight_symmetrically(tmp_path):
    """A MatMul's 1-D weight has no channel axis, so ORT quantizes it per tensor: there only the
    WeightSymmetric option keeps its zero point 0 (per-channel weights are symmetric regardless)."""
    w = np.random.default_rng(1).uniform(-0.2, 1.0, 8).astype(np.float32)  # lopsided: asymmetric would shift
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "mm",
                              [helper.make_tensor_value_info("x", FLOAT, ["N", 8])],
                              [helper.make_tensor_value_info("y", FLOAT, ["N"])], [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    calibration = random_calibration(tmp_path, ranges={"x": (-1.0, 1.0)}, shapes={"x": (1, 8)})
    q = apply_precision(model, "int8", calibration=calibration)
    inits = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    assert inits["w_zero_point"] == 0 and inits["w_zero_point"].dtype == np.int8
    np.testing.assert_allclose(inits["w_scale"], np.abs(w).max() / 127, rtol=1e-6)
    np.testing.assert_array_equal(inits["w_quantized"], np.round(w / (np.abs(w).max() / 127)).astype(np.int8))


def test_int8_costs_more_than_fp16(tmp_path):
    model, data = conv_softmax_model(), feeds(2, (2, 3, 16, 16), seed=6)
    c16 = measure_cost(model, apply_precision(model, "fp16"), data)["y"]
    c8 = measure_cost(model, apply_precision(model, "int8", calibration=random_calibration(tmp_path)), data)["y"]
    assert c8.max_abs > c16.max_abs and c8.median_abs > c16.median_abs


def test_int8_keeps_a_node_named_in_keep_fp32_unquantized(tmp_path):
    q = apply_precision(conv_softmax_model(), "int8", keep_fp32=["Softmax", "conv2"],
                        calibration=random_calibration(tmp_path))
    producers = {o: n.op_type for n in q.graph.node for o in n.output}
    assert [producers.get(t) for t in node(q, "conv2").input] == ["Relu", None]  # fp32 activation, fp32 weight
    assert [producers.get(t) for t in node(q, "conv1").input] == ["DequantizeLinear", "DequantizeLinear", None]


def test_int8_drops_onnx_runtimes_pre_processing_advice_and_only_while_quantizing(tmp_path, caplog):
    root = logging.getLogger()
    filters = list(root.filters)
    with caplog.at_level("WARNING"):
        apply_precision(conv_softmax_model(), "int8", calibration=random_calibration(tmp_path))
    assert not [r.getMessage() for r in caplog.records if "pre-process" in r.getMessage()]
    assert root.filters == filters


def test_int8_quantizes_a_gemm_by_default(tmp_path):
    rng = np.random.default_rng(34)
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="gemm")], "gemm",
                              [helper.make_tensor_value_info("x", FLOAT, ["N", 8])],
                              [helper.make_tensor_value_info("y", FLOAT, ["N", 4])],
                              [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w"),
                               numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    q = apply_precision(model, "int8", calibration=random_calibration(tmp_path, ranges={"x": (-1.0, 1.0)},
                                                                      shapes={"x": (1, 8)}))
    producers = {o: n.op_type for n in q.graph.node for o in n.output}
    assert [producers.get(t) for t in node(q, "gemm").input] == ["DequantizeLinear", "DequantizeLinear", None]
def test_int8_on_an_onnx_runtime_without_calibration_caches_is_a_missing_dependency(tmp_path, monkeypatch):
    def old_quantize_static(model_input, model_output, calibration_data_reader, quant_format=None):
        raise AssertionError("not to be called")

    monkeypatch.setattr("deepjit_compiler.precision.calibration.quantize_static", old_quantize_static)
    with pytest.raises(MissingDependency, match=r"int8 needs ONNX Runtime's calibration cache.*upgrade it") as e:
        apply_precision(conv_softmax_model(), "int8", calibration=random_calibration(tmp_path))
    assert e.value.exit_code == 2


@pytest.fixture
def calibrations(monkeypatch):
    """Counts calibration runs: ONNX Runtime creates one calibrator per run, none on a cache hit."""
    runs = []
    real = ort_quantize.create_calibrator

    def counting(*args, **kwargs):
        runs.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ort_quantize, "create_calibrator", counting)
    return runs


def test_calibration_cache_hit_skips_calibration(tmp_path, calibrations):
    model, settings = conv_softmax_model(), random_calibration(tmp_path)
    first = apply_precision(model, "int8", calibration=settings)
    assert len(calibrations) == 1
    entries = list((tmp_path / "calib").glob("*.json"))
    assert len(entries) == 1
    again = apply_precision(model, "int8", calibration=settings)
    assert len(calibrations) == 1  # ranges came from the cache
    assert again.SerializeToString() == first.SerializeToString()
    apply_precision(model, "int8", calibration=random_calibration(tmp_path, seed=1))  # other data
    assert len(calibrations) == 2 and len(list((tmp_path / "calib").glob("*.json"))) == 2
    apply_precision(conv_softmax_model(seed=1), "int8", calibration=settings)  # other weights
    assert len(calibrations) == 3
    percentile = random_calibration(tmp_path, method="percentile")
    apply_precision(model, "int8", calibration=percentile)
    assert len(calibrations) == 4
    apply_precision(model, "int8", calibration=settings)  # each method has its own entry
    assert len(calibrations) == 4 and len(list((tmp_path / "calib").glob("*.json"))) == 4


def test_corrupt_calibration_cache_entry_is_a_miss(tmp_path, calibrations):
    model, settings = conv_softmax_model(), random_calibration(tmp_path)
    first = apply_precision(model, "int8", calibration=settings)
    (entry,) = (tmp_path / "calib").glob("*.json")
    good = entry.read_text()
    assert json.loads(good)
    entry.write_text("{ not json")
    again = apply_precision(model, "int8", calibration=settings)
    assert len(calibrations) == 2  # calibrated again instead of reading the broken entry
    assert entry.read_text() == good  # rewritten whole, with the same ranges
    assert again.SerializeToString() == first.SerializeToString()
    other = random_calibration(tmp_path, method="percentile")
    apply_precision(model, "int8", calibration=other)
    (percentile,) = set((tmp_path / "calib").glob("*.json")) - {entry}
    entry.write_text(percentile.read_text())  # ranges of another method under minmax's key
    assert apply_precision(model, "int8", calibration=settings).SerializeToString() == first.SerializeToString()
    assert len(calibrations) == 4 and entry.read_text() == good
    entry.unlink()
    entry.mkdir()
    with pytest.raises(SpecError, match=rf"engine.calibration.cache: .*{entry.name} is not a file"):
        apply_precision(model, "int8", calibration=settings)


def test_calibration_cache_key_covers_the_op_types_onnx_runtime_and_the_cache_format(tmp_path, monkeypatch):
    model, settings = conv_softmax_model(), random_calibration(tmp_path)
    key = cache_key(model, "data", settings)
    assert cache_key(model, "data", random_calibration(tmp_path, op_types=("Conv",))) != key
    monkeypatch.setattr(ort, "__version__", "1.0.0")
    assert cache_key(model, "data", settings) != key
    monkeypatch.undo()
    monkeypatch.setattr("deepjit_compiler.precision.calibration.CACHE_FORMAT", 2)
    assert cache_key(model, "data", settings) != key


def test_calibration_logs_a_cache_hit_and_what_it_calibrates_on(tmp_path, caplog):
    model, settings = conv_softmax_model(), random_calibration(tmp_path)
    with caplog.at_level("INFO", logger="deepjit.calibration"):
        apply_precision(model, "int8", calibration=settings)
        apply_precision(model, "int8", calibration=settings)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("int8: ")]
    assert [m.split(" (")[0] for m in said] == ["int8: calibrating on 4 seeded random samples",
                                                "int8: calibration cache hit, skipping calibration"]


# -- calibration data -----------------------------------------------------------------------------

def test_folder_reader_reads_samples_in_name_order_with_a_content_digest(tmp_path):
    rng = np.random.default_rng(7)
    arrays = [rng.uniform(-1, 1, size=(3, 16, 16)) for _ in range(3)]  # no batch axis, float64
    for i, a in enumerate(arrays):
        np.savez(tmp_path / f"s{i}.npz", x=a)
    settings = CalibrationSettings(data=tmp_path, cache=tmp_path / "c", samples=2)
    reader = reader_for(conv_softmax_model(), settings)
    got = [reader.get_next(), reader.get_next(), reader.get_next()]
    assert got[2] is None and reader.reads == 2 and len(reader) == 2
    for g, a in zip(got[:2], arrays):
        assert g["x"].dtype == np.float32 and g["x"].shape == (1, 3, 16, 16)
        np.testing.assert_array_equal(g["x"][0], a.astype(np.float32))
    before = reader.digest
    np.savez(tmp_path / "s1.npz", x=arrays[1] + 1)
    assert reader_for(conv_softmax_model(), settings).digest != before
    np.savez(tmp_path / "s2.npz", x=arrays[2] + 1)  # beyond `samples`: not part of the data
    assert reader_for(conv_softmax_model(), settings).digest == reader_for(conv_softmax_model(), settings).digest


def test_folder_reader_takes_images_letterboxed_like_the_validation_data(tmp_path):
    image = pytest.importorskip("PIL.Image", reason="decoding images needs Pillow")
    rng = np.random.default_rng(8)
    for k, (h, w) in enumerate([(12, 20), (30, 10), (16, 16)]):
        image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / f"p{k}.png")
    settings = CalibrationSettings(data=tmp_path, cache=tmp_path / "c", samples=2)
    reader = reader_for(conv_softmax_model(), settings)
    assert len(reader) == 2 and reader.source == f"2 of 3 images in {tmp_path.name}"
    want = folder_feeds(tmp_path, {"x": ("float32", (1, 3, 16, 16))})  # the validation data, same letterbox
    for k in range(2):
        np.testing.assert_array_equal(reader.get_next()["x"], want[k]["x"])
    q = apply_precision(conv_softmax_model(), "int8", calibration=settings)  # and int8 calibrates on them
    assert any(n.op_type == "QuantizeLinear" for n in q.graph.node)
    with pytest.raises(SpecError, match=r"holds images, but the segment's input 'x' \[N, 4, 8, 8\] takes none"):
        reader_for(chain_model(), settings)


def test_folder_reader_reads_npy_samples(tmp_path):
    """A folder of .npy files for a one-input segment (np.load gives an array, not an archive)."""
    a = np.random.default_rng(9).uniform(-1, 1, size=(1, 3, 16, 16)).astype(np.float32)
    np.save(tmp_path / "a.npy", a)
    settings = CalibrationSettings(data=tmp_path, cache=tmp_path / "c")
    reader = reader_for(conv_softmax_model(), settings)
    assert reader.source == f"1 of 1 .npy files in {tmp_path.name}"
    np.testing.assert_array_equal(reader.get_next()["x"], a)
    assert any(n.op_type == "QuantizeLinear" for n in apply_precision(conv_softmax_model(), "int8",
                                                                        calibration=settings).graph.node)


def test_folder_reader_reads_npy_samples_in_name_order(tmp_path):
    rng = np.random.default_rng(35)
    arrays = {name: rng.uniform(-1, 1, size=(1, 3, 16, 16)).astype(np.float32) for name in "fbdaec"}
    for name, a in arrays.items():
        np.save(tmp_path / f"{name}.npy", a)
    reader = reader_for(conv_softmax_model(), CalibrationSettings(data=tmp_path, cache=tmp_path / "c", samples=4))
    for name in "abcd":
        np.testing.assert_array_equal(reader.get_next()["x"], arrays[name])


def test_folder_reader_letterboxes_images_in_the_inputs_dtype(tmp_path):
    image = pytest.importorskip("PIL.Image", reason="decoding images needs Pillow")
    image.fromarray(np.random.default_rng(36).integers(0, 256, (12, 20, 3), dtype=np.uint8)).save(tmp_path / "p.png")
    model = conv_softmax_model()
    model.graph.input[0].type.tensor_type.elem_type = F16
    got = reader_for(model, CalibrationSettings(data=tmp_path, cache=tmp_path / "c")).get_next()["x"]
    want = folder_feeds(tmp_path, {"x": ("float16", (1, 3, 16, 16))})[0]["x"]  # the validation data's letterbox
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want)


def test_folder_reader_errors_name_the_file(tmp_path):
    np.savez(tmp_path / "bad.npz", x=np.zeros((1, 3, 8, 8), np.float32) + 0.5)
    reader = reader_for(conv_softmax_model(), CalibrationSettings(data=tmp_path, cache=tmp_path / "c"))
    with pytest.raises(SpecError, match=r"bad\.npz.*'x' has shape \(1, 3, 8, 8\).*\[N, 3, 16, 16\]"):
        reader.get_next()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SpecError, match=r"no images \(.jpg.*\), .npz or .npy files in .*empty"):
        reader_for(conv_softmax_model(), CalibrationSettings(data=empty, cache=tmp_path / "c"))
    with pytest.raises(SpecError, match="does not exist"):
        reader_for(conv_softmax_model(), CalibrationSettings(data=tmp_path / "missing", cache=tmp_path / "c"))


def test_calibration_data_that_is_a_file_is_named_as_no_folder(tmp_path):
    np.save(tmp_path / "a.npy", np.random.default_rng(33).uniform(-1, 1, size=(1, 3, 16, 16)).astype(np.float32))
    with pytest.raises(SpecError, match=r"engine\.calibration\.data: .*a\.npy is not a folder"):
        reader_for(conv_softmax_model(), CalibrationSettings(data=tmp_path / "a.npy", cache=tmp_path / "c"))


def test_nan_calibration_data_is_refused_naming_the_file_before_onnx_runtime_sees_it(tmp_path):
    a = np.random.default_rng(10).uniform(-1, 1, size=(1, 3, 16, 16)).astype(np.float32)
    a[0, 1, 2, 3] = np.nan
    np.save(tmp_path / "a.npy", a)
    settings = CalibrationSettings(data=tmp_path, cache=tmp_path / "c")
    with pytest.raises(RuntimeInputError, match=r"a\.npy: 1 of its 768 values are NaN or infinite \(the first at "
                                                r"index \[0, 1, 2, 3\]\)"):
        apply_precision(conv_softmax_model(), "int8", calibration=settings)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())  # nothing cached from it
    (tmp_path / "a.npy").unlink()  # a member the segment is not fed may hold anything
    np.savez(tmp_path / "a.npz", x=np.nan_to_num(a, nan=0.5), note=np.array([np.nan]))
    q = apply_precision(conv_softmax_model(), "int8", calibration=settings)
    assert any(n.op_type == "QuantizeLinear" for n in q.graph.node)


def test_calibration_reader_ranges_rewinds_and_counts_its_reads(tmp_path):
    """ONNX Runtime may calibrate a range of the samples and rewind to its start; each sample is the
    uniform draw of a generator seeded by (seed, index)."""
    want = [np.random.default_rng([5, k]).uniform(-1, 1, size=(1, 3, 16, 16)).astype(np.float32) for k in range(3)]
    reader = reader_for(conv_softmax_model(), random_calibration(tmp_path, seed=5, samples=3))
    counted = []
    reader.on_read = lambda: counted.append(1)
    reader.set_range(1, 10)  # past the end: up to the last sample
    got = [reader.get_next(), reader.get_next(), reader.get_next()]
    assert got[2] is None and len(counted) == reader.reads == 2
    for g, w in zip(got, want[1:]):
        np.testing.assert_array_equal(g["x"], w)
    reader.rewind()
    np.testing.assert_array_equal(reader.get_next()["x"], want[1])
    reader.set_range(0, 1)
    np.testing.assert_array_equal(reader.get_next()["x"], want[0])
    assert reader.get_next() is None


def test_random_reader_is_seeded_and_in_range(tmp_path):
    settings = random_calibration(tmp_path, samples=2)
    a = reader_for(conv_softmax_model(), settings).get_next()["x"]
    b = reader_for(conv_softmax_model(), settings).get_next()["x"]
    np.testing.assert_array_equal(a, b)
    assert a.shape == (1, 3, 16, 16) and a.dtype == np.float32 and -1 <= a.min() < a.max() <= 1
    other = reader_for(conv_softmax_model(), random_calibration(tmp_path, seed=9)).get_next()["x"]
    assert not np.array_equal(a, other)


def _square_input_model(dims=("N", 3, "S", "S")) -> onnx.ModelProto:
    """conv_softmax_model with symbolic input dims (its output's left unknown)."""
    model = conv_softmax_model()
    for d, v in zip(model.graph.input[0].type.tensor_type.shape.dim, dims):
        if isinstance(v, str):
            d.dim_param = v  # a oneof with dim_value
        else:
            d.dim_value = v
    model.graph.output[0].type.tensor_type.ClearField("shape")
    return model


def test_random_reader_draws_each_sample_and_refuses_bad_shapes_and_ranges(tmp_path):
    reader = reader_for(conv_softmax_model(), random_calibration(tmp_path, samples=2))
    assert not np.array_equal(reader.get_next()["x"], reader.get_next()["x"])  # seeded per sample
    for shape in ((1, 3, 16), (1, 3, 8, 8)):
        with pytest.raises(SpecError, match=rf"calibration shape for input 'x' is \({', '.join(map(str, shape))}\), "
                                            r"but the segment takes \[N, 3, 16, 16\]"):
            reader_for(conv_softmax_model(), random_calibration(tmp_path, shapes={"x": shape}))
    with pytest.raises(SpecError, match=r"input 'x' \[N, 3, S, S\]: its symbolic dims need a concrete shape"):
        reader_for(_square_input_model(), random_calibration(tmp_path, shapes={}))
    with pytest.raises(SpecError, match=r"range for input 'x': need low < high, got \[1.0, 1.0\]"):
        reader_for(conv_softmax_model(), random_calibration(tmp_path, ranges={"x": (1.0, 1.0)}))


def test_random_reader_takes_integer_ends_skips_initializer_inputs_and_digests_its_recipe(tmp_path):
    model = conv_softmax_model()
    model.graph.input.extend([helper.make_tensor_value_info("k", TensorProto.INT64, [8, 8]),
                              helper.make_tensor_value_info("w1", FLOAT, [8, 3, 3, 3])])  # an IR 3 style weight
    settings = random_calibration(tmp_path, ranges={"x": (-1.0, 1.0), "k": (0, 2)})
    feeds = reader_for(model, settings).get_next()
    assert set(feeds) == {"x", "k"} and sorted(np.unique(feeds["k"])) == [0, 1, 2]
    digest = reader_for(model, settings).digest
    for other in (random_calibration(tmp_path, samples=5, ranges={"x": (-1.0, 1.0), "k": (0, 2)}),
                  random_calibration(tmp_path, ranges={"x": (-1.0, 2.0), "k": (0, 2)})):
        assert reader_for(model, other).digest != digest


def test_random_reader_defaults_to_zero_one_and_digests_the_calibration_shape(tmp_path):
    settings = CalibrationSettings(data="random", cache=tmp_path / "c", seed=3, shapes={"x": (1, 3, 16, 16)})
    want = np.random.default_rng([3, 0]).uniform(0, 1, size=(1, 3, 16, 16)).astype(np.float32)
    np.testing.assert_array_equal(reader_for(_square_input_model(), settings).get_next()["x"], want)
    at32 = CalibrationSettings(data="random", cache=tmp_path / "c", seed=3, shapes={"x": (1, 3, 32, 32)})
    assert reader_for(_square_input_model(), at32).digest != reader_for(_square_input_model(), settings).digest
    # a dim exported as 0 (unknown, in some exporters) needs a shape as a symbolic one does
    with pytest.raises(SpecError, match=r"input 'x' \[N, 3, 0, 0\]: its symbolic dims need a concrete shape"):
        reader_for(_square_input_model(("N", 3, 0, 0)), CalibrationSettings(data="random", cache=tmp_path / "c"))


def test_folder_reader_images_need_one_square_input_and_digest_their_size(tmp_path):
    image = pytest.importorskip("PIL.Image", reason="decoding images needs Pillow")
    image.fromarray(np.random.default_rng(20).integers(0, 256, (12, 20, 3), dtype=np.uint8)).save(
        tmp_path / "P0.PNG", format="PNG")  # a camera's upper-case suffix
    square = _square_input_model()
    def at(size: int) -> CalibrationSettings:
        return CalibrationSettings(data=tmp_path, cache=tmp_path / "c", shapes={"x": (1, 3, size, size)})

    assert reader_for(square, at(16)).get_next()["x"].shape == (1, 3, 16, 16)
    assert reader_for(square, at(16)).digest != reader_for(square, at(32)).digest  # letterboxed to another size
    with pytest.raises(SpecError, match=r"holds images, but the segment's input 'x' \[N, 3, 16, 32\] takes none"):
        reader_for(_square_input_model(("N", 3, 16, 32)), CalibrationSettings(data=tmp_path, cache=tmp_path / "c"))
    with pytest.raises(SpecError, match=r"holds images, but the segment has 2 inputs \(scale, images\)"):
        reader_for(two_input_model(), CalibrationSettings(data=tmp_path, cache=tmp_path / "c"))


def test_npz_sample_without_the_input_or_of_another_rank_is_named(tmp_path):
    x = np.random.default_rng(21).uniform(-1, 1, size=(1, 3, 16, 16, 2)).astype(np.float32)
    for name, arrays, error in [("a", {"images": x[0]}, r"a\.npz: no array 'x'; it holds images"),
                                ("b", {"x": x}, r"b\.npz: 'x' has shape \(1, 3, 16, 16, 2\), the segment takes "
                                                r"\[N, 3, 16, 16\]")]:
        (tmp_path / name).mkdir()
        np.savez(tmp_path / name / f"{name}.npz", **arrays)
        reader = reader_for(conv_softmax_model(), CalibrationSettings(data=tmp_path / name, cache=tmp_path / "c"))
        with pytest.raises(SpecError, match=error):
            reader.get_next()


# -- synthetic YOLOv8n ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def yolo():
    from deepjit_compiler.model.synth import synthesize_yolov8

    model = synthesize_yolov8("yolov8n", seed=0, batch=None)
    rng = np.random.default_rng(11)
    data = [{"images": rng.uniform(0, 1, size=(1, 3, 640, 640)).astype(np.float32)} for _ in range(2)]
    return model, data


DFL = ("/model.22/dfl/Softmax", "/model.22/dfl/conv/Conv")


@pytest.mark.slow
def test_yolov8n_fp16_keeps_io_and_dfl_in_fp32_and_reports_its_cost(yolo):
    model, data = yolo
    m16 = apply_precision(model, "fp16")
    onnx.checker.check_model(m16)
    types = tensor_types(m16)
    assert types["images"] == FLOAT and types["output0"] == FLOAT
    for name in DFL:
        n = node(m16, name)
        assert all(types[t] == FLOAT for t in (*n.input, *n.output) if t), name
    assert types[node(m16, "/model.0/conv/Conv").output[0]] == F16
    cost = measure_cost(model, m16, data)["output0"]
    assert 0 < cost.median_abs < 1e-3  # boxes are in pixels (up to 640), scores in [0, 1]


@pytest.mark.slow
def test_yolov8n_int8_costs_more_than_fp16(yolo, tmp_path):
    model, data = yolo
    settings = CalibrationSettings(data="random", cache=tmp_path / "calib", samples=4, ranges={"images": (0.0, 1.0)})
    q = apply_precision(model, "int8", calibration=settings)
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] in node(q, DFL[0]).output for n in q.graph.node)
    producers = {o: n for n in q.graph.node for o in n.output}
    assert node(q, DFL[1]).input[1] not in producers  # the DFL weights: the fp32 initializer, no DequantizeLinear
    c8 = measure_cost(model, q, data)["output0"]
    c16 = measure_cost(model, apply_precision(model, "fp16"), data)["output0"]
    assert c8.median_abs > c16.median_abs > 0 and c8.max_abs > c16.max_abs


def test_calibration_settings_from_spec(write_spec):
    from deepjit_compiler.spec.load import load_spec

    int8 = "  precision: int8\n  calibration: {data: random, cache: calib, samples: 3}\n"
    path = write_spec({"  precision: fp16": int8 + "  # was", "  samples: 2\n  seed: 0": "  samples: 2\n  seed: 7",
                       "ranges: {images: [0.0, 1.0]}": "ranges: {images: [0.0, 255.0]}"})
    spec = load_spec(path).spec
    s = CalibrationSettings.from_spec(spec)
    assert (s.data, s.samples, s.cache) == ("random", 3, path.parent / "calib")
    assert s.ranges == {"images": (0.0, 255.0)} and s.seed == 7
    assert s.shapes == {"images": spec.inputs["images"].min_shape}
    assert s.method == "minmax"  # the default
    assert CalibrationSettings.from_spec(load_spec(write_spec()).spec) is None
    percentile = int8.replace("samples: 3}", "samples: 3, method: percentile}")
    assert CalibrationSettings.from_spec(load_spec(write_spec({"  precision: fp16": percentile + "  # was"}))
                                         .spec).method == "percentile"
    with pytest.raises(SpecError, match=r"engine\.calibration\.method.*'minmax' or 'percentile'"):
        load_spec(write_spec({"  precision: fp16": int8.replace("samples: 3}", "samples: 3, method: entropy}")
                              + "  # was"}))


def test_calibration_settings_refuse_a_bad_method_sample_count_or_data(tmp_path):
    for bad, error in [({"method": "entropy"}, r"engine\.calibration\.method: must be one of minmax, percentile, got "
                                               r"'entropy'"),
                       ({"samples": 0}, r"engine\.calibration\.samples: must be >= 1, got 0"),
                       ({"data": "randon"}, r"engine\.calibration\.data: a folder or 'random', got 'randon'")]:
        with pytest.raises(SpecError, match=error):
            CalibrationSettings(**{"data": "random", "cache": tmp_path / "c", **bad})


def test_percentile_calibration_clips_an_outlier_that_min_max_keeps(tmp_path):
    """One value 100 times the others': min-max stretches the input's range over it, the 99.999th
    percentile (of ~123k values) does not."""
    rng = np.random.default_rng(12)
    data = tmp_path / "data"
    data.mkdir()
    for k in range(16):
        sample = rng.uniform(-1, 1, size=(10, 3, 16, 16)).astype(np.float32)
        if k == 3:
            sample[0, 1, 7, 9] = 100.0
        np.save(data / f"s{k:02d}.npy", sample)
    scales = {}
    for method in ("minmax", "percentile"):
        settings = CalibrationSettings(data=data, cache=tmp_path / method, method=method)
        q = apply_precision(conv_softmax_model(), "int8", calibration=settings)
        quantize_x = next(n for n in q.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "x")
        scales[method] = float(numpy_helper.to_array(next(i for i in q.graph.initializer
                                                          if i.name == quantize_x.input[1])))
    assert scales["minmax"] == pytest.approx(100.0 / 127, rel=0.02)  # symmetric int8 over [-100, 100]
    assert scales["percentile"] < 1.1 / 127  # the uniform data's [-1, 1]


@pytest.mark.parametrize("name, body", [("cut.npz", "zip"), ("pickled.npy", "pickle"), ("noise.npy", "noise")])
def test_a_calibration_file_that_is_no_array_is_exit_2_naming_it(tmp_path, name, body):
    from deepjit_compiler.errors import DeepJITError

    a = np.random.default_rng(10).uniform(-1, 1, size=(1, 3, 16, 16)).astype(np.float32)
    if body == "zip":  # a truncated archive: zipfile's own error, not an OSError
        np.savez(tmp_path / name, x=a)
        (tmp_path / name).write_bytes((tmp_path / name).read_bytes()[:200])
    elif body == "pickle":
        np.save(tmp_path / name, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    else:
        (tmp_path / name).write_bytes(np.random.default_rng(11).bytes(300))
    reader = reader_for(conv_softmax_model(), CalibrationSettings(data=tmp_path, cache=tmp_path / "c"))
    with pytest.raises(DeepJITError, match=rf"{name}: cannot read it as a \.np[yz]") as e:
        reader.get_next()
    assert e.value.exit_code == 2


def test_a_calibration_cache_that_is_a_file_is_named(tmp_path):
    """ONNX Runtime's quantization failed on it with FileExistsError (exit 3)."""
    import dataclasses

    from deepjit_compiler.errors import SpecError

    (tmp_path / "notes.txt").write_text("a user's")
    settings = dataclasses.replace(random_calibration(tmp_path), cache=tmp_path / "notes.txt")
    with pytest.raises(SpecError, match=r"engine.calibration.cache: .*notes.txt exists and is not a folder"):
        apply_precision(conv_softmax_model(), "int8", calibration=settings)
    assert (tmp_path / "notes.txt").read_text() == "a user's"
