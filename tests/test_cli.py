"""The command line, through a subprocess, as a user runs it."""
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from conftest import PIPELINES, run_cli

from deepjit_compiler.cli import main


def test_help_everywhere():
    for args in ([], ["build"], ["schema"], ["model", "synth"], ["inspect"], ["push"], ["pull"], ["ls"]):
        r = run_cli(*args, "--help")
        assert r.returncode == 0, (args, r.stderr)
        assert "Usage:" in r.stdout
    for command in ("run", "bench", "validate"):  # a plan, or exit 2 with why not
        r = run_cli(command, "--help")
        assert r.returncode == 0 and "--engine [auto|plan|onnxruntime]" in r.stdout, r.stdout


def test_the_command_line_imports_no_stage_until_a_command_runs():
    """`deepjit --help` took ~1.5 s when the CLI imported every stage (onnx, GraphSurgeon, ONNX Runtime, oras)
    up front; each command now imports what it drives."""
    heavy = ("numpy", "onnx", "onnx_graphsurgeon", "onnxruntime", "polygraphy", "pydantic", "oras", "jinja2",
             "deepjit_compiler.build", "deepjit_compiler.store", "deepjit_compiler.runtime")
    code = f"import sys, deepjit_compiler.cli; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout


def test_tensorrt_rtx_for_the_h200_is_refused_at_spec_check(write_spec):
    path = write_spec({"  backend: auto": "  backend: tensorrt-rtx"}, text=(PIPELINES / "yolov8_h200.yaml").read_text())
    r = run_cli("build", str(path), "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{path}:" in r.stderr and "engine: backend tensorrt-rtx" in r.stderr
    assert "compute capabilities 7.5, 8.0, 8.6, 8.9, 12.0, 12.1; the target H200 is sm_90 (9.0)" in r.stderr


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

    monkeypatch.setattr("deepjit_compiler.build.build_pipeline", broken)  # what `build` imports when it runs
    assert cli.main(["build", str(path), "--json"]) == 3
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["exit_code"] == 3 and "ZeroDivisionError" in out
    assert "a library's log line" in err and "Traceback" in err


def test_verbosity_options_work_after_the_subcommand(write_spec):
    path = write_spec({"path: ../models/yolov8s.onnx": "path: m.onnx", "synthesize: yolov8s": "synthesize: yolov8n"},
                      model=True)
    r = run_cli("build", str(path), "--dry-run", "-q")
    assert r.returncode == 0, r.stderr
    assert "[INFO]" not in r.stderr and "decode" in r.stdout
    r = run_cli("build", "-v", str(path), "--dry-run")
    assert r.returncode == 0 and "[DEBUG]" in r.stderr


def test_verbosity_options_work_between_a_group_and_its_command(tmp_path):
    """`deepjit model -q synth ...` was 'No such option: -q' (exit 2) while `deepjit -q model synth` worked."""
    for flag, shown, hidden in (("-q", None, "[INFO]"), ("-v", "[DEBUG]", None)):
        out = tmp_path / f"m{flag}.onnx"
        r = run_cli("model", flag, "synth", "yolov8n", "-o", str(out))
        assert r.returncode == 0 and out.is_file(), r.stderr
        assert (shown is None or shown in r.stderr) and (hidden is None or hidden not in r.stderr), r.stderr
    r = run_cli("export", "-q", "--help")
    assert r.returncode == 0 and "triton" in r.stdout


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


def test_model_synth_refuses_to_write_through_a_dangling_link(tmp_path, capsys):
    """A link to a file not there yet is something at OUTPUT too: writing through it would create its target."""
    link = tmp_path / "m.onnx"
    link.symlink_to(tmp_path / "elsewhere.onnx")
    capsys.readouterr()
    assert main(["model", "synth", "yolov8n", "-o", str(link)]) == 2
    assert f"{link}: exists; refusing to overwrite it" in capsys.readouterr().err
    assert link.is_symlink() and not (tmp_path / "elsewhere.onnx").exists()


@pytest.mark.parametrize("name, fmt", [("m.json", "json"), ("m.textproto", "textproto"), ("m.onnxtxt", "onnxtxt")])
def test_model_synth_refuses_a_name_onnx_reads_as_another_format(tmp_path, name, fmt):
    """It wrote binary ONNX there, which `inspect` and `build` then refused as unreadable."""
    r = run_cli("model", "synth", "yolov8n", "-o", str(tmp_path / name))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert (f"error: {tmp_path / name}: onnx reads a '{name[1:]}' file as its {fmt} format, and DeepJIT writes "
            "the binary one: name the file .onnx") in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


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
    assert r.returncode == 2 and f"{tmp_path}: no manifest.json; not a DeepJIT bundle" in r.stderr, r.stderr


def test_internal_error_exits_3_with_traceback(monkeypatch, capsys):
    from deepjit_compiler import cli

    def broken():
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr("deepjit_compiler.spec.load.json_schema", broken)
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


@pytest.fixture(scope="module")
def yolov8n(tmp_path_factory):
    from deepjit_compiler.model.synth import write_synthetic

    return write_synthetic("yolov8n", tmp_path_factory.mktemp("m") / "yolov8n.onnx")


def test_suggest_cuts_counts_the_network_layers_a_cut_removes(yolov8n):
    trt_rtx = pytest.importorskip("tensorrt_rtx", reason="needs a TensorRT parser: pip install deepjit[tensorrt-rtx]")
    r = run_cli("inspect", str(yolov8n), "--suggest-cuts", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    logger = trt_rtx.Logger(trt_rtx.Logger.ERROR)
    network = trt_rtx.Builder(logger).create_network(1 << int(trt_rtx.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    assert trt_rtx.OnnxParser(network, logger).parse(yolov8n.read_bytes())
    assert info["network_layers"] == {"parser": f"tensorrt_rtx {trt_rtx.__version__}", "model": network.num_layers}
    decode = info["suggested_cuts"][0]
    assert decode["preset"] == "yolov8_decode"
    layers = decode["network_layers"]
    assert layers["model"] == network.num_layers and 0 < layers["segments"] < layers["model"]
    assert layers["removed"] == layers["model"] - layers["segments"] > decode["nodes"]  # constants are layers too
    r = run_cli("inspect", str(yolov8n), "--suggest-cuts")
    assert r.returncode == 0, r.stderr
    assert f"network layers: {layers['model']} -> {layers['segments']} ({layers['removed']} fewer) with this cut" \
        in r.stdout


def test_suggest_cuts_without_a_tensorrt_parser_says_so(yolov8n):
    code = ("import sys; sys.modules['tensorrt'] = sys.modules['tensorrt_rtx'] = None\n"
            "from pathlib import Path\n"
            "from deepjit_compiler.report import inspect_target\n"
            f"info = inspect_target(Path({str(yolov8n)!r}), suggest_cuts=True)\n"
            "assert info.data['network_layers'] is None\n"
            "assert all('network_layers' not in s for s in info.data['suggested_cuts'])\n"
            "print(info.text)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "network layers: not counted (no TensorRT or TensorRT-RTX ONNX parser is importable here" in r.stdout


def test_inspect_bundle_shows_its_engine(t4_build):
    pytest.importorskip("tensorrt_rtx", reason="needs TensorRT-RTX: without it the T4 bundle has no plan")
    r = run_cli("inspect", str(t4_build.bundle.path), "--json")
    assert r.returncode == 0, r.stderr
    engine = json.loads(r.stdout)["engine"]
    (plan,) = engine["segments"]["segment"]["plans"]
    assert engine["backend"] == "tensorrt-rtx" and not engine["deferred"]
    assert (plan["flavour"], plan["compute_capabilities"], plan["inputs"][0]["name"]) == ("tensorrt-rtx", ["7.5"],
                                                                                        "images")
    assert plan["size"] > 1_000_000 and plan["network_layers"] > 100
    r = run_cli("inspect", str(t4_build.bundle.path))
    assert r.returncode == 0, r.stderr
    assert "engine: tensorrt-rtx, fp16:" in r.stdout
    assert f"plan engines/segment.rtx.plan: tensorrt-rtx (tensorrt_rtx {plan['version']}), compute capability 7.5, " \
           f"{plan['size'] / 1e6:.1f} MB, {plan['network_layers']} network layers" in r.stdout
    assert "input  images: float32 [-1, 3, 640, 640]" in r.stdout


def test_inspect_prints_a_manifests_control_characters_as_escapes(real_bundles, tmp_path, capsys):
    """A pulled bundle's strings must not retitle or clear the user's terminal."""
    import shutil

    from deepjit_compiler.bundle.manifest import manifest_bytes, manifest_digest
    from deepjit_compiler.cli import main

    bundle = tmp_path / "b"
    shutil.copytree(real_bundles["host_letterbox"], bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["toolchain"]["onnx"] = "1.0\x1b]0;pwned\x07\x1b[2J\x9b2J"
    manifest["digest"] = manifest_digest({k: v for k, v in manifest.items() if k != "digest"})
    (bundle / "manifest.json").write_bytes(manifest_bytes(manifest))
    capsys.readouterr()
    assert main(["inspect", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert "onnx 1.0\\x1b]0;pwned" in out and "\\x9b2J" in out
    assert not any(c in out for c in "\x1b\x07\x9b")


def test_error_messages_print_control_characters_as_escapes(monkeypatch, capsys):
    from deepjit_compiler import cli
    from deepjit_compiler.errors import BundleError

    def refused():
        raise BundleError("manifest: step 'a\x1b]0;pwned\x07' is\nrefused")

    monkeypatch.setattr("deepjit_compiler.spec.load.json_schema", refused)
    assert cli.main(["schema"]) == 2
    err = capsys.readouterr().err
    assert err == "error: manifest: step 'a\\x1b]0;pwned\\x07' is\nrefused\n"


def test_a_bad_log_level_is_exit_2_naming_the_variable(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    r = run_cli("ls", store, env={**os.environ, "DEEPJIT_LOG_LEVEL": "BOGUS"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "$DEEPJIT_LOG_LEVEL is 'BOGUS': one of DEBUG, INFO, WARNING, ERROR, CRITICAL" in r.stderr
    ok = run_cli("ls", store, env={**os.environ, "DEEPJIT_LOG_LEVEL": "debug"})  # any case; on to the store
    assert ok.returncode == 2 and "DEEPJIT_LOG_LEVEL" not in ok.stderr and "does not exist" in ok.stderr


def test_a_path_with_a_name_too_long_is_bad_input_not_a_bug(tmp_path, t4_build):
    """ENAMETOOLONG from a path the user gave is exit 2 naming it (it was exit 3 with a traceback)."""
    long = tmp_path / ("a" * 300)
    for args in (["ls", f"file://{long}", "--json"], ["pull", f"file://{long}:v1", str(tmp_path / "p")],
                 ["export", "triton", str(t4_build.bundle.path), str(long), "--json"]):
        r = run_cli(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
        assert f"error: {long}: a name in this path is longer than the file system allows" in r.stderr, r.stderr
        if "--json" in args:
            assert json.loads(r.stdout)["error"]["exit_code"] == 2


def test_an_output_under_a_file_names_that_file(tmp_path):
    """`model synth -o notes.txt/m.onnx` with notes.txt a file said only 'cannot write (File exists)'."""
    (tmp_path / "notes.txt").write_text("a user's")
    out = tmp_path / "notes.txt" / "sub" / "m.onnx"
    r = run_cli("model", "synth", "yolov8n", "-o", str(out))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"error: {out}: cannot write ({tmp_path / 'notes.txt'} is a file, not a folder); nothing was left " \
           "half-written" in r.stderr, r.stderr
    assert (tmp_path / "notes.txt").read_text() == "a user's"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a device every write to fails, ENOSPC)")
def test_a_full_disk_under_stdout_is_named_not_reported_as_a_bug():
    """`deepjit schema > /dev/full`: ENOSPC writing the result was exit 3, 'internal error ... a bug'."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "deepjit_compiler.cli", "schema"], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "a bug" not in r.stderr, r.stderr
    assert "error: writing the output: No space left on device; free some space (or quota) and run it again" \
        in r.stderr, r.stderr


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_or_quota_is_named_inside_a_command_or_printing_its_result(monkeypatch, capsys, code):
    """A quota runs out as a disk fills (EDQUOT): either, while a command writes a file or prints its
    result, was exit 3, 'internal error ... a bug'."""
    from deepjit_compiler import cli

    def full(*_):
        raise OSError(code, os.strerror(code), "/out/b.tar.gz")

    monkeypatch.setattr("deepjit_compiler.spec.load.json_schema", full)
    assert cli.main(["schema"]) == 2
    assert capsys.readouterr().err == (f"error: /out/b.tar.gz: {os.strerror(code)}; free some space (or quota) and "
                                       "run it again\n")
    monkeypatch.undo()
    monkeypatch.setattr(cli, "_emit_json", full)  # outside `working`: as stdout on a full disk
    assert cli.main(["schema"]) == 2
    assert capsys.readouterr().err == (f"error: /out/b.tar.gz: {os.strerror(code)}; free some space (or quota) and "
                                       "run it again\n")


@pytest.mark.parametrize("name, text", [("m.json", '{"irVersion": "x"}'), ("m.textproto", "garbage {"),
                                        ("m.onnxtxt", "garbage")])
def test_a_model_in_onnx_text_or_json_format_that_does_not_parse_exits_2(tmp_path, name, text):
    """onnx.load reads .json, .textproto and .onnxtxt as those formats; their parse errors were exit 3."""
    (tmp_path / name).write_text(text)
    r = run_cli("inspect", str(tmp_path / name))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"error: {tmp_path / name}: not a readable ONNX model (ParseError: " in r.stderr, r.stderr


@pytest.mark.parametrize("value", ["", " "])
def test_bench_with_an_empty_batch_list_is_exit_2(t4_build, value):
    """`--batch ""` (an unset shell variable, say) benched every bucket as if the option were not given."""
    r = run_cli("bench", str(t4_build.bundle.path), "--device", "cpu", "--iters", "1", "--warmup", "0",
                "--batch", value)
    assert r.returncode == 2 and f"Invalid value for --batch: {value!r}: give batch sizes like 1,8,32" in r.stderr, \
        r.stderr
    assert r.stdout == ""


def test_bench_with_a_batch_size_given_twice_is_exit_2(t4_build):
    """`--batch 1,1` benched batch 1 twice and printed two rows for it."""
    r = run_cli("bench", str(t4_build.bundle.path), "--device", "cpu", "--iters", "1", "--warmup", "0",
                "--batch", "1,2,1")
    assert r.returncode == 2 and "Invalid value for --batch: '1,2,1': a batch size is given twice; give each once, " \
                                 "like 1,8,32" in r.stderr, r.stderr
    assert r.stdout == ""
