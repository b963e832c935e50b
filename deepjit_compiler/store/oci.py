"""The OCI registry store (`oci://HOST[:PORT]/REPO`), through the oras Python client.

A bundle is one OCI artifact manifest:

    artifactType  application/vnd.deepjit.bundle.v1
    config        application/vnd.deepjit.manifest.v1+json          = the bundle's manifest.json
    layers[0]     application/vnd.deepjit.bundle.layer.v1.tar+gzip  = the deterministic tarball
    annotations   dev.deepjit.bundle.digest / .name                  (read by `ls` and `pull`)

The manifest is serialised canonically, so one bundle always gets one manifest digest.
Plain http is used for 127.0.0.1, localhost and ::1, https elsewhere. Credentials come from
DEEPJIT_REGISTRY_USER / DEEPJIT_REGISTRY_PASSWORD, else from the Docker config file
(~/.docker/config.json: auths, credsStore, credHelpers) through oras; never from the spec or oras's
own ORAS_USER / ORAS_PASS, and they are scrubbed from every message this module raises or logs.
They go only to the registry's origin (store/auth.py): redirects, upload locations and token
realms elsewhere are followed without them, and a tag list continuing on another host is refused.

Concurrency: the registry API has no compare-and-swap on tags. A push reads the tag first
(refusing other content unless forced), uploads blobs before the manifest (so a tag only ever
names a complete artifact) and reads the tag back after its PUT: a push that lost a race with
different content is reported as refused. Pushes of identical content all succeed.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import oras.container
import oras.provider
import requests

from .. import config
from ..bundle.archive import pack_to, sha256_stream
from ..bundle.folder import MANIFEST, check_replaceable, read_bundle, sealed_size, unpack_bundle
from ..bundle.manifest import canonical_json
from ..bundle.view import BundleView
from ..errors import BundleError, StoreError, closest
from ..files import output_lock, staging_dir
from .auth import Origin, PinnedCredentials, origin, realm_url, show
from .http import RegistrySession
from .refs import DIGEST_RE, TAG_RE, Entry, PushResult, Store, check_tag, level_statuses

log = logging.getLogger("deepjit.store")

ARTIFACT_TYPE = "application/vnd.deepjit.bundle.v1"
CONFIG_MEDIA_TYPE = "application/vnd.deepjit.manifest.v1+json"
LAYER_MEDIA_TYPE = "application/vnd.deepjit.bundle.layer.v1.tar+gzip"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
ANN_DIGEST = "dev.deepjit.bundle.digest"
ANN_NAME = "dev.deepjit.bundle.name"
ANN_LEVELS = "dev.deepjit.bundle.validation"  # {level: status} as JSON, for `ls` without fetching the config
ANN_TITLE = "org.opencontainers.image.title"
USER_ENV, PASSWORD_ENV, HOST_ENV = "DEEPJIT_REGISTRY_USER", "DEEPJIT_REGISTRY_PASSWORD", "DEEPJIT_REGISTRY_HOST"

_LOOPBACK = {"127.0.0.1", "localhost", "[::1]"}
_PUT_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class _Artifact:
    """The DeepJIT fields of a registry manifest."""

    manifest_digest: str
    bundle_digest: str
    name: str
    config: dict[str, Any]
    layer: dict[str, Any]
    levels: dict[str, str]


def _sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return "sha256:" + sha256_stream(f)


def _secrets_of(basic: str | None) -> tuple[str, ...]:
    """What error messages must not show of a Basic credential oras holds (base64 of 'user:password'):
    the encoded pair and the password, as for the environment's credentials."""
    if not basic:
        return ()
    try:
        password = base64.b64decode(basic, validate=True).decode().partition(":")[2]
    except (ValueError, UnicodeDecodeError):
        return (basic,)
    return (basic, password) if password else (basic,)


class OciStore(Store):
    """Bundles as OCI artifacts in one repository of a registry."""

    def __init__(self, host: str, repo: str):
        self.host, self.repo = host, repo
        self.url = f"oci://{host}/{repo}"
        hostname = host.split("]")[0] + "]" if host.startswith("[") else host.rsplit(":", 1)[0]
        self.insecure = hostname in _LOOPBACK
        self._base = f"{'http' if self.insecure else 'https'}://{host}"
        self._origin = origin(self._base)
        if self._origin is None:  # credentials are pinned to this origin: it must parse
            raise StoreError(f"{self.url}: '{host}' has no valid port (1 to 65535)")
        self._reg: oras.provider.Registry | None = None
        self._secrets: tuple[str, ...] = ()
        self._container = self._make_container()

    def __repr__(self) -> str:
        return f"OciStore({self.url!r})"

    def _make_container(self) -> oras.container.Container:
        # oras's parser takes the first component as the registry only if it has a '.' or ':'.
        name = f"{self.host}/{self.repo}" if any(c in self.host for c in ".:[") else self.repo
        container = oras.container.Container(name, registry=self.host)
        if container.registry != self.host or container.api_prefix != self.repo:
            raise StoreError(f"{self.url}: cannot address repository '{self.repo}' on '{self.host}'")
        return container

    # ------------------------------------------------------------------------ connection
    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _registry(self) -> oras.provider.Registry:
        if self._reg is None:
            self._reg = self._connect()
        return self._reg

    def _session(self, session: requests.Session, origins: frozenset[Origin]) -> requests.Session:
        adapter = PinnedCredentials(self.host, config.registry_timeout_s(), config.registry_deadline_s(), origins)
        for scheme in ("http://", "https://"):
            session.mount(scheme, adapter)
        return session

    def _env_credentials(self) -> tuple[str, str] | None:
        """DEEPJIT_REGISTRY_USER/PASSWORD, for the host DEEPJIT_REGISTRY_HOST names and no other: a
        reference or a spec could otherwise send them to any host it names."""
        user, password = os.environ.get(USER_ENV, ""), os.environ.get(PASSWORD_ENV, "")
        if not (user or password):
            return None
        if not (user and password):
            missing = PASSWORD_ENV if user else USER_ENV
            raise StoreError(f"{self.url}: {USER_ENV} and {PASSWORD_ENV} go together; {missing} is not set")
        host = os.environ.get(HOST_ENV, "")
        if host != self.host:
            log.debug("%s: %s/%s are for %s, not sent to %s", self.url, USER_ENV, PASSWORD_ENV, host or "no host",
                      self.host)
            return None
        return user, password

    def _connect(self) -> oras.provider.Registry:
        """Ping /v2/ once (fast failure, and it tells Basic from Bearer auth), then set up oras."""
        try:
            ping = self._session(requests.Session(), frozenset({self._origin})).get(f"{self._base}/v2/")
        except requests.RequestException as e:
            raise StoreError(f"{self.url}: cannot reach the registry at {self._base} ({type(e).__name__})") from None
        if ping.status_code not in (200, 401):
            raise StoreError(f"{self.url}: {self._base}/v2/ answered HTTP {ping.status_code}; is it an OCI registry?")
        challenge = ping.headers.get("WWW-Authenticate", "")
        basic = challenge.lower().startswith("basic")
        reg = RegistrySession(hostname=self.host, insecure=self.insecure, auth_backend="basic" if basic else "token")
        # oras's BasicAuth takes ORAS_USER/ORAS_PASS from the environment for whatever host it talks to.
        vars(reg.auth).pop("_basic_auth", None)
        realm = self._origin if basic else origin(realm_url(challenge, self._origin[0]) or self._base)
        # A token client sends its credentials to the realm: only to the registry's own host and
        # scheme (a token server beside it on another port is trusted: the registry names it).
        nearby = realm is not None and realm[:2] == self._origin[:2]
        self._session(reg.session, frozenset({self._origin, realm} if nearby else {self._origin}))
        if not nearby:
            log.warning("%s: the registry sends token requests to %s: no credentials go there", self.url, show(realm))
            return reg
        env = self._env_credentials()
        if env is not None:
            user, password = env
            self._secrets = (password, base64.b64encode(f"{user}:{password}".encode()).decode())
            reg.auth.set_basic_auth(user, password)
            if basic:
                reg.session.auth = (user, password)  # send at once instead of after each 401
        else:
            reg.auth.load_configs(self._container)  # the Docker config file: its entry for this host only
            self._secrets = _secrets_of(getattr(reg.auth, "_basic_auth", None))
            # oras keeps what it found there in `_basic_auth`; without it a Basic registry would
            # make oras retry for a minute before failing.
            if basic and not getattr(reg.auth, "_basic_auth", None):
                raise StoreError(f"{self.url}: the registry asks for credentials: set {USER_ENV} and "
                                 f"{PASSWORD_ENV} with {HOST_ENV}={self.host}, or log in with "
                                 f"`docker login {self.host}`")
        return reg

    def _request(self, method: str, url: str, what: str, ok: tuple[int, ...] = (200,),
                 **kwargs: Any) -> requests.Response:
        try:
            response = self._registry().do_request(url, method, **kwargs)
        except (requests.RequestException, ValueError) as e:
            raise StoreError(self._redact(f"{self.url}: {what} failed: {e}")) from None
        if response.status_code in (401, 403):
            raise StoreError(f"{self.url}: {what}: the registry refused the credentials (HTTP "
                             f"{response.status_code}); check {USER_ENV}/{PASSWORD_ENV} or `docker login {self.host}`")
        if response.status_code not in ok:
            raise StoreError(self._redact(f"{self.url}: {what}: HTTP {response.status_code}{self._errors(response)}"))
        return response

    @staticmethod
    def _errors(response: requests.Response) -> str:
        try:
            errors = response.json().get("errors") or []
            return "".join(f"; {e.get('code')}: {e.get('message')}" for e in errors if isinstance(e, dict))
        except (ValueError, AttributeError):
            return ""

    # ------------------------------------------------------------------------ manifests and blobs
    def _manifest_url(self, reference: str) -> str:
        return f"{self._base}/v2/{self.repo}/manifests/{reference}"

    def _get_manifest(self, reference: str) -> tuple[dict[str, Any], str] | None:
        """The manifest at a tag or digest and its digest (computed here), or None if absent."""
        r = self._request("GET", self._manifest_url(reference), f"fetching manifest '{reference}'",
                          ok=(200, 404), headers={"Accept": OCI_MANIFEST})
        if r.status_code == 404:
            return None
        digest = "sha256:" + hashlib.sha256(r.content).hexdigest()
        if DIGEST_RE.fullmatch(reference) and digest != reference:
            raise StoreError(f"{self.url}: the registry answered {reference} with a manifest of digest {digest}")
        try:
            manifest = json.loads(r.content)
        except (ValueError, RecursionError):
            raise StoreError(f"{self.url}: manifest '{reference}' is not JSON (or nested absurdly deep)") from None
        if not isinstance(manifest, dict):
            raise StoreError(f"{self.url}: manifest '{reference}' is not a JSON object")
        return manifest, digest

    def _artifact(self, manifest: dict[str, Any], digest: str, reference: str) -> _Artifact:
        config, layers, annotations = (manifest.get(k) for k in ("config", "layers", "annotations"))
        config = config if isinstance(config, dict) else {}
        if manifest.get("artifactType") != ARTIFACT_TYPE and config.get("mediaType") != CONFIG_MEDIA_TYPE:
            kind = manifest.get("artifactType") or config.get("mediaType")
            raise StoreError(f"{self.url}: '{reference}' is not a DeepJIT bundle (artifact type {kind!r})")
        layers = [layer for layer in (layers if isinstance(layers, list) else [])
                  if isinstance(layer, dict) and layer.get("mediaType") == LAYER_MEDIA_TYPE]
        annotations = annotations if isinstance(annotations, dict) else {}
        bundle_digest = annotations.get(ANN_DIGEST, "")
        if len(layers) != 1 or not isinstance(bundle_digest, str) or not DIGEST_RE.fullmatch(bundle_digest):
            raise StoreError(f"{self.url}: '{reference}' is a malformed DeepJIT artifact "
                             f"(needs one {LAYER_MEDIA_TYPE} layer and a {ANN_DIGEST} annotation)")
        try:
            levels = json.loads(str(annotations.get(ANN_LEVELS) or "{}"))
        except (ValueError, RecursionError):
            levels = None
        levels = {str(k): str(v) for k, v in levels.items()} if isinstance(levels, dict) else {}
        return _Artifact(digest, bundle_digest, str(annotations.get(ANN_NAME, "")), config, layers[0], levels)

    def _upload(self, path: Path, descriptor: dict[str, Any]) -> None:
        what = f"uploading blob {descriptor['digest']}"
        try:
            r = self._registry().upload_blob(str(path), self._container, descriptor)
        except (requests.RequestException, ValueError) as e:
            raise StoreError(self._redact(f"{self.url}: {what} failed: {e}")) from None
        if r.status_code not in (200, 201, 202):
            raise StoreError(self._redact(f"{self.url}: {what}: HTTP {r.status_code}{self._errors(r)}"))

    def _put(self, tag: str, body: bytes, blobs: list[tuple[Path, dict[str, Any]]]) -> None:
        """Upload the blobs, then the manifest. A registry may briefly not see a blob that
        concurrent pushes of the same content are linking (distribution's filesystem driver
        rewrites link files in place): such a manifest PUT is retried after uploading again."""
        for attempt in range(_PUT_ATTEMPTS):
            for path, descriptor in blobs:
                self._upload(path, descriptor)
            r = self._request("PUT", self._manifest_url(tag), f"pushing the manifest of tag '{tag}'",
                              ok=(201, 400), data=body, headers={"Content-Type": OCI_MANIFEST})
            if r.status_code == 201:
                return
            errors = self._errors(r)
            if "MANIFEST_BLOB_UNKNOWN" not in errors or attempt == _PUT_ATTEMPTS - 1:
                raise StoreError(self._redact(f"{self.url}: pushing the manifest of tag '{tag}': HTTP 400{errors}"))
            log.debug("%s: the registry does not see the blobs yet%s; retrying", self.url, errors)
            time.sleep(0.05 * 2 ** attempt)

    def _download(self, descriptor: dict[str, Any], path: Path) -> Path:
        """Fetch a blob and check it against its descriptor (the registry's digest and size)."""
        digest = str(descriptor.get("digest", ""))
        if not DIGEST_RE.fullmatch(digest):
            raise StoreError(f"{self.url}: blob digest {digest!r} is not a sha256 digest")
        try:
            self._registry().download_blob(self._container, digest, str(path))
        except (requests.RequestException, ValueError) as e:
            raise StoreError(self._redact(f"{self.url}: downloading blob {digest} failed: {e}")) from None
        size, got = path.stat().st_size, _sha256_file(path)
        if size != descriptor.get("size") or got != digest:
            raise StoreError(f"{self.url}: blob {digest} from the registry has {size} bytes and digest {got}; "
                             f"expected {descriptor.get('size')} bytes: tampered or truncated, refused")
        return path

    def _tags(self, missing_ok: bool = True) -> list[str]:
        url, tags = f"{self._base}/v2/{self.repo}/tags/list", []
        while url:
            r = self._request("GET", url, "listing tags", ok=(200, 404))
            if r.status_code == 404:  # the repository does not exist (yet: a push creates it)
                if missing_ok:
                    return []
                raise StoreError(f"{self.url}: the registry has no repository '{self.repo}' (a push creates it)")
            try:
                page = r.json().get("tags") or []
            except (ValueError, RecursionError, AttributeError):
                page = None
            if not isinstance(page, list) or not all(isinstance(t, str) and TAG_RE.fullmatch(t) for t in page):
                raise StoreError(f"{self.url}: the registry's tag list is not a list of tags; refused")
            tags += page
            nxt = r.links.get("next", {}).get("url")
            url = self._next_page(url, nxt) if nxt else ""
        return sorted(tags)

    def _next_page(self, url: str, link: str) -> str:
        """The next page of the tag list, which must stay on the registry: the session would follow
        it without credentials, but a listing that another host completes is not this repository's."""
        nxt = urllib.parse.urljoin(url, link)
        if origin(nxt) != self._origin:
            raise StoreError(f"{self.url}: the registry's tag list continues on another host "
                             f"({show(origin(nxt))}); refused")
        return nxt

    # ------------------------------------------------------------------------ verbs
    def push(self, bundle: Path | BundleView, tag: str, *, force: bool = False) -> PushResult:
        check_tag(tag)
        b = read_bundle(bundle)
        ref = f"{self.url}:{tag}"
        with tempfile.TemporaryDirectory(prefix="deepjit-oci-") as tmp:
            layer_path, config_path = Path(tmp) / "bundle.tar.gz", b.root / MANIFEST
            config = {"mediaType": CONFIG_MEDIA_TYPE, "digest": _sha256_file(config_path),
                      "size": config_path.stat().st_size}
            layer = {"mediaType": LAYER_MEDIA_TYPE, "digest": pack_to(b.root, layer_path),
                     "size": layer_path.stat().st_size, "annotations": {ANN_TITLE: "bundle.tar.gz"}}
            body = canonical_json({
                "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ARTIFACT_TYPE,
                "config": config, "layers": [layer],
                "annotations": {ANN_DIGEST: b.digest, ANN_NAME: b.name,
                                ANN_LEVELS: json.dumps(level_statuses(b.manifest), sort_keys=True)},
            })
            digest = "sha256:" + hashlib.sha256(body).hexdigest()
            existing = self._get_manifest(tag)
            if existing is not None:
                held = (existing[0].get("annotations") or {}).get(ANN_DIGEST)
                if held == b.digest:
                    log.info("%s already holds %s", ref, b.digest)
                    return PushResult(ref, b.digest, f"{self.url}@{existing[1]}")
                if not force:
                    raise StoreError(f"{self.url}: tag '{tag}' already holds {held or 'another artifact'}, "
                                     f"not this bundle ({b.digest}); push with --force to move it")
            self._put(tag, body, [(config_path, config), (layer_path, layer)])
        now = self._get_manifest(tag)
        if now is None or now[1] != digest:
            held = (now[0].get("annotations") or {}).get(ANN_DIGEST) if now else None
            raise StoreError(f"{self.url}: tag '{tag}' was moved to {held or 'other content'} by a concurrent "
                             f"push; this bundle ({b.digest}) was uploaded but is not tagged")
        log.info("pushed %s to %s (%s)", b.digest, ref, digest)
        return PushResult(ref, b.digest, f"{self.url}@{digest}")

    def pull(self, tag_or_digest: str, dest: Path) -> Path:
        if not DIGEST_RE.fullmatch(tag_or_digest):
            check_tag(tag_or_digest)
        got = self._get_manifest(tag_or_digest)
        if got is None:
            hint = "" if DIGEST_RE.fullmatch(tag_or_digest) else closest(tag_or_digest, self._tags())
            raise StoreError(f"{self.url}: no '{tag_or_digest}' in the repository{hint}")
        art = self._artifact(got[0], got[1], tag_or_digest)
        dest = Path(dest)
        check_replaceable(dest)
        with output_lock(dest), staging_dir(dest) as stage:  # the lock first: its way in clears stale stages
            try:
                config = json.loads(self._download(art.config, stage / "config.json").read_bytes())
            except (ValueError, RecursionError):
                config = None
            # Its sizes bound unpacking: only the sealed manifest's (a registry could lift them).
            max_bytes = sealed_size(config, art.bundle_digest)
            if max_bytes is None:
                raise StoreError(f"{self.url}: '{tag_or_digest}': the config blob is not the sealed manifest of "
                                 f"the bundle {art.bundle_digest} (its digest field or its content differs); refused")
            layer = self._download(art.layer, stage / "bundle.tar.gz")
            try:
                unpack_bundle(layer, dest, expected_digest=art.bundle_digest, max_bytes=max_bytes)
            except BundleError as e:
                raise StoreError(f"{self.url}: refusing '{tag_or_digest}': the bundle failed verification: {e}") from None
        log.info("pulled %s from %s@%s into %s", art.bundle_digest, self.url, art.manifest_digest, dest)
        return dest

    def ls(self) -> list[Entry]:
        entries = []
        for tag in self._tags(missing_ok=False):
            got = self._get_manifest(tag)
            if got is None:  # deleted meanwhile
                continue
            try:
                art = self._artifact(got[0], got[1], tag)
            except StoreError:
                log.debug("%s:%s is not a DeepJIT bundle; not listed", self.url, tag)
                continue
            entries.append(Entry(tag, art.bundle_digest, art.name, int(art.layer.get("size", 0)), art.levels))
        return entries
