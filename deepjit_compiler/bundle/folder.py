"""The deployable bundle: a folder of files plus `manifest.json`, and its deterministic `.tar.gz`.

The manifest holds the caller's fields (spec text and sha256, model sha256, toolchain, target,
kernels, engines, validation record...) and three fields of this module:

- `schema_version`: the manifest format (SCHEMA_VERSION);
- `files`: `{path: {"sha256": hex, "size": bytes}}` for every file except manifest.json;
- `digest`: `"sha256:<hex>"` over the canonical JSON of the manifest without `digest` (sorted keys,
  `,`/`:` separators, UTF-8). It covers every file's digest, so it names the whole bundle.

`manifest.json` itself is written with sorted keys, an indent of 2 and a trailing newline
(manifest.py makes those bytes and the digest). The same files and fields always give byte-identical
folders, archives and digests: nothing here writes a time or an absolute path, and fields holding an
absolute path of this machine are refused. Writes are atomic: a bundle is assembled in a hidden
`.NAME.tmp-*` folder next to its destination and renamed into place, so an interrupted build leaves
no half bundle.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BundleError, OutputError
from ..files import cannot_write, output_lock, replace_dir, staging_dir
from .archive import archived_manifest, list_files, pack_to, safe_extract, sha256_stream
from .manifest import manifest_bytes, manifest_digest, plain_manifest
from .view import BundleView

log = logging.getLogger("deepjit.bundle")


SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
_OWN_FIELDS = ("schema_version", "files", "digest")
_CHUNK = 1 << 20
_MAX_MANIFEST = 16 << 20  # a manifest this large above a destination is not read to see if it is a bundle's


@dataclass(frozen=True, slots=True)
class BundleInfo:
    """What write_bundle / update_bundle wrote: the folder (or the lone archive), the archive,
    the bundle digest and the manifest as written."""

    path: Path
    archive: Path | None
    digest: str
    manifest: dict[str, Any]


# ---------------------------------------------------------------------------- file names
def _check_rel(path: Any, where: str) -> str:
    if not isinstance(path, str) or not path:
        raise BundleError(f"{where}: {path!r} is not a bundle path (a non-empty relative POSIX path)")
    if path.startswith("/") or "\\" in path or "\x00" in path:
        raise BundleError(f"{where}: '{path}' is absolute or has a backslash or NUL; bundle paths are relative "
                          "POSIX paths")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise BundleError(f"{where}: '{path}' has an empty, '.' or '..' component; bundle paths stay inside the bundle")
    if path == MANIFEST:
        raise BundleError(f"{where}: '{MANIFEST}' is written by DeepJIT itself; pass its fields as `manifest`")
    return path


def _check_names(paths: list[str], where: str) -> None:
    """No file may also be a folder of another, and no two may differ only by case."""
    folded: dict[str, str] = {}
    names = set(paths)
    for path in paths:
        other = folded.setdefault(path.casefold(), path)
        if other != path:
            raise BundleError(f"{where}: '{other}' and '{path}' differ only by case")
        parts = path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in names:
                raise BundleError(f"{where}: '{path}' would be inside '{'/'.join(parts[:i])}', which is a file")


def _copy_in(root: Path, rel: str, content: bytes | os.PathLike) -> dict[str, Any]:
    target = root / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, (bytes, bytearray, memoryview)):
        data = bytes(content)
        target.write_bytes(data)
        entry = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    elif isinstance(content, os.PathLike):
        src = Path(content)
        if not src.is_file():
            raise BundleError(f"files['{rel}']: {src} is not a readable regular file")
        h, size = hashlib.sha256(), 0
        with src.open("rb") as f, target.open("wb") as out:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                size += len(chunk)
                out.write(chunk)
        entry = {"sha256": h.hexdigest(), "size": size}
    else:
        raise BundleError(f"files['{rel}']: a {type(content).__name__} is neither bytes nor a Path")
    os.chmod(target, 0o644)
    return entry


# ---------------------------------------------------------------------------- write
def _refuse_own_fields(fields: Mapping[str, Any]) -> None:
    own = sorted(set(fields) & set(_OWN_FIELDS))
    if own:
        raise BundleError(f"manifest fields {own} are written by DeepJIT itself; leave them out")


def _holds_cwd(dest: Path) -> bool:
    try:
        return Path.cwd().is_relative_to(dest.resolve())
    except OSError:  # the working folder is gone: nothing of it to protect
        return False


def check_replaceable(dest: Path) -> None:
    """Refuse (BundleError) unless `dest` is absent, an empty folder, or a bundle exactly as DeepJIT
    wrote it (it verifies: no file added, changed or missing). A folder that merely holds a
    manifest.json, a user's `app/src/` say, is never replaced: DeepJIT deletes only what it made."""
    dest = Path(dest)
    outer = _enclosing_bundle(dest)
    if outer is not None:
        raise BundleError(f"{dest}: inside the bundle {outer}, which would no longer verify (a file its manifest does "
                          "not list); choose a folder outside it")
    if not dest.exists() and not dest.is_symlink():
        return
    if _holds_cwd(dest):  # replacing it would pull the folder from under the shell
        raise BundleError(f"{str(dest) or '.'}: is the current folder or holds it; refusing to replace it "
                          "(name a folder inside it, e.g. ./bundle)")
    if dest.is_dir() and not dest.is_symlink():
        if not any(dest.iterdir()):
            return
        if (dest / MANIFEST).is_file():
            try:
                verify_folder(dest)
                return
            except BundleError as e:
                why = str(e).split("\n", 1)[-1].strip()
                raise BundleError(f"{dest}: holds a {MANIFEST} but is not a DeepJIT bundle as DeepJIT wrote it "
                                  f"({why}); refusing to replace it: move it away or choose another folder") from None
    raise BundleError(f"{dest}: exists and is not a DeepJIT bundle; refusing to replace it "
                      "(choose another output folder or remove it)")


def _enclosing_bundle(dest: Path) -> Path | None:
    """The DeepJIT bundle a folder above `dest` is (its manifest reads as one), or None. A user's folder
    that merely holds a manifest.json is not one."""
    try:
        parents = dest.absolute().parents
    except OSError:  # a relative path with the working folder gone: nothing above it to judge
        return None
    for parent in parents:
        manifest = parent / MANIFEST
        if manifest.is_file() and manifest.stat().st_size <= _MAX_MANIFEST:
            try:
                _load_manifest(parent, str(parent))
            except BundleError:
                continue
            return parent
    return None


def archive_path(dest: Path) -> Path:
    """Where the .tar.gz of the bundle folder `dest` goes: `<dest>.tar.gz` next to it."""
    dest = Path(dest)
    return dest.with_name(dest.name + ".tar.gz")


def is_bundle_archive(tar_path: Path) -> bool:
    """Whether `tar_path` is a regular file (not a symlink) holding a DeepJIT bundle's manifest: the
    only kind of file at `<dest>.tar.gz` that DeepJIT replaces or removes."""
    tar_path = Path(tar_path)
    return tar_path.is_file() and not tar_path.is_symlink() and archived_manifest(tar_path) is not None


def check_archive_replaceable(dest: Path) -> None:
    """Refuse (BundleError) unless `<dest>.tar.gz` is absent or a DeepJIT bundle archive (any bundle's:
    as with the folder, what DeepJIT wrote at its own output path is its to replace). A user's file, or
    a symlink, there is never overwritten."""
    tar_path = archive_path(dest)
    if (tar_path.exists() or tar_path.is_symlink()) and not is_bundle_archive(tar_path):
        kind = "is a symlink" if tar_path.is_symlink() else "exists and is not a DeepJIT bundle archive"
        raise BundleError(f"{tar_path}: {kind}; refusing to replace it with the bundle's archive "
                          "(move it away, choose another output, or build without an archive)")


def _sealed(dest: Path, manifest: Mapping[str, Any], archive: bool) -> tuple[dict[str, Any], Path]:
    """The caller's manifest fields as written for the bundle at `dest`, and its archive path; refuses
    DeepJIT's own fields, anything not plain JSON, a `dest` that is not a bundle folder and (when
    `archive`) a `<dest>.tar.gz` that is not a bundle archive."""
    _refuse_own_fields(manifest)
    body = plain_manifest(manifest, dest)
    check_replaceable(dest)
    tar_path = archive_path(dest)
    if tar_path.is_dir():
        raise BundleError(f"{tar_path}: is a folder; the bundle archive needs that name")
    if archive:
        check_archive_replaceable(dest)
    return body, tar_path


class StagedBundle:
    """A bundle's files copied into a hidden `.NAME.tmp-*` folder next to `near`, its manifest not yet
    written: a build's GPU levels read it there (`view`), then `commit` writes manifest.json and the
    archive and renames both into place. Leaving the `with` block without a commit removes it all.

    `files` maps bundle-relative POSIX paths (`segments/backbone.onnx`,
    `kernels/decode/yolov8_decode.sm_75.cubin`...) to bytes or to a Path to copy."""

    def __init__(self, near: Path, files: Mapping[str, bytes | Path]):
        entries = {_check_rel(rel, f"files['{rel}']"): content for rel, content in files.items()}
        _check_names(sorted(entries), "files")
        self._exit = ExitStack()
        self._exit.enter_context(output_lock(Path(near)))
        try:
            self.stage = self._exit.enter_context(staging_dir(Path(near)))
            self.root = self.stage / "bundle"
            self.root.mkdir()
            self.listed = {rel: _copy_in(self.root, rel, entries[rel]) for rel in sorted(entries)}
        except OSError as e:
            self.close()
            raise cannot_write(Path(near), e) from None
        except BaseException:
            self.close()
            raise

    def view(self, manifest: Mapping[str, Any]) -> BundleView:
        """The staged bundle with the manifest fields it is about to get (no digest yet)."""
        return BundleView(self.root, {**manifest, "schema_version": SCHEMA_VERSION, "files": self.listed})

    def commit(self, dest: Path, manifest: Mapping[str, Any], *, archive: bool = True) -> BundleInfo:
        """Write manifest.json (and the archive), then rename the folder to `dest` and the archive to
        `<dest>.tar.gz`: each is whole or absent. An existing bundle at `dest` is replaced; any other
        existing folder is refused, and so is a file at `<dest>.tar.gz` that is not a bundle archive.
        Without `archive`, a bundle archive at `<dest>.tar.gz` is removed, whichever bundle it holds:
        it sits at this output's archive path, so left there it would pass for this bundle's archive
        while no longer matching the folder (the same rule replaces any DeepJIT bundle at `dest`, not
        only an earlier build of this one); any other file there stays."""
        dest = Path(dest)
        with output_lock(dest):
            body, tar_path = _sealed(dest, manifest, archive)
            stale = not archive and is_bundle_archive(tar_path)
            body.update(schema_version=SCHEMA_VERSION, files=self.listed)
            body["digest"] = manifest_digest(body)
            try:
                (self.root / MANIFEST).write_bytes(manifest_bytes(body))
                os.chmod(self.root / MANIFEST, 0o644)
                if archive:
                    pack_to(self.root, self.stage / "bundle.tar.gz")
                dest.parent.mkdir(parents=True, exist_ok=True)
                replace_dir(self.root, dest)
                if archive:
                    os.replace(self.stage / "bundle.tar.gz", tar_path)
                elif stale:
                    log.info("removing %s: an archive of an earlier build of this bundle", tar_path)
                    tar_path.unlink()
            except OSError as e:
                raise cannot_write(dest, e) from None
            except OutputError as e:  # a staged file's: name the bundle it was for
                raise OutputError(f"{dest}: cannot write the bundle ({e})") from None
        self.close()
        log.info("wrote bundle %s (%d files, %s)", dest, len(self.listed), body["digest"])
        return BundleInfo(dest, tar_path if archive else None, body["digest"], body)

    def close(self) -> None:
        self._exit.close()

    def __enter__(self) -> StagedBundle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_bundle(dest: Path, files: Mapping[str, bytes | Path], manifest: Mapping[str, Any],
                 *, archive: bool = True) -> BundleInfo:
    """Write the bundle folder `dest` and (when `archive`) `<dest>.tar.gz`, atomically (see StagedBundle).

    `manifest` holds the caller's JSON fields; `schema_version`, `files` and `digest` are added here
    (and refused from the caller). Returns the digest and the manifest as written."""
    _sealed(Path(dest), manifest, archive)  # refuse before copying anything
    with StagedBundle(dest, files) as staged:
        return staged.commit(dest, manifest, archive=archive)


def update_bundle(path: Path, files: Mapping[str, bytes | Path],
                  manifest_updates: Mapping[str, Any]) -> BundleInfo:
    """Add or replace files of the bundle at `path` (folder or .tar.gz) and replace top-level
    manifest fields (dict.update semantics: `{"validation": record}` replaces the whole record).

    The bundle is verified first (a tampered bundle is not updated), then rewritten atomically
    with a new digest: a folder (and its `<folder>.tar.gz`, when it has one), a lone archive in place."""
    path = Path(path)
    _refuse_own_fields(manifest_updates)
    bundle = read_bundle(path)
    manifest = {k: v for k, v in bundle.manifest.items() if k not in _OWN_FIELDS}
    manifest.update(manifest_updates)
    merged: dict[str, bytes | Path] = {rel: bundle.root / rel for rel in bundle.files}
    merged.update(files)
    if path.is_dir():  # its archive, if it has one, is rewritten with it (a user's file there stays)
        return write_bundle(path, merged, manifest, archive=is_bundle_archive(archive_path(path)))
    with staging_dir(path) as stage:
        info = write_bundle(stage / "bundle", merged, manifest)
        os.replace(info.archive, path)
    return BundleInfo(path, path, info.digest, info.manifest)


# ---------------------------------------------------------------------------- read and verify
def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _load_manifest(root: Path, label: str) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise BundleError(f"{label}: no {MANIFEST}; not a DeepJIT bundle")
    try:
        manifest = json.loads(path.read_bytes(), parse_constant=_no_constant)
    except RecursionError:
        raise BundleError(f"{label}: {MANIFEST} is nested absurdly deep; refused") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BundleError(f"{label}: {MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise BundleError(f"{label}: {MANIFEST} is not a JSON object")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BundleError(f"{label}: {MANIFEST} schema_version {version!r} is not supported "
                          f"(this DeepJIT reads {SCHEMA_VERSION})")
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        raise BundleError(f"{label}: {MANIFEST} has no 'files' object")
    for rel, entry in listed.items():
        _check_rel(rel, f"{label}: {MANIFEST} files")
        ok = (isinstance(entry, dict) and isinstance(entry.get("size"), int) and entry["size"] >= 0
              and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64)
        if not ok:
            raise BundleError(f"{label}: {MANIFEST} files['{rel}'] needs 'sha256' (64 hex digits) and 'size'")
    return manifest


def _file_problem(path: Path, rel: str, entry: Mapping[str, Any]) -> str | None:
    size = path.stat().st_size
    if size != entry["size"]:
        return f"'{rel}' has {size} bytes, {MANIFEST} says {entry['size']} (truncated or replaced)"
    with path.open("rb") as f:
        if sha256_stream(f) != entry["sha256"]:
            return f"'{rel}' does not match its sha256 in {MANIFEST} (tampered or corrupt)"
    return None


def verify_folder(root: Path, label: str | None = None) -> dict[str, Any]:
    """Check every file of the bundle folder `root` against manifest.json (no extra, no missing
    file, sizes and sha256) and the manifest against its digest; returns the manifest."""
    root = Path(root)
    label = label or str(root)
    manifest = _load_manifest(root, label)
    listed = set(manifest["files"])
    present = set(list_files(root)) - {MANIFEST}
    problems = [f"'{rel}' is not listed in {MANIFEST}" for rel in sorted(present - listed)]
    problems += [f"'{rel}' is listed in {MANIFEST} but missing" for rel in sorted(listed - present)]
    for rel in sorted(listed & present):
        problem = _file_problem(root / rel, rel, manifest["files"][rel])
        if problem:
            problems.append(problem)
    try:
        digest = manifest_digest(manifest)
    except ValueError as e:
        raise BundleError(f"{label}: {MANIFEST} cannot be digested ({e})") from None
    if manifest.get("digest") != digest:
        problems.append(f"{MANIFEST} 'digest' {manifest.get('digest')!r} does not match its content "
                        f"({digest}): edited after it was written")
    if problems:
        raise BundleError(f"{label}: bundle verification failed:\n  " + "\n  ".join(problems))
    return manifest


def read_bundle(path: Path | BundleView) -> BundleView:
    """Open and verify the bundle at `path`: a bundle folder or its .tar.gz (extracted safely to a
    private temporary folder that lives as long as the returned Bundle). Raises BundleError naming
    each extra, missing, truncated or tampered file, or a manifest edited after the build."""
    if isinstance(path, BundleView):
        return path  # read and verified already
    path = Path(path)
    if path.is_dir():
        return BundleView(path, verify_folder(path), path)
    if not path.is_file():
        raise BundleError(f"{path}: no such bundle (give a bundle folder or its .tar.gz)")
    tmp = tempfile.TemporaryDirectory(prefix="deepjit-bundle-")
    root = Path(tmp.name) / "bundle"
    safe_extract(path, root)
    return BundleView(root, verify_folder(root, str(path)), path, tmp)


def declared_size(manifest: Mapping[str, Any]) -> int:
    """The bytes a bundle's files add up to, as its manifest says (what extracting it may write)."""
    files = manifest.get("files") if isinstance(manifest, Mapping) else None
    entries = files.values() if isinstance(files, Mapping) else ()
    return sum(e["size"] for e in entries if isinstance(e, Mapping) and isinstance(e.get("size"), int)) + \
        len(manifest_bytes(manifest))


def sealed_size(manifest: Any, digest: str) -> int | None:
    """declared_size of `manifest` when it is the manifest sealed as `digest` (its digest field and its
    content both say so), else None: an edited copy's sizes must not lift the gzip-bomb bound."""
    try:
        sealed = isinstance(manifest, dict) and manifest.get("digest") == digest == manifest_digest(manifest)
    except (ValueError, RecursionError):  # NaN, inf or absurd nesting: no manifest DeepJIT wrote
        return None
    return declared_size(manifest) if sealed else None


def unpack_bundle(archive: bytes | Path, dest: Path, *, expected_digest: str | None = None,
                  max_bytes: int | None = None) -> BundleView:
    """Extract a bundle archive into the folder `dest`, verify it (and that its digest is
    `expected_digest` when given), and only then move it into place. An existing bundle at `dest` is
    replaced; any other existing folder is refused. `max_bytes`: what its manifest declares (a store
    knows it before unpacking), so a bomb stops there."""
    dest = Path(dest)
    label = "bundle archive" if isinstance(archive, (bytes, bytearray)) else str(archive)
    with output_lock(dest), staging_dir(dest) as stage:
        check_replaceable(dest)
        root = stage / "bundle"
        safe_extract(archive, root, max_bytes)
        manifest = verify_folder(root, label)
        if expected_digest is not None and manifest["digest"] != expected_digest:
            raise BundleError(f"{label}: bundle digest {manifest['digest']} is not the expected {expected_digest}")
        replace_dir(root, dest)
    return BundleView(dest, manifest, dest)
