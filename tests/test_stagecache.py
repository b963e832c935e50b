"""The build's stage cache (stagecache.py): each ingredient of a key changes it, a tampered entry is a
miss, and an edited spec field reruns exactly the stages it feeds (full builds of the T4 variant)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import YOLOV8N_T4

from deepjit_compiler import config, stagecache
from deepjit_compiler.build import build_pipeline
from deepjit_compiler.stagecache import StageCache, arrays_digest, level_from_record, level_record
from deepjit_compiler.validation.gate import LevelResult, OutputResult

MATERIAL = {"plan": "ab" * 32, "model": "cd" * 32, "seed": 0}


def test_each_key_ingredient_changes_the_key(tmp_path, monkeypatch):
    cache = StageCache(tmp_path)
    base = cache.key("graph", MATERIAL)
    assert cache.key("graph", dict(MATERIAL)) == base
    assert cache.key("precision", MATERIAL) != base
    assert cache.key("graph", {**MATERIAL, "seed": 1}) != base
    monkeypatch.setattr(stagecache, "toolchain_digest", lambda: "another DeepJIT or ONNX Runtime")
    assert cache.key("graph", MATERIAL) != base
    monkeypatch.undo()
    assert cache.key("graph", MATERIAL) == base
    monkeypatch.setattr(stagecache, "FORMAT", stagecache.FORMAT + 1)
    assert cache.key("graph", MATERIAL) != base


def test_the_toolchain_digest_covers_deepjits_own_source(tmp_path, monkeypatch):
    """A DeepJIT whose code changed without a version bump must not reuse results."""
    (tmp_path / "stage.py").write_text("def level(): return 1\n")
    monkeypatch.setattr(stagecache, "_PACKAGE", tmp_path)
    stagecache.toolchain_digest.cache_clear()
    try:
        digest = stagecache.toolchain_digest()
        (tmp_path / "stage.py").write_text("def level(): return 2\n")
        stagecache.toolchain_digest.cache_clear()
        assert stagecache.toolchain_digest() != digest
    finally:
        stagecache.toolchain_digest.cache_clear()


def test_feeds_digest_sees_values_dtypes_and_shapes():
    rng = np.random.default_rng(3)
    a = rng.uniform(0, 1, (2, 3, 8, 8)).astype(np.float32)
    base = arrays_digest([{"images": a}])
    assert arrays_digest([{"images": a.copy()}]) == base
    b = a.copy()
    b[0, 0, 0, 0] += 1e-3
    assert arrays_digest([{"images": b}]) != base
    assert arrays_digest([{"images": a.astype(np.float64)}]) != base
    assert arrays_digest([{"images": a.reshape(1, 6, 8, 8)}]) != base


def test_a_level_round_trips_and_a_tampered_entry_is_a_miss(tmp_path):
    level = LevelResult("precision", "passed", "fp16 vs fp32", (OutputResult("output0", True, 1.5, 1e-4, 0.2, 1e-3),))
    assert level_from_record(json.loads(json.dumps(level_record(level)))) == level
    cache = StageCache(tmp_path, enabled=True)
    cache.put("precision", MATERIAL, {"segment.onnx": b"\x08\x07rewritten"}, {"level": level_record(level)})
    record, blobs = cache.get("precision", MATERIAL)
    assert level_from_record(record["level"]) == level and blobs == {"segment.onnx": b"\x08\x07rewritten"}
    folder = cache._store.folder(cache.key("precision", MATERIAL))
    stored = json.loads((folder / "meta.json").read_text())
    stored["record"]["level"]["outputs"]["output0"]["max_abs"] = 0.0  # a better figure, written by someone else
    (folder / "meta.json").write_text(json.dumps(stored, sort_keys=True))
    assert cache.get("precision", MATERIAL) is None  # its signature no longer matches: a miss


def test_asking_for_every_run_result_bypasses_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPJIT_KEEP_RUN_RESULTS", "1")
    cache = StageCache(tmp_path)
    cache.put("graph", MATERIAL, {}, {"level": {}})
    assert cache.get("graph", MATERIAL) is None  # a cached level would write no RunResults


EDITS = {  # spec edit -> the stages a rebuild takes from the stage cache (kernels: the compile cache's)
    "nothing": ({}, ["graph", "precision"]),
    "the bundle's archive": ({"path: out/yolov8n_t4": "path: out/yolov8n_t4\n  archive: true"}, ["graph", "precision"]),
    "a precision tolerance": ({"  gate: true": "  precision_tolerances:\n    default: {atol: 0.06, rtol: 0.05, "
                                               "check_error_stat: median}\n    detections: {min_iou: 0.5, "
                                               "score_atol: 0.05, min_map: 0.8}\n"
                                               "  gate: true"}, ["graph"]),
    "the validation seed": ({"  samples: 2\n  seed: 0": "  samples: 2\n  seed: 1"}, []),
    "an NVRTC option": ({"fast_math: false": "fast_math: true"}, ["graph", "precision"]),
    "an NMS param (its reference)": ({"iou_threshold: 0.45": "iou_threshold: 0.5"}, []),
}


@pytest.mark.slow  # seven builds, most of them partly cached
def test_an_edited_field_reruns_exactly_the_stages_it_feeds(t4_build, write_spec, tmp_path, monkeypatch):
    """A build of the unchanged spec fills a fresh stage cache; each edit of it reruns what reads the field."""
    monkeypatch.setattr(config, "stage_cache_dir", lambda: tmp_path / "stages")
    first = build_pipeline(write_spec(YOLOV8N_T4, name="first.yaml"), publish=False)
    assert [s for s in first.times.cached if s != "kernels"] == []
    for edit, (replacements, cached) in EDITS.items():
        result = build_pipeline(write_spec({**YOLOV8N_T4, **replacements}), publish=False)
        assert [s for s in result.times.cached if s != "kernels"] == cached, edit
        assert result.to_dict()["cached"] == result.times.cached
        if edit == "nothing":
            assert "kernels" in result.times.cached  # and the build says so
            assert result.bundle.digest == first.bundle.digest == t4_build.bundle.digest  # cached: the same bundle
            assert result.report.to_record() == first.report.to_record()
