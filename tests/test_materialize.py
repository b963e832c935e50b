"""`deepjit materialize`: TensorRT plans on the target, for a deferred bundle or beside a bundle's
TensorRT-RTX plans; what it refuses. Building needs TensorRT and the target GPU (test_tensorrt_build.py)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

import deepjit_compiler.materialize as materialize_module
from deepjit_compiler.bundle.folder import read_bundle, update_bundle
from deepjit_compiler.bundle.manifest import manifest_bytes, manifest_digest
from deepjit_compiler.engines import rtx_sms, tensorrt_importable
from deepjit_compiler.errors import BundleError, MissingDependency, OutputError
from deepjit_compiler.materialize import materialize_bundle


@pytest.fixture
def bundle(t4_build, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(t4_build.bundle.path, copy)
    return copy


@pytest.mark.skipif(tensorrt_importable(), reason="TensorRT is installed here: materialize would build")
def test_a_bundle_with_an_rtx_plan_or_none_needs_tensorrt_to_materialize(bundle):
    engine = read_bundle(bundle).engine
    assert engine.deferred or rtx_sms() is not None and engine.plans
    with pytest.raises(MissingDependency, match=r"building TensorRT engines needs TensorRT: install deepjit\[tensorrt"):
        materialize_bundle(bundle)


def test_nothing_to_materialize(bundle):
    record = dict(read_bundle(bundle).manifest["engine"])
    update_bundle(bundle, {}, {"engine": {**record, "backend": "onnxruntime", "deferred": False, "plans": {}}})
    with pytest.raises(BundleError, match="nothing to materialize: its segments run on onnxruntime"):
        materialize_bundle(bundle)
    trt_plan = {"file": "engines/segment.plan", "flavour": "tensorrt", "version": "10.13"}
    update_bundle(bundle, {"engines/segment.plan": b"a plan"},
                  {"engine": {**record, "deferred": False, "plans": {"segment": [trt_plan]}}})
    with pytest.raises(BundleError, match="every segment already has a TensorRT plan"):
        materialize_bundle(bundle)


def test_a_segment_without_its_onnx_is_refused_naming_it(bundle):
    """A plan is built from the segment's ONNX: a manifest that lists none for a segment has nothing to build from."""
    record = dict(read_bundle(bundle).manifest["engine"])
    plans_only = {name: [f for f in files if not f.endswith(".onnx")] for name, files in record["segments"].items()}
    update_bundle(bundle, {}, {"engine": {**record, "deferred": True, "plans": {}, "segments": plans_only}})
    with pytest.raises(BundleError, match=r"segment 'segment' carries no ONNX to build a plan from"):
        materialize_bundle(bundle)


class _Built(Exception):
    """Stops materialize where the engine build would start (needs TensorRT and the target GPU)."""


@pytest.mark.parametrize("mine", [None, "mine.cache"])
def test_a_bundle_never_chooses_where_the_timing_cache_is_written(bundle, tmp_path, monkeypatch, caplog, mine):
    victim = tmp_path / "home" / ".bashrc"  # what a hostile publisher's bundle names, sealed by hand
    path = bundle / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["engine"]["settings"]["timing_cache"] = str(victim)
    manifest["digest"] = manifest_digest({k: v for k, v in manifest.items() if k != "digest"})
    path.write_bytes(manifest_bytes(manifest))
    seen = {}

    def build(segments, settings, *, timing_cache=None):
        seen.update(settings=settings["timing_cache"], argument=timing_cache)
        raise _Built

    monkeypatch.setattr(materialize_module, "materialize", build)
    with pytest.raises(_Built):
        materialize_bundle(bundle, timing_cache=mine and tmp_path / mine)
    assert seen == {"settings": None, "argument": mine and tmp_path / mine}
    assert "ignoring its engine.settings.timing_cache" in caplog.text


@pytest.mark.parametrize("kind", ["folder", "fifo", "dangling link"])
def test_a_timing_cache_that_is_not_a_file_is_refused_before_any_build(bundle, tmp_path, kind):
    """It was found only by TensorRT, after the bundle was read (a FIFO would block its read)."""
    cache = tmp_path / "cache"
    if kind == "folder":
        cache.mkdir()
    elif kind == "fifo":
        os.mkfifo(cache)
    else:
        cache.symlink_to(tmp_path / "nowhere")
    for path in (bundle, tmp_path / "no-bundle"):  # before the bundle is read: a missing one is not named first
        with pytest.raises(OutputError, match=f"^--timing-cache {cache}: is not a file; give TensorRT's timing cache "
                                              r"file \(it is created if missing\)$"):
            materialize_bundle(path, timing_cache=cache)
