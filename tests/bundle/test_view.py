"""BundleView: a bundle's manifest parsed once into typed steps, kernels and engine record; malformed
manifests are BundleErrors naming the field; a staged bundle is readable before it is committed."""
from __future__ import annotations

import copy
import shutil

import pytest

from deepjit_compiler.bundle.folder import StagedBundle, read_bundle
from deepjit_compiler.bundle.view import BundleView
from deepjit_compiler.engines import rtx_sms
from deepjit_compiler.errors import BundleError


def test_the_t4_bundle_typed(t4_build):
    view = read_bundle(t4_build.bundle.path)
    assert read_bundle(view) is view                      # a view is read once
    assert [s.kind for s in view.steps] == ["segment", "kernel", "added"]
    (images,) = view.inputs
    assert (images.name, images.min, images.max, images.buckets) == ("images", (1, 3, 640, 640), (8, 3, 640, 640),
                                                                     (1, 2, 4, 8))
    decode = view.step("decode").kernels[0]
    assert (decode.contract, decode.sm, decode.params["mode"]) == ("yolov8_decode", 75, "candidates")
    assert view.engine.segments == {"segment": ("engines/segment.onnx",)}
    if rtx_sms():  # the build made a TensorRT-RTX plan for 7.5 (test_contents.py checks its record)
        (plan,) = view.engine.plans["segment"]
        assert not view.engine.deferred and (plan.file, plan.flavour) == ("engines/segment.rtx.plan", "tensorrt-rtx")
        assert plan.runs_on(75) is True and plan.runs_on(90) is False
    else:
        assert view.engine.deferred and view.engine.plans == {}
    assert view.levels["graph"]["status"] == "passed" and view.precision == "fp16"
    compiled = view.compiled(decode)
    assert compiled.cubin[:4] == b"\x7fELF" and compiled.symbol("decode").startswith("_Z")
    assert view.contract(decode).model.roles.twin == {"mode": "output0", "lanes_per_anchor": 1, "large_batch_lanes": 0}
    assert [d.count for d in view.detections] == ["num_dets"]
    assert view.spec().name == t4_build.spec.spec.name == view.name


def _read_typed(view: BundleView) -> None:
    """Every typed field of the view (each is parsed, and its part of the manifest checked, on first use)."""
    view.inputs, view.outputs, view.steps, view.engine, view.name, view.target_sm, view.levels  # noqa: B018


def _steps_with_kernels(m: dict) -> list[dict]:
    return [s for s in m["plan"]["steps"] if s.get("kernels")]


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("plan"), "'plan' is missing"),
    (lambda m: m["inputs"].pop("images"), r"input 'images' has symbolic dims \['\w+', 3, 640, 640\] but no "
     "inputs.<name>.min/max profile"),
    (lambda m: m["engine"].update(plans=["engines/segment.rtx.plan"]), "'engine.plans': Input should be a valid dict"),
    (lambda m: m["engine"].update(plans={"segment": [{"flavour": "tensorrt-rtx"}]}),
     r"'engine.plans.segment\[0\].file' is missing"),
    (lambda m: m["plan"]["steps"][1].update(kind="gadget"),
     r"'plan.steps\[1\].kind': Input should be 'segment', 'kernel' or 'added', got 'gadget'"),
    (lambda m: m["plan"]["steps"][2].pop("reference"), r"'plan.steps\[nms\].reference' is missing"),
    (lambda m: m["plan"]["steps"][1]["kernels"][0].update(arch="75"), "manifest arch '75' is not sm_XX"),
    (lambda m: m["plan"]["steps"][1]["kernels"][0].update(arch="sm_7x"), "manifest arch 'sm_7x' is not sm_XX"),
    (lambda m: m["plan"]["steps"][1].update(kernels=[]), r"step 'decode' \(kernel\) has no compiled kernels"),
    (lambda m: m["plan"].update(inputs=[{"name": "images"}]), r"'plan.inputs\[0\].dtype' is missing"),
    # what a resealed manifest of a pulled bundle could hold, each of which once crashed (exit 3)
    (lambda m: m["inputs"]["images"].update(buckets=["a"]), r"'inputs.images.buckets\[0\]': .*integer, got 'a'"),
    (lambda m: m["inputs"].update(images="x"), "'inputs.images': Input should be a valid dictionary, got 'x'"),
    (lambda m: m["inputs"]["images"].update(min=[0]), r"'inputs.images.min\[0\]': .*greater than or equal to 1"),
    (lambda m: m["inputs"]["images"].update(min=[1]), r"'inputs.images': min \[1\].* do not fit its shape"),
    (lambda m: m["inputs"]["images"].update(max=["8", 3, 640, 640]), r"'inputs.images.max\[0\]': .*integer"),
    (lambda m: m["inputs"]["images"].update(max=[10**12, 3, 640, 640]), r"'inputs.images.max\[0\]': .*2147483647"),
    (lambda m: m["inputs"]["images"].update(opt=[9, 3, 640, 640]), "min <= opt <= max"),
    (lambda m: m["inputs"]["images"].update(opt=[4, 3, 640]), r"opt \[4, 3, 640\].* each needs its rank"),
    (lambda m: m["inputs"].update(images={"buckets": [1, 2]}), r"'inputs.images': min \['\w+', 3, 640, 640\]"),
    (lambda m: m["inputs"]["images"].update(min=[1, 3, 640, 600], opt=[4, 3, 640, 600], max=[8, 3, 640, 600]),
     "that keep its static dims"),
    (lambda m: m["plan"]["inputs"][0].update(shape=5), r"'plan.inputs\[0\].shape': Input should be a valid list"),
    (lambda m: m["plan"]["inputs"][0].update(dtype="nope"), r"'plan.inputs\[0\].dtype': Input should be 'bfloat16'"),
    (lambda m: m["plan"]["outputs"][0].update(dtype="object"), r"'plan.outputs\[0\].dtype'"),
    (lambda m: m["plan"].update(steps={"a": 1}), "'plan.steps': Input should be a valid list"),
    (lambda m: m["plan"]["steps"].__setitem__(0, "x"), r"'plan.steps\[0\]': Input should be a valid dictionary"),
    (lambda m: _steps_with_kernels(m)[0]["kernels"][0].update(params=[1]),
     r"'plan.steps\[1\].kernels\[0\].params': Input should be a valid dictionary"),
    (lambda m: m["plan"]["steps"][0].update(file="engines/segment.bin"), r"'plan.steps\[0\].file': should be a "
     "bundle path ending in .onnx"),
    (lambda m: m["plan"]["steps"][0].update(file="engines/segment.onnx.data"), r"'plan.steps\[0\].file': should be a "
     "bundle path ending in .onnx"),
    (lambda m: m["target"].update(sm=5), "'target.sm': Input should be greater than or equal to 10"),
    (lambda m: m.update(engine=[1]), "'engine': Input should be a valid dictionary"),
    (lambda m: m["engine"].update(settings=[1]), "'engine.settings': Input should be a valid dictionary"),
    (lambda m: m["engine"].update(deferred="no"), "'engine.deferred': Input should be a valid boolean"),
    (lambda m: m.update(target="T4"), "'target': Input should be a valid dictionary, got 'T4'"),
    (lambda m: m.update(validation="x"), "'validation': Input should be a valid dictionary"),
    (lambda m: m["validation"]["levels"]["graph"].update(status="great"), "'validation.levels.graph.status'"),
    (lambda m: m.update(name=5), "'name': Input should be a valid string"),
    (lambda m: m.update(name="../up"), r"'name': should be a plain name \(1 to 200 letters"),
])
def test_malformed_manifests_name_the_field(t4_build, edit, message):
    manifest = copy.deepcopy(read_bundle(t4_build.bundle.path).manifest)
    edit(manifest)
    with pytest.raises(BundleError, match=message):
        _read_typed(BundleView(t4_build.bundle.path, manifest))


@pytest.mark.parametrize("name", ["x/../../../../tmp/written_by_bundle", "../up", ".hidden", "-opt", "a b", "a\\b",
                                  "", "x" * 201, "a+b"])
def test_step_names_are_plain_names(t4_build, name):
    """A step's name becomes part of a report's file name (`deepjit validate` writes kernels.<steps>.runresults.json)."""
    manifest = copy.deepcopy(read_bundle(t4_build.bundle.path).manifest)
    manifest["plan"]["steps"][1]["name"] = name
    with pytest.raises(BundleError, match=r"'plan.steps\[1\].name': should be a plain name \(1 to 200 letters, digits"):
        BundleView(t4_build.bundle.path, manifest).steps  # noqa: B018


def test_batch_buckets_are_sorted_kept_within_the_profile_and_end_at_its_max(t4_build):
    manifest = copy.deepcopy(read_bundle(t4_build.bundle.path).manifest)
    manifest["inputs"]["images"]["buckets"] = [4, 2, 99, 2, 1]
    (images,) = BundleView(t4_build.bundle.path, manifest).inputs
    assert (images.min[0], images.max[0], images.buckets) == (1, 8, (1, 2, 4, 8))


def test_an_older_engine_record_reads_as_this_one(t4_build):
    """A plan may be one record or a bare file name (known then by its flavour only); no engine record
    at all is ONNX Runtime in fp32."""
    manifest = copy.deepcopy(read_bundle(t4_build.bundle.path).manifest)
    record = {"file": "engines/segment.rtx.plan", "flavour": "tensorrt-rtx", "compute_capabilities": ["7.5"]}
    for plans, on_75, on_86 in (({"segment": record}, True, False),
                                ({"segment": "engines/segment.rtx.plan"}, None, None)):
        manifest["engine"]["plans"] = plans
        (plan,) = BundleView(t4_build.bundle.path, manifest).engine.plans["segment"]
        assert (plan.file, plan.flavour, plan.runs_on(75), plan.runs_on(86)) == (
            "engines/segment.rtx.plan", "tensorrt-rtx", on_75, on_86)
    del manifest["engine"]
    view = BundleView(t4_build.bundle.path, manifest)
    assert (view.engine.backend, view.precision, view.engine.plans) == ("onnxruntime", "fp32", {})


def test_the_outputs_and_the_reference_model_are_what_the_bundle_holds(t4_build):
    manifest = copy.deepcopy(read_bundle(t4_build.bundle.path).manifest)
    view = BundleView(t4_build.bundle.path, manifest)
    assert [t.name for t in view.outputs] == [t["name"] for t in manifest["plan"]["outputs"]]
    assert [t.name for t in view.outputs] != [t.name for t in view.inputs]
    raw = {s["name"]: s for s in manifest["plan"]["steps"]}
    assert view.step("nms").facts == raw["nms"]["params"] and view.step("nms").facts["max_det"] == 300
    assert view.step("decode").facts == raw["decode"]["facts"] and view.step("decode").facts["num_classes"] == 80
    manifest["model"]["file"] = "reference/model.onnx"  # named, but not one of the bundle's files
    view = BundleView(t4_build.bundle.path, manifest)
    assert view.reference_model is None
    with pytest.raises(BundleError, match="the bundle carries no reference model"):
        view.model_file()


def test_a_kernel_file_that_is_not_utf8_is_a_bundle_error(t4_build, tmp_path):
    root = shutil.copytree(t4_build.bundle.path, tmp_path / "b")
    view = BundleView(root, read_bundle(t4_build.bundle.path).manifest)
    kernel = view.step("nms").kernels[0]
    (root / kernel.files["ptx"]).write_bytes(b"\xff\xfe not text")
    with pytest.raises(BundleError, match=f"'{kernel.files['ptx']}' is not UTF-8 text"):
        view.compiled(kernel)


def test_a_staged_bundle_reads_before_its_manifest_is_written(tmp_path):
    with StagedBundle(tmp_path / "b", {"a.txt": b"hello"}) as staged:
        view = staged.view({"name": "b"})
        assert view.file("a.txt").read_bytes() == b"hello" and view.digest == ""
        assert not (tmp_path / "b").exists() and not (view.root / "manifest.json").exists()
        info = staged.commit(tmp_path / "b", {"name": "b"})
    assert read_bundle(tmp_path / "b").digest == info.digest and (tmp_path / "b.tar.gz").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "b.tar.gz"]   # the staging folder is gone


def test_a_contract_the_bundle_carries_no_copy_of_loads_only_from_the_bundle_or_by_built_in_name(
        t4_build, tmp_path, monkeypatch):
    manifest = copy.deepcopy(read_bundle(t4_build.bundle.path).manifest)
    kernel = manifest["plan"]["steps"][1]["kernels"][0]
    bundled = kernel["files"].pop("contract")  # as in a bundle that carries no copy
    outside = tmp_path / "outside"  # a contract on this machine, outside the bundle
    shutil.copytree(t4_build.bundle.path / bundled.rsplit("/", 1)[0], outside)
    monkeypatch.chdir(tmp_path)
    for ref in (str(outside / "yolov8_decode.yaml"), "outside/yolov8_decode.yaml"):
        kernel["contract"] = ref
        view = BundleView(t4_build.bundle.path, manifest)
        with pytest.raises(BundleError, match=f"'{ref}' is a path, not one of the bundle's files"):
            view.contract(view.step("decode").kernels[0])
    for ref in (bundled, "yolov8_decode"):  # a bundle file by its path; a built-in by its name
        kernel["contract"] = ref
        view = BundleView(t4_build.bundle.path, manifest)
        assert view.contract(view.step("decode").kernels[0]).name == "yolov8_decode"
    kernel["files"]["contract"] = "kernels/decode/contract/gone.yaml"  # a copy it lists but does not hold
    view = BundleView(t4_build.bundle.path, manifest)
    assert view.contract(view.step("decode").kernels[0]).name == "yolov8_decode"
