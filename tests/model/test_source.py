"""The spec's inputs against the model (model/source.py): an input size the model's strides do not
divide is exit 2 at spec check, naming the input and the sizes allowed."""
from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from conftest import run_cli
from conftest_models import make_model
from onnx import TensorProto, helper, numpy_helper

from deepjit_compiler.errors import SpecError
from deepjit_compiler.graph.shapes import input_stride, shape_problem, shape_skeleton
from deepjit_compiler.model.source import check_inputs
from deepjit_compiler.spec.load import load_spec


def skip_model(seed: int = 0) -> onnx.ModelProto:
    """x [N, 4, H, W] -> two stride-2 convs -> two 2x upsamples -> Concat with x: only H, W that are
    multiples of 4 line up (a U-Net or a detector's FPN in small)."""
    rng = np.random.default_rng(seed)
    w = [numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), f"w{i}") for i in range(2)]
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    nodes = [helper.make_node("Conv", ["x", "w0"], ["d1"], kernel_shape=[3, 3], pads=[1] * 4, strides=[2, 2]),
             helper.make_node("Conv", ["d1", "w1"], ["d2"], kernel_shape=[3, 3], pads=[1] * 4, strides=[2, 2]),
             helper.make_node("Resize", ["d2", "", "scales"], ["u1"], mode="nearest"),
             helper.make_node("Resize", ["u1", "", "scales"], ["u2"], mode="nearest"),
             helper.make_node("Concat", ["x", "u2"], ["y"], axis=1)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, "H", "W"])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, "H", "W"])], [*w, scales])


def spec_for(folder, lo: int, opt: int, hi: int):
    onnx.save(skip_model(), folder / "skip.onnx")
    (folder / "spec.yaml").write_text(
        "name: skip\nmodel: {path: skip.onnx}\ntarget: {gpu: T4}\ninputs:\n"
        f"  x: {{shape: [N, 4, H, W], profile: {{min: [1, 4, {lo}, {lo}], opt: [1, 4, {opt}, {opt}], "
        f"max: [2, 4, {hi}, {hi}]}}}}\nbundle: {{path: out/skip}}\n")
    return load_spec(folder / "spec.yaml")


def test_the_stride_and_the_sizes_that_fit():
    skeleton = shape_skeleton(skip_model())
    assert input_stride(skeleton, ["x"]) == 4
    assert shape_problem(skeleton, {"x": [1, 4, 32, 36]}) is None
    assert "Concat" in shape_problem(skeleton, {"x": [1, 4, 30, 32]})


def test_sizes_the_strides_divide_pass(tmp_path):
    loaded = spec_for(tmp_path, 16, 32, 64)
    assert check_inputs(loaded, onnx.load(str(tmp_path / "skip.onnx"))) is None


def test_a_model_input_of_unknown_rank_is_taken_as_the_spec_describes_it(tmp_path):
    """An input that declares no shape at all (rank unknown) was read as rank 0 and refused: 'has rank 0 []'."""
    loaded = spec_for(tmp_path, 16, 32, 64)
    model = skip_model()
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, None))
    assert check_inputs(loaded, model) is None
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT16, None))
    with pytest.raises(SpecError, match=r"spec\.yaml: inputs\.x\.dtype: the model's 'x' is float16, the spec says "
                                        r"float32$"):
        check_inputs(loaded, model)


def with_input(model: onnx.ModelProto, *extra: onnx.ValueInfoProto, x_shape=("N", 4, "H", "W")) -> onnx.ModelProto:
    """`model` with input x declared as `x_shape` and the graph inputs `extra` after it."""
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape)))
    model.graph.input.extend(extra)
    return model


@pytest.mark.parametrize("x_shape, message", [
    (("N", 4, "H"), "inputs.x.shape: the model's 'x' has rank 3 ['N', 4, 'H'], the spec gives ['N', 4, 'H', 'W']"),
    (("N", 5, "H", "W"), "inputs.x: dim 1 is fixed to 5 in the model's 'x', the spec's shape/profile allows 4"),
    (("N", 4, 64, "W"), "inputs.x: dim 2 is fixed to 64 in the model's 'x', the spec's shape/profile allows 16..64"),
])
def test_a_model_input_unlike_the_spec_is_named(tmp_path, x_shape, message):
    """A fixed model dim must hold over the whole profile: H fixed to 64 with profile H 16..64 passed the
    dry run and failed at the engine build, naming no spec field."""
    loaded = spec_for(tmp_path, 16, 32, 64)
    with pytest.raises(SpecError, match=re.escape(f"{tmp_path / 'spec.yaml'}: {message}")):
        check_inputs(loaded, with_input(skip_model(), x_shape=x_shape))


def test_a_model_input_the_spec_does_not_describe_is_named(tmp_path):
    loaded = spec_for(tmp_path, 16, 32, 64)
    extra = helper.make_tensor_value_info("scale", TensorProto.FLOAT, [1])
    with pytest.raises(SpecError, match=re.escape("inputs: the model also needs ['scale']; describe every model input")):
        check_inputs(loaded, with_input(skip_model(), extra))


def test_a_model_input_fixed_to_the_profiles_one_size_passes(tmp_path):
    loaded = spec_for(tmp_path, 64, 64, 64)
    assert check_inputs(loaded, with_input(skip_model(), x_shape=("N", 4, 64, 64))) is None


def test_a_model_dim_of_0_is_taken_as_free(tmp_path):
    """Older exporters write dim_value 0 for a dim they leave open."""
    loaded = spec_for(tmp_path, 16, 32, 64)
    assert check_inputs(loaded, with_input(skip_model(), x_shape=(0, 4, "H", "W"))) is None


@pytest.mark.parametrize("lo, opt, hi, which, bad", [(30, 32, 64, "min", 30), (16, 33, 64, "opt", 33),
                                                       (16, 32, 66, "max", 66)])
def test_a_size_the_strides_do_not_divide_is_named(tmp_path, lo, opt, hi, which, bad):
    loaded = spec_for(tmp_path, lo, opt, hi)
    with pytest.raises(SpecError) as e:
        check_inputs(loaded, onnx.load(str(tmp_path / "skip.onnx")))
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'spec.yaml'}: inputs.x.profile.{which}: the model cannot run at")
    assert "dims 2, 3 must be multiples of 4" in message
    assert f"dim 2: {bad // 4 * 4} or {bad // 4 * 4 + 4}, not {bad}" in message


def test_a_yolov8_profile_at_300_is_exit_2_at_dry_run(write_spec):
    """The issue's case: a dynamic YOLOv8 at 300x300 used to pass --dry-run and crash in ONNX Runtime."""
    spec = write_spec({"path: ../models/yolov8s.onnx": "path: m.onnx", "synthesize: yolov8s": "synthesize: yolov8n",
                       "dynamic: false": "dynamic: true", "shape: [batch, 3, 640, 640]": "shape: [batch, 3, h, w]",
                       "min: [1, 3, 640, 640]": "min: [1, 3, 300, 300]"})
    r = run_cli("build", str(spec), "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "inputs.images.profile.min: the model cannot run at [1, 3, 300, 300]: dims 2, 3 must be multiples of 32" \
        in r.stderr and "dim 2: 288 or 320, not 300" in r.stderr
