"""`deepjit build` end to end on the CPU: surgery, graph + precision levels, kernels, bundle, gate, publish."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import DECODE_MODE, FUSED, NMS_LAST_PARAM, PIPELINES, REPO, YOLOV8N_T4, letterbox_variant, run_cli

from deepjit_compiler import build
from deepjit_compiler.build import build_pipeline
from deepjit_compiler.bundle.archive import pack
from deepjit_compiler.bundle.folder import read_bundle
from deepjit_compiler.engines import rtx_sms
from deepjit_compiler.errors import StoreError
from deepjit_compiler.jit.geometry import check_launch
from deepjit_compiler.runtime import run as runbundle
from deepjit_compiler.runtime.layout import Layout

N = YOLOV8N_T4  # tests/validation/test_gate_gpu.py builds the same variant


def _spec(write_spec, model=False, **extra):
    """The yolov8n variant of the T4 spec with `extra` edits; model=True places its synthetic model too
    (conftest.synthetic_model: the dry runs below test other things than synthesizing it)."""
    return write_spec({**N, **extra}, model=model)


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow  # a full build
def test_build_writes_validated_reproducible_bundle(t4_build, write_spec, tmp_path, monkeypatch):
    result = t4_build  # the first build, in its own folder (conftest.py)
    first = Path(result.spec.path).parent
    bundle = read_bundle(first / "out/yolov8n_t4")
    m = bundle.manifest
    levels = m["validation"]["levels"]
    assert levels["graph"]["status"] == "passed" and levels["precision"]["status"] == "passed"
    assert all(o["detail"] == "bit-identical" for o in levels["graph"]["outputs"].values())
    assert levels["precision"]["outputs"]["output0"]["max_abs"] > 0  # fp16 costs something, and it is measured
    assert levels["kernels"]["status"] == levels["end_to_end"]["status"] == levels["engine"]["status"] == "not_run"
    assert "no GPU" in levels["kernels"]["reason"]
    assert m["target"] == {"gpu": "T4", "sm": 75}
    assert [s["kind"] for s in m["plan"]["steps"]] == ["segment", "kernel", "added"]
    for step in m["plan"]["steps"][1:]:
        for k in step["kernels"]:
            assert k["arch"] == "sm_75" and k["ptx_arch"] == "compute_75"
            assert bundle.file(k["files"]["cubin"]).read_bytes()[:4] == b"\x7fELF"
            assert ".target sm_75" in bundle.file(k["files"]["ptx"]).read_text()
    assert "/tmp/" not in json.dumps(m) and str(first) not in json.dumps(m)
    digest = result.bundle.digest
    assert bundle.digest == digest and result.published.digest == digest
    # What a build leaves on disk: the folder (no archive: the store holds that), the store blob and
    # a report without RunResults (they are kept for failed comparisons only)
    assert sorted(p.name for p in (first / "out").iterdir()) == ["yolov8n_t4", "yolov8n_t4.report"]
    assert sorted(p.name for p in (first / "out/yolov8n_t4.report").iterdir()) == ["build-report.json"]
    blob = first / "store/blobs/sha256" / f"{digest.split(':')[1]}.tar.gz"
    assert blob.is_file() and "reference/model.onnx" not in bundle.files
    # The same spec built again in another folder, asking for the archive and every RunResults: the
    # same bytes, kernels from the compile cache.
    again = build_pipeline(_spec(write_spec, **{"path: out/yolov8n_t4": "path: out/yolov8n_t4\n  archive: true"}),
                           publish=False)
    assert again.bundle.digest != digest  # the spec differs, and the bundle carries it
    assert (tmp_path / "out/yolov8n_t4.tar.gz").read_bytes() == pack(tmp_path / "out/yolov8n_t4")
    monkeypatch.setenv("DEEPJIT_KEEP_RUN_RESULTS", "1")
    again = build_pipeline(_spec(write_spec), publish=False)
    assert again.bundle.digest == digest
    assert tree(tmp_path / "out/yolov8n_t4") == tree(first / "out/yolov8n_t4")
    assert not (tmp_path / "out/yolov8n_t4.tar.gz").exists()  # the archive of the first build here went stale
    assert all(k.from_cache for ks in again.kernels.values() for k in ks)  # the second build hits the cache
    # A TensorRT-RTX plan (where the library is installed) comes from the plan cache, as the kernels do: its
    # builds are not byte-identical (engines/plans.py), its inputs are.
    plans = again.to_dict()["engine"]["plans"]
    assert len(plans) == (1 if rtx_sms() else 0) and all(p["from_cache"] for p in plans)
    from polygraphy.comparator import RunResults

    runs = RunResults.load(str(tmp_path / "out/yolov8n_t4.report/precision.runresults.json"))
    assert [name for name, _ in runs] == ["fp32", "fp16"] and len(runs["fp16"]) == 2  # 2 samples


@pytest.mark.slow  # a full build
def test_gate_failure_exits_1_and_writes_only_rejected(write_spec, tmp_path):
    strict = ("  gate: true", "  precision_tolerances:\n    default: {atol: 0.0, rtol: 0.0}\n"
              "    detections: {min_iou: 1.0, score_atol: 0.0}\n  gate: true")
    keep = ("  precision: fp16", "  precision: fp16\n  keep_fp32: [Softmax]")  # the DFL softmax is in the cut
    spec = _spec(write_spec, **{strict[0]: strict[1], keep[0]: keep[1]})
    r = run_cli("build", str(spec), "--json")
    assert r.returncode == 1, r.stderr
    assert "accuracy gate failed" in r.stderr and "precision: output0: max abs" in r.stderr
    # --json: stdout is one JSON document, the rejected build with its error; Polygraphy's lines went to stderr
    doc = json.loads(r.stdout)
    assert doc["error"]["exit_code"] == 1 and doc["error"]["type"] == "GateFailed" and doc["gate_failed"]
    assert doc["validation"]["levels"]["precision"]["status"] == "failed"
    assert doc["rejected"] == str(tmp_path / "out/rejected/yolov8n_t4")
    assert "[E]" in r.stderr and "[E]" not in r.stdout
    # the log names steps plainly, the final paths only, and what a keep_fp32 entry did not find
    assert "segment 'segment'" in r.stderr and "segment segment" not in r.stderr and ".tmp-" not in r.stderr
    assert "keep_fp32[0]: no engine segment has a Softmax node" in r.stderr  # it is inside the decode cut
    # piped, long steps count in lines (a terminal gets a bar)
    assert "precision level: 1 of 2 samples (50%)" in r.stderr and "precision level: 2 of 2 samples" in r.stderr
    assert not (tmp_path / "out/yolov8n_t4").exists() and not (tmp_path / "out/yolov8n_t4.tar.gz").exists()
    rejected = read_bundle(tmp_path / "out/rejected/yolov8n_t4")
    assert rejected.manifest["validation"]["levels"]["precision"]["status"] == "failed"
    assert (tmp_path / "out/rejected/yolov8n_t4.report/build-report.json").exists()
    assert (tmp_path / "out/rejected/yolov8n_t4.report/precision.runresults.json").exists()
    assert json.loads((tmp_path / "out/rejected/yolov8n_t4.report/build-report.json").read_text())["gate_failed"]
    assert not (tmp_path / "store").exists()  # nothing published


def test_dry_run_writes_nothing(write_spec, tmp_path):
    """Not the synthetic model either: a build writes it (the README says so)."""
    r = run_cli("build", str(_spec(write_spec)), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]
    assert f"a build writes it to {tmp_path / 'models/yolov8n.onnx'}" in r.stdout
    assert "decode" in r.stdout and "yolov8_decode" in r.stdout


@pytest.mark.parametrize("sm", [99, 130])
def test_a_target_nvrtc_cannot_compile_for_is_exit_2_before_any_work(write_spec, tmp_path, sm):
    """sm: 99 (no such GPU) got past the spec and the dry run and failed at the kernels stage, after the
    model, surgery and precision work; now it is named at once, with what the installed NVRTC targets."""
    r = run_cli("build", str(_spec(write_spec, **{"gpu: T4": f"sm: {sm}"})), "--dry-run")
    assert r.returncode == 2, r.stderr
    assert f"spec.yaml: target: NVRTC 13.0 cannot target sm_{sm}; supported: sm_75, sm_80, " in r.stderr
    assert "sm_90, sm_100" in r.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


@pytest.mark.slow  # a full build
def test_publish_refused_by_policy(write_spec, tmp_path):
    spec = _spec(write_spec, **{"require: [graph, precision]": "require: [graph, precision, kernels]"})
    with pytest.raises(StoreError, match="kernels"):
        build_pipeline(spec)
    assert read_bundle(tmp_path / "out/yolov8n_t4").digest  # the bundle is fine, only the push is refused


@pytest.mark.slow  # a full build (the shared one)
def test_an_fp16_bundle_carries_the_head_maps_in_fp16_from_the_engine_to_the_decode(t4_build):
    """The example is fp16: the segment's outputs at the decode boundary, the decode's inputs, its dtype
    param, its cubin's symbol and the plan TensorRT-RTX built (where installed) are all fp16; the
    pipeline's own inputs and outputs, and what the decode hands the nms, keep their dtypes."""
    bundle = read_bundle(Path(t4_build.spec.path).parent / "out/yolov8n_t4")
    segment, decode, nms = bundle.steps
    assert [t.dtype for t in segment.outputs] == [t.dtype for t in decode.inputs] == ["float16"] * 6
    assert [t.dtype for t in segment.inputs] == ["float32"] and [t.dtype for t in nms.inputs] == ["float32"]
    assert [t.dtype for t in bundle.outputs] == ["int32", "float32", "float32", "int32"]
    (kernel,) = decode.kernels
    assert kernel.params["dtype"] == "float16" and "__half" in bundle.compiled(kernel).symbol("decode")
    segment_onnx = bundle.onnx(bundle.engine.segments["segment"][0])
    assert {o.type.tensor_type.elem_type for o in segment_onnx.graph.output} == {onnx.TensorProto.FLOAT16}
    for plan in bundle.engine.plans.get("segment", ()):
        assert {o["dtype"] for o in plan.outputs} == {"float16"} and [i["dtype"] for i in plan.inputs] == ["float32"]


@pytest.mark.parametrize("precision, head_dtype", [("fp32", "float32"), ("fp16", "float16")])
def test_dry_run_plan_hands_the_decode_the_engines_dtype(write_spec, precision, head_dtype):
    spec = _spec(write_spec, model=True, **{"precision: fp16": f"precision: {precision}"})
    r = run_cli("build", str(spec), "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    segment, decode, nms = json.loads(r.stdout)["plan"]
    assert {t["dtype"] for t in segment["outputs"]} == {t["dtype"] for t in decode["inputs"]} == {head_dtype}
    assert decode["facts"].get("input_dtype", "float32") == head_dtype
    assert {t["dtype"] for t in nms["inputs"]} == {"float32"}


@pytest.mark.parametrize("layout,dynamic", [("split", False), ("separate", True)])
def test_dry_run_json_plan_both_layouts(write_spec, layout, dynamic):
    extra = {"head_layout: separate": f"head_layout: {layout}", "dynamic: false": f"dynamic: {str(dynamic).lower()}"}
    if dynamic:
        extra.update({"shape: [batch, 3, 640, 640]": "shape: [batch, 3, height, width]",
                      "max: [8, 3, 640, 640]": "max: [8, 3, 1280, 1280]", "min: [1, 3, 640, 640]": "min: [1, 3, 320, 320]"})
    r = run_cli("build", str(_spec(write_spec, model=True, **extra)), "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["plan"]
    decode = next(s for s in plan if s["name"] == "decode")
    assert decode["facts"]["head_layout"] == layout and decode["facts"]["num_classes"] == 80
    assert [t["name"] for t in plan[-1]["outputs"]] == ["num_dets", "boxes", "scores", "classes"]


DECODE_CONF = "conf_threshold: 0.25        # same as NMS's"


def test_a_decode_threshold_above_the_nms_one_is_refused_and_one_below_is_a_warning(write_spec, tmp_path):
    """Found through the contracts' roles.score_threshold (the decode's candidates feed the nms)."""
    r = run_cli("build", str(_spec(write_spec, model=True, **{DECODE_CONF: "conf_threshold: 0.3 #"})), "--dry-run")
    assert r.returncode == 2, r.stderr
    assert ("cut 'decode' kernels[0] (yolov8_decode)'s conf_threshold 0.3 and cut 'nms' kernels[0] (nms)'s "
            "conf_threshold 0.25") in r.stderr and "(0.25, 0.3] that cut 'nms'" in r.stderr and "lost" in r.stderr
    spec = _spec(write_spec, model=True, **{DECODE_CONF: "conf_threshold: 0.2 #"})
    r = run_cli("build", str(spec), "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    (warning,) = [n for n in json.loads(r.stdout)["notes"] if n.startswith("warning:")]
    assert "the candidates cut 'decode' kernels[0] (yolov8_decode) keeps in (0.2, 0.25] are dropped" in warning
    assert warning in r.stderr


@pytest.mark.parametrize("edits, message", [
    ({DECODE_MODE: FUSED[DECODE_MODE]},
     "cut 'nms' kernels[0] (nms) writes 'num_dets', which cut 'decode' kernels[0] (yolov8_decode) writes already"),
    ({NMS_LAST_PARAM: FUSED[NMS_LAST_PARAM]},
     "cut 'nms' kernels[0] (nms) has fused: true, so the kernel before it must do its work, but cut 'decode' "
     "kernels[0] (yolov8_decode) does not write boxes, classes, num_dets, scores"),
    ({**FUSED, DECODE_MODE: "mode: nms\n          iou_threshold: 0.5  #"},
     "cut 'nms' kernels[0] (nms)'s iou_threshold is 0.45 and cut 'decode' kernels[0] (yolov8_decode)'s is 0.5")])
def test_a_half_fused_decode_and_nms_is_refused_before_any_work(write_spec, edits, message):
    """yolov8_decode mode nms does the nms stage's work; the stage must then say fused: true, with the
    same thresholds, max_det and agnostic (the contracts' roles.done_before), and not otherwise."""
    r = run_cli("build", str(_spec(write_spec, model=True, **edits)), "--dry-run")
    assert r.returncode == 2, r.stderr
    assert message in r.stderr, r.stderr


def test_a_fused_decode_and_nms_keep_the_nms_stage_and_its_outputs(write_spec):
    """Fully fused, the spec passes its checks and the plan still ends in the nms stage, whose outputs
    (what its reference and the gate compare) are the pipeline's."""
    r = run_cli("build", str(_spec(write_spec, model=True, **FUSED)), "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["plan"]
    assert [s["name"] for s in plan][-2:] == ["decode", "nms"]
    assert [t["name"] for t in plan[-1]["outputs"]] == ["num_dets", "boxes", "scores", "classes"]


@pytest.mark.slow  # a full build
def test_build_publishes_to_an_oci_registry(write_spec, tmp_path, registry_server):
    url = f"oci://{registry_server.host}/deepjit/yolov8n"
    result = build_pipeline(_spec(write_spec, **{"store: file://store": f"store: {url}"}))
    from deepjit_compiler import store

    entries = store.ls(url)
    assert [(e.tag, e.digest) for e in entries] == [("yolov8s-t4", result.bundle.digest)]
    pulled = store.pull(f"{url}:yolov8s-t4", tmp_path / "pulled")
    assert read_bundle(pulled).digest == result.bundle.digest


def copy_contract(folder: Path, builtin: str, name: str) -> str:
    """A user's copy of a built-in contract under another name (its template is found in DeepJIT's)."""
    text = (REPO / "kernels" / f"{builtin}.yaml").read_text()
    assert f"\nname: {builtin}\n" in text
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.yaml").write_text(text.replace(f"\nname: {builtin}\n", f"\nname: {name}\n"))
    return f"{folder.name}/{name}.yaml"


@pytest.mark.slow  # a full build
def test_users_copies_of_the_builtin_kernels_get_the_same_treatment(t4_build, write_spec, tmp_path):
    """DeepJIT knows its kernels only through their contracts' declared roles, so copies under other
    names (nms: its reference and its detection outputs; decode: which cut input each of its inputs is,
    and its twin) build, gate and run exactly like the built-in ones."""
    nms = copy_contract(tmp_path / "my_kernels", "nms", "my_nms")
    decode = copy_contract(tmp_path / "my_kernels", "yolov8_decode", "my_decode")
    spec = _spec(write_spec, **{"      - contract: yolov8_decode ": f"      - contract: {decode} ",
                                "      - contract: nms\n": f"      - contract: {nms}\n"})
    ours, theirs = read_bundle(t4_build.bundle.path), read_bundle(build_pipeline(spec, publish=False).bundle.path)
    # the build: the same plan, the copy of nms added with the NMS reference, the same binaries
    assert [(s.name, s.kind) for s in theirs.steps] == [(s.name, s.kind) for s in ours.steps]
    assert [k.contract for s in theirs.steps for k in s.kernels] == ["my_decode", "my_nms"]
    assert theirs.file("references/nms.onnx").read_bytes() == ours.file("references/nms.onnx").read_bytes()
    for step in ("decode", "nms"):
        mine, builtin = theirs.step(step).kernels[0], ours.step(step).kernels[0]
        assert theirs.file(mine.files["cubin"]).read_bytes() == ours.file(builtin.files["cubin"]).read_bytes()
    # the gate: the copy's outputs are detections, compared as sets, with the same figures
    assert "detections" in theirs.levels["precision"]["outputs"]
    assert theirs.levels["precision"] == ours.levels["precision"]
    # the runtime: the copy of the decode reads the cut's head maps, the copy of nms makes detections
    layout, builtin_layout = Layout.from_bundle(theirs), Layout.from_bundle(ours)
    assert [(s.reads, s.writes) for s in layout.steps] == [(s.reads, s.writes) for s in builtin_layout.steps]
    assert layout.detections == builtin_layout.detections and len(layout.detections) == 1
    outputs = {"num_dets": np.array([1], np.int32), "boxes": np.array([[[1.0, 2.0, 3.0, 4.0]]], np.float32),
               "scores": np.array([[0.5]], np.float32), "classes": np.array([[7]], np.int32)}
    record = runbundle.result_of(outputs, 0, runbundle.Sample("x.npy", {}), layout)
    assert record["detections"] == [{"class": 7, "score": 0.5, "box": [1.0, 2.0, 3.0, 4.0]}]


def test_a_report_folder_with_the_users_files_is_never_replaced(write_spec, tmp_path):
    spec = _spec(write_spec)
    report = tmp_path / "out/yolov8n_t4.report"
    report.mkdir(parents=True)
    (report / "my-notes.txt").write_text("mine")
    r = run_cli("build", str(spec), "--no-publish")
    assert r.returncode == 2 and "holds files DeepJIT did not write (my-notes.txt)" in r.stderr
    assert (report / "my-notes.txt").read_text() == "mine" and not (tmp_path / "out/yolov8n_t4").exists()


def test_a_build_that_fails_leaves_the_previous_report(t4_build, write_spec, tmp_path):
    """The report is replaced at the end of a build, like the bundle: a build stopped on bad input
    (exit 2) leaves the last one as it was."""
    first = Path(t4_build.spec.path).parent
    report = first / "out/yolov8n_t4.report"
    before = {p.name: p.read_bytes() for p in report.iterdir()}
    spec = first / "broken.yaml"
    assert "anchors_per_thread: 4" in t4_build.spec.text
    spec.write_text(t4_build.spec.text.replace("anchors_per_thread: 4", "anchors_per_thread: 3"))  # fails at kernels
    r = run_cli("build", str(spec), "--no-publish")
    assert r.returncode == 2 and "param 'anchors_per_thread' must be one of" in r.stderr
    assert {p.name: p.read_bytes() for p in report.iterdir()} == before


def test_an_output_path_that_cannot_be_written_exits_2(write_spec, tmp_path):
    (tmp_path / "out").write_text("a file where the output folder should be")
    r = run_cli("build", str(_spec(write_spec)), "--no-publish")
    assert r.returncode == 2 and "cannot write" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow  # four builds
def test_concurrent_builds_of_one_spec_all_succeed_with_the_same_bundle(write_spec, tmp_path):
    spec = _spec(write_spec)
    procs = [subprocess.Popen([sys.executable, "-m", "deepjit_compiler.cli", "-q", "build", str(spec), "--no-publish",
                               "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-2000:] for _, err in results]
    digests = {json.loads(out)["bundle"]["digest"] for out, _ in results}
    assert len(digests) == 1 and read_bundle(tmp_path / "out/yolov8n_t4").digest in digests
    assert not [p.name for p in (tmp_path / "out").iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_a_users_file_at_the_archive_path_is_refused_before_any_work(write_spec, tmp_path):
    (tmp_path / "out").mkdir()
    theirs = tmp_path / "out/yolov8n_t4.tar.gz"
    theirs.write_bytes(b"a user's own tarball")
    r = run_cli("build", str(_spec(write_spec, **{"path: out/yolov8n_t4": "path: out/yolov8n_t4\n  archive: true"})))
    assert r.returncode == 2, r.stderr
    assert f"{theirs}: exists and is not a DeepJIT bundle archive; refusing to replace it" in r.stderr
    assert theirs.read_bytes() == b"a user's own tarball"
    assert not (tmp_path / "out/yolov8n_t4").exists() and "graph level" not in r.stderr  # refused before the work


def edited_contract(folder: Path, builtin: str, name: str, old: str, new: str) -> str:
    """A user's copy of a built-in contract with one line of it changed."""
    ref = copy_contract(folder, builtin, name)
    path = folder.parent / ref
    text = path.read_text()
    assert old in text, f"test bug: {old!r} is not in kernels/{builtin}.yaml"
    path.write_text(text.replace(old, new))
    return ref


NMS_REF, DECODE_REF = "      - contract: nms\n", "      - contract: yolov8_decode "
MAX_4 = {"max: [8, 3, 640, 640]": "max: [4, 3, 640, 640]", "buckets: [1, 2, 4, 8]             #": "buckets: [1, 2, 4]  #"}
BLOCK_ALLOWED = "allows x and y from 1 to 1024, z from 1 to 64, at most 1024 threads in all"
GRID_ALLOWED = "allows x from 1 to 2147483647, y and z from 1 to 65535"


@pytest.mark.parametrize("builtin, old, new, message", [
    ("nms", "block: [block]", "block: [block, 4]",
     f"entry point 'nms' at batch 1: block is [512, 4, 1] (2048 threads); the target sm_75 (T4) {BLOCK_ALLOWED}"),
    ("nms", "block: [block]", "block: [8, 1, 128]",
     f"entry point 'nms' at batch 1: block is [8, 1, 128] (z is 128); the target sm_75 (T4) {BLOCK_ALLOWED}"),
    ("nms", 'grid: ["B * cluster"]', 'grid: ["B * cluster - 1"]',
     f"entry point 'nms' at batch 1: grid is [0, 1, 1] (x is 0); the target sm_75 (T4) {GRID_ALLOWED}"),
    ("yolov8_decode", '"ceil_div(A * lanes_per_anchor, anchors_per_thread * block)", B]',
     '"ceil_div(A * lanes_per_anchor, anchors_per_thread * block)", "B * 8192"]',
     f"entry point 'decode' at batch 8: grid is [17, 65536, 1] (y is 65536); the target sm_75 (T4) {GRID_ALLOWED}"),
    ("nms", 'shared_mem: "chunk * (chunk // 8 + 28)"', "shared_mem: 100000",
     "entry point 'nms' at batch 1: shared_mem is 100000 bytes; the target sm_75 (T4) allows 0 to 65536 bytes of "
     "dynamic shared memory a block (its static shared memory counts against that too)"),
])
def test_a_users_launch_past_cudas_limits_is_refused_before_any_work(write_spec, tmp_path, builtin, old, new, message):
    """A contract's grid, block and shared_mem are checked at every batch the bundle runs (its buckets, the
    profile's min and max) against the target's limits, so `build --dry-run` on a CPU box says what the
    driver would only say on the GPU; the message names the spec, the cut, the contract's path and the rest."""
    ref = edited_contract(tmp_path / "my_kernels", builtin, "mine", old, new)
    spec = _spec(write_spec, model=True, **({NMS_REF: f"      - contract: {ref}\n"} if builtin == "nms" else
                                {DECODE_REF: f"      - contract: {ref} "}))
    r = run_cli("build", str(spec), "--dry-run")
    assert r.returncode == 2, r.stderr
    step = "nms" if builtin == "nms" else "decode"
    assert f"{spec}: cut '{step}' kernels[0] (my_kernels/mine.yaml): {message}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_grid_past_its_limit_only_at_the_max_batch_is_refused_only_with_that_batch(write_spec, tmp_path):
    """grid y is B * 8192: 65536 at batch 8 is one past the limit, 32768 at batch 4 is fine."""
    ref = edited_contract(tmp_path / "my_kernels", "yolov8_decode", "mine", ", B]\n", ', "B * 8192"]\n')
    to_mine = {DECODE_REF: f"      - contract: {ref} "}
    r = run_cli("build", str(_spec(write_spec, model=True, **to_mine)), "--dry-run")
    assert r.returncode == 2 and "at batch 8: grid is [17, 65536, 1] (y is 65536)" in r.stderr, r.stderr
    r = run_cli("build", str(_spec(write_spec, model=True, **to_mine, **MAX_4)), "--dry-run")
    assert r.returncode == 0, r.stderr


def test_shared_memory_past_the_t4s_limit_is_fine_for_an_h200(write_spec, tmp_path):
    """100,000 bytes of dynamic shared memory a block: past a T4's 64 KiB (sm_75), within an H200's 227 KiB."""
    ref = edited_contract(tmp_path / "my_kernels", "nms", "mine", 'shared_mem: "chunk * (chunk // 8 + 28)"',
                          "shared_mem: 100000")
    to_mine = {NMS_REF: f"      - contract: {ref}\n"}
    r = run_cli("build", str(_spec(write_spec, model=True, **to_mine)), "--dry-run")
    assert r.returncode == 2 and "shared_mem is 100000 bytes; the target sm_75 (T4) allows 0 to 65536" in r.stderr
    r = run_cli("build", str(_spec(write_spec, model=True, **to_mine, **{"gpu: T4 ": "gpu: H200 "})), "--dry-run")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("pipeline", [*sorted(p.stem for p in PIPELINES.glob("*.yaml")), "yolov8_t4 + letterbox"])
def test_the_builtin_kernels_of_every_shipped_pipeline_launch_within_their_targets_limits(pipeline, write_spec,
                                                                                           monkeypatch):
    """Each kernel is checked at each batch of the spec (none left to the runtime), and passes."""
    checked = []
    monkeypatch.setattr(build, "check_launch", lambda launch, sm, where, batch, target:
                        checked.append((where.rsplit(": ", 1)[-1], launch.entry, batch))
                        or check_launch(launch, sm, where, batch=batch, target=target))
    path = PIPELINES / f"{pipeline}.yaml" if "+" not in pipeline else write_spec(letterbox_variant())
    result = build_pipeline(path, dry_run=True)
    spec = result.spec.spec
    batches = sorted({b for i in spec.inputs.values() for b in (*i.batch_buckets, i.min_shape[0], i.max_shape[0])})
    kernels = [(f"cut '{c.name}' kernels[{j}] ({k.contract})", k.contract) for c in spec.cuts
               for j, k in enumerate(c.kernels)]
    entries = {"yolov8_decode": "decode", "nms": "nms", "letterbox": "letterbox"}
    assert sorted(checked) == sorted((label, entries[ref], b) for label, ref in kernels for b in batches)
    assert not [n for n in result.notes if "launch geometry" in n]


def test_a_kernel_whose_inputs_only_the_engine_sizes_is_left_to_the_runtime(write_spec):
    """A model with a dynamic input size: the head maps' sizes are dims no input names, so the decode and
    the nms are checked when the bundle loads (runtime/launch.py), and the dry run says so."""
    r = run_cli("build", str(_spec(write_spec, model=True, **{
        "dynamic: false": "dynamic: true", "shape: [batch, 3, 640, 640]": "shape: [batch, 3, height, width]",
        "max: [8, 3, 640, 640]": "max: [8, 3, 1280, 1280]", "min: [1, 3, 640, 640]": "min: [1, 3, 320, 320]"})),
        "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    notes = [n for n in json.loads(r.stdout)["notes"] if "launch geometry" in n]
    assert notes == [f"cut '{s}' kernels[0] ({s if s == 'nms' else 'yolov8_decode'}): launch geometry checked when "
                     "the bundle loads (its input shapes come from the engine)" for s in ("decode", "nms")]


@pytest.mark.parametrize("builtin, old, new, message", [
    ("nms", 'grid: ["B * cluster"]', 'grid: ["Q"]',
     "entry_points[0].grid: 'Q' is neither a param nor a bound dim; allowed: an int expression"),
    ("nms", 'shared_mem: "chunk * (chunk // 8 + 28)"', 'shared_mem: "foo"',
     "entry_points[0].shared_mem: 'foo' is neither a param nor a bound dim; allowed: an int expression"),
    ("yolov8_decode", '"ceil_div(A * lanes_per_anchor, anchors_per_thread * block)", B]', '"mode", B]',
     "entry_points[0].grid: 'mode' gives 'candidates', not a number; allowed: an int expression"),
])
def test_a_launch_size_that_is_not_a_number_is_exit_2_naming_the_field(write_spec, tmp_path, builtin, old, new,
                                                                       message):
    """A bare name that is neither a param nor a dim, or a str param, in grid, block or shared_mem: the
    launch check evaluates them at dry run, where int() of the name was a ValueError (exit 3)."""
    ref = edited_contract(tmp_path / "my_kernels", builtin, "mine", old, new)
    spec = _spec(write_spec, model=True, **({NMS_REF: f"      - contract: {ref}\n"} if builtin == "nms" else
                                {DECODE_REF: f"      - contract: {ref} "}))
    r = run_cli("build", str(spec), "--dry-run")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert f"{spec}: at batch 1: {tmp_path / 'my_kernels/mine.yaml'}: {message}" in r.stderr, r.stderr


@pytest.mark.parametrize("old, new, message", [
    ("{name: K, type: i32}", "{name: KK, type: i32}",
     "entry_points[0].args[5]: no tensor, dim or param named 'KK' (did you mean 'K'?)"),
    ('value: "pow2ceil(K) if pow2ceil(K) > sort_capacity else 0"', 'value: "K // 0"',
     "entry_points[0].args[7].value: cannot evaluate 'K // 0': ZeroDivisionError"),
    ('workspace: "B * pow2ceil(K) * 12 if pow2ceil(K) > sort_capacity else 0"', 'workspace: "B // 0"',
     "workspace: cannot evaluate 'B // 0': ZeroDivisionError"),
])
def test_an_arg_or_workspace_that_does_not_evaluate_is_exit_2_before_any_work(write_spec, tmp_path, old, new, message):
    """Only a launch on the GPU evaluated them: the build (and its dry run) passed, and the bundle failed
    when it loaded."""
    ref = edited_contract(tmp_path / "my_kernels", "nms", "mine", old, new)
    spec = _spec(write_spec, model=True, **{NMS_REF: f"      - contract: {ref}\n"})
    r = run_cli("build", str(spec), "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{spec}: at batch 1: {tmp_path / 'my_kernels/mine.yaml'}: {message}" in r.stderr, r.stderr


def test_a_launch_is_checked_at_the_largest_frame_the_profile_allows(write_spec, tmp_path):
    """grid y of H * 61: 65,880 at the profile's max 1080 rows is past the limit, 1,952 at its min 32 is
    not; the build checks the size a bucket is prepared at (the max), so it is refused."""
    ref = edited_contract(tmp_path / "my_kernels", "letterbox", "mine", 'grid: ["ceil_div(size, 32)", "ceil_div(size, 8)", B]',
                          'grid: ["ceil_div(size, 32)", "H * 61", B]')
    variant = letterbox_variant()
    variant["cuts:\n"] = variant["cuts:\n"].replace("contract: letterbox", f"contract: {ref}")
    r = run_cli("build", str(_spec(write_spec, model=True, **variant)), "--dry-run")
    assert r.returncode == 2, r.stderr
    assert "cut 'letterbox' kernels[0] (my_kernels/mine.yaml): entry point 'letterbox' at batch 1: grid is " \
           "[20, 65880, 1] (y is 65880)" in r.stderr, r.stderr


def test_an_undescribed_input_of_a_stage_added_before_the_model_is_exit_2(write_spec):
    """A letterbox spec whose `inputs` describes only the model's images: raw_images has symbolic dims no
    profile sizes (the build's validation data refused it later; the launch check raised ValueError)."""
    variant = letterbox_variant()
    del variant["inputs:\n  images:"]
    variant["ranges: {images: [0.0, 1.0]}"] = "ranges: {images: [0.0, 1.0]}"
    spec = _spec(write_spec, model=True, **variant)
    r = run_cli("build", str(spec), "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{spec}: inputs.raw_images: the pipeline takes 'raw_images' ['batch', 'height', 'width', 3] (stage " \
           "'letterbox' added before the model reads it) and `inputs` does not describe it" in r.stderr, r.stderr


@pytest.mark.parametrize("old, new, message", [
    ("dtype: uint8", "dtype: float32", "inputs.raw_images.dtype: 'raw_images' (what stage 'letterbox', added before "
                                       "the model, reads) is uint8, the spec says float32"),
    (", 3]", ", 4]", "inputs.raw_images: dim 3 is fixed to 3 in 'raw_images' (what stage 'letterbox', added before "
                     "the model, reads), the spec's shape/profile allows 4"),
    (", 3]", "]", "inputs.raw_images.shape: 'raw_images' (what stage 'letterbox', added before the model, reads) has "
                  "rank 4 ['batch', 'height', 'width', 3]"),
])
def test_a_stage_input_described_unlike_what_the_stage_reads_is_exit_2(write_spec, old, new, message):
    """raw_images described as float32 frames was accepted (the letterbox kernel reads uint8 bytes), and a
    wrong channel count was named only by the launch check, in the kernel's words."""
    variant = letterbox_variant()
    variant["inputs:\n  images:"] = variant["inputs:\n  images:"].replace(old, new)
    spec = _spec(write_spec, model=True, **variant)
    r = run_cli("build", str(spec), "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{spec}: {message}" in r.stderr, r.stderr


def test_an_input_neither_the_pipeline_nor_its_model_takes_is_exit_2(write_spec):
    """With a stage added before the model, `inputs` describes both the pipeline's input and the model's
    input it replaces; any other name (a misspelling) was silently ignored."""
    variant = letterbox_variant()
    variant["inputs:\n  images:"] = variant["inputs:\n  images:"].replace(
        "  images:", "  raw_image:\n    shape: [1, 480, 640, 3]\n    dtype: uint8\n  images:")
    spec = _spec(write_spec, model=True, **variant)
    r = run_cli("build", str(spec), "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{spec}: inputs.raw_image: neither the pipeline nor its model takes 'raw_image' (did you mean " \
           "'raw_images'?); allowed: raw_images, images" in r.stderr, r.stderr
