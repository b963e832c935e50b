import hashlib
import re

import pytest
from conftest import PIPELINES

from deepjit_compiler.errors import SpecError
from deepjit_compiler.spec.load import json_schema, load_spec
from deepjit_compiler.spec.models import EXACT_TOLERANCES, LOSSY_TOLERANCES
from deepjit_compiler.spec.targets import compute_capability, sm_for_gpu


@pytest.mark.parametrize("name,sm", [("yolov8_t4.yaml", 75), ("yolov8_h200.yaml", 90)])
def test_example_specs_load_with_paths_resolved_against_their_folder(name, sm):
    loaded = load_spec(PIPELINES / name)
    s = loaded.spec
    assert s.target.resolved_sm == sm
    assert s.engine.precision == "fp16"
    assert s.model.synthesize == "yolov8s"
    assert s.inputs["images"].batch_buckets == (1, 2, 4, 8)
    assert [c.name for c in s.cuts] == ["decode", "nms"]
    # relative paths resolve against the spec's folder, not the working directory
    assert s.model.path == (PIPELINES / "../models/yolov8s.onnx").resolve()
    assert s.engine.workspace == 2 * 2**30
    assert loaded.sha256 == hashlib.sha256((PIPELINES / name).read_bytes()).hexdigest()


def _error(write_spec, replacements) -> str:
    path = write_spec(replacements)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:"), msg
    return msg


def _line_of(path_text: str, needle: str) -> int:
    return next(i for i, line in enumerate(path_text.splitlines(), 1) if needle in line)


def test_unknown_key_names_line_and_suggests(write_spec):
    msg = _error(write_spec, {"  precision: fp16": "  precison: fp16"})
    text = (PIPELINES / "yolov8_t4.yaml").read_text()
    assert f":{_line_of(text, '  precision: fp16')}:3: engine.precison: unknown key" in msg
    assert "did you mean 'precision'" in msg
    assert "allowed: backend, precision" in msg


def test_nested_unknown_key_in_list(write_spec):
    msg = _error(write_spec, {"      - contract: nms": "      - contrct: nms"})
    assert "cuts[1].kernels[0].contrct: unknown key" in msg and "did you mean 'contract'" in msg


def test_wrong_type_names_the_field_expected_type_and_value(write_spec):
    msg = _error(write_spec, {"optimization_level: 3": "optimization_level: fast"})
    assert "engine.optimization_level" in msg and "integer" in msg and "'fast'" in msg


def test_literal_lists_choices_and_suggests_the_closest(write_spec):
    msg = _error(write_spec, {"  backend: auto": "  backend: tensorrtt"})
    assert "'auto', 'tensorrt', 'tensorrt-rtx' or 'onnxruntime'" in msg and "did you mean 'tensorrt'" in msg


def test_yaml_syntax_error_has_line_and_column(write_spec):
    msg = _error(write_spec, {"    random:\n": "    random: [}\n"})
    assert re.search(r":\d+:\d+: YAML error", msg)


def test_python_tag_is_refused_and_never_run(write_spec, tmp_path):
    marker = tmp_path / "pwned"
    msg = _error(write_spec, {"name: yolov8s_t4": f"name: !!python/object/apply:os.system ['touch {marker}']"})
    assert "no Python tags" in msg
    assert not marker.exists()


def test_profile_min_above_max_is_refused(write_spec):
    msg = _error(write_spec, {"min: [1, 3, 640, 640]": "min: [9, 3, 640, 640]"})
    assert "inputs.images" in msg and "min <= opt <= max" in msg and "got 9, 4, 8" in msg


def test_profile_must_keep_the_fixed_dims(write_spec):
    msg = _error(write_spec, {"max: [8, 3, 640, 640]": "max: [8, 3, 640, 800]"})
    assert "dim 3" in msg and "fixes it to 640" in msg


def test_buckets_outside_the_profile_are_named(write_spec):
    msg = _error(write_spec, {"buckets: [1, 2, 4, 8]": "buckets: [1, 16]"})
    assert "buckets [16]" in msg


def test_unknown_gpu_suggests_a_known_one(write_spec):
    msg = _error(write_spec, {"  gpu: T4 ": "  gpu: L40X "})
    assert "target.gpu: unknown GPU 'L40X'" in msg and "did you mean 'L40'" in msg


def test_gpu_and_sm_must_agree(write_spec):
    msg = _error(write_spec, {"  gpu: T4 ": "  sm: 86\n  gpu: T4 "})
    assert "gpu T4 is sm_75, but sm is 86" in msg


def test_sm_below_75_refused(write_spec):
    msg = _error(write_spec, {"  gpu: T4 ": "  sm: 70\n  #"})
    assert "target.sm" in msg and "75" in msg


def test_int8_without_calibration_is_refused(write_spec):
    msg = _error(write_spec, {"precision: fp16": "precision: int8"})
    assert "int8 needs `calibration`" in msg


def test_bf16_for_a_target_without_it_is_refused(write_spec):
    """The error is at the spec's `engine:` line; an sm_80 target (A100) is the first with bf16."""
    msg = _error(write_spec, {"precision: fp16": "precision: bf16"})  # the T4 is sm_75
    line = _line_of((PIPELINES / "yolov8_t4.yaml").read_text(), "engine:")
    assert f":{line}:1: engine: precision bf16 needs sm_80 or newer, but the target T4 is sm_75" in msg, msg
    msg = _error(write_spec, {"precision: fp16": "precision: bf16", "  gpu: T4 ": "  sm: 75\n  #"})
    assert "precision bf16 needs sm_80 or newer, but the target is sm_75 and has no bf16" in msg, msg
    for gpu in ("A10", "A100"):
        assert load_spec(write_spec({"precision: fp16": "precision: bf16", "  gpu: T4 ": f"  gpu: {gpu} "},
                                    name=f"{gpu}.yaml")).spec.engine.precision == "bf16"


def test_repeated_cut_names_are_named_at_the_cuts_line(write_spec):
    msg = _error(write_spec, {"  - name: nms": "  - name: decode"})
    line = _line_of((PIPELINES / "yolov8_t4.yaml").read_text(), "cuts:")
    assert f":{line}:1: cuts: cut names must be unique, repeated: ['decode']" in msg, msg


def test_tolerances_given_keep_the_defaults_of_the_fields_they_leave_out(write_spec):
    """Setting one field of a level's tolerances changes that field only: the others keep that level's
    defaults (a spec's `precision_tolerances.default` leaves the lossy detection settings alone)."""
    given = ("  gate: true", "  precision_tolerances:\n    default: {atol: 0.1}\n"
             "    detections: {margin: 0.01}\n    outputs:\n      output0: {rtol: 0.2}\n  gate: true")
    v = load_spec(write_spec(dict([given]))).spec.validation
    lossy, exact = LOSSY_TOLERANCES, EXACT_TOLERANCES
    assert v.precision_tolerances.default == lossy.default.model_copy(update={"atol": 0.1})
    assert v.precision_tolerances.detections == lossy.detections.model_copy(update={"margin": 0.01})
    # an output's entry starts from the level's default, as given
    assert v.precision_tolerances.outputs["output0"] == lossy.default.model_copy(update={"atol": 0.1, "rtol": 0.2})
    # the T4 spec's own `tolerances` (default atol/rtol 1e-3; output0 atol 2e-2, rtol 1e-2) keep the rest
    assert v.tolerances.default.check_error_stat == exact.default.check_error_stat == "elemwise"
    assert v.tolerances.outputs["output0"].model_dump() == {"atol": 2e-2, "rtol": 1e-2, "check_error_stat": "elemwise"}
    assert v.tolerances.detections == exact.detections
    # what the spec leaves out entirely is the level's default
    assert load_spec(write_spec(name="bare.yaml")).spec.validation.precision_tolerances == lossy
    msg = _error(write_spec, {"  gate: true": "  precision_tolerances:\n    detections: {min_mapp: 0.5}\n  gate: true"})
    assert "precision_tolerances.detections.min_mapp: unknown key" in msg and "did you mean 'min_map'" in msg


def test_cut_needs_one_boundary(write_spec):
    msg = _error(write_spec, {"    preset: yolov8_decode": "    preset: yolov8_decode\n    add: after\n    at: x"})
    assert "cuts[0]" in msg and "exactly one boundary" in msg


def test_missing_required_key(write_spec):
    msg = _error(write_spec, {"      - contract: yolov8_decode": "      - #"})
    assert "required key 'contract' is missing" in msg


def test_symbolic_shape_needs_profile(write_spec):
    text = (PIPELINES / "yolov8_t4.yaml").read_text()
    start, end = text.index("    profile:"), text.index("    buckets:")
    msg = _error(write_spec, {text[start:end]: "", "    buckets: [1, 2, 4, 8]": ""})
    assert "symbolic dims ['batch']" in msg


def _static(shape: str, buckets: str = "") -> dict[str, str]:
    """The T4 spec's input given as a static shape: no profile, and `buckets` in place of its buckets line."""
    text = (PIPELINES / "yolov8_t4.yaml").read_text()
    profile = text[text.index("    profile:"):text.index("    buckets:")]
    return {profile: "", "    buckets: [1, 2, 4, 8]": buckets, "shape: [batch, 3, 640, 640]": f"shape: {shape}"}


@pytest.mark.parametrize("shape, buckets, message", [
    ("[1, 3, 0, 640]", "", "inputs.images: shape dim 2: need 1 <= dim <= 2147483647 (TensorRT's dims are int32), got 0"),
    ("[0, 3, 640, 640]", "", "inputs.images: shape dim 0: need 1 <= dim <= 2147483647"),
    ("[1, 3, -640, 640]", "", "shape dim 2: need 1 <= dim <= 2147483647 (TensorRT's dims are int32), got -640"),
    ("[1, 3, 2147483648, 1]", "", "shape dim 2: need 1 <= dim <= 2147483647"),
    ("[100000000, 3, 640, 640]", "",
     "inputs.images: shape [100000000, 3, 640, 640] of float32 is 491520000000000 bytes a batch; at most 1099511627776"),
    ("[]", "", "inputs.images.shape: List should have at least 1 item"),
    ("[2, 3, 640, 640]", "    buckets: [1, 2, 8]", "buckets [1, 8] lie outside the shape's batch range 2..2"),
])
def test_a_static_shape_is_held_to_the_bounds_of_a_profile(write_spec, shape, buckets, message):
    """Without a profile a shape is its own min, opt and max: a dim of 0, a 1 PB batch, no batch dim at
    all or buckets past its batch loaded (exit 0) and failed later, in the build or the runtime."""
    assert message in _error(write_spec, _static(shape, buckets))


def test_a_static_shape_within_the_bounds_loads_with_its_batch_as_its_bucket(write_spec):
    images = load_spec(write_spec(_static("[2, 3, 640, 640]", "    buckets: [2]"))).spec.inputs["images"]
    assert (images.min_shape, images.max_shape, images.batch_buckets) == ((2, 3, 640, 640),) * 2 + ((2,),)
    assert load_spec(write_spec(_static("[3, 3, 640, 640]"), name="b.yaml")).spec.inputs["images"].batch_buckets == (3,)


@pytest.mark.parametrize("given, size", [
    ("512MiB", 512 * 1024 * 1024), ("1.5GiB", 3 * 2**29), ("2 KiB", 2048), ("3GB", 3_000_000_000), ("64MB", 64_000_000),
    ("10KB", 10_000), ("4096B", 4096), ("12345", 12345), ("0.25 GB", 250_000_000),
])
def test_workspace_sizes_in_binary_and_decimal_units(write_spec, given, size):
    assert load_spec(write_spec({"workspace: 2GiB": f"workspace: {given}"})).spec.engine.workspace == size


@pytest.mark.parametrize("given, message", [
    ("true", "engine.workspace: expected a size such as 2GiB, 512MiB or a number of bytes, got True"),
    ("2 GiBs", "engine.workspace: expected a size such as 2GiB, 512MiB or a number of bytes, got '2 GiBs'"),
    ("0", "engine.workspace: Input should be greater than 0, got 0"),
    ("0.5B", "engine.workspace: Input should be greater than 0, got 0"),
    ("1025GiB", "engine.workspace: Input should be less than or equal to 1099511627776, got 1100585369600"),
    ("99999999999999999999999", "engine.workspace: Input should be less than or equal to 1099511627776"),
])
def test_a_workspace_that_is_no_size_or_past_1_tib_is_refused(write_spec, given, message):
    """A workspace of 10**23 bytes loaded and reached TensorRT's size_t pool limit at build time."""
    assert message in _error(write_spec, {"workspace: 2GiB": f"workspace: {given}"})


CALIBRATION = "  optimization_level: 3\n  calibration: {data: random, cache: cal, samples: 0}"


@pytest.mark.parametrize("old, new, message", [
    ("target:\n  gpu: T4", "target: {}\n  #", "target: give `gpu` (e.g. T4), `sm` (e.g. 75) or both"),
    ("opt: [4, 3, 640, 640]", "opt: [4, 3, 640]", "inputs.images: profile.opt has 3 dims, shape has 4"),
    ("min: [1, 3, 640, 640]", "min: [0, 3, 640, 640]", "profile dim 0: need 1 <= min <= opt <= max"),
    ("opt: [4, 3, 640, 640]", "opt: [9, 3, 640, 640]", "need 1 <= min <= opt <= max <= 2147483647 (TensorRT's dims "
                                                         "are int32), got 1, 9, 8"),
    ("min: [1, 3, 640, 640]", "min: [2, 3, 640, 640]", "buckets [1] lie outside the profile's batch range 2..8"),
    ("inputs:\n  images:", "inputs: {}\nmore:\n  images:", "inputs: Dictionary should have at least 1 item"),
    ("buckets: [1, 2, 4, 8]", "buckets: [true, 2]", "inputs.images.buckets[0]: Input should be a valid integer, "
                                                   "got True"),
    ("max: [8, 3, 640, 640]", "max: [8, 3, 640.0, 640]", "inputs.images.profile.max[2]: Input should be a valid "
                                                         "integer, got 640.0"),
    ("shape: [batch, 3, 640, 640]", "shape: [batch, 3, true, 640]", "inputs.images.shape[2]: Input should be a "
                                                                   "valid integer, got True"),
    ("optimization_level: 3", "optimization_level: 6", "engine.optimization_level: Input should be less than or "
                                                       "equal to 5, got 6"),
    ("  optimization_level: 3", CALIBRATION, "engine.calibration.samples: Input should be greater than or equal to 1"),
    ("    preset: yolov8_decode", "    inputs: [a]", "cuts[0]: a cut by tensor names needs both `inputs` and `outputs`"),
    ("    at: output0\n", "", "cuts[1]: an added stage needs both `add` (before|after) and `at` (a model tensor)"),
    ("ranges: {images: [0.0, 1.0]}", "ranges: {images: [1.0, 1.0]}", "images: [1.0, 1.0]: a range is [low, high]"),
    ("    random:\n", "    folder: photos\n    random:\n", "validation.data: give exactly one of `random` or `folder`"),
    ("  samples: 2", "  samples: 0", "validation.samples: Input should be greater than or equal to 1, got 0"),
    ("file://../build/store", "oci://me:secret@registry.example:5000/repo",
     "publish.store: credentials in a store URL are refused: the spec travels inside every bundle"),
    ("tag: yolov8s-t4", "tag: .hidden", "publish.tag: should be 1 to 128 letters, digits, '_', '.' and '-', not "
                                        "starting with '.' or '-', got '.hidden'"),
    ("output0: {atol: 2.0e-2", "output0: {atl: 2.0e-2",
     "validation.tolerances.outputs.output0.atl: unknown key 'atl' (did you mean 'atol'?); allowed: atol, rtol, "
     "check_error_stat"),
])
def test_each_field_out_of_bounds_names_itself_and_what_is_allowed(write_spec, old, new, message):
    assert message in _error(write_spec, {old: new})


def test_a_bfloat16_batch_is_sized_at_two_bytes_a_value(write_spec):
    """100000 x 3 x 2048 x 1024 bfloat16 values are 1.26e12 bytes: past 1 TiB, though their count is not."""
    msg = _error(write_spec, {"dtype: float32": "dtype: bfloat16", "max: [8, 3, 640, 640]": "max: [100000, 3, 2048, 1024]",
                              "shape: [batch, 3, 640, 640]": "shape: [batch, 3, 2048, 1024]",
                              "min: [1, 3, 640, 640]": "min: [1, 3, 2048, 1024]",
                              "opt: [4, 3, 640, 640]": "opt: [4, 3, 2048, 1024]"})
    assert "profile.max [100000, 3, 2048, 1024] of bfloat16 is 1258291200000 bytes a batch" in msg, msg


@pytest.mark.parametrize("option", ["--include-path=/etc", " -I/etc", "-include=x.h", "--pre-include=x.h",
                                    "-pch", "--dependency", "--time=t.csv", " -arch=sm_90"])
def test_every_compile_option_that_reads_or_writes_files_or_picks_the_target_is_refused(write_spec, option):
    msg = _error(write_spec, {"  fast_math: false ": f"  options: ['{option}']\n  fast_math: false "})
    assert f"compile.options: {option!r}: " in msg, msg


def test_a_file_store_resolves_against_the_specs_folder_and_an_oci_one_stays(write_spec, tmp_path):
    assert load_spec(write_spec()).spec.publish.store == f"file://{(tmp_path.parent / 'build' / 'store').resolve()}"
    oci = "oci://registry.example:5000/team/repo"
    assert load_spec(write_spec({"file://../build/store": oci}, name="oci.yaml")).spec.publish.store == oci


def test_a_spec_loaded_by_a_relative_path_knows_its_absolute_folder(write_spec, tmp_path, monkeypatch):
    write_spec(name="here.yaml")
    monkeypatch.chdir(tmp_path)
    loaded = load_spec("here.yaml")
    assert loaded.path == tmp_path / "here.yaml" and loaded.folder == tmp_path


def test_buckets_are_sorted_without_repeats_and_default_to_powers_of_two_up_to_8_plus_the_max(write_spec):
    assert load_spec(write_spec({"buckets: [1, 2, 4, 8]": "buckets: [8, 2, 2, 1]"})).spec.inputs[
        "images"].batch_buckets == (1, 2, 8)
    path = write_spec({"    buckets: [1, 2, 4, 8]": "", "max: [8, 3, 640, 640]": "max: [16, 3, 640, 640]"}, name="b.yaml")
    assert load_spec(path).spec.inputs["images"].batch_buckets == (1, 2, 4, 8, 16)


def test_missing_spec_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="spec file not found"):
        load_spec(tmp_path / "nope.yaml")


def test_default_buckets_are_1_2_4_8_within_the_profile_plus_its_max(write_spec):
    path = write_spec({"    buckets: [1, 2, 4, 8]": "", "max: [8, 3, 640, 640]": "max: [6, 3, 640, 640]",
                       "opt: [4, 3, 640, 640]": "opt: [2, 3, 640, 640]", "min: [1, 3, 640, 640]": "min: [2, 3, 640, 640]"})
    assert load_spec(path).spec.inputs["images"].batch_buckets == (2, 4, 6)


def test_gpu_names_map_to_their_sm():
    assert [sm_for_gpu(n) for n in ("T4", "a10", "L4", "H100", "h200")] == [75, 86, 89, 90, 90]
    assert [sm_for_gpu(n) for n in ("Jetson Orin", "RTX-4090", "rtx 6000 ada", "a10g")] == [87, 89, 89, 86]


def test_compute_capabilities_are_written_major_dot_minor():
    assert [compute_capability(sm) for sm in (75, 80, 90, 100, 120, 121)] == ["7.5", "8.0", "9.0", "10.0", "12.0",
                                                                               "12.1"]


def test_json_schema_describes_the_spec():
    schema = json_schema()
    assert set(schema["required"]) >= {"name", "model", "target", "inputs"}
    assert schema["$defs"]["Engine"]["additionalProperties"] is False
    assert "yolov8_decode" in str(schema["$defs"]["Cut"])


@pytest.mark.parametrize("name", ["a" * 201, "-rf", ".hidden", "two words", "../up"])
def test_a_name_that_cannot_be_a_file_name_is_refused(write_spec, name):
    """The name becomes build/NAME, NAME.tar.gz and NAME.report: at most 200 plain characters, so each fits
    a file system's 255 bytes and none is a path or an option."""
    msg = _error(write_spec, {"name: yolov8s_t4": f"name: '{name}'"})
    assert "name:" in msg and "1 to 200 letters, digits, '_', '.' and '-'" in msg, msg


def test_a_name_of_200_characters_loads(write_spec):
    assert load_spec(write_spec({"name: yolov8s_t4": f"name: {'b' * 200}"})).spec.name == "b" * 200


@pytest.mark.parametrize("old, new, message", [
    ("max: [8, 3, 640, 640]", "max: [2147483648, 3, 640, 640]", "need 1 <= min <= opt <= max <= 2147483647"),
    ("max: [8, 3, 640, 640]", "max: [100000000, 3, 640, 640]",
     "profile.max [100000000, 3, 640, 640] of float32 is 491520000000000 bytes a batch; at most 1099511627776"),
    ("buckets: [1, 2, 4, 8] ", "buckets: [] ", "inputs.images.buckets"),
    ("ranges: {images: [0.0, 1.0]}", "ranges: {images: [1.0, 0.0]}", "images: [1.0, 0.0]: a range is [low, high]"),
    ("ranges: {images: [0.0, 1.0]}", "ranges: {images: [.nan, 1.0]}", "a range is [low, high], both finite"),
    ("ranges: {images: [0.0, 1.0]}", "ranges: {images: [0.0, .inf]}", "a range is [low, high], both finite"),
])
def test_shapes_and_ranges_that_no_build_could_use_are_refused(write_spec, old, new, message):
    """They built (exit 0) and failed later: a 1 PB batch on the CPU, an empty bucket list, an inverted
    range (exit 3 in numpy)."""
    assert message in _error(write_spec, {old: new})


@pytest.mark.parametrize("option, message", [
    ("--gpu-architecture=sm_90", "the architecture comes from `target`"), ("-arch=compute_90", "from `target`"),
    ("-I/etc", "options that read or write files are not allowed"),
    ("-time=t.csv", "options that read or write files are not allowed"),
])
def test_compile_options_that_pick_the_target_or_read_files_name_compile_options(write_spec, option, message):
    """An sm_90 cubin named and recorded as the T4's sm_75 built with exit 0 before."""
    msg = _error(write_spec, {"  fast_math: false ": f"  options: ['{option}']\n  fast_math: false "})
    assert "compile.options" in msg and message in msg, msg


def test_a_compile_cache_dir_that_is_a_file_is_named(write_spec, tmp_path):
    """It built with exit 0, every kernel warning of a 'corrupt cache entry' under the file's name."""
    (tmp_path / "README.md").write_text("# mine\n")
    msg = _error(write_spec, {"  fast_math: false ": "  cache_dir: README.md\n  fast_math: false "})
    assert "compile.cache_dir" in msg and "README.md exists and is not a folder" in msg, msg
