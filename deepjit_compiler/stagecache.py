"""The build's stage results, cached by the digest of everything each stage reads (the compile
cache's way, for the graph level and for the precision rewrite with its level): a second build of
an unchanged spec runs neither again, and an edited field reruns exactly the stages it feeds.

A key is the sha256 of: the stage and FORMAT; DeepJIT's version and the digest of its own source (a
changed DeepJIT is another DeepJIT); the versions of the libraries the stages run; and the stage's
material, which build.py gives: the plan's digest (the model's bytes and the cuts, through the
surgery), the model's sha256, the spec fields the stage reads, and the digest of its validation
data. Entries are jit/cache.py entries under `config.stage_cache_dir()`: signed with this user's
key and checked on read, so an edited or torn entry is a miss. Only results that did not fail are
kept: a failing stage runs again and writes its RunResults for the report.
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__, config
from .jit.cache import CacheStats, KernelCache, key_of
from .validation.gate import LevelResult, OutputResult

log = logging.getLogger("deepjit.cache")
FORMAT = 2  # 2: the record in the entry's signed meta.json (1: a record.json blob)
_LIBRARIES = ("onnx", "onnxruntime", "polygraphy", "onnx-graphsurgeon", "numpy", "ml_dtypes")
_PACKAGE = Path(__file__).resolve().parent


@lru_cache(maxsize=1)
def toolchain_digest() -> str:
    """DeepJIT's version and source, and the versions of the libraries its CPU stages run."""
    h = hashlib.sha256(f"deepjit {__version__}\0".encode())
    for path in sorted(_PACKAGE.rglob("*.py")):
        h.update(path.relative_to(_PACKAGE).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    for dist in _LIBRARIES:
        try:
            h.update(f"{dist} {metadata.version(dist)}\0".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist} absent\0".encode())
    return h.hexdigest()


def arrays_digest(feeds: Iterable[Mapping[str, np.ndarray]]) -> str:
    """sha256 over validation feeds: names, dtypes, shapes and bytes, in order."""
    h = hashlib.sha256()
    for feed in feeds:
        for name, a in feed.items():
            a = np.ascontiguousarray(a)
            h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
            h.update(a.data)
    return h.hexdigest()


def folder_digest(folder: Path | str | None) -> str | None:
    """sha256 over a data folder's file names and bytes (calibration data), None for no folder."""
    if folder is None or not Path(folder).is_dir():
        return None
    h = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def level_record(level: LevelResult) -> dict[str, Any]:
    return {"level": level.level, **level.to_dict()}


def level_from_record(d: Mapping[str, Any]) -> LevelResult:
    outputs = tuple(OutputResult(name, **fields) for name, fields in (d.get("outputs") or {}).items())
    return LevelResult(d["level"], d["status"], d.get("reason", ""), outputs)


class StageCache:
    """get(stage, material) -> (record, blobs) or None; put(stage, material, blobs, record). The record
    (a level's figures) is in the entry's meta.json, which its signature covers. Each put prunes the
    least recently used entries past $DEEPJIT_STAGE_CACHE_MB. Disabled (every get a miss) when
    RunResults of every comparison are asked for: a cached level writes none."""

    def __init__(self, root: Path | None = None, *, enabled: bool | None = None):
        # Counters of its own: the kernel cache's count compiles (tests assert on them).
        self._store = KernelCache(root if root is not None else config.stage_cache_dir(), CacheStats(),
                                  what="stage cache")
        self.enabled = (not config.keep_run_results()) if enabled is None else enabled

    def key(self, stage: str, material: Mapping[str, Any]) -> str:
        return key_of({"stage": stage, "format": FORMAT, "toolchain": toolchain_digest(), "material": material})

    def get(self, stage: str, material: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, bytes]] | None:
        if not self.enabled:
            return None
        found = self._store.get(self.key(stage, material))
        if found is None:
            return None
        log.debug("stage %s: cached result %s", stage, self.key(stage, material)[:16])
        return found[0]["record"], found[1]

    def put(self, stage: str, material: Mapping[str, Any], blobs: Mapping[str, bytes],
            record: Mapping[str, Any]) -> None:
        if self.enabled:
            key = self.key(stage, material)
            self._store.put(key, blobs, {"stage": stage, "record": record})
            self._store.prune(config.stage_cache_max_bytes(), keep=key)
