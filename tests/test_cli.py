"""The command line, through a subprocess, as a user runs it."""
import json

import onnx
from conftest import run_cli


def test_help_everywhere():
    for args in ([], ["build"], ["schema"], ["model", "synth"], ["inspect"], ["push"], ["pull"], ["ls"]):
        r = run_cli(*args, "--help")
        assert r.returncode == 0, (args, r.stderr)
        assert "Usage:" in r.stdout


def test_schema_is_json_schema():
    r = run_cli("schema")
    assert r.returncode == 0, r.stderr
    schema = json.loads(r.stdout)
    assert schema["title"] == "DeepJIT pipeline spec" and "cuts" in schema["properties"]


def test_bad_spec_exits_2_with_location(write_spec):
    path = write_spec({"  precision: fp16": "  precison: fp16"})
    r = run_cli("build", str(path))
    assert r.returncode == 2
    assert f"{path}:" in r.stderr and "did you mean 'precision'" in r.stderr
    assert "Traceback" not in r.stderr


def test_json_is_one_document_on_every_exit_code(write_spec, monkeypatch, capsys):
    path = write_spec({"  precision: fp16": "  precison: fp16"})
    r = run_cli("build", str(path), "--json")
    assert r.returncode == 2
    error = json.loads(r.stdout)["error"]
    assert error["exit_code"] == 2 and error["type"] == "SpecError" and "did you mean 'precision'" in error["message"]
    assert "did you mean 'precision'" in r.stderr  # and the message on stderr, as without --json
    r = run_cli("inspect", "no-such-bundle", "--json")  # refused by the command line itself
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["type"] == "UsageError"

    from deepjit_compiler import cli

    def broken(*args, **kwargs):
        print("a library's log line")  # what Polygraphy and GraphSurgeon do
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli, "build_pipeline", broken)
    assert cli.main(["build", str(path), "--json"]) == 3
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["exit_code"] == 3 and "ZeroDivisionError" in out
    assert "a library's log line" in err and "Traceback" in err


def test_verbosity_options_work_after_the_subcommand(write_spec):
    path = write_spec({"path: ../models/yolov8s.onnx": "path: m.onnx", "synthesize: yolov8s": "synthesize: yolov8n"})
    r = run_cli("build", str(path), "--dry-run", "-q")
    assert r.returncode == 0, r.stderr
    assert "[INFO]" not in r.stderr and "decode" in r.stdout
    r = run_cli("build", "-v", str(path), "--dry-run")
    assert r.returncode == 0 and "[DEBUG]" in r.stderr


def test_every_json_flag_says_what_it_prints():
    for args in (["build"], ["inspect"], ["run"], ["bench"], ["validate"], ["push"], ["ls"]):
        text = " ".join(run_cli(*args, "--help").stdout.split())  # help wraps lines
        assert "--json Print" in text and "as one JSON document on stdout" in text, args


def test_model_synth_refuses_to_overwrite(tmp_path):
    out = tmp_path / "m.onnx"
    out.write_bytes(b"my model")
    r = run_cli("model", "synth", "yolov8n", "-o", str(out))
    assert r.returncode == 2 and f"{out}: exists" in r.stderr and "--force" in r.stderr
    assert out.read_bytes() == b"my model"
    r = run_cli("model", "synth", "yolov8n", "-o", str(out), "--force")
    assert r.returncode == 0, r.stderr
    assert onnx.load(str(out)).graph.output[0].name == "output0"


def test_missing_model_without_synthesize_exits_2(write_spec):
    path = write_spec({"  synthesize: yolov8s": "  # no synthesize"})
    r = run_cli("build", str(path))
    assert r.returncode == 2
    assert "model.path" in r.stderr and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_unreadable_model_exits_2(write_spec, tmp_path):
    (tmp_path / "broken.onnx").write_bytes(b"this is not a protobuf \xff\xfe")
    path = write_spec({"path: ../models/yolov8s.onnx": "path: broken.onnx"})
    r = run_cli("build", str(path))
    assert r.returncode == 2 and "broken.onnx" in r.stderr and "Traceback" not in r.stderr


def test_model_synth_and_inspect(tmp_path):
    out = tmp_path / "m.onnx"
    r = run_cli("model", "synth", "yolov8n", "-o", str(out), "--seed", "3", "--head-layout", "split")
    assert r.returncode == 0, r.stderr
    model = onnx.load(str(out))
    assert [o.name for o in model.graph.output] == ["output0"]
    assert any(n.op_type == "Split" and n.name.startswith("/model.22") for n in model.graph.node)
    r = run_cli("inspect", str(out), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["opset"] == 17
    assert info["inputs"][0]["name"] == "images" and info["inputs"][0]["shape"] == ["batch", 3, 640, 640]
    assert info["outputs"][0]["shape"] == ["batch", 84, 8400]
    assert info["parameter_count"] == sum(onnx.numpy_helper.to_array(t).size for t in model.graph.initializer)
    assert info["ops"]["MaxPool"] == 3
    r = run_cli("inspect", str(out))
    assert r.returncode == 0 and "op histogram" in r.stdout


def test_spec_input_must_match_model(write_spec, tmp_path):
    from deepjit_compiler.model.synth import write_synthetic

    write_synthetic("yolov8n", tmp_path / "m.onnx")  # in this process: `model synth` has its own test
    path = write_spec({"path: ../models/yolov8s.onnx": "path: m.onnx", "  images:": "  image:"})
    r = run_cli("build", str(path), "--dry-run")
    assert r.returncode == 2 and "inputs.image: the model has no input 'image' (did you mean 'images'?)" in r.stderr
    assert "Traceback" not in r.stderr


def test_folder_that_is_neither_model_nor_bundle_exits_2(tmp_path):
    r = run_cli("inspect", str(tmp_path))
    assert r.returncode == 2 and str(tmp_path) in r.stderr and "Traceback" not in r.stderr


def test_internal_error_exits_3_with_traceback(monkeypatch, capsys):
    from deepjit_compiler import cli

    def broken():
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli, "json_schema", broken)
    assert cli.main(["schema"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err and "internal error" in err


def test_validate_needs_a_bundle_folder_and_a_gpu(t4_build, tmp_path):
    from deepjit_compiler.bundle.archive import pack_to

    archive = tmp_path / "b.tar.gz"
    pack_to(t4_build.bundle.path, archive)
    r = run_cli("validate", str(archive))
    assert r.returncode == 2 and "records its results in a bundle folder" in r.stderr
    from conftest import HAS_GPU

    if not HAS_GPU:
        r = run_cli("validate", str(t4_build.bundle.path))
        assert r.returncode == 2 and "need an NVIDIA GPU" in r.stderr and "Traceback" not in r.stderr
