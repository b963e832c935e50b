"""Atomic file-system writes: a file or a folder becomes visible whole or not at all.

Every file DeepJIT writes goes through a temporary name in the same folder and `os.replace`, so an
interrupted process never leaves a half-written file under the real name. One writer at a time per
output path (`output_lock`), and under that lock what an interrupted writer left behind is removed,
but only what DeepJIT provably made (`_ours`: its name, tempfile's random suffix, this user's, and
DeepJIT's mark inside a folder or mkstemp's 0600 on a file): a user's `.NAME.old-2023` stays. A
write the file system refuses (disk full, read-only) is an OutputError naming the path (exit 2),
never a traceback. Files DeepJIT reads
but did not write (a cache entry, a store's tag, an input array) are opened as regular files only.
"""
from __future__ import annotations

import errno
import fcntl
import glob
import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from .errors import BundleError, OutputError

log = logging.getLogger("deepjit.files")

_FILE_MODE, _EXEC_MODE, _DIR_MODE = 0o644, 0o755, 0o755
# What DeepJIT's own writers of NAME leave beside it while they work: these prefixes, then tempfile's
# random suffix; its folders hold MARK (written first), its files are still mkstemp's 0600.
_LEFTOVERS = (".{n}.tmp-", ".{n}.old-", ".{n}.report.tmp-", ".{n}.report.old-", ".{n}.tar.gz.tmp-")
_RANDOM = re.compile(r"[a-z0-9_]{8}")  # tempfile's names (its _RandomNameSequence)
MARK = ".deepjit-temporary"
_held: dict[str, int] = {}  # output locks this process holds, and how deep


def cannot_write(path: Path, e: OSError) -> OutputError:
    blocker = _file_on_path(Path(path)) if e.errno in (errno.EEXIST, errno.ENOTDIR) else None
    why = f"{blocker} is a file, not a folder" if blocker else e.strerror or e  # mkdir's EEXIST said only that
    return OutputError(f"{path}: cannot write ({why}); nothing was left half-written")


def _file_on_path(path: Path) -> Path | None:
    """The first folder on `path`'s way (from the root down) that is something else, or None."""
    return next((p for p in reversed(path.parents) if p.exists() and not p.is_dir()), None)


# ---------------------------------------------------------------------------- reading
def open_regular(path: Path, *, follow: bool = True) -> BinaryIO:
    """`path` opened for reading if it is a regular file, else an OSError naming it. O_NONBLOCK: a FIFO
    put where a file is expected opens at once (and is refused) instead of waiting for a writer;
    `follow=False` (O_NOFOLLOW): a symlink planted in a shared folder does not lead out of it."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags if follow else flags | getattr(os, "O_NOFOLLOW", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return os.fdopen(fd, "rb")


def read_regular(path: Path, limit: int | None = None, *, follow: bool = True) -> bytes:
    """A regular file's bytes (open_regular); past `limit` a ValueError, read no further than that."""
    with open_regular(path, follow=follow) as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise ValueError(f"over {limit} bytes")
    return data


# ---------------------------------------------------------------------------- atomic file system
def _temporary_folder(parent: Path, prefix: str) -> Path:
    """A fresh folder `prefix` + random in `parent`, marked as DeepJIT's before anything goes in."""
    folder = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
    (folder / MARK).touch()
    return folder


def _ours(path: Path, prefix: str) -> bool:
    """Whether `path` (named `prefix`...) is provably a temporary of DeepJIT's: tempfile's random suffix,
    this user's, and a folder with DeepJIT's mark inside or a regular file still 0600 (atomic_file
    widens it only when it renames it into place)."""
    try:
        st = path.lstat()
        if not _RANDOM.fullmatch(path.name[len(prefix):]) or st.st_uid != os.getuid():
            return False
        if stat.S_ISDIR(st.st_mode):
            return stat.S_ISREG((path / MARK).lstat().st_mode)
        return stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    except OSError:
        return False


@contextmanager
def staging_dir(dest: Path) -> Iterator[Path]:
    """A fresh hidden folder next to `dest` (same file system, so os.replace is atomic),
    removed on exit whatever happened; an interrupted process leaves only `.NAME.tmp-*`."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        stage = _temporary_folder(dest.parent, f".{dest.name}.tmp-")
    except OSError as e:
        raise cannot_write(dest, e) from None
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file (read/write) that becomes `path` only when the block ends without error:
    a temporary file in the same folder, fsynced, made 0o644 and os.replace'd; removed on error."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    except OSError as e:
        raise cannot_write(path, e) from None
    try:
        with os.fdopen(fd, "w+b") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise cannot_write(path, e) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder and os.replace."""
    with atomic_file(path) as f:
        f.write(data)


def replace_dir(src: Path, dest: Path) -> None:
    """Move the folder `src` to `dest`, replacing a folder already there.

    Linux has no portable atomic exchange of two folders, so the old one is renamed aside first;
    `dest` is missing only between two renames, and is never half written."""
    src, dest = Path(src), Path(dest)
    try:
        if not dest.exists() and not dest.is_symlink():
            os.replace(src, dest)
            return
        if dest.is_symlink() or not dest.is_dir():
            raise BundleError(f"{dest}: exists and is not a folder; refusing to replace it")
        old = _temporary_folder(dest.parent, f".{dest.name}.old-")
        os.replace(dest, old / "old")
    except OSError as e:
        raise cannot_write(dest, e) from None
    try:
        os.replace(src, dest)
    except OSError as e:
        os.replace(old / "old", dest)  # put the previous folder back
        raise cannot_write(dest, e) from None
    except BaseException:
        os.replace(old / "old", dest)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------- one writer per output
@contextmanager
def output_lock(dest: Path) -> Iterator[None]:
    """Hold the output `dest` (a bundle path) alone: an exclusive flock on a lock file named after its
    absolute path (in this user's lock folder under the temp dir, so nothing lands beside the
    user's files), re-entrant within this process. Two builds or pulls of one path then run one after the other, and
    what an interrupted writer of `dest` left beside it is removed on the way in."""
    dest = Path(dest).absolute()
    key = str(dest)
    if _held.get(key):
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.gettempdir()) / f"deepjit-locks-{os.getuid()}"
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            # another user's folder, or one others can write: they could swap or link its lock files
            raise OutputError(f"{dest}: cannot take its lock: {folder} is not a folder of this user's that only "
                              "they can write; remove it")
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        lock = os.fdopen(os.open(folder / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".lock"), flags, 0o600), "ab")
    except OSError as e:
        raise cannot_write(dest, e) from None
    with lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        _held[key] = 1
        try:
            remove_leftovers(dest)
            yield
        finally:
            _held.pop(key, None)
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def remove_leftovers(dest: Path) -> None:
    """Remove what interrupted DeepJIT writers of `dest` left beside it (call under its lock)."""
    for prefix in (p.format(n=dest.name) for p in _LEFTOVERS):
        # glob.escape: an output named `*` must not match a user's `.bashrc.old-2019`
        for stale in dest.parent.glob(glob.escape(prefix) + "*"):
            if _ours(stale, prefix):
                log.info("removing %s, left by an interrupted run", stale)
                shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)


def remove_old_temporaries(folder: Path, min_age_s: float = 600.0) -> None:
    """Remove `.*.tmp-*` files in `folder` untouched for `min_age_s`: atomic writes that an interrupted
    process never finished (a live one rewrites its file within seconds)."""
    now = time.time()
    for stale in folder.glob(".*.tmp-*"):
        try:
            prefix = stale.name[:stale.name.rindex(".tmp-") + len(".tmp-")]
            if _ours(stale, prefix) and stale.is_file() and now - stale.stat().st_mtime > min_age_s:
                stale.unlink()
                log.info("removed %s, left by an interrupted write", stale)
        except OSError:
            continue
