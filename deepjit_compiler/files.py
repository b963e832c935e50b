"""Atomic file-system writes: a file or a folder becomes visible whole or not at all.

Every file DeepJIT writes goes through a temporary name in the same folder and `os.replace`, so an
interrupted process never leaves a half-written file under the real name."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from .errors import BundleError

_FILE_MODE, _EXEC_MODE, _DIR_MODE = 0o644, 0o755, 0o755


# ---------------------------------------------------------------------------- atomic file system
@contextmanager
def staging_dir(dest: Path) -> Iterator[Path]:
    """A fresh hidden folder next to `dest` (same file system, so os.replace is atomic),
    removed on exit whatever happened; an interrupted process leaves only `.NAME.tmp-*`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file (read/write) that becomes `path` only when the block ends without error:
    a temporary file in the same folder, fsynced, made 0o644 and os.replace'd; removed on error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "w+b") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
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
    if not dest.exists() and not dest.is_symlink():
        os.replace(src, dest)
        return
    if dest.is_symlink() or not dest.is_dir():
        raise BundleError(f"{dest}: exists and is not a folder; refusing to replace it")
    old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.old-"))
    os.replace(dest, old / "old")
    try:
        os.replace(src, dest)
    except BaseException:
        os.replace(old / "old", dest)  # put the previous folder back
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
