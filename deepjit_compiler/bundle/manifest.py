"""The bundle manifest as bytes: its canonical JSON, its digest, and the check that the caller's
fields are plain JSON holding no path of this machine (so the same build gives the same digest).
bundle.py writes, reads and verifies bundles with these.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import BundleError


def canonical_json(value: Any) -> bytes:
    """The bytes the digest is taken over: sorted keys, no spaces, UTF-8, no NaN."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """'sha256:<hex>' over the canonical JSON of `manifest` without its `digest` field."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return "sha256:" + hashlib.sha256(canonical_json(body)).hexdigest()


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    """manifest.json as written: sorted keys, an indent of 2, a trailing newline."""
    return (json.dumps(manifest, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode()


def _local_roots(dest: Path) -> tuple[str, ...]:
    """Folders of this machine whose paths must never end up in a bundle."""
    roots = set()
    for get in (Path.home, lambda: Path(tempfile.gettempdir()), Path.cwd, lambda: dest.parent.absolute()):
        try:
            p = get()
        except (OSError, RuntimeError):  # no home, or a deleted working folder
            continue
        roots.update({str(p), os.path.realpath(p)})
    return tuple(sorted(r.rstrip("/") for r in roots if r not in ("", "/")))


def _is_local_path(text: str, roots: tuple[str, ...]) -> bool:
    # Multi-line text (the spec) may quote paths; only a field that *is* a path is refused.
    # ONNX tensor names such as '/model.22/Concat' start with '/' too: they neither exist here
    # nor sit under home, temp, cwd or the output folder.
    if "\n" in text or not text.startswith("/") or text == "/":
        return False
    return any(text == r or text.startswith(r + "/") for r in roots) or os.path.lexists(text)


def _plain(value: Any, where: str, roots: tuple[str, ...]) -> Any:
    """A JSON-ready copy of a manifest value; BundleError naming the field for anything else."""
    name = where or "<manifest>"
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise BundleError(f"manifest field '{name}': key {key!r} is not a string")
            out[key] = _plain(item, f"{where}.{key}" if where else key, roots)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{name}[{i}]", roots) for i, item in enumerate(value)]
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        if not math.isfinite(value):
            raise BundleError(f"manifest field '{name}': {value} is not a finite number (JSON has no NaN or inf)")
        return float(value)
    if isinstance(value, str):
        if _is_local_path(value, roots):
            raise BundleError(
                f"manifest field '{name}': '{value}' is an absolute path of this machine; bundles are "
                "relocatable and reproducible: store a bundle-relative path or a file name instead")
        return value
    raise BundleError(f"manifest field '{name}': a {type(value).__name__} is not JSON "
                      "(allowed: str, int, float, bool, None, lists and string-keyed mappings)")


def plain_manifest(fields: Mapping[str, Any], dest: Path) -> dict[str, Any]:
    """A JSON-ready copy of the caller's manifest fields for the bundle at `dest`; BundleError names
    the field holding anything that is not plain JSON or is an absolute path of this machine."""
    return _plain(fields, "", _local_roots(dest))
