"""What the CLI prints (report.py): `deepjit inspect BUNDLE` on the built T4 example."""
from __future__ import annotations

import json

from conftest import run_cli, table_text

from deepjit_compiler.bundle.archive import pack_to
from deepjit_compiler.bundle.folder import read_bundle
from deepjit_compiler.engines.flavours import TENSORRT_RTX
from deepjit_compiler.report import _entries, _rule, describe, inspect_target, print_build

# With TensorRT-RTX here (the README's install) the T4 build makes its plan; without it, the plan is deferred.
RTX = TENSORRT_RTX.importable()


def test_describe_reads_the_steps_their_kernels_and_the_validation_figures(t4_build):
    view = read_bundle(t4_build.bundle.path)
    d = describe(t4_build.bundle.path)
    assert d["name"] == "yolov8s_t4" and d["digest"] == view.digest and d["target"] == {"gpu": "T4", "sm": 75}
    assert d["toolchain"]["deepjit"] == "0.1.0" and d["toolchain"]["nvrtc"] == "13.0"
    assert [(s["name"], s["kind"]) for s in d["steps"]] == [("segment", "segment"), ("decode", "kernel"),
                                                           ("nms", "added")]
    segment, decode, nms = d["steps"]
    assert segment["engine"] == {"backend": "tensorrt-rtx" if RTX else "tensorrt", "precision": "fp16",
                                 "deferred": not RTX, "files": ["engines/segment.onnx"],
                                 "plans": ["engines/segment.rtx.plan"] if RTX else []}
    if RTX:  # the plan's own record: flavour, compute capability, I/O
        plan = d["engine"]["segments"]["segment"]["plans"][0]
        assert plan["flavour"] == "tensorrt-rtx" and plan["compute_capabilities"] == ["7.5"]
        assert plan["size"] == view.files["engines/segment.rtx.plan"]["size"] > 0
    assert [k["contract"] for k in decode["kernels"]] == ["yolov8_decode"] and nms["position"] == "after"
    k = decode["kernels"][0]
    assert (k["arch"], k["ptx_arch"]) == ("sm_75", "compute_75") and k["params"]["num_classes"] == 80
    assert k["cubin_size"] == view.files[k["files"]["cubin"]]["size"] > 0
    assert list(d["validation"]) == ["graph", "precision", "kernels", "end_to_end", "engine"]
    assert d["validation"]["precision"]["outputs"]["output0"]["max_abs"] > 0
    assert {f["path"]: f["size"] for f in d["files"]} == {rel: e["size"] for rel, e in view.files.items()}
    assert json.loads(json.dumps(d)) == d


def test_inspect_bundle_prints_tables_and_json(t4_build):
    r = run_cli("inspect", str(t4_build.bundle.path))
    assert r.returncode == 0, r.stderr
    text = r.stdout
    for title in ("steps, in run order", "kernels", "validation", "files ("):
        assert title in text
    assert "sm_75 cubin (" in text and "compute_75 PTX (" in text and ("tensorrt-rtx fp16: plan engines/segment.rtx.plan" if RTX else "tensorrt fp16: plan deferred") in text
    assert "num_classes=80" in text and "output0: max abs" in text and "engines/segment.onnx" in text
    assert "gate: abs <= 0.05 or rel <= 0.05, on the mean" in table_text(text)  # the rule, from the record
    assert "{'" not in text  # no Python dicts
    # each step's number, name and kind, whatever the width its tensors' names take
    lines = text.splitlines()
    assert [line.split(":")[0] for line in lines if line[:1].isdigit()] == [
        "1. segment (segment)", "2. decode (kernel)", "3. nms (added, after)"]
    assert lines[lines.index(next(line for line in lines if line.startswith("3. nms"))) + 1].split() == [
        "in", "output0", "float32", "['batch',", "84,", "8400]"]
    r = run_cli("inspect", str(t4_build.bundle.path), "--json")
    assert json.loads(r.stdout) == describe(t4_build.bundle.path)


def test_the_build_table_shows_tensors_the_engine_and_each_outputs_gate(t4_build, capsys):
    print_build(t4_build)
    out = capsys.readouterr().out
    lines = out.splitlines()
    # tensor names whole (a pipe is not cut at 80 columns), with dtype (the fp16 engine hands the decode
    # fp16 head maps) and shape
    assert any("/model.22/cv2.0/cv2.0.2/Conv_output_0 float16 ['batch', 64, 80, 80]" in line for line in lines)
    assert [line.split(":")[0] for line in lines if line[:1].isdigit()] == [
        "1. segment (segment)", "2. decode (kernel)", "3. nms (added, after)"]
    if RTX:
        assert "tensorrt-rtx fp16" in out and "plan segment: tensorrt-rtx" in out
    else:
        assert "tensorrt fp16, plan deferred" in out and "(ONNX Runtime here)" in out
    precision = next(line for line in lines if "output0: max abs" in line)
    assert "gate: abs <= 0.05 or rel <= 0.05, on the mean" in precision  # the lossy defaults
    assert "min_map 0.9, min_map50 0.95, min_precision 0.9, min_recall 0.9" in table_text(out)


def test_a_kernel_with_a_from_batch_kernel_lists_each_under_its_entry():
    assert _entries({"nms": "deepjit_nms<300, false>"}) == "deepjit_nms<300, false>"
    assert _entries({"decode": "deepjit_yolov8_decode_candidates<__half, 4>",
                     "decode (batch 4+)": "deepjit_yolov8_decode_candidates<__half, 2>"}) == \
        "decode: deepjit_yolov8_decode_candidates<__half, 4>\ndecode (batch 4+): deepjit_yolov8_decode_candidates<__half, 2>"


def test_store_and_manifest_strings_print_as_text_not_markup():
    """A store or a pulled bundle names things: `[/x]` must not crash the table, `[red]` must not restyle it."""
    from deepjit_compiler.report import format_store
    from deepjit_compiler.store.refs import Entry

    text = format_store("file://st", [Entry("v1", "sha256:" + "a" * 64, "[/x]evil[red]name", 1234, {"graph": "passed"})])
    assert "[/x]evil[red]name" in text and "graph passed" in text


def test_suggest_cuts_on_a_bundle_is_refused_naming_what_it_reads(t4_build):
    """The option was ignored: the bundle printed, exit 0, and no cuts suggested."""
    bundle = t4_build.bundle.path
    r = run_cli("inspect", str(bundle), "--suggest-cuts", "--json")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    message = (f"{bundle}: --suggest-cuts finds cuts in an ONNX model, and this is a bundle: give the model "
               "it was built from")
    assert f"error: {message}" in r.stderr and json.loads(r.stdout)["error"]["message"] == message


def test_inspect_reads_a_bundle_archive_as_the_bundle(t4_build, tmp_path):
    archive = tmp_path / "b.tar.gz"
    pack_to(t4_build.bundle.path, archive)
    assert inspect_target(archive).data == describe(t4_build.bundle.path) | {"path": str(archive)}


def test_a_gate_rule_names_atol_and_rtol_each_in_its_place():
    rule = {"atol": 0.001, "rtol": 0.25, "check_error_stat": "max"}
    assert _rule(rule) == "gate: abs <= 0.001 or rel <= 0.25, on the max"
