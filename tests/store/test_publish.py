"""The publish policy and push after a passing gate (deepjit_compiler/publish.py)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from deepjit_compiler.bundle.folder import read_bundle, write_bundle
from deepjit_compiler.errors import BundleError, StoreError
from deepjit_compiler.spec.models import LEVELS
from deepjit_compiler.store import open_store
from deepjit_compiler.store.publish import check_policy, publish

ALL_PASSED = {lvl: {"status": "passed", "reason": ""} for lvl in LEVELS}


def make_bundle(dest: Path, seed: int, levels: dict | None):
    rng = random.Random(seed)
    manifest = {"name": "tiny", "seed": seed}
    if levels is not None:
        manifest["validation"] = {"levels": levels}
    return write_bundle(dest, {"segments/a.onnx": rng.randbytes(2000), "kernels/k.cubin": rng.randbytes(900)}, manifest)


def test_policy_accepts_required_levels_that_passed():
    levels = {**ALL_PASSED, "engine": {"status": "not_run", "reason": "TensorRT is not installed"}}
    assert check_policy({"validation": {"levels": levels}}, ["graph", "precision", "kernels", "end_to_end"]) is None
    assert check_policy({"validation": {"levels": {}}}, []) is None
    # the same record with the level that did not run required: refused, so the pass above was a real check
    with pytest.raises(StoreError, match="engine: did not run: TensorRT is not installed"):
        check_policy({"validation": {"levels": levels}}, ["graph", "engine"])


def test_policy_names_each_level_that_did_not_run_or_pass():
    levels = {**ALL_PASSED,
              "precision": {"status": "failed", "reason": "output0: max abs err 0.2 > atol 1e-3"},
              "engine": {"status": "not_run", "reason": "TensorRT is not installed"}}
    with pytest.raises(StoreError) as err:
        check_policy({"name": "yolov8n", "validation": {"levels": levels}}, list(LEVELS))
    text = str(err.value)
    assert "publish refused for yolov8n" in text
    assert "precision: did not pass (failed): output0: max abs err 0.2 > atol 1e-3" in text
    assert "engine: did not run: TensorRT is not installed" in text
    for passed in ("graph", "kernels", "end_to_end"):
        assert f"\n  {passed}:" not in text


def test_policy_without_a_validation_record_refuses_every_required_level():
    with pytest.raises(StoreError) as err:
        check_policy({"name": "x"}, ["graph", "end_to_end"])
    assert "graph: did not run" in str(err.value) and "end_to_end: did not run" in str(err.value)
    with pytest.raises(StoreError, match="kernels: did not run"):
        check_policy({"validation": {"levels": {"kernels": "passed"}}}, ["kernels"])  # not a record
    with pytest.raises(StoreError, match="kernels: did not run: no GPU"):
        check_policy({"validation": {"levels": {"kernels": {"reason": "no GPU"}}}}, ["kernels"])  # no status


def test_policy_refuses_unknown_levels():
    with pytest.raises(StoreError, match="unknown level 'end-to-end' \\(did you mean 'end_to_end'\\?\\)"):
        check_policy({"validation": {"levels": ALL_PASSED}}, ["graph", "end-to-end"])


def test_publish_pushes_a_bundle_that_passes(tmp_path):
    info = make_bundle(tmp_path / "b", 1, ALL_PASSED)
    result = publish(info.path, f"file://{tmp_path}/store", "v1", ["graph", "end_to_end"])
    assert result.digest == info.digest
    assert [(e.tag, e.digest) for e in open_store(f"file://{tmp_path}/store").ls()] == [("v1", info.digest)]
    # the tag may come with the URL instead
    publish(info.archive, f"file://{tmp_path}/store:v2", None, ["graph"])
    assert [e.tag for e in open_store(f"file://{tmp_path}/store").ls()] == ["v1", "v2"]


def test_publish_refused_by_policy_pushes_nothing(tmp_path):
    levels = {**ALL_PASSED, "kernels": {"status": "failed", "reason": "decode mismatch"}}
    info = make_bundle(tmp_path / "b", 2, levels)
    with pytest.raises(StoreError, match="kernels: did not pass \\(failed\\): decode mismatch"):
        publish(info.path, f"file://{tmp_path}/store", "v1", ["graph", "kernels"])
    assert not (tmp_path / "store").exists()  # not even the store's folder


def test_publish_verifies_the_bundle_first(tmp_path):
    info = make_bundle(tmp_path / "b", 3, ALL_PASSED)
    (info.path / "kernels/k.cubin").write_bytes(b"swapped")
    with pytest.raises(BundleError, match="'kernels/k.cubin'"):
        publish(info.path, f"file://{tmp_path}/store", "v1", ["graph"])
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("url, tag, message", [
    ("file:///s", None, "has no tag"),
    ("file:///s:v1", "v2", "differs from the one in"),
    ("file:///s@sha256:" + "a" * 64, "v1", "names a digest"),
])
def test_publish_needs_one_tag(tmp_path, url, tag, message):
    info = make_bundle(tmp_path / "b", 4, ALL_PASSED)
    with pytest.raises(StoreError, match=message):
        publish(info.path, url, tag, ["graph"])


def test_publish_to_a_registry(registry_server, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    info = make_bundle(tmp_path / "b", 5, ALL_PASSED)
    repo = f"{registry_server.url}/publish/tiny"
    result = publish(info.path, f"{repo}:v1", None, list(LEVELS))
    assert read_bundle(open_store(repo).pull("v1", tmp_path / "p")).digest == result.digest == info.digest
