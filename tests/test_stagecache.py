"""The build's stage cache (stagecache.py): each ingredient of a key changes it, a tampered entry is a
miss, and an edited spec field reruns exactly the stages it feeds (full builds of the T4 variant)."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from conftest import YOLOV8N_T4

from deepjit_compiler import config, stagecache
from deepjit_compiler.build import build_pipeline
from deepjit_compiler.errors import DeepJITError
from deepjit_compiler.stagecache import StageCache, arrays_digest, folder_digest, level_from_record, level_record
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


def test_the_toolchain_digest_covers_the_libraries_versions(monkeypatch):
    """Another ONNX Runtime (or NumPy, ...) may compute the levels differently: its results are not reused."""
    stagecache.toolchain_digest.cache_clear()
    try:
        digest = stagecache.toolchain_digest()
        real = stagecache.metadata.version
        monkeypatch.setattr(stagecache.metadata, "version", lambda d: "0.0.1" if d == "onnxruntime" else real(d))
        stagecache.toolchain_digest.cache_clear()
        assert stagecache.toolchain_digest() != digest
    finally:
        stagecache.toolchain_digest.cache_clear()


def test_feeds_digest_sees_every_batch_and_the_names():
    rng = np.random.default_rng(5)
    a, b = (rng.uniform(0, 1, (1, 3, 4, 4)).astype(np.float32) for _ in range(2))
    base = arrays_digest([{"images": a}, {"images": b}])
    assert arrays_digest([{"images": a}, {"images": b + np.float32(0.5)}]) != base  # the second batch counts too
    assert arrays_digest([{"image": a}, {"image": b}]) != base


def test_the_data_folder_digest_sees_names_and_bytes(tmp_path):
    rng = np.random.default_rng(6)
    (tmp_path / "calib").mkdir()
    (tmp_path / "calib" / "a.npy").write_bytes(rng.bytes(64))
    base = folder_digest(tmp_path / "calib")
    (tmp_path / "calib" / "a.npy").rename(tmp_path / "calib" / "b.npy")
    renamed = folder_digest(tmp_path / "calib")
    (tmp_path / "calib" / "b.npy").write_bytes(rng.bytes(64))
    assert len({base, renamed, folder_digest(tmp_path / "calib")}) == 3
    assert folder_digest(None) is None and folder_digest(tmp_path / "calib" / "b.npy") is None  # no folder


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


def _entries(cache: StageCache, n: int) -> list[str]:
    """n entries of ~10 kB (seeded random blobs), last used 100, 90, ... s ago: their keys, oldest first."""
    rng = np.random.default_rng(7)
    keys = []
    for i in range(n):
        material = {**MATERIAL, "seed": i}
        cache.put("precision", material, {"segment.onnx": rng.bytes(10_000)}, {"level": {"i": i}})
        keys.append(cache.key("precision", material))
        meta = cache._store.folder(keys[-1]) / "meta.json"
        os.utime(meta, (meta.stat().st_atime, time.time() - 100 + 10 * i))
    return keys


def test_past_its_size_bound_the_least_recently_used_entries_go(tmp_path, monkeypatch):
    cache = StageCache(tmp_path, enabled=True)
    keys = _entries(cache, 4)
    assert cache.get("precision", {**MATERIAL, "seed": 0}) is not None  # used now: the newest
    monkeypatch.setenv("DEEPJIT_STAGE_CACHE_MB", "0.035")  # room for three
    cache.put("precision", {**MATERIAL, "seed": 9}, {"segment.onnx": b"\x08" * 10_000}, {"level": {}})
    present = [cache._store.folder(k).exists() for k in keys]
    assert present == [True, False, False, True]  # seed 0 was used last; 1 and 2 were the oldest
    assert cache.get("precision", {**MATERIAL, "seed": 9}) is not None  # the entry just written stays
    assert cache.get("precision", {**MATERIAL, "seed": 1}) is None


def test_pruning_removes_only_what_deepjit_wrote(tmp_path, monkeypatch):
    cache = StageCache(tmp_path, enabled=True)
    keys = _entries(cache, 3)
    mine = cache._store.folder(keys[0]) / "notes.txt"  # a user's file in an entry's folder
    mine.write_text("mine")
    foreign = tmp_path / keys[1][:2] / ("f" * 64)  # an entry-shaped folder DeepJIT did not sign
    foreign.mkdir()
    (foreign / "meta.json").write_text(json.dumps({"cache_format": 2, "key": "f" * 64, "blobs": {}, "mac": "0"}))
    (foreign / "big").write_bytes(b"x" * 50_000)
    (tmp_path / "README").write_text("a user's file")
    monkeypatch.setenv("DEEPJIT_STAGE_CACHE_MB", "0.001")
    cache.put("precision", {**MATERIAL, "seed": 9}, {"segment.onnx": b"\x08" * 10_000}, {"level": {}})
    assert mine.read_text() == "mine" and not (mine.parent / "meta.json").exists()  # its entry went, the file stayed
    assert (foreign / "big").stat().st_size == 50_000 and (foreign / "meta.json").exists()
    assert (tmp_path / "README").exists()
    assert not cache._store.folder(keys[1]).exists() and not cache._store.folder(keys[2]).exists()
    assert cache.get("precision", {**MATERIAL, "seed": 9}) is not None


def test_an_unsigned_record_is_neither_counted_nor_followed(tmp_path, monkeypatch):
    """A foreign meta.json naming a big file outside the cache must not push our entries out."""
    cache = StageCache(tmp_path / "stages", enabled=True)
    keys = _entries(cache, 2)
    (tmp_path / "outside").write_bytes(b"x" * 200_000)
    foreign = tmp_path / "stages" / "ff" / ("f" * 64)
    foreign.mkdir(parents=True)
    (foreign / "meta.json").write_text(json.dumps({"cache_format": 2, "key": "f" * 64, "mac": "0",
                                                   "blobs": {"../../../outside": "0" * 64}}))
    monkeypatch.setenv("DEEPJIT_STAGE_CACHE_MB", "0.05")  # room for our three entries, not for the foreign file
    cache.put("precision", {**MATERIAL, "seed": 9}, {"segment.onnx": b"\x08" * 10_000}, {"level": {}})
    assert all(cache._store.folder(k).exists() for k in keys)
    assert (tmp_path / "outside").stat().st_size == 200_000 and (foreign / "meta.json").exists()


def test_a_cache_it_cannot_prune_does_not_fail_the_put(tmp_path, monkeypatch, caplog):
    cache = StageCache(tmp_path, enabled=True)
    keys = _entries(cache, 2)
    monkeypatch.setenv("DEEPJIT_STAGE_CACHE_MB", "0.001")

    def refuse(self, missing_ok=False):
        raise PermissionError(13, "Read-only file system", str(self))

    monkeypatch.setattr(type(tmp_path), "unlink", refuse)
    cache.put("precision", {**MATERIAL, "seed": 9}, {"segment.onnx": b"\x08" * 10_000}, {"level": {}})
    monkeypatch.undo()
    assert "cannot prune stage cache entry" in caplog.text and "Read-only file system" in caplog.text
    assert all(cache._store.folder(k).exists() for k in keys)
    assert cache.get("precision", {**MATERIAL, "seed": 9}) is not None


@pytest.mark.parametrize("value", ["lots", "0", "-1", "nan"])
def test_a_bad_size_bound_is_named(tmp_path, monkeypatch, value):
    monkeypatch.setenv("DEEPJIT_STAGE_CACHE_MB", value)
    with pytest.raises(DeepJITError, match=rf"\$DEEPJIT_STAGE_CACHE_MB is '{value}': a number of megabytes above 0"):
        StageCache(tmp_path, enabled=True).put("graph", MATERIAL, {}, {"level": {}})


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
