"""StepRunner: a pipeline's steps on the CPU in order, ONNX models and callables alike, with wiring
errors that name the step; plan_runner's overrides; the reference model with added stages around it."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest_models import chain_model, make_model, tiny_detector
from onnx import TensorProto, helper

from deepjit_compiler.graph.ort import ort_session
from deepjit_compiler.graph.steps import StepRunner, WiringError
from deepjit_compiler.surgery.cut import plan_from_model
from deepjit_compiler.surgery.plan import CutRequest, KernelRequest
from deepjit_compiler.validation.executor import plan_runner, reference_model

F32 = TensorProto.FLOAT


def scale_model(x: str, y: str, factor: float) -> onnx.ModelProto:
    """y = factor * x, [2] float32."""
    k = onnx.numpy_helper.from_array(np.array([factor], np.float32), "k")
    return make_model([helper.make_node("Mul", [x, "k"], [y])], [helper.make_tensor_value_info(x, F32, [2])],
                      [helper.make_tensor_value_info(y, F32, [2])], [k])


def test_steps_run_in_order_over_one_environment():
    seen = []
    runner = StepRunner([("double", scale_model("x", "y", 2.0)),
                         ("add_one", lambda env: {"z": env["y"] + 1.0}),
                         ("triple", scale_model("z", "w", 3.0))])
    env = runner.tensors({"x": np.array([1.0, -2.0], np.float32)}, after=lambda name, out: seen.append((name, set(out))))
    np.testing.assert_array_equal(env["w"], [9.0, -9.0])            # ((x * 2) + 1) * 3
    assert set(env) == {"x", "y", "z", "w"}
    assert seen == [("double", {"y"}), ("add_one", {"z"}), ("triple", {"w"})]


def test_a_step_that_remakes_a_tensor_replaces_it_for_the_steps_after():
    x = np.random.default_rng(1).uniform(-2, 2, 2).astype(np.float32)
    runner = StepRunner([("clip", lambda env: {"x": np.clip(env["x"], 0.0, 1.0)}), ("double", scale_model("x", "y", 2.0))])
    env = runner.tensors({"x": x})
    np.testing.assert_array_equal(env["y"], 2 * np.clip(x, 0.0, 1.0))
    np.testing.assert_array_equal(env["x"], np.clip(x, 0.0, 1.0))


def test_a_step_that_reads_what_no_earlier_step_makes_is_a_wiring_error():
    runner = StepRunner([("triple", scale_model("z", "w", 3.0)), ("double", scale_model("x", "z", 2.0))])
    with pytest.raises(WiringError, match="step 'triple' reads 'z', which no earlier step produces"):
        runner.tensors({"x": np.ones(2, np.float32)})


def test_onnx_runtime_refusing_the_inputs_is_a_wiring_error_naming_the_step():
    runner = StepRunner([("double", scale_model("x", "y", 2.0))])
    with pytest.raises(WiringError, match="step 'double' failed in ONNX Runtime"):
        runner.tensors({"x": np.ones(3, np.float64)})


def test_plan_runner_swaps_only_the_overridden_steps():
    model = chain_model()
    plan = plan_from_model(model, [CutRequest("soft", inputs=["a"], outputs=["mid"], kernels=(KernelRequest("k"),))])
    x = np.random.default_rng(0).random((2, 4, 8, 8), dtype=np.float32)
    want = ort_session(model).run(["y"], {"x": x})[0]
    np.testing.assert_array_equal(plan_runner(plan).tensors({"x": x})["y"], want)   # the pieces are the model
    zeros = plan_runner(plan, {"soft": lambda env: {"mid": np.zeros_like(env["a"])}}).tensors({"x": x})
    assert not zeros["mid"].any() and not np.array_equal(zeros["y"], want)
    np.testing.assert_array_equal(zeros["a"], plan_runner(plan).tensors({"x": x})["a"])  # segment_0 ran as it is


def test_reference_model_wraps_the_model_in_its_added_stages():
    model = tiny_detector()
    plan = plan_from_model(model, [CutRequest("nms", add="after", at="output0",
                                              kernels=(KernelRequest("nms", {"max_det": 5,
                                                                             "conf_threshold": 0.01}),))])
    ref = reference_model(plan, model)
    assert [i.name for i in ref.graph.input] == ["images"]
    outputs = ["num_dets", "boxes", "scores", "classes"]
    assert [o.name for o in ref.graph.output] == outputs
    x = np.random.default_rng(1).random((2, 3, 32, 32), dtype=np.float32)
    whole = dict(zip(outputs, ort_session(ref).run(outputs, {"images": x})))
    stepwise = StepRunner([("model", model), ("nms", plan.step("nms").reference)]).tensors({"images": x})
    assert (whole["num_dets"] > 0).all()  # tiny_detector's scores are below the default 0.25: 0.01 keeps some
    for name in outputs:
        np.testing.assert_array_equal(whole[name], stepwise[name])
    assert whole["boxes"].shape == (2, 5, 4)
