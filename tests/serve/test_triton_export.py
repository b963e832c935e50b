"""`deepjit export triton`: the model repository it writes, and what it refuses (exit 2, nothing changed).

The bundles are the trained YOLOv8n's (conftest.py): with the letterbox on the GPU (raw uint8 images in,
max batch 2, buckets 1 and 2, 100 detections) and on the host (float [B, 3, 320, 320] in)."""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from deepjit_compiler.bundle.folder import read_bundle, verify_folder
from deepjit_compiler.bundle.manifest import manifest_bytes, manifest_digest
from deepjit_compiler.cli import main
from deepjit_compiler.errors import ServeError
from deepjit_compiler.runtime.layout import Layout
from deepjit_compiler.serve.triton import (
    TritonOptions,
    checked_options,
    config_text,
    export_triton,
    model_config,
    model_py,
)

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2",
                                       reason="the export writes config.pbtxt with tritonclient's schema")
text_format = pytest.importorskip("google.protobuf.text_format")


def parsed(model_dir: Path):
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def export_cli(capsys, *args: str) -> tuple[int, str]:
    """`deepjit export triton ARGS` in this process: (exit code, stderr)."""
    capsys.readouterr()
    code = main(["export", "triton", *args])
    return code, capsys.readouterr().err


def tree(folder: Path) -> dict[str, str]:
    """Every file under `folder` with its sha256: to show nothing changed."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_config_of_the_letterbox_bundle(real_bundles, tmp_path):
    result = export_triton(real_bundles["gpu_letterbox"], tmp_path / "repo", TritonOptions(name="det", kind="cpu",
                                                                                         instances=3))
    assert result.model_dir == tmp_path / "repo" / "det" and result.maps_boxes
    c = parsed(result.model_dir)
    mc = model_config_pb2
    assert (c.name, c.backend, c.max_batch_size) == ("det", "python", 2)
    assert [(t.name, t.data_type, list(t.dims)) for t in c.input] == [("raw_images", mc.TYPE_UINT8, [-1, -1, 3])]
    assert [(t.name, t.data_type, list(t.dims)) for t in c.output] == [
        ("num_dets", mc.TYPE_INT32, [1]), ("boxes", mc.TYPE_FP32, [100, 4]), ("scores", mc.TYPE_FP32, [100]),
        ("classes", mc.TYPE_INT32, [100]), ("ratio_pad", mc.TYPE_FP32, [3])]
    assert c.output[0].HasField("reshape") and list(c.output[0].reshape.shape) == []   # [B] inside, [B, 1] out
    assert list(c.dynamic_batching.preferred_batch_size) == [2]
    assert c.dynamic_batching.max_queue_delay_microseconds == 100
    assert [(g.kind, g.count, list(g.gpus)) for g in c.instance_group] == [(mc.ModelInstanceGroup.KIND_CPU, 3, [])]
    assert "EXECUTION_ENV_PATH" not in c.parameters


def test_config_of_gpu_instances_and_the_options(real_bundles, tmp_path):
    options = TritonOptions(name="det", version=3, max_batch=1, kind="gpu", instances=2, gpus=(0, 1),
                            env="/opt/deepjit-env", dynamic_batching=False)
    result = export_triton(real_bundles["host_letterbox"], tmp_path, options)
    c = parsed(result.model_dir)
    mc = model_config_pb2
    assert not result.maps_boxes
    assert c.max_batch_size == 1 and not c.HasField("dynamic_batching")
    assert [(t.name, t.data_type, list(t.dims)) for t in c.input] == [("images", mc.TYPE_FP32, [3, 320, 320])]
    assert [(g.kind, g.count, list(g.gpus)) for g in c.instance_group] == [(mc.ModelInstanceGroup.KIND_GPU, 2, [0, 1])]
    assert c.parameters["EXECUTION_ENV_PATH"].string_value == "/opt/deepjit-env"
    assert (tmp_path / "det" / "3" / "model.py").is_file()


def test_preferred_batch_sizes_stay_within_the_max_batch_asked(real_bundles, tmp_path):
    c = parsed(export_triton(real_bundles["gpu_letterbox"], tmp_path, TritonOptions(name="det", max_batch=1)).model_dir)
    assert c.max_batch_size == 1 and list(c.dynamic_batching.preferred_batch_size) == []


def test_the_bundle_travels_whole_and_model_py_pins_its_digest(real_bundles, tmp_path):
    source = read_bundle(real_bundles["gpu_letterbox"])
    result = export_triton(source.source, tmp_path, TritonOptions(name="det", kind="cpu"))
    copied = verify_folder(result.model_dir / "1" / "bundle")
    assert copied["digest"] == source.digest == result.bundle_digest
    assert tree(result.model_dir / "1" / "bundle") == tree(source.root)
    model_py = (result.model_dir / "1" / "model.py").read_text()
    assert "from deepjit_compiler.serve.triton_model import DeepJITModel" in model_py
    assert f"bundle_digest = '{source.digest}'" in model_py
    marker = json.loads((result.model_dir / "deepjit-export.json").read_text())
    assert marker["bundles"] == ["1/bundle"] and marker["bundle_digest"] == source.digest
    assert marker["files"] == {rel: h for rel, h in tree(result.model_dir).items() if rel in ("config.pbtxt", "1/model.py")}


def test_an_export_replaces_its_own_and_leaves_the_other_models(real_bundles, tmp_path):
    repo = tmp_path / "repo"
    export_triton(real_bundles["gpu_letterbox"], repo, TritonOptions(name="det", kind="cpu"))
    other = repo / "someone_elses" / "config.pbtxt"
    other.parent.mkdir()
    other.write_text('backend: "onnxruntime"\n')
    cache = repo / "det" / "1" / "__pycache__" / f"model.cpython-{sys.version_info.major}{sys.version_info.minor}.pyc"
    cache.parent.mkdir()
    cache.write_bytes(b"bytecode Python cached when Triton loaded model.py")
    export_triton(real_bundles["host_letterbox"], repo, TritonOptions(name="det", kind="cpu", max_batch=1))
    assert parsed(repo / "det").input[0].name == "images" and parsed(repo / "det").max_batch_size == 1
    assert not cache.exists() and other.read_text() == 'backend: "onnxruntime"\n'
    assert sorted(p.name for p in repo.iterdir()) == ["det", "someone_elses"]   # no staging folder left


def _write_pyc(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"bytecode")


def _edit_config(d: Path) -> None:
    (d / "config.pbtxt").write_text((d / "config.pbtxt").read_text().replace("max_batch_size: 2", "max_batch_size: 1"))


@pytest.mark.parametrize("change, why", [
    (lambda d: (d / "notes.txt").write_text("mine"), "'notes.txt' is not one of its files"),
    (_edit_config, "'config.pbtxt' was changed after the export"),
    (lambda d: (d / "1" / "model.py").unlink(), "'1/model.py' is missing"),
    (lambda d: (d / "1" / "bundle" / "manifest.json").write_text("{}"), "its bundle 1/bundle/ does not verify"),
    (lambda d: (d / "deepjit-export.json").unlink(), "no deepjit-export.json"),
    (lambda d: (d / "1" / "bundlex.txt").write_text("mine"), "'1/bundlex.txt' is not one of its files"),
    (lambda d: _write_pyc(d / "1" / "__pycache__" / "evil.cpython-311.pyc"),
     "'1/__pycache__/evil.cpython-311.pyc' is not one of its files"),
    (lambda d: _write_pyc(d / "7" / "__pycache__" / "model.cpython-311.pyc"),
     "'7/__pycache__/model.cpython-311.pyc' is not one of its files"),
])
def test_a_model_folder_holding_what_export_did_not_write_is_refused(real_bundles, tmp_path, capsys, change, why):
    repo = tmp_path / "repo"
    export_triton(real_bundles["gpu_letterbox"], repo, TritonOptions(name="det", kind="cpu"))
    change(repo / "det")
    before = tree(repo)
    code, err = export_cli(capsys, str(real_bundles["host_letterbox"]), str(repo), "--name", "det", "--kind", "cpu")
    assert code == 2, err
    assert f"{repo / 'det'}: holds files `deepjit export triton` did not write" in err and why in err
    assert "refusing to replace it" in err and "Traceback" not in err
    assert tree(repo) == before


def test_a_link_inside_an_exported_folder_is_refused(real_bundles, tmp_path):
    repo = tmp_path / "repo"
    export_triton(real_bundles["gpu_letterbox"], repo, TritonOptions(name="det", kind="cpu"))
    (repo / "det" / "link").symlink_to(repo / "det" / "config.pbtxt")
    with pytest.raises(ServeError, match=re.escape(f"{repo / 'det'}: 'link' is a link or not a plain file")):
        export_triton(real_bundles["gpu_letterbox"], repo, TritonOptions(name="det", kind="cpu"))
    assert (repo / "det" / "link").is_symlink()


def test_a_users_folder_is_refused(real_bundles, tmp_path):
    user = tmp_path / "repo" / "det"
    (user / "1").mkdir(parents=True)
    (user / "1" / "model.onnx").write_bytes(b"a user's model")
    with pytest.raises(ServeError, match="no deepjit-export.json"):
        export_triton(real_bundles["gpu_letterbox"], tmp_path / "repo", TritonOptions(name="det"))
    assert tree(tmp_path / "repo") == {"det/1/model.onnx": hashlib.sha256(b"a user's model").hexdigest()}


@pytest.mark.parametrize("link_to", ["empty", "missing"])
def test_a_link_at_the_model_folder_is_refused(real_bundles, tmp_path, link_to):
    (tmp_path / "empty").mkdir()
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "det").symlink_to(tmp_path / link_to)
    with pytest.raises(ServeError, match=re.escape(f"{tmp_path / 'repo' / 'det'}: exists and is not a folder")):
        export_triton(real_bundles["gpu_letterbox"], tmp_path / "repo", TritonOptions(name="det"))
    assert (tmp_path / "repo" / "det").is_symlink() and list((tmp_path / "empty").iterdir()) == []


def test_a_repo_that_is_a_file_is_refused(real_bundles, tmp_path):
    (tmp_path / "repo").write_text("a file")
    with pytest.raises(ServeError, match=re.escape(f"{tmp_path / 'repo'}: is not a folder")):
        export_triton(real_bundles["gpu_letterbox"], tmp_path / "repo", TritonOptions(name="det"))
    assert (tmp_path / "repo").read_text() == "a file"


@pytest.mark.parametrize("args, message", [
    (["--max-batch", "3"], "--max-batch 3: this bundle takes batches 1..2 (its profile)"),
    (["--max-batch", "0"], "--max-batch 0: this bundle takes batches 1..2"),
    (["--max-batch", "-1"], "--max-batch -1: this bundle takes batches 1..2 (its profile)"),  # was "from 0 to ..."
    (["--name", "../up"], "--name '../up': a Triton model name here is 1 to 200 letters, digits"),
    (["--name", "m" * 201], f"--name '{'m' * 201}': a Triton model name here is 1 to 200 letters, digits"),
    (["--kind", "cpu", "--gpus", "0"], "--gpus 0: distinct GPU numbers (0, 1, ... up to 2147483647), and only with --kind gpu"),
    (["--gpus", "0,0"], "--gpus 0,0: distinct GPU numbers"),
    (["--env", "venv"], "--env venv: give the serving environment's absolute path"),
    (["--version", "0"], "--version 0: Triton model versions are whole numbers from 1"),
    (["--instances", "0"], "--instances 0: a whole number from 1 to 2147483647"),
    (["--instances", "2147483648"], "--instances 2147483648: a whole number from 1 to 2147483647"),
    (["--version", "9223372036854775808"], "--version 9223372036854775808: Triton model versions are whole numbers "
                                           "from 1 to 9223372036854775807"),
    (["--gpus", "2147483648"], "--gpus 2147483648: distinct GPU numbers (0, 1, ... up to 2147483647)"),
    (["--gpus", ""], "give GPU numbers like 0,1"),
    (["--gpus", "0,-1"], "--gpus 0,-1: distinct GPU numbers (0, 1, ... up to 2147483647)"),
    (["--max-queue-delay-us", "-1"], "--max-queue-delay-us -1: a whole number from 0 to 9223372036854775807"),
    (["--max-queue-delay-us", "18446744073709551616"], "--max-queue-delay-us 18446744073709551616: a whole number "
                                                        "from 0 to 9223372036854775807"),
    (["--name", ""], "--name '': a Triton model name here is 1 to 200"),
    (["--kind", "tpu"], "Invalid value for '--kind'"),
    (["--frobnicate"], "No such option '--frobnicate'"),
])
def test_bad_options_exit_2_and_write_nothing(real_bundles, tmp_path, capsys, args, message):
    code, err = export_cli(capsys, str(real_bundles["gpu_letterbox"]), str(tmp_path / "repo"), *args)
    assert code == 2 and message in err, err
    assert not (tmp_path / "repo").exists()


def test_a_bundle_that_fails_verification_is_refused(real_bundles, tmp_path, capsys):
    bundle = tmp_path / "bundle"
    shutil.copytree(real_bundles["gpu_letterbox"], bundle)
    onnx_file = next(bundle.rglob("*.onnx"))
    onnx_file.write_bytes(onnx_file.read_bytes()[:-1] + b"\0")
    code, err = export_cli(capsys, str(bundle), str(tmp_path / "repo"))
    assert code == 2 and "bundle verification failed" in err, err
    assert f"'{onnx_file.relative_to(bundle).as_posix()}' does not match its sha256" in err
    assert not (tmp_path / "repo").exists()


def test_the_export_without_tritonclient_names_the_extra(real_bundles, tmp_path):
    code = ("import sys; sys.modules['tritonclient'] = None\n"
            "from deepjit_compiler.cli import main\n"
            f"sys.exit(main(['export', 'triton', {str(real_bundles['gpu_letterbox'])!r}, {str(tmp_path / 'r')!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "install deepjit[triton]" in proc.stderr, proc.stderr
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------- a pulled bundle is untrusted
HOSTILE = ('det\n"""\nimport os; os.system("touch pwned")\n"""\n'
           'parameters { key: "EXECUTION_ENV_PATH" value { string_value: "/tmp/evil.tar.gz" } }\n#')


def resealed(source: Path, folder: Path, edit) -> Path:
    """A copy of the bundle with `edit(manifest)` applied and sealed again, as a hostile publisher can."""
    shutil.copytree(source, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    manifest["digest"] = manifest_digest({k: v for k, v in manifest.items() if k != "digest"})
    (folder / "manifest.json").write_bytes(manifest_bytes(manifest))
    return folder


@pytest.fixture
def letterbox(real_bundles):
    """The GPU-letterbox bundle (view), its layout, and a stand-in for the view whose name is HOSTILE: to
    test the export's own checks, whatever read_bundle refuses first."""
    view = read_bundle(real_bundles["gpu_letterbox"])
    return SimpleNamespace(view=view, layout=Layout.from_bundle(view),
                           hostile=SimpleNamespace(name=HOSTILE, digest=view.digest, source=view.source))


def test_bundle_strings_reach_model_py_and_config_only_as_literals(letterbox):
    layout, bundle = letterbox.layout, letterbox.hostile
    bundle.name += "\x1b]0;x\x07\u202e"
    module = ast.parse(model_py(bundle))
    assert [type(node).__name__ for node in module.body] == ["Expr", "ImportFrom", "Assign", "ClassDef"]
    assert ast.literal_eval(module.body[2].value) == bundle.name
    text = config_text(model_config(layout, TritonOptions(name="det", max_batch=2)), bundle)
    assert text.isascii() and [line.startswith("#") for line in text.splitlines()[:3]] == [True, True, False]
    assert "EXECUTION_ENV_PATH" not in text_format.Parse(text, model_config_pb2.ModelConfig()).parameters


def test_a_bundle_name_that_is_no_name_is_refused_even_with_name(letterbox):
    layout, bundle = letterbox.layout, letterbox.hostile
    with pytest.raises(ServeError, match=re.escape("manifest.json field 'name' is 'det\\n\"\"\"\\nimport os")) as e:
        checked_options(layout, bundle, TritonOptions(name="det"))
    assert "is 1 to 200 letters, digits, '_', '.' and '-'" in str(e.value) and "\n" not in str(e.value)


def _output(layout, **changes):
    return dataclasses.replace(layout, outputs=(layout.outputs[0], dataclasses.replace(layout.outputs[1], **changes),
                                                *layout.outputs[2:]))


def _input(layout, **changes):
    return dataclasses.replace(layout, inputs=(dataclasses.replace(layout.inputs[0], **changes),))


@pytest.mark.parametrize("change, message", [
    (lambda c: _output(c, name="boxes\nparameters {"),
     "manifest plan.outputs[1] ('boxes\\nparameters {'): tensor name 'boxes\\nparameters {' is not printable text"),
    (lambda c: _output(c, name=7), "manifest plan.outputs[1] ('7'): tensor name 7 is not printable text"),
    (lambda c: _output(c, dtype="complex999"), "manifest plan.outputs[1] ('boxes') dtype is complex999: Triton's "
                                               "Python backend passes numpy arrays of"),
    (lambda c: _output(c, shape=("batch", 10**20, 4)),
     "manifest plan.outputs[1] ('boxes') shape[1] is 100000000000000000000: Triton's config.pbtxt holds"),
    (lambda c: _input(c, max=(10**12, 1024, 1024, 3)),
     "manifest inputs.raw_images.max[0] (the profile's max batch) is 1000000000000: Triton's config.pbtxt holds a "
     "whole number from 0 to 2147483647 there; pass a smaller --max-batch"),
    (lambda c: _input(c, min=(1, 32, 32, 3 * 10**19), max=(2, 1024, 1024, 3 * 10**19)),
     "manifest plan.inputs[0] ('raw_images') profile min[3] is 30000000000000000000"),
    (lambda c: _output(c, shape=()), "manifest plan.outputs[1] ('boxes') has no batch dimension"),
    (lambda c: _input(c, max=(2, 1024, 3)), "manifest plan.inputs[0] ('raw_images'): its profile min [1, 32, 32, 3] "
                                            "and max [2, 1024, 3] do not have the 4 dims of its shape"),
])
def test_what_config_pbtxt_cannot_hold_is_refused(letterbox, change, message):
    layout = change(letterbox.layout)
    with pytest.raises(ServeError, match=re.escape(message)):
        model_config(layout, checked_options(layout, letterbox.view, TritonOptions(name="det")))


@pytest.mark.parametrize("options, message", [
    (TritonOptions(name="det", kind="tpu"), "--kind 'tpu': one of gpu, cpu"),
    (TritonOptions(name="det", max_batch=True), "--max-batch is True: Triton's config.pbtxt holds a whole number"),
])
def test_options_the_cli_cannot_pass_are_refused_too(letterbox, options, message):
    with pytest.raises(ServeError, match=re.escape(message)):
        checked_options(letterbox.layout, letterbox.view, options)


def test_a_profile_min_batch_above_1_is_refused(letterbox):
    layout = _input(letterbox.layout, min=(2, 32, 32, 3))
    with pytest.raises(ServeError, match=re.escape("its profile's min batch is 2; Triton sends batches from 1")):
        checked_options(layout, letterbox.view, TritonOptions(name="det"))


def test_a_huge_profile_max_batch_exports_with_a_smaller_max_batch(letterbox):
    layout = _input(letterbox.layout, max=(10**12, 1024, 1024, 3))
    options = checked_options(layout, letterbox.view, TritonOptions(name="det", max_batch=2))
    assert model_config(layout, options).max_batch_size == 2


@pytest.mark.parametrize("edit, says", [
    (lambda m: m.update(name=HOSTILE), ["manifest.json", "'name'", "import os"]),
    (lambda m: m["plan"]["outputs"][1].update(shape=["batch", 10**20, 4]),
     ["plan.outputs[1]", "100000000000000000000"]),
    (lambda m: m["inputs"]["raw_images"].update(max=[10**12, 1024, 1024, 3]),
     ["inputs.raw_images.max[0]", "1000000000000"]),
])
def test_a_hostile_manifest_exits_2_on_one_line_and_writes_nothing(real_bundles, tmp_path, capsys, edit, says):
    bundle = resealed(real_bundles["gpu_letterbox"], tmp_path / "b", edit)
    code, err = export_cli(capsys, str(bundle), str(tmp_path / "repo"), "--name", "det", "--kind", "cpu")
    assert code == 2 and all(s in err for s in says) and len(err.splitlines()) == 1, err
    assert not (tmp_path / "repo").exists()


def test_a_tensor_name_of_protobuf_syntax_stays_a_name(real_bundles, tmp_path):
    name = 'boxes" } parameters { key: "EXECUTION_ENV_PATH" value { string_value: "/tmp/evil" } } output { name: "x'
    bundle = resealed(real_bundles["gpu_letterbox"], tmp_path / "b",
                      lambda m: m["plan"]["outputs"][1].update(name=name))
    c = parsed(export_triton(bundle, tmp_path / "repo", TritonOptions(name="det", kind="cpu")).model_dir)
    assert [t.name for t in c.output][1] == name and len(c.output) == 5 and not c.parameters


def test_json_export_errors_are_one_json_document(real_bundles, tmp_path, capsys):
    capsys.readouterr()
    code = main(["export", "triton", str(real_bundles["gpu_letterbox"]), str(tmp_path / "repo"), "--max-batch", "3",
                 "--json"])
    out, err = capsys.readouterr()
    assert code == 2 and json.loads(out)["error"] == {
        "type": "ServeError", "exit_code": 2, "message": "--max-batch 3: this bundle takes batches 1..2 (its profile)"}
    assert "--max-batch 3" in err and not (tmp_path / "repo").exists()
