"""Deterministic tar.gz of a folder, extraction that refuses anything unsafe, and atomic writes.

`pack(folder)` gives the same bytes for the same files whatever the clock, owner, umask or walk
order: members sorted by path, mtime 0, uid/gid 0, empty user and group names, mode 0o644 (0o755
when the file is executable), gzip header with mtime 0 and no file name. Only regular files are
packed: a bundle never holds links, devices or empty folders. The bytes depend on zlib's deflate
output at level 9, which is stable across the zlib versions Python ships with.

`safe_extract` is the only way DeepJIT unpacks an archive. It never calls tarfile's extract: it
checks each member's name and type and writes regular files itself into a private staging folder,
which replaces `dest` only when the whole archive was read without fault.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import shutil
import stat
import tarfile
import zlib
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from ..errors import BundleError
from ..files import atomic_file, cannot_write, replace_dir, staging_dir
from ..log import Progress

log = logging.getLogger("deepjit.bundle")

_CHUNK = 1 << 20
_DEFAULT_RATIO = 100        # a bundle compresses about 1.1 : 1; a gzip bomb about 1000 : 1
_TRAILER_SLACK = 64 << 20   # tar headers and padding, and the end-of-archive blocks
_FILE_MODE, _EXEC_MODE, _DIR_MODE = 0o644, 0o755, 0o755
_PROGRESS_BYTES = 64 << 20  # packing less than this takes about a second: no progress counts


# ---------------------------------------------------------------------------- packing
def sha256_stream(f: BinaryIO) -> str:
    """Hex sha256 of what is left to read in the binary file object `f`."""
    h = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        h.update(chunk)
    return h.hexdigest()


def list_files(folder: Path) -> list[str]:
    """Bundle-relative POSIX paths of every regular file under `folder`, sorted by their UTF-8
    bytes. Links and special files are refused (BundleError naming them)."""
    folder = Path(folder)
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(folder).as_posix()
            mode = full.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise BundleError(f"{folder}: '{rel}' is a symbolic link; bundles hold regular files only")
            if stat.S_ISREG(mode):
                found.append(rel)
            elif not stat.S_ISDIR(mode):
                raise BundleError(f"{folder}: '{rel}' is not a regular file; bundles hold regular files only")
    return sorted(found, key=lambda p: p.encode("utf-8"))


def _tarinfo(rel: str, size: int, executable: bool) -> tarfile.TarInfo:
    info = tarfile.TarInfo(rel)
    info.size = size
    info.mtime = 0
    info.mode = _EXEC_MODE if executable else _FILE_MODE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def write_archive(folder: Path, out: BinaryIO) -> None:
    """Stream the deterministic tar.gz of `folder` into the binary file object `out`."""
    folder = Path(folder)
    files = list_files(folder)
    sizes = {rel: (folder / rel).stat().st_size for rel in files}
    total = sum(sizes.values())
    # filename="" keeps the name out of the gzip header; mtime=0 keeps the clock out.
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, compresslevel=9, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT, encoding="utf-8") as tar, \
            Progress(f"packing {folder.name}", total if total >= _PROGRESS_BYTES else 0, unit="bytes",
                     logger=log.name) as progress:
        for rel in files:
            path = folder / rel
            with path.open("rb") as f:
                tar.addfile(_tarinfo(rel, sizes[rel], bool(path.stat().st_mode & 0o111)), f)
            progress.advance(sizes[rel])


def pack(folder: Path) -> bytes:
    """The deterministic tar.gz of `folder` as bytes (see the module docstring)."""
    buf = io.BytesIO()
    write_archive(folder, buf)
    return buf.getvalue()


def pack_to(folder: Path, dest: Path) -> str:
    """Write the deterministic tar.gz of `folder` to `dest` atomically; returns 'sha256:<hex>'
    of the archive."""
    with atomic_file(dest) as f:
        write_archive(folder, f)
        f.seek(0)
        digest = sha256_stream(f)
    return f"sha256:{digest}"


# ---------------------------------------------------------------------------- extraction
def _member_path(label: str, name: str) -> str:
    """The normalised relative path of a member, or BundleError if it could leave the folder."""
    if "\x00" in name or "\\" in name:
        raise BundleError(f"{label}: member {name!r} has a NUL or backslash in its name")
    if name.startswith("/") or PurePosixPath(name).is_absolute():
        raise BundleError(f"{label}: member '{name}' is an absolute path; archives may hold relative paths only")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise BundleError(f"{label}: member '{name}' contains '..'; archives may not point outside their folder")
    if not parts:
        raise BundleError(f"{label}: member {name!r} has an empty name")
    return "/".join(parts)


class _Names:
    """Member names seen so far; refuses duplicates (also by case) and file/folder clashes."""

    def __init__(self, label: str):
        self.label, self.files, self.dirs, self.folded = label, set(), set(), {}

    def add(self, rel: str, is_dir: bool) -> None:
        folded = rel.casefold()
        if rel in self.files or (not is_dir and rel in self.dirs) or (is_dir and rel in self.files):
            raise BundleError(f"{self.label}: member '{rel}' appears twice or clashes with a folder")
        if not is_dir and self.folded.get(folded, rel) != rel:
            raise BundleError(f"{self.label}: members '{self.folded[folded]}' and '{rel}' differ only by case")
        parents = PurePosixPath(rel).parents
        for parent in list(parents)[:-1]:
            if parent.as_posix() in self.files:
                raise BundleError(f"{self.label}: member '{rel}' is under '{parent}', which is a file")
            self.dirs.add(parent.as_posix())
        if is_dir:
            self.dirs.add(rel)
        else:
            self.files.add(rel)
            self.folded[folded] = rel


def _extract_into(tar: tarfile.TarFile, root: Path, label: str, max_bytes: int, bound_by: str) -> list[str]:
    names = _Names(label)
    total = 0
    for member in tar:
        if member.isdir() and member.name.rstrip("/") == ".":  # the folder itself, as `tar -C folder .` names it
            continue
        rel = _member_path(label, member.name)
        total += max(member.size, 0)
        if total > max_bytes:  # before a byte of it is inflated: a gzip bomb stops here
            raise BundleError(f"{label}: the archive holds more than the {max_bytes} bytes {bound_by} "
                              f"(at member '{rel}'); refused")
        if member.issym() or member.islnk():
            raise BundleError(f"{label}: member '{rel}' is a link (to '{member.linkname}'); archives may hold files only")
        if member.isdir():
            names.add(rel, is_dir=True)
            (root / rel).mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
            continue
        if not member.isreg():
            raise BundleError(f"{label}: member '{rel}' is a device, fifo or other special file; archives may hold files only")
        names.add(rel, is_dir=False)
        target = root / rel
        target.parent.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        src = tar.extractfile(member)
        with open(target, "xb") as out:
            shutil.copyfileobj(src, out, _CHUNK)
        os.chmod(target, _EXEC_MODE if member.mode & 0o111 else _FILE_MODE)
    # Read to the end of the gzip stream so its CRC and length are checked too (bounded as well).
    while chunk := tar.fileobj.read(_CHUNK):
        total += len(chunk)
        if total > max_bytes + _TRAILER_SLACK:
            raise BundleError(f"{label}: the archive goes on past its members ({total} bytes inflated); refused")
    return sorted(names.files)


def archived_manifest(path: Path, max_bytes: int = 16 << 20) -> dict | None:
    """The manifest.json inside the bundle archive at `path`, or None when it is not one (read as a
    stream, nothing extracted): how a build knows a `.tar.gz` at its output path is its own."""
    try:
        with tarfile.open(path, mode="r|gz") as tar:
            for member in tar:
                if member.name == "manifest.json" and member.isfile() and member.size <= max_bytes:
                    data = json.loads(tar.extractfile(member).read())
                    return data if isinstance(data, dict) and "digest" in data and "files" in data else None
    except (OSError, tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, ValueError, RecursionError):
        return None
    return None


def safe_extract(source: bytes | Path, dest: Path, max_bytes: int | None = None) -> list[str]:
    """Extract the tar.gz `source` (bytes or a path) into the folder `dest`, atomically.

    Refuses (BundleError naming the member) absolute names, '..', symbolic and hard links,
    devices and fifos, names that appear twice or differ only by case, truncated or corrupt
    archives, and more than `max_bytes` of contents (what the bundle's manifest declares, when the
    caller knows it) or than a hundred times the archive's own size. `dest` must not exist or be an
    empty folder; on any refusal it is left untouched. Returns the extracted files' relative paths,
    sorted."""
    dest = Path(dest)
    label = "archive" if isinstance(source, (bytes, bytearray)) else str(source)
    try:
        size = len(source) if isinstance(source, (bytes, bytearray)) else Path(source).stat().st_size
    except OSError as e:
        raise BundleError(f"{label}: cannot open archive ({e.strerror})") from None
    # The ratio bounds a declared size too: a registry that forges a whole self-consistent manifest
    # (its digest recomputed) lifts what it declares, but not what its archive may inflate to.
    ratio_bound = _DEFAULT_RATIO * size + _TRAILER_SLACK
    bound = (max_bytes, "its bundle declares") if max_bytes is not None and max_bytes <= ratio_bound else \
        (ratio_bound, f"{_DEFAULT_RATIO} times its own {size} bytes allow")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise BundleError(f"{dest}: exists and is not an empty folder; refusing to extract {label} over it")
    with staging_dir(dest) as stage:
        root = stage / "x"
        root.mkdir()
        try:
            fileobj = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else open(source, "rb")
        except OSError as e:
            raise BundleError(f"{label}: cannot open archive ({e.strerror})") from None
        try:
            with fileobj, tarfile.open(fileobj=fileobj, mode="r:gz") as tar:
                files = _extract_into(tar, root, label, *bound)
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise BundleError(f"{label}: archive is truncated or corrupt ({e}); a bundle is a folder or the "
                              ".tar.gz DeepJIT made of one") from None
        except OSError as e:
            raise cannot_write(dest, e) from None
        replace_dir(root, dest)
    log.debug("extracted %d files from %s into %s", len(files), label, dest)
    return files
