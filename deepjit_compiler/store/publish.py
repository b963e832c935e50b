"""`publish:` in the spec: push a bundle after a passing gate, if its validation record satisfies
the policy.

The gate writes `manifest["validation"]["levels"][level] = {"status": "passed" | "failed" |
"not_run", "reason": str, ...}` for the levels in LEVELS. A policy `require: [...]` accepts the
bundle only when every required level is present with status "passed"; otherwise nothing is
pushed and StoreError names each level that did not run or did not pass, with its reason.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..bundle.folder import read_bundle
from ..bundle.view import BundleView
from ..errors import StoreError, closest
from ..spec.models import LEVELS
from . import PushResult, open_store, parse_ref

log = logging.getLogger("deepjit.publish")


def check_policy(manifest: Mapping[str, Any], require: Sequence[str]) -> None:
    """Raise StoreError unless every level in `require` passed in the manifest's validation record."""
    unknown = [lvl for lvl in require if lvl not in LEVELS]
    if unknown:
        raise StoreError("publish.require: " + "; ".join(
            f"unknown level '{lvl}'{closest(lvl, LEVELS)}" for lvl in unknown) + f" (levels: {', '.join(LEVELS)})")
    validation = manifest.get("validation")
    levels = validation.get("levels") if isinstance(validation, Mapping) else None
    levels = levels if isinstance(levels, Mapping) else {}
    refused = []
    for lvl in dict.fromkeys(require):
        record = levels.get(lvl)
        if not isinstance(record, Mapping):
            refused.append(f"{lvl}: did not run (no record in the bundle's validation record)")
            continue
        status = record.get("status", "not_run")
        if status != "passed":
            verb = "did not run" if status == "not_run" else f"did not pass ({status})"
            reason = record.get("reason")
            refused.append(f"{lvl}: {verb}" + (f": {reason}" if reason else ""))
    if refused:
        name = manifest.get("name") or manifest.get("digest") or "bundle"
        raise StoreError(f"publish refused for {name}: the policy requires "
                         f"{', '.join(dict.fromkeys(require))}, but\n  " + "\n  ".join(refused))


def publish(bundle_path: Path | BundleView, store_url: str, tag: str | None, require: Sequence[str],
            *, force: bool = False) -> PushResult:
    """Verify the bundle, check the policy, then push it to `store_url` under `tag`.

    `store_url` is `file://PATH` or `oci://HOST[:PORT]/REPO`; it may carry the tag itself
    (`oci://host/repo:v1`) when `tag` is None. Nothing is pushed when the policy refuses."""
    ref = parse_ref(store_url)
    if ref.digest:
        raise StoreError(f"publish.to: '{store_url}' names a digest; publish needs a store and a tag")
    if tag and ref.tag and tag != ref.tag:
        raise StoreError(f"publish: the tag '{tag}' differs from the one in '{store_url}'")
    tag = tag or ref.tag
    if not tag:
        raise StoreError(f"publish.to: '{store_url}' has no tag; e.g. '{ref.store}:v1'")
    bundle = read_bundle(bundle_path)
    check_policy(bundle.manifest, require)
    result = open_store(ref.store).push(bundle, tag, force=force)
    log.info("published %s as %s", result.digest, result.ref)
    return result
