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

The secret is made whole or not at all (written to a temp file beside it, then os.link'ed into place),
so no reader ever sees it half written. A key file of another user's, one its group or others can
read or write, or one that cannot be read or made is refused with a warning: signing is then off, so
every get is a miss and put writes nothing (a forgeable secret must not sign or vouch for anything).
A short one of ours (an older DeepJIT's first run, killed between creating and writing it) is
replaced. get reads meta.json and checks its format, key and MAC before it opens any binary the
record names; names are plain file names in the entry folder, and only regular files are read (no
symlink followed, no FIFO or device opened), so a planted entry cannot make DeepJIT read elsewhere.

Root: the spec's `compile.cache_dir`, else $DEEPJIT_CACHE_DIR, else the user cache dir (config.py).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import config
from ..files import atomic_write, open_regular, read_regular

log = logging.getLogger("deepjit.cache")
META = "meta.json"
FORMAT = 2  # meta.json's "cache_format": 2 signs the whole record
KEY_BYTES = 32
_MAX_META = 16 << 20  # a record is a few KB: a planted giant meta.json must not fill memory
_refused: set[str] = set()  # key files already warned about


def _read_key_file(path: Path) -> bytes:
    """The key file's bytes; ValueError if anyone but this user could know or change them (and so forge
    entries). A symlink is followed: it is the user's own config; the file it names must pass too."""
    with open_regular(path) as f:
        st = os.fstat(f.fileno())
        if os.name == "posix" and st.st_uid != os.getuid():
            raise ValueError("another user owns it")
        if os.name == "posix" and st.st_mode & 0o066:
            raise ValueError("its group or others can read or write it")
        return f.read()


def _make_key_file(path: Path) -> None:
    """A new secret, written and fsynced beside `path` (mkstemp: mode 0600), then linked into place: the
    key file appears whole or not at all. If another process linked its own first, theirs stays."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        Path(tmp).unlink(missing_ok=True)


def _secret() -> bytes | None:
    """This user's cache secret: KEY_BYTES random bytes, made once, readable by the user alone. None when
    it cannot be made or trusted: signing is off (every get a miss, put writes nothing), with a warning."""
    path = config.cache_key_file()
    try:
        try:
            data = _read_key_file(path)
        except FileNotFoundError:
            data = b""
        else:
            if len(data) < KEY_BYTES:  # ours and private (checked), left short by an older DeepJIT
                path.unlink(missing_ok=True)
        if len(data) < KEY_BYTES:
            _make_key_file(path)
            data = _read_key_file(path)
        if len(data) < KEY_BYTES:  # an older DeepJIT is writing one right now
            raise ValueError(f"it is shorter than {KEY_BYTES} bytes")
        return data
    except (OSError, ValueError) as e:
        if str(path) not in _refused:  # once per process: every get and put asks
            _refused.add(str(path))
            log.warning("not using the cache key file %s (%s): the kernel, plan and stage caches are off "
                        "until it is fixed or removed", path, e)
        return None


def _mac(record: Mapping[str, Any], secret: bytes) -> str:
    """The HMAC of a meta.json record (plain JSON values), every field but the MAC itself."""
    message = json.dumps({k: v for k, v in record.items() if k != "mac"}, sort_keys=True).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _signed(meta: Mapping[str, Any], secret: bytes) -> bool:
    """Did this user's DeepJIT write this record, unedited? (Bytes: compare_digest refuses non-ASCII str.)"""
    return hmac.compare_digest(str(meta.get("mac", "")).encode(), _mac(meta, secret).encode())


def _plain_name(name: object) -> bool:
    """A blob name is a file directly in its entry folder: no separator, no '.' or '..', not the record."""
    return (isinstance(name, str) and name not in ("", ".", "..", META)
            and not any(c in name for c in "/\\\0"))


def _blob_names(meta: Mapping[str, Any]) -> dict[str, str]:
    """A record's blob names and digests; ValueError if one is not a plain name."""
    blobs = meta["blobs"]
    if not isinstance(blobs, dict) or not all(_plain_name(n) for n in blobs):
        raise ValueError("a blob name is not a plain file name")
    return blobs


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
        secret = _secret()
        if secret is None:  # signing is off: nothing can be trusted
            self.counters.bump("misses")
            return None
        meta = self._trusted_meta(key, secret)
        if meta is None:
            return None
        folder = self.folder(key)
        try:
            blobs = {name: read_regular(folder / name, follow=False) for name in meta["blobs"]}
        except FileNotFoundError:
            self.counters.bump("misses")
            return None
        except OSError as e:
            return self._corrupt(key, f"unreadable ({e})")
        for name, data in blobs.items():
            if hashlib.sha256(data).hexdigest() != meta["blobs"][name]:
                return self._corrupt(key, f"{name} does not match its digest")
        self.counters.bump("hits")
        _touch(folder / META)  # last used: prune keeps the recently used
        return meta, blobs

    def _trusted_meta(self, key: str, secret: bytes) -> dict[str, Any] | None:
        """The entry's record if this user's DeepJIT signed it for `key`, else None (a miss, counted).
        Checked before any file it names is opened: an unsigned record's names are not followed."""
        folder = self.folder(key)
        try:
            meta = json.loads(read_regular(folder / META, _MAX_META, follow=False))
        except FileNotFoundError:
            self.counters.bump("misses")
            return None
        except (OSError, ValueError) as e:
            return self._corrupt(key, f"unreadable ({e})")
        if not isinstance(meta, dict):
            return self._corrupt(key, "meta.json is not a record")
        if meta.get("cache_format") != FORMAT:
            log.debug("%s entry %s is of an older format: a miss, rewritten", self.what, folder)
            self.counters.bump("misses")
            return None
        if meta.get("key") != key:
            return self._corrupt(key, "meta.json belongs to another key")
        if not _signed(meta, secret):
            return self._corrupt(key, "it was not written by this user's DeepJIT (or was edited since)")
        try:
            _blob_names(meta)
        except (KeyError, ValueError) as e:  # signed, so a bug of ours: still never leave the folder
            return self._corrupt(key, str(e))
        return meta

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
        secret = _secret()
        if secret is None:
            return 0  # which entries are ours cannot be told
        entries = []
        for meta_path in self.root.glob(f"??/*/{META}"):
            try:
                meta = json.loads(read_regular(meta_path, _MAX_META, follow=False))
                if meta.get("cache_format") != FORMAT or meta.get("key") != meta_path.parent.name \
                        or not _signed(meta, secret):
                    continue  # not an entry of ours (or one being written): neither counted nor removed
                files = [meta_path] + [meta_path.parent / name for name in _blob_names(meta)]
                size = sum(f.lstat().st_size for f in files if f.is_symlink() or f.exists())
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
        secret = _secret()
        if secret is None:
            return  # an entry nobody can verify is worth nothing (_secret said why)
        if not all(_plain_name(name) for name in blobs):  # get would refuse it: a miss, not a failed build
            log.warning("not caching %s entry %s: blob names %s are not all plain file names",
                        self.what, key, sorted(blobs))
            return
        folder = self.folder(key)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for name, data in blobs.items():
                atomic_write(folder / name, data)
            digests = {n: hashlib.sha256(d).hexdigest() for n, d in blobs.items()}
            record = json.loads(json.dumps({**meta, "cache_format": FORMAT, "key": key, "blobs": digests}, default=list))
            mac = _mac(record, secret)
            atomic_write(folder / META, json.dumps({**record, "mac": mac}, indent=1, sort_keys=True).encode())
        except OSError as e:
            # A read-only or full cache must not fail the build: the kernel is compiled either way.
            log.warning("cannot write %s entry %s: %s", self.what, folder, e)
            return
        self.counters.bump("writes")
