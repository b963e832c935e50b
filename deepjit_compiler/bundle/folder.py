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

from ..errors import BundleError
from ..files import replace_dir, staging_dir
from .archive import list_files, pack_to, safe_extract, sha256_stream
from .manifest import manifest_bytes, manifest_digest, plain_manifest
from .view import BundleView

log = logging.getLogger("deepjit.bundle")


SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
_OWN_FIELDS = ("schema_version", "files", "digest")
_CHUNK = 1 << 20


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
        raise BundleError(f"{where}: '{path}' is absolute or has a backslash; bundle paths are relative POSIX paths")
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


def check_replaceable(dest: Path) -> None:
    """Refuse (BundleError) unless `dest` is absent, an empty folder or a bundle folder."""
    if not dest.exists() and not dest.is_symlink():
        return
    if dest.is_dir() and not dest.is_symlink() and ((dest / MANIFEST).is_file() or not any(dest.iterdir())):
        return
    raise BundleError(f"{dest}: exists and is not a DeepJIT bundle; refusing to replace it "
                      "(choose another output folder or remove it)")


def archive_path(dest: Path) -> Path:
    """Where the .tar.gz of the bundle folder `dest` goes: `<dest>.tar.gz` next to it."""
    dest = Path(dest)
    return dest.with_name(dest.name + ".tar.gz")


def _sealed(dest: Path, manifest: Mapping[str, Any]) -> tuple[dict[str, Any], Path]:
    """The caller's manifest fields as written for the bundle at `dest`, and its archive path; refuses
    DeepJIT's own fields, anything not plain JSON, and a `dest` that is not a bundle folder."""
    _refuse_own_fields(manifest)
    body = plain_manifest(manifest, dest)
    check_replaceable(dest)
    tar_path = archive_path(dest)
    if tar_path.is_dir():
        raise BundleError(f"{tar_path}: is a folder; the bundle archive needs that name")
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
        self.stage = self._exit.enter_context(staging_dir(Path(near)))
        try:
            self.root = self.stage / "bundle"
            self.root.mkdir()
            self.listed = {rel: _copy_in(self.root, rel, entries[rel]) for rel in sorted(entries)}
        except BaseException:
            self.close()
            raise

    def view(self, manifest: Mapping[str, Any]) -> BundleView:
        """The staged bundle with the manifest fields it is about to get (no digest yet)."""
        return BundleView(self.root, {**manifest, "schema_version": SCHEMA_VERSION, "files": self.listed})

    def commit(self, dest: Path, manifest: Mapping[str, Any], *, archive: bool = True) -> BundleInfo:
        """Write manifest.json (and the archive), then rename the folder to `dest` and the archive to
        `<dest>.tar.gz`: each is whole or absent. An existing bundle at `dest` is replaced; any other
        existing folder is refused."""
        dest = Path(dest)
        body, tar_path = _sealed(dest, manifest)
        body.update(schema_version=SCHEMA_VERSION, files=self.listed)
        body["digest"] = manifest_digest(body)
        (self.root / MANIFEST).write_bytes(manifest_bytes(body))
        os.chmod(self.root / MANIFEST, 0o644)
        if archive:
            pack_to(self.root, self.stage / "bundle.tar.gz")
        dest.parent.mkdir(parents=True, exist_ok=True)
        replace_dir(self.root, dest)
        if archive:
            os.replace(self.stage / "bundle.tar.gz", tar_path)
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
    _sealed(Path(dest), manifest)  # refuse before copying anything
    with StagedBundle(dest, files) as staged:
        return staged.commit(dest, manifest, archive=archive)


def update_bundle(path: Path, files: Mapping[str, bytes | Path],
                  manifest_updates: Mapping[str, Any]) -> BundleInfo:
    """Add or replace files of the bundle at `path` (folder or .tar.gz) and replace top-level
    manifest fields (dict.update semantics: `{"validation": record}` replaces the whole record).

    The bundle is verified first (a tampered bundle is not updated), then rewritten atomically
    with a new digest: a folder together with its `<folder>.tar.gz`, a lone archive in place."""
    path = Path(path)
    _refuse_own_fields(manifest_updates)
    bundle = read_bundle(path)
    manifest = {k: v for k, v in bundle.manifest.items() if k not in _OWN_FIELDS}
    manifest.update(manifest_updates)
    merged: dict[str, bytes | Path] = {rel: bundle.root / rel for rel in bundle.files}
    merged.update(files)
    if path.is_dir():
        return write_bundle(path, merged, manifest)
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


def unpack_bundle(archive: bytes | Path, dest: Path, *, expected_digest: str | None = None) -> BundleView:
    """Extract a bundle archive into the folder `dest`, verify it (and that its digest is
    `expected_digest` when given), and only then move it into place. An existing bundle folder at
    `dest` is replaced; any other existing folder is refused."""
    dest = Path(dest)
    label = "bundle archive" if isinstance(archive, (bytes, bytearray)) else str(archive)
    check_replaceable(dest)
    with staging_dir(dest) as stage:
        root = stage / "bundle"
        safe_extract(archive, root)
        manifest = verify_folder(root, label)
        if expected_digest is not None and manifest["digest"] != expected_digest:
            raise BundleError(f"{label}: bundle digest {manifest['digest']} is not the expected {expected_digest}")
        replace_dir(root, dest)
    return BundleView(dest, manifest, dest)


# ---------------------------------------------------------------------------- inspect
def _summary(value: Any) -> Any:
    """Long texts (rendered sources, logs) shortened for display."""
    if isinstance(value, dict):
        return {k: _summary(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_summary(v) for v in value]
    if isinstance(value, str) and (len(value) > 160 or "\n" in value):
        return f"<{len(value)} characters>"
    return value


def _entries(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [_summary({"name": k, **v}) if isinstance(v, dict) else _summary({"name": k, "value": v})
                for k, v in value.items()]
    return _summary(list(value)) if isinstance(value, list) else []


def engine_summary(b: BundleView) -> dict[str, Any]:
    """How the bundle's segments run: the backend decision and why, and each segment's ONNX and plans
    (flavour, library version, compute capabilities, size, network layers, I/O tensors)."""
    e = b.engine
    segments = {}
    for name in dict.fromkeys([*e.segments, *e.plans]):
        plans = [{"file": p.file, "flavour": p.flavour, "library": p.library, "version": p.version,
                  "compute_capabilities": list(p.compute_capabilities),
                  "size": (b.files.get(p.file) or {}).get("size"), "network_layers": p.network_layers,
                  "inputs": [dict(t) for t in p.inputs], "outputs": [dict(t) for t in p.outputs],
                  "profiles": dict(p.profiles)} for p in e.plans.get(name, ())]
        segments[name] = {"onnx": list(e.segments.get(name, ())), "plans": plans}
    return {"backend": e.backend, "deferred": e.deferred, "reason": e.reason, "precision": e.precision,
            "segments": segments}


def describe(bundle: BundleView | Path) -> dict[str, Any]:
    """A JSON-ready summary for `deepjit inspect BUNDLE`: name, digest, target, toolchain, spec and
    model hashes, files (path, size, sha256), kernels, engines and validation level statuses."""
    b = read_bundle(bundle)
    m = b.manifest
    files = [{"path": rel, "size": e["size"], "sha256": e["sha256"]} for rel, e in sorted(b.files.items())]
    validation = m.get("validation") if isinstance(m.get("validation"), dict) else {}
    levels = validation.get("levels") if isinstance(validation.get("levels"), dict) else {}
    return {
        "path": str(b.source),
        "name": m.get("name"),
        "digest": m["digest"],
        "schema_version": m["schema_version"],
        "target": _summary(m.get("target")),
        "toolchain": _summary(m.get("toolchain")),
        "spec_sha256": (m.get("spec") or {}).get("sha256") if isinstance(m.get("spec"), dict) else None,
        "model_sha256": (m.get("model") or {}).get("sha256") if isinstance(m.get("model"), dict) else None,
        "files": files,
        "total_size": sum(f["size"] for f in files),
        "kernels": _entries(m.get("kernels")),
        "engines": _entries(m.get("engines")),
        "engine": engine_summary(b),
        "validation": {lvl: rec.get("status", "unknown") if isinstance(rec, dict) else "unknown"
                       for lvl, rec in sorted(levels.items())},
    }
