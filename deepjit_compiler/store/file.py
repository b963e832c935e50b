"""The folder store (`file://PATH`), DeepJIT's default.

Layout (content-addressed by the bundle digest, which covers every file of the bundle):

    PATH/blobs/sha256/<hex>.tar.gz          the deterministic bundle archive
    PATH/blobs/sha256/<hex>.manifest.json   its manifest.json, read by `ls` without unpacking
    PATH/tags/<tag>                         'sha256:<hex>\\n'
    PATH/.lock                              flock'ed while a tag is read and moved

Safe for concurrent pushes: blobs are written to a temporary file and renamed (two writers of
one digest write identical bytes), and a tag is compared and moved under an exclusive flock, so
of two pushes of one tag with different content exactly one wins and the other is refused
(unless forced). A tag never points at a blob that is not complete.
"""
from __future__ import annotations

import fcntl
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..bundle.archive import pack_to
from ..bundle.folder import MANIFEST, check_replaceable, read_bundle, sealed_size, unpack_bundle
from ..bundle.view import BundleView
from ..errors import BundleError, StoreError, closest
from ..files import atomic_write, cannot_write, read_regular, remove_old_temporaries
from .refs import DIGEST_RE, TAG_RE, Entry, PushResult, Store, check_tag, level_statuses

log = logging.getLogger("deepjit.store")
_MAX_TAG = 4096         # a tag holds 'sha256:<64 hex>\n': a planted giant file is not read whole
_MAX_META = 16 << 20    # a manifest is a few KB


class FileStore(Store):
    """Bundles in a folder; see the module docstring for the layout."""

    def __init__(self, root: Path):
        self.root = Path(root).expanduser().absolute()
        self.url = f"file://{self.root}"
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"{self.url}: {self.root} exists and is not a folder")
        self._blobs = self.root / "blobs" / "sha256"
        self._tags = self.root / "tags"

    def __repr__(self) -> str:
        return f"FileStore({str(self.root)!r})"

    def _blob(self, digest: str) -> Path:
        return self._blobs / f"{digest.split(':', 1)[1]}.tar.gz"

    def _meta(self, digest: str) -> Path:
        return self._blobs / f"{digest.split(':', 1)[1]}.manifest.json"

    @contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            lock = open(self.root / ".lock", "ab")
        except OSError as e:
            raise cannot_write(self.root, e) from None
        with lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                for folder in (self._blobs, self._tags):  # what interrupted pushes left
                    remove_old_temporaries(folder)
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _read_tag(self, tag: str) -> str | None:
        """The digest the tag names, None if there is no such tag; StoreError for anything but a
        small regular file holding a digest (a folder, a FIFO, binary junk)."""
        path = self._tags / tag
        try:
            text = read_regular(path, _MAX_TAG).decode("ascii", errors="replace").strip()
            problem = "" if DIGEST_RE.fullmatch(text) else "it holds no digest"
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # its content is not echoed: the tag may be anything
            problem = e.strerror if isinstance(e, OSError) else str(e)
        if problem:
            raise StoreError(f"{self.url}: tag file {path} is corrupt ({problem}; expected a regular file "
                             "holding 'sha256:<64 hex digits>')")
        return text

    def _declared_size(self, digest: str) -> int | None:
        """The bytes the bundle `digest` unpacks to, from its stored manifest.json, trusted only when
        that manifest's own digest is `digest` (so its sizes are the sealed ones: an edited copy must
        not lift the gzip-bomb bound); else None, and the archive's own size bounds unpacking."""
        meta = self._meta(digest)
        try:
            size = sealed_size(json.loads(read_regular(meta, _MAX_META)), digest)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError):
            size = None
        if size is None:
            log.warning("%s: %s does not match %s; its sizes are ignored", self.url, meta.name, digest)
        return size

    def _tags_list(self) -> list[str]:
        if not self._tags.is_dir():
            return []
        return sorted(p.name for p in self._tags.iterdir() if TAG_RE.fullmatch(p.name))

    def push(self, bundle: Path | BundleView, tag: str, *, force: bool = False) -> PushResult:
        check_tag(tag)
        b = read_bundle(bundle)
        digest = b.digest
        with self._locked():
            current = self._read_tag(tag)
            if current not in (None, digest) and not force:  # refused before a byte is written
                raise StoreError(f"{self.url}: tag '{tag}' already holds {current}, not this bundle "
                                 f"({digest}); push with --force to move it")
            # Blobs before the tag, so a tag only ever names a complete blob.
            if not self._blob(digest).is_file():
                pack_to(b.root, self._blob(digest))
            atomic_write(self._meta(digest), (b.root / MANIFEST).read_bytes())
            if current != digest:
                atomic_write(self._tags / tag, f"{digest}\n".encode())
        log.info("pushed %s to %s:%s%s", digest, self.url, tag, " (unchanged)" if current == digest else "")
        return PushResult(f"{self.url}:{tag}", digest, f"{self.url}@{digest}")

    def _check_is_store(self) -> None:
        """Reading a store that is not one is bad input: a missing folder, or one holding other things."""
        if not self.root.is_dir():
            raise StoreError(f"{self.url}: no store there ({self.root} does not exist; a push creates it)")
        if not (self._tags.is_dir() or self._blobs.is_dir()) and any(self.root.iterdir()):
            raise StoreError(f"{self.url}: {self.root} is not a DeepJIT store (no tags/ or blobs/ in it)")

    def _resolve(self, tag_or_digest: str) -> str:
        if DIGEST_RE.fullmatch(tag_or_digest):
            return tag_or_digest
        check_tag(tag_or_digest)
        digest = self._read_tag(tag_or_digest)
        if digest is None:
            self._check_is_store()
            raise StoreError(f"{self.url}: no tag '{tag_or_digest}'{closest(tag_or_digest, self._tags_list())}")
        return digest

    def pull(self, tag_or_digest: str, dest: Path) -> Path:
        digest = self._resolve(tag_or_digest)
        check_replaceable(Path(dest))
        blob = self._blob(digest)
        if not blob.is_file():
            raise StoreError(f"{self.url}: no bundle {digest} in the store")
        try:
            unpack_bundle(blob, Path(dest), expected_digest=digest, max_bytes=self._declared_size(digest))
        except BundleError as e:
            raise StoreError(f"{self.url}: refusing {tag_or_digest}: the stored bundle failed verification: {e}") from None
        log.info("pulled %s from %s into %s", digest, self.url, dest)
        return Path(dest)

    def ls(self) -> list[Entry]:
        self._check_is_store()
        entries = []
        for tag in self._tags_list():
            try:
                digest = self._read_tag(tag)
            except StoreError as e:  # one bad tag file: say so, list the rest
                log.warning("%s", e)
                continue
            if digest is None:  # removed meanwhile
                continue
            blob, meta = self._blob(digest), self._meta(digest)
            try:
                manifest = json.loads(read_regular(meta, _MAX_META))
                name = str(manifest.get("name") or "")
            except (OSError, ValueError, AttributeError, RecursionError):
                manifest, name = None, ""
            size = blob.stat().st_size if blob.is_file() else 0
            entries.append(Entry(tag, digest, name, size, level_statuses(manifest)))
        return entries
