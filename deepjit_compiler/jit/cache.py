"""Content-addressed on-disk cache of compiled kernels (CuPy's _compiler_cache, Triton's FileCacheManager).

Layout: <root>/<key[:2]>/<key>/ holds one file per binary (cubin, ptx) and meta.json. Each file is
written to a temp file in the same folder, fsynced and os.replace'd; meta.json goes last and is the
commit marker: it records each binary's sha256, so a torn or corrupt entry reads as a miss (and is
rebuilt). Concurrent builders of one key write identical bytes, so either replace wins safely.

An entry is trusted only if this user's DeepJIT wrote it: meta.json carries an HMAC of its whole
record (the key, the binaries' digests and every other field: a kernel's entry names, a plan's I/O)
under a secret kept in the user's config folder (config.cache_key_file), so an entry edited in a
shared or copied cache reads as a miss and is rebuilt instead of shipped in a bundle. Entries of an
older FORMAT (whose MAC covered the key and digests alone) are plain misses, rewritten in place.

Root: the spec's `compile.cache_dir`, else $DEEPJIT_CACHE_DIR, else the user cache dir (config.py).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import config
from ..files import atomic_write

log = logging.getLogger("deepjit.cache")
META = "meta.json"
FORMAT = 2  # meta.json's "cache_format": 2 signs the whole record


def _secret() -> bytes:
    """This user's cache secret: 32 random bytes, made once, readable by the user alone."""
    path = config.cache_key_file()
    try:
        data = path.read_bytes()
        if len(data) >= 32:
            return data
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it meanwhile
        return path.read_bytes()
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(32))
    return path.read_bytes()


def _mac(record: Mapping[str, Any]) -> str:
    """The HMAC of a meta.json record (plain JSON values), every field but the MAC itself."""
    message = json.dumps({k: v for k, v in record.items() if k != "mac"}, sort_keys=True).encode()
    return hmac.new(_secret(), message, hashlib.sha256).hexdigest()


def _signed(meta: Mapping[str, Any]) -> bool:
    """Did this user's DeepJIT write this record, unedited?"""
    return hmac.compare_digest(str(meta.get("mac", "")), _mac(meta))


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass  # a read-only cache is still read


def key_of(material: Mapping[str, Any]) -> str:
    """sha256 of a JSON-able mapping, keys sorted: the same material always gives the same key."""
    return hashlib.sha256(json.dumps(material, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class CacheStats:
    """Counters a test can assert on ("ten builds compile once")."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    corrupt: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def bump(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)


stats = CacheStats()


class KernelCache:
    """get(key) -> (meta, blobs) or None; put(key, blobs, meta). engines/plans.py keeps plans in one
    too, under its own root and counters."""

    def __init__(self, root: Path | None = None, counters: CacheStats | None = None, *, what: str = "kernel cache"):
        self.root = Path(root) if root is not None else config.cache_dir()
        self.counters = counters if counters is not None else stats
        self.what = what  # for its log lines: the build's stage cache keeps its entries the same way

    def folder(self, key: str) -> Path:
        return self.root / key[:2] / key

    def get(self, key: str) -> tuple[dict[str, Any], dict[str, bytes]] | None:
        folder = self.folder(key)
        try:
            meta = json.loads((folder / META).read_text())
            blobs = {name: (folder / name).read_bytes() for name in meta["blobs"]}
        except FileNotFoundError:
            self.counters.bump("misses")
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            return self._corrupt(key, f"unreadable ({e})")
        if meta.get("cache_format") != FORMAT:
            log.debug("%s entry %s is of an older format: a miss, rewritten", self.what, folder)
            self.counters.bump("misses")
            return None
        for name, data in blobs.items():
            if hashlib.sha256(data).hexdigest() != meta["blobs"][name]:
                return self._corrupt(key, f"{name} does not match its digest")
        if meta.get("key") != key:
            return self._corrupt(key, "meta.json belongs to another key")
        if not _signed(meta):
            return self._corrupt(key, "it was not written by this user's DeepJIT (or was edited since)")
        self.counters.bump("hits")
        _touch(folder / META)  # last used: prune keeps the recently used
        return meta, blobs

    def _corrupt(self, key: str, why: str) -> None:
        log.warning("ignoring corrupt %s entry %s: %s; it will be rebuilt", self.what, self.folder(key), why)
        self.counters.bump("corrupt")
        self.counters.bump("misses")
        return None

    def prune(self, max_bytes: int, keep: str = "") -> int:
        """Remove the least recently used entries until the rest take at most max_bytes; `keep`, a key,
        stays whatever its size. Only entries this user's DeepJIT signed go, and only the files their
        record names (a folder with anything else in it stays): the bound counts those entries alone,
        and no other record's file names are followed. Returns the bytes removed."""
        entries = []
        for meta_path in self.root.glob(f"??/*/{META}"):
            try:
                meta = json.loads(meta_path.read_text())
                if meta.get("cache_format") != FORMAT or meta.get("key") != meta_path.parent.name or not _signed(meta):
                    continue  # not an entry of ours (or one being written): neither counted nor removed
                files = [meta_path] + [meta_path.parent / name for name in meta["blobs"]]
                size = sum(f.stat().st_size for f in files if f.exists())
                entries.append((meta_path.stat().st_mtime, meta_path.parent.name, files, size))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
        total, removed = sum(e[3] for e in entries), 0
        for _, key, files, size in sorted(entries):
            if total <= max_bytes:
                break
            if key == keep:
                continue
            try:
                for f in files:  # meta.json first: a reader finds a miss, not an entry losing its blobs
                    f.unlink(missing_ok=True)
            except OSError as e:  # a read-only cache must not fail the build, as in put
                log.warning("cannot prune %s entry %s: %s", self.what, files[0].parent, e)
                return removed
            try:
                files[0].parent.rmdir()
            except OSError:
                pass  # something else is in it
            total, removed = total - size, removed + size
            log.info("%s: removed %s (%.1f MB, least recently used)", self.what, files[0].parent, size / 1e6)
        return removed

    def put(self, key: str, blobs: Mapping[str, bytes], meta: Mapping[str, Any]) -> None:
        folder = self.folder(key)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for name, data in blobs.items():
                atomic_write(folder / name, data)
            digests = {n: hashlib.sha256(d).hexdigest() for n, d in blobs.items()}
            record = json.loads(json.dumps({**meta, "cache_format": FORMAT, "key": key, "blobs": digests}, default=list))
            atomic_write(folder / META, json.dumps({**record, "mac": _mac(record)}, indent=1, sort_keys=True).encode())
        except OSError as e:
            # A read-only or full cache must not fail the build: the kernel is compiled either way.
            log.warning("cannot write %s entry %s: %s", self.what, folder, e)
            return
        self.counters.bump("writes")
