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


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("plan"), "'.plan' is missing"),
    (lambda m: m["engine"].update(plans=["engines/segment.rtx.plan"]), "'engine.plans' is not a mapping"),
    (lambda m: m["engine"].update(plans={"segment": [{"flavour": "tensorrt-rtx"}]}),
     r"'engine.plans\[segment\].file' is missing"),
    (lambda m: m["plan"]["steps"][1].update(kind="gadget"), "step 'decode' has kind 'gadget'"),
    (lambda m: m["plan"]["steps"][2].pop("reference"), r"'plan.steps\[nms\].reference' is missing"),
    (lambda m: m["plan"]["steps"][1]["kernels"][0].update(arch="75"), "manifest arch '75' is not sm_XX"),
    (lambda m: m["plan"]["steps"][1].update(kernels=[]), r"step 'decode' \(kernel\) has no compiled kernels"),
    (lambda m: m["plan"].update(inputs=[{"name": "images"}]), "plan.inputs: malformed tensor list"),
])
def test_malformed_manifests_name_the_field(t4_build, edit, message):
    manifest = copy.deepcopy(read_bundle(t4_build.bundle.path).manifest)
    edit(manifest)
    view = BundleView(t4_build.bundle.path, manifest)
    with pytest.raises(BundleError, match=message):
        view.inputs, view.steps, view.engine  # noqa: B018 (parsed on first use)


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
