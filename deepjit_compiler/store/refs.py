"""References to stores and bundles (`file://PATH:TAG`, `oci://HOST/REPO@sha256:...`, a bare TAG), and
what every store answers with; see the package docstring for the forms."""
from __future__ import annotations

import abc
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

from ..bundle.view import BundleView
from ..errors import StoreError
from ..spec.models import LEVELS

TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_REPO_RE = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_HOST_RE = re.compile(r"(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\])(?::[0-9]{1,5})?")
_FORMS = ("file://PATH[:TAG], oci://HOST[:PORT]/REPO[:TAG], either with @sha256:<hex> instead of "
          ":TAG, or a bare TAG for the default store")


@dataclass(frozen=True, slots=True)
class Ref:
    """A parsed reference: the store's URL and at most one of tag and digest."""

    store: str
    tag: str | None = None
    digest: str | None = None

    def __str__(self) -> str:
        if self.digest:
            return f"{self.store}@{self.digest}"
        return f"{self.store}:{self.tag}" if self.tag else self.store


@dataclass(frozen=True, slots=True)
class PushResult:
    """`ref`: the tagged reference pushed; `digest`: the bundle's digest (what `deepjit inspect`
    shows); `pinned`: a reference that pulls exactly this content."""

    ref: str
    digest: str
    pinned: str


@dataclass(frozen=True, slots=True)
class Entry:
    """One tag of a store, for `deepjit ls`: bundle digest, bundle name, archive size in bytes, and
    the status of each validation level the bundle records (empty when the store does not say)."""

    tag: str
    digest: str
    name: str
    size: int
    levels: Mapping[str, str] = field(default_factory=dict)


def level_statuses(manifest: Any) -> dict[str, str]:
    """{level: status} from a bundle manifest's validation record, levels in their run order; {} for
    anything malformed."""
    validation = manifest.get("validation") if isinstance(manifest, Mapping) else None
    levels = validation.get("levels") if isinstance(validation, Mapping) else None
    if not isinstance(levels, Mapping):
        return {}
    order = {name: i for i, name in enumerate(LEVELS)}
    return {str(k): str(v.get("status", "unknown")) for k, v in sorted(levels.items(), key=lambda kv: (
        order.get(kv[0], len(order)), str(kv[0]))) if isinstance(v, Mapping)}


class Store(abc.ABC):
    """A place bundles are pushed to and pulled from; see file.py and oci.py."""

    url: str

    @abc.abstractmethod
    def push(self, bundle: Path | BundleView, tag: str, *, force: bool = False) -> PushResult:
        """Store the (verified) bundle under `tag`. A tag that already names other content is
        refused with StoreError unless `force`; pushing the same content again succeeds."""

    @abc.abstractmethod
    def pull(self, tag_or_digest: str, dest: Path) -> Path:
        """Fetch a bundle into the folder `dest`, verify every digest, then move it into place;
        returns `dest`. Tampered or truncated content raises StoreError or BundleError."""

    @abc.abstractmethod
    def ls(self) -> list[Entry]:
        """Every tag of the store, sorted by tag."""


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not TAG_RE.fullmatch(tag):
        raise StoreError(f"tag {tag!r} is not valid: use letters, digits, '_', '.' and '-' "
                         "(at most 128, not starting with '.' or '-')")
    return tag


def default_store_url() -> str:
    """The store a bare TAG refers to: a folder in the user's data directory."""
    return "file://" + str(platformdirs.user_data_path("deepjit") / "store")


def _split_digest(rest: str, ref: str) -> tuple[str, str | None]:
    head, at, digest = rest.rpartition("@")
    if not at or "/" in digest:  # none, or an '@' in a folder of a file:// store's path (file:///a@b/store)
        return rest, None
    if not DIGEST_RE.fullmatch(digest):
        raise StoreError(f"reference '{ref}': '@{digest}' is not a digest (sha256: and 64 lowercase hex digits)")
    return head, digest


def _split_tag(rest: str, ref: str) -> tuple[str, str | None]:
    last = rest.rsplit("/", 1)[-1]
    if ":" not in last:
        return rest, None
    head, tag = rest.rsplit(":", 1)
    check_tag(tag)
    return head, tag


def _parse_oci(rest: str, ref: str) -> tuple[str, str]:
    host, _, repo = rest.partition("/")
    if not host or not _HOST_RE.fullmatch(host):
        raise StoreError(f"reference '{ref}': '{host}' is not a registry HOST[:PORT]; expected {_FORMS}")
    if not _REPO_RE.fullmatch(repo):
        raise StoreError(f"reference '{ref}': repository '{repo}' must be lowercase letters, digits and "
                         "'.', '_', '-' separators, in '/'-separated parts (oci://HOST[:PORT]/REPO[:TAG])")
    return host, repo


_USERINFO = re.compile(r"(?P<scheme>[a-z]+://)[^/@\s]*@")


def redact(text: str) -> str:
    """`text` with the credentials of any `scheme://user:password@host` reference replaced by ***
    (a lone user part may be a token too)."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}***@", text)


def _tag_and_digest(ref: str) -> StoreError:
    return StoreError(f"reference '{ref}' names a tag and a digest: give one (the digest pins the bundle exactly, "
                      "a tag may move)")


def parse_ref(ref: str, *, default_store: str | None = None) -> Ref:
    """Parse a reference (see the module docstring) into Ref(store, tag, digest). `store` is
    normalised: `file://` + an absolute path, or `oci://HOST[:PORT]/REPO`. Credentials inside a
    reference are refused (and never printed): they would travel wherever the reference goes."""
    if not isinstance(ref, str) or not ref:
        raise StoreError(f"empty reference; expected {_FORMS}")
    if ref.startswith("oci://") and "@" in ref[len("oci://"):].split("/", 1)[0]:
        raise StoreError(f"reference '{redact(ref)}': credentials in a reference are refused; set "
                         "DEEPJIT_REGISTRY_USER, DEEPJIT_REGISTRY_PASSWORD and DEEPJIT_REGISTRY_HOST, or `docker login`")
    if "://" not in ref:
        rest, digest = _split_digest(ref, ref)
        if rest and (("/" in rest) or ":" in rest):
            raise StoreError(f"reference '{ref}' has no scheme; expected {_FORMS}")
        if rest and digest:  # `tag@digest`: push used the tag, pull the digest
            raise _tag_and_digest(ref)
        tag = check_tag(rest) if rest else None
        base = parse_ref(default_store or default_store_url())
        return Ref(base.store, tag, digest)
    scheme, rest = ref.split("://", 1)
    rest, digest = _split_digest(rest, ref)
    if digest and ":" in rest.rsplit("/", 1)[-1]:  # `store:tag@digest` (read as a store `s:t`, it was `s`)
        raise _tag_and_digest(ref)
    if scheme == "file":
        path, tag = _split_tag(rest, ref) if not digest else (rest, None)
        if not path:
            raise StoreError(f"reference '{ref}' names no folder; expected file://PATH[:TAG]")
        if ":" in Path(path).name:  # `run:3` in `file://run:3:v1` would be read as store `run`, tag `3` again
            raise StoreError(f"reference '{ref}': the store folder '{Path(path).name}' holds ':', which a "
                             "reference reads as the start of a tag; allowed: a store folder name without ':'")
        store = "file://" + str(Path(path).expanduser().absolute())
    elif scheme == "oci":
        if "/" not in rest:
            raise StoreError(f"reference '{ref}' names no repository; expected oci://HOST[:PORT]/REPO[:TAG]")
        rest, tag = _split_tag(rest, ref) if not digest else (rest, None)
        host, repo = _parse_oci(rest, ref)
        store = f"oci://{host}/{repo}"
    else:
        raise StoreError(f"reference '{ref}': unknown scheme '{scheme}://'; expected {_FORMS}")
    return Ref(store, tag, digest)
