"""Artifact storage for bundles: references, `open_store(url)` and the push / pull / ls verbs.

References (REF in `deepjit push BUNDLE REF`, `deepjit pull REF [DIR]`, `deepjit ls STORE`):

- `file://PATH[:TAG]` or `file://PATH@sha256:<hex>`: a folder store (`file.py`), content-addressed
  by bundle digest, tags as small files. `file:///abs/path` and `file://relative/path` both work.
- `oci://HOST[:PORT]/REPO[:TAG]` or `...@sha256:<hex>`: an OCI registry (`oci.py`); plain http for
  127.0.0.1, localhost and ::1, https otherwise. Its `@sha256:` is the registry's manifest digest.
- a bare `TAG` or `@sha256:<hex>`: the default store, `file://<user data dir>/deepjit/store`.

Tags follow the OCI rule `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}` in both kinds of store.
"""
from __future__ import annotations

import logging
from pathlib import Path

from ..bundle.folder import read_bundle
from ..bundle.view import BundleView
from ..errors import StoreError
from .file import FileStore
from .oci import OciStore
from .refs import Entry, PushResult, Ref, Store, parse_ref

log = logging.getLogger("deepjit.store")
__all__ = ["Entry", "FileStore", "OciStore", "PushResult", "Ref", "Store", "ls", "open_store", "parse_ref", "pull", "push"]


def open_store(url: str) -> Store:
    """The store for `url` (`file://PATH` or `oci://HOST[:PORT]/REPO`; a tag or digest in the URL is
    ignored here: pass it to push / pull)."""
    ref = parse_ref(url)
    scheme, rest = ref.store.split("://", 1)
    if scheme == "file":
        return FileStore(Path(rest))
    host, repo = rest.split("/", 1)
    return OciStore(host, repo)


def push(bundle: Path | BundleView, ref: str, *, force: bool = False) -> PushResult:
    """`deepjit push BUNDLE REF`: REF must carry a tag. A bundle its accuracy gate rejected is
    refused unless `force` (which also moves a tag that holds other content)."""
    parsed = parse_ref(ref)
    if not parsed.tag:
        raise StoreError(f"reference '{ref}' has no tag; push needs one, e.g. '{parsed.store}:v1'")
    view = read_bundle(bundle)
    failed = [lvl for lvl, rec in view.levels.items() if isinstance(rec, dict) and rec.get("status") == "failed"]
    if failed and not force:
        raise StoreError(f"{view.source}: its accuracy gate rejected this bundle ({', '.join(failed)} failed); "
                         "push it anyway with --force")
    target = open_store(parsed.store)
    if "://" not in ref and isinstance(target, FileStore) and not target.root.exists():
        log.warning("creating the default store %s: a bare TAG refers to it (`deepjit ls %s` lists it)",
                    target.root, target.url)
    return target.push(view, parsed.tag, force=force)


def pull(ref: str, dest: Path | None = None) -> Path:
    """`deepjit pull REF [DIR]`: REF carries a tag or a digest; DIR defaults to ./TAG (or
    ./bundle-<first 12 hex digits> for a digest)."""
    parsed = parse_ref(ref)
    if not (parsed.tag or parsed.digest):
        raise StoreError(f"reference '{ref}' has neither tag nor digest; e.g. '{parsed.store}:v1'")
    if dest is None:
        dest = Path(parsed.tag or "bundle-" + parsed.digest.split(":", 1)[1][:12])
    return open_store(parsed.store).pull(parsed.digest or parsed.tag, Path(dest))


def ls(url: str) -> list[Entry]:
    """`deepjit ls STORE`: the store's tags, sorted."""
    parsed = parse_ref(url)
    if parsed.tag or parsed.digest:
        raise StoreError(f"'{url}' names a tag or digest; `ls` takes a store ('{parsed.store}')")
    return open_store(parsed.store).ls()
