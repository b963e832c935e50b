"""The OCI store against a real registry on loopback (deepjit_compiler/store/oci.py).

Needs Debian's `docker-registry` (`.ci/run` installs it); skipped with a reason without it.
"""
from __future__ import annotations

import base64
import gzip
import hashlib
import json
import logging
import random
import re
import socket
import tarfile
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import oras.provider
import pytest
import requests
from conftest import run_cli
from registry import fake_registry

from deepjit_compiler import store
from deepjit_compiler.bundle import archive
from deepjit_compiler.bundle.folder import declared_size, read_bundle, write_bundle
from deepjit_compiler.bundle.manifest import manifest_digest
from deepjit_compiler.errors import DeepJITError, StoreError
from deepjit_compiler.store import open_store
from deepjit_compiler.store.auth import origin, realm_url
from deepjit_compiler.store.http import Deadline
from deepjit_compiler.store.oci import (
    ANN_DIGEST,
    ARTIFACT_TYPE,
    CONFIG_MEDIA_TYPE,
    HOST_ENV,
    LAYER_MEDIA_TYPE,
    OCI_MANIFEST,
    PASSWORD_ENV,
    USER_ENV,
)


def make_bundle(dest: Path, seed: int, name: str = "tiny"):
    rng = random.Random(seed)
    files = {"segments/backbone.onnx": rng.randbytes(30_000), "kernels/decode/decode.cu": rng.randbytes(300),
             "kernels/decode/decode.sm_75.cubin": rng.randbytes(2000)}
    return write_bundle(dest, files, {"name": name, "seed": seed, "target": {"sm": 75}})


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def fresh_repo(server) -> str:
    return f"{server.url}/t/{uuid.uuid4().hex[:12]}"


@pytest.fixture(autouse=True)
def no_ambient_credentials(monkeypatch, tmp_path):
    """No credentials from the developer's environment or ~/.docker/config.json."""
    for var in (USER_ENV, PASSWORD_ENV, HOST_ENV, "ORAS_USER", "ORAS_PASS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def _get(server, path: str, **headers) -> requests.Response:
    r = requests.get(f"http://{server.host}/v2/{path}", headers=headers, timeout=10)
    r.raise_for_status()
    return r


def test_push_writes_deepjit_media_types_and_pull_round_trips(registry_server, tmp_path):
    info = make_bundle(tmp_path / "b", 101)
    repo = fresh_repo(registry_server)
    result = store.push(info.path, f"{repo}:v1")
    assert result.digest == info.digest and result.ref == f"{repo}:v1"
    path = repo.split("/", 3)[3]
    raw = _get(registry_server, f"{path}/manifests/v1", Accept=OCI_MANIFEST).content
    assert result.pinned == f"{repo}@sha256:{hashlib.sha256(raw).hexdigest()}"
    manifest = json.loads(raw)
    assert manifest["artifactType"] == ARTIFACT_TYPE
    assert manifest["config"]["mediaType"] == CONFIG_MEDIA_TYPE
    assert [layer["mediaType"] for layer in manifest["layers"]] == [LAYER_MEDIA_TYPE]
    assert manifest["annotations"][ANN_DIGEST] == info.digest
    config = _get(registry_server, f"{path}/blobs/{manifest['config']['digest']}").content
    layer = _get(registry_server, f"{path}/blobs/{manifest['layers'][0]['digest']}").content
    assert config == (info.path / "manifest.json").read_bytes()
    assert layer == info.archive.read_bytes()

    assert tree(store.pull(f"{repo}:v1", tmp_path / "pulled")) == tree(info.path)
    assert read_bundle(store.pull(result.pinned, tmp_path / "pinned")).digest == info.digest


def test_identical_builds_push_identical_manifests(registry_server, tmp_path):
    one, two = make_bundle(tmp_path / "one", 102), make_bundle(tmp_path / "two", 102)
    repo = fresh_repo(registry_server)
    r1, r2 = store.push(one.path, f"{repo}:a"), store.push(two.archive, f"{repo}:b")
    assert r1.pinned == r2.pinned and r1.digest == r2.digest


def test_ls_lists_bundles_and_skips_foreign_artifacts(registry_server, tmp_path, monkeypatch):
    a, b = make_bundle(tmp_path / "a", 103, name="alpha"), make_bundle(tmp_path / "b", 104, name="beta")
    repo = fresh_repo(registry_server)
    with pytest.raises(StoreError, match=r"the registry has no repository 't/\w+' \(a push creates it\)"):
        store.ls(repo)  # the repository does not exist yet: as `ls` of a file store that does not
    store.push(b.path, f"{repo}:z")
    store.push(a.path, f"{repo}:a")
    # Something else in the same repository, pushed by plain oras.
    (tmp_path / "notes.txt").write_text("not a bundle")
    monkeypatch.chdir(tmp_path)
    oras.provider.Registry(hostname=registry_server.host, insecure=True).push(
        f"{repo.removeprefix('oci://')}:foreign", files=["notes.txt"])
    entries = store.ls(repo)
    assert [(e.tag, e.digest, e.name, e.size) for e in entries] == [
        ("a", a.digest, "alpha", a.archive.stat().st_size), ("z", b.digest, "beta", b.archive.stat().st_size)]
    checked = write_bundle(tmp_path / "c", {"k.cubin": random.Random(5).randbytes(500)}, {"name": "c", "validation": {
        "levels": {"precision": {"status": "failed"}, "graph": {"status": "passed"}}}})
    store.push(checked.path, f"{repo}:c", force=True)
    levels = {e.tag: e.levels for e in store.ls(repo)}  # from the manifest's annotation, without a fetch
    assert levels == {"a": {}, "c": {"graph": "passed", "precision": "failed"}, "z": {}}
    with pytest.raises(StoreError, match="'foreign' is not a DeepJIT bundle"):
        store.pull(f"{repo}:foreign", tmp_path / "p")


def test_existing_tag_with_other_content_needs_force(registry_server, tmp_path):
    a, b = make_bundle(tmp_path / "a", 105), make_bundle(tmp_path / "b", 106)
    s = open_store(fresh_repo(registry_server))
    first = s.push(a.path, "v1")
    assert s.push(a.path, "v1") == first
    with pytest.raises(StoreError, match=f"tag 'v1' already holds {a.digest}, not this bundle .*--force"):
        s.push(b.path, "v1")
    assert [e.digest for e in s.ls()] == [a.digest]
    s.push(b.path, "v1", force=True)
    assert tree(s.pull("v1", tmp_path / "p")) == tree(b.path)
    # the old content stays pullable by its pinned digest
    assert read_bundle(s.pull(first.pinned.rsplit("@", 1)[1], tmp_path / "old")).digest == a.digest


def test_unknown_tag_suggests_a_close_one(registry_server, tmp_path):
    s = open_store(fresh_repo(registry_server))
    s.push(make_bundle(tmp_path / "a", 107).path, "release-1")
    with pytest.raises(StoreError, match="no 'release-2' .*did you mean 'release-1'"):
        s.pull("release-2", tmp_path / "p")


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_pull_refuses_a_layer_damaged_in_the_registry(registry_server, tmp_path, damage):
    info = make_bundle(tmp_path / "b", 110 + (damage == "flip"))
    repo = fresh_repo(registry_server)
    store.push(info.path, f"{repo}:v1")
    layer = registry_server.blob_path("sha256:" + hashlib.sha256(info.archive.read_bytes()).hexdigest())
    data = bytearray(layer.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[len(data) // 2:]
    layer.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="tampered or truncated|downloading blob .* failed"):
        store.pull(f"{repo}:v1", tmp_path / "pulled")
    assert not (tmp_path / "pulled").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _race(bundles: list[Path], repo: str, tag: str) -> list[tuple[str, object]]:
    results: list[tuple[str, object]] = [("", None)] * len(bundles)
    barrier = threading.Barrier(len(bundles))

    def worker(i: int, bundle: Path) -> None:
        s = open_store(repo)  # one client per pusher, as separate processes would have
        barrier.wait()
        try:
            results[i] = ("ok", s.push(bundle, tag))
        except StoreError as e:
            results[i] = ("refused", str(e))

    threads = [threading.Thread(target=worker, args=(i, b)) for i, b in enumerate(bundles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_concurrent_pushes_of_the_same_content_all_succeed(registry_server, tmp_path):
    info = make_bundle(tmp_path / "a", 120)
    repo = fresh_repo(registry_server)
    results = _race([info.path] * 6, repo, "v1")
    assert {kind for kind, _ in results} == {"ok"}
    assert len({r.pinned for _, r in results}) == 1
    assert read_bundle(store.pull(f"{repo}:v1", tmp_path / "p")).digest == info.digest


def test_concurrent_pushes_of_different_content_leave_a_consistent_tag(registry_server, tmp_path):
    """The registry has no compare-and-swap: what is guaranteed is that the tag ends on one complete
    bundle, a push that reports success is pullable by its pinned ref, and a refused push says why."""
    a, b = make_bundle(tmp_path / "a", 121), make_bundle(tmp_path / "b", 122)
    repo = fresh_repo(registry_server)
    results = _race([a.path, b.path] * 3, repo, "v1")
    assert {kind for kind, _ in results} <= {"ok", "refused"}
    final = read_bundle(store.pull(f"{repo}:v1", tmp_path / "final")).digest
    assert final in (a.digest, b.digest)
    assert any(kind == "ok" and r.digest == final for kind, r in results)
    for i, (kind, r) in enumerate(results):
        if kind == "ok":
            assert read_bundle(store.pull(r.pinned, tmp_path / f"ok{i}")).digest == r.digest
        else:
            assert "already holds" in r or "concurrent push" in r


@pytest.mark.parametrize("host, insecure", [("127.0.0.1:5000", True), ("localhost", True), ("[::1]:5000", True),
                                           ("registry.example.com", False), ("127.0.0.1.example.com:5000", False),
                                           ("localhost.example", False)])
def test_plain_http_is_used_only_for_loopback(host, insecure):
    assert open_store(f"oci://{host}/t/x").insecure is insecure


def test_a_registry_host_with_no_valid_port_is_refused():
    with pytest.raises(StoreError, match=r"/t/x: '127.0.0.1:99999' has no valid port \(1 to 65535\)"):
        open_store("oci://127.0.0.1:99999/t/x")


def test_a_server_that_is_no_registry_is_named_and_a_bad_tag_never_leaves(tmp_path):
    with fake_registry(lambda method, path, headers: (404, {}, b"not found")) as web:
        with pytest.raises(StoreError, match=f"http://{web.host}/v2/ answered HTTP 404; is it an OCI registry"):
            store.pull(f"oci://{web.host}/t/x:v1", tmp_path / "p")
        with pytest.raises(StoreError, match=r"tag '\.\./v1' is not valid"):
            open_store(f"oci://{web.host}/t/x").pull("../v1", tmp_path / "p")
    assert [path for _, path, _ in web.requests] == ["/v2/"] and not (tmp_path / "p").exists()


def test_no_request_starts_past_the_commands_deadline():
    adapter = Deadline("127.0.0.1:9", timeout_s=5, deadline_s=-1)
    with pytest.raises(StoreError, match=r"registry 127.0.0.1:9: the command's deadline \(.*\) passed"):
        adapter.send(requests.Request("GET", "http://127.0.0.1:9/v2/").prepare())


def test_unreachable_registry_fails_fast(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bundle = make_bundle(tmp_path / "a", 130).path
    start = time.monotonic()
    with pytest.raises(StoreError, match=f"cannot reach the registry at http://127.0.0.1:{port}"):
        store.push(bundle, f"oci://127.0.0.1:{port}/t/x:v1")
    assert time.monotonic() - start < 10  # a refused connection is not retried for minutes (oras's default)


# ---------------------------------------------------------------------------- credentials
@pytest.mark.parametrize("challenge, realm", [
    ('Bearer realm="https://auth.example/token",service="r"', "https://auth.example/token"),
    ('Bearer service="r", realm="https://auth.example/token"', "https://auth.example/token"),
    ('Bearer realm="auth.example:5001/token"', "http://auth.example:5001/token"),  # oras adds the scheme
    ('Basic charset="UTF-8"', None),
])
def test_the_token_realm_is_judged_as_the_url_oras_requests(challenge, realm):
    assert realm_url(challenge, "http") == realm


@pytest.mark.parametrize("url, expected", [
    ("https://Registry.example/v2/", ("https", "registry.example", 443)),
    ("http://127.0.0.1/v2/", ("http", "127.0.0.1", 80)),
    ("http://[::1]:5000/v2/", ("http", "::1", 5000)),
    ("http://registry.example:99999/v2/", None),
])
def test_an_origin_is_scheme_host_and_port_with_the_default_filled_in(url, expected):
    assert origin(url) == expected


def test_a_registry_that_needs_credentials_says_how_to_give_them(auth_registry_server, tmp_path, monkeypatch):
    info = make_bundle(tmp_path / "a", 140)
    ref = f"{fresh_repo(auth_registry_server)}:v1"
    with pytest.raises(StoreError, match=f"asks for credentials: set {USER_ENV} and {PASSWORD_ENV} with {HOST_ENV}="):
        store.push(info.path, ref)
    monkeypatch.setenv(USER_ENV, "deepjit")
    with pytest.raises(StoreError, match=f"{PASSWORD_ENV} is not set"):
        store.push(info.path, ref)


def test_wrong_password_is_refused_without_showing_it(auth_registry_server, tmp_path, monkeypatch, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    wrong = "Wr0ng-" + uuid.uuid4().hex
    monkeypatch.setenv(USER_ENV, "deepjit")
    monkeypatch.setenv(PASSWORD_ENV, wrong)
    monkeypatch.setenv(HOST_ENV, auth_registry_server.host)
    with pytest.raises(StoreError, match="refused the credentials") as err:
        store.push(make_bundle(tmp_path / "a", 141).path, f"{fresh_repo(auth_registry_server)}:v1")
    encoded = base64.b64encode(f"deepjit:{wrong}".encode()).decode()
    out = capsys.readouterr()
    for text in (str(err.value), caplog.text, out.out, out.err):
        assert wrong not in text and encoded not in text


def test_credentials_from_the_environment(auth_registry_server, tmp_path, monkeypatch, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    (user, password), = auth_registry_server.users.items()
    monkeypatch.setenv(USER_ENV, user)
    monkeypatch.setenv(PASSWORD_ENV, password)
    monkeypatch.setenv(HOST_ENV, auth_registry_server.host)
    info = make_bundle(tmp_path / "a", 142)
    repo = fresh_repo(auth_registry_server)
    store.push(info.path, f"{repo}:v1")
    assert [e.digest for e in store.ls(repo)] == [info.digest]
    assert tree(store.pull(f"{repo}:v1", tmp_path / "p")) == tree(info.path)
    out = capsys.readouterr()
    assert all(password not in text for text in (caplog.text, out.out, out.err))


def test_credentials_from_the_docker_config(auth_registry_server, tmp_path):
    (user, password), = auth_registry_server.users.items()
    config = tmp_path / "home" / ".docker" / "config.json"
    config.parent.mkdir(parents=True)
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    config.write_text(json.dumps({"auths": {auth_registry_server.host: {"auth": auth}}}))
    info = make_bundle(tmp_path / "a", 143)
    repo = fresh_repo(auth_registry_server)
    store.push(info.path, f"{repo}:v1")
    assert read_bundle(store.pull(f"{repo}:v1", tmp_path / "p")).digest == info.digest


# ---------------------------------------------------------------------------- hostile or careless registries
SECRET = "s3cret-" + uuid.uuid4().hex


def basic_challenge(method, path, headers):
    """A registry that asks for Basic credentials everywhere (and logs what it is sent)."""
    return 401, {"WWW-Authenticate": 'Basic realm="fake"'}, b"{}"


def test_credentials_go_only_to_the_host_they_name(tmp_path, monkeypatch):
    monkeypatch.setenv(USER_ENV, "deepjit")
    monkeypatch.setenv(PASSWORD_ENV, SECRET)
    encoded = base64.b64encode(f"deepjit:{SECRET}".encode()).decode()
    with fake_registry(basic_challenge) as stranger:
        for host in (None, "registry.example:5000"):   # not set, or set for another registry
            if host:
                monkeypatch.setenv(HOST_ENV, host)
            with pytest.raises(StoreError, match=f"asks for credentials.*{HOST_ENV}={stranger.host}") as e:
                store.pull(f"oci://{stranger.host}/t/x:v1", tmp_path / "p")
            assert SECRET not in str(e.value)
        assert stranger.requests and not any("Authorization" in h for h in stranger.headers_seen())
        monkeypatch.setenv(HOST_ENV, stranger.host)   # named: now it gets them
        with pytest.raises(StoreError, match="refused the credentials"):
            store.pull(f"oci://{stranger.host}/t/x:v1", tmp_path / "p")
        assert any(h.get("Authorization") == f"Basic {encoded}" for h in stranger.headers_seen())


# A second host on loopback: the fake servers listen on 127.0.0.1, and "localhost" is another host
# name (another origin) for the same machine: where a hostile registry sends the client next.
ENCODED = base64.b64encode(f"deepjit:{SECRET}".encode()).decode()


def elsewhere(server) -> str:
    return server.host.replace("127.0.0.1", "localhost")


def credentials_for(monkeypatch, host: str) -> None:
    monkeypatch.setenv(USER_ENV, "deepjit")
    monkeypatch.setenv(PASSWORD_ENV, SECRET)
    monkeypatch.setenv(HOST_ENV, host)


def authorized(server) -> list[str]:
    """The requests that reached `server` with an Authorization header."""
    return [path for _, path, h in server.requests if any(k.lower() == "authorization" for k in h)]


def basic_registry(routes):
    """A registry that wants Basic deepjit:SECRET, then answers as `routes(method, path)` says."""
    def answer(method, path, headers):
        if headers.get("Authorization") != f"Basic {ENCODED}":
            return basic_challenge(method, path, headers)
        return routes(method, path)
    return answer


def test_ls_follows_next_pages_on_the_registry_only(tmp_path, monkeypatch):
    def tags(*names):
        return json.dumps({"tags": list(names)}).encode()

    with fake_registry(basic_challenge) as other:
        def routes(method, path):
            if path.endswith("/tags/list"):
                return 200, {"Link": '</v2/t/x/tags/list?last=a>; rel="next"'}, tags("a")
            if path.endswith("?last=a"):
                return 200, {"Link": f'<http://{elsewhere(other)}/v2/t/x/tags/list?last=b>; rel="next"'}, tags("b")
            return 404, {}, b"{}"

        with fake_registry(basic_registry(routes)) as registry:
            credentials_for(monkeypatch, registry.host)
            with pytest.raises(StoreError, match=rf"tag list continues on another host \(http://{elsewhere(other)}\)"):
                store.ls(f"oci://{registry.host}/t/x")
    assert "/v2/t/x/tags/list?last=a" in authorized(registry)  # a relative link is followed, credentials and all
    assert other.requests == []


def test_push_uploads_to_a_location_on_another_host_without_credentials(tmp_path, monkeypatch):
    with fake_registry(basic_challenge) as storage:
        def routes(method, path):
            if method == "POST" and "/blobs/uploads/" in path:
                return 202, {"Location": f"http://{elsewhere(storage)}/upload/1"}, b""
            return 404, {}, b"{}"  # no tag, no blob yet

        with fake_registry(basic_registry(routes)) as registry:
            credentials_for(monkeypatch, registry.host)
            with pytest.raises(StoreError, match="uploading blob .*HTTP 401") as e:
                store.push(make_bundle(tmp_path / "a", 150).path, f"oci://{registry.host}/t/x:v1")
    assert any(path.startswith("/upload/1") for _, path, _ in storage.requests)
    assert authorized(storage) == [] and SECRET not in str(e.value)


def artifact(info, config: bytes, layer: bytes | None = None) -> tuple[bytes, dict[str, bytes]]:
    """The OCI manifest a push of the bundle `info` writes, with `config` as its config blob (and `layer` as
    its layer, else the bundle's archive), and the blobs."""
    layer = info.archive.read_bytes() if layer is None else layer
    blobs = {f"sha256:{hashlib.sha256(data).hexdigest()}": data for data in (config, layer)}
    config, layer = ({"mediaType": m, "digest": d, "size": len(blobs[d])}
                     for m, d in zip((CONFIG_MEDIA_TYPE, LAYER_MEDIA_TYPE), blobs))
    manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ARTIFACT_TYPE,
                           "config": config, "layers": [layer], "annotations": {ANN_DIGEST: info.digest}}).encode()
    return manifest, blobs


def serving(manifest: bytes, blobs: dict[str, bytes]):
    """A fake registry's answer that serves one artifact: its manifest at any tag, its blobs by digest."""
    def answer(method, path, headers):
        if "/manifests/" in path:
            return 200, {"Content-Type": OCI_MANIFEST}, manifest
        return (200, {}, blobs[path.rsplit("/", 1)[1]]) if "/blobs/" in path else (200, {}, b"{}")
    return answer


def test_pull_refuses_a_config_that_is_not_the_bundles_sealed_manifest(tmp_path):
    """The config's sizes bound unpacking: a registry that lifts them (keeping the digest field) must not
    let a gzip bomb through, so such a config is refused before the layer is unpacked."""
    info = make_bundle(tmp_path / "b", 152)
    lifted = {**info.manifest, "files": {rel: {**e, "size": 1 << 40} for rel, e in info.manifest["files"].items()}}
    manifest, blobs = artifact(info, json.dumps(lifted).encode())

    with fake_registry(serving(manifest, blobs)) as registry:
        with pytest.raises(StoreError, match=f"config blob is not the sealed manifest of the bundle {info.digest}"):
            store.pull(f"oci://{registry.host}/t/x:v1", tmp_path / "p")
    assert not (tmp_path / "p").exists()


def test_pull_refuses_a_layer_that_is_not_the_annotated_bundle_or_inflates_past_it(tmp_path):
    """The layer must unpack to the bundle the annotation and the sealed config name, within the size that
    config declares."""
    info, other = make_bundle(tmp_path / "a", 157), make_bundle(tmp_path / "b", 158)
    bomb = tarfile.TarInfo("zeros.bin")
    bomb.size = 8 << 20
    layers = {"other": other.archive.read_bytes(),
              "bomb": gzip.compress(bomb.tobuf(format=tarfile.PAX_FORMAT) + bytes(bomb.size), mtime=0)}
    for kind, message in (("other", f"bundle digest {other.digest} is not the expected {info.digest}"),
                          ("bomb", f"holds more than the {declared_size(info.manifest)} bytes its bundle declares")):
        manifest, blobs = artifact(info, (info.path / "manifest.json").read_bytes(), layers[kind])

        with fake_registry(serving(manifest, blobs)) as registry:
            with pytest.raises(StoreError, match=f"refusing 'v1': the bundle failed verification: .*{message}"):
                store.pull(f"oci://{registry.host}/t/x:v1", tmp_path / "p")
        assert not (tmp_path / "p").exists()


def test_pull_bounds_a_forged_sealed_config_by_its_layers_own_size(tmp_path, monkeypatch):
    """A registry that forges the whole config (sizes lifted, its digest recomputed to match, the annotation
    renamed) passes the sealed-manifest check: a hundred times the layer's own size still stops its bomb."""
    monkeypatch.setattr(archive, "_TRAILER_SLACK", 1 << 16)
    info = make_bundle(tmp_path / "b", 159)
    forged = {**info.manifest, "files": {rel: {**e, "size": 1 << 40} for rel, e in info.manifest["files"].items()}}
    forged["digest"] = manifest_digest(forged)
    bomb = tarfile.TarInfo("zeros.bin")
    bomb.size = 8 << 20  # about 8 kB compressed
    layer = gzip.compress(bomb.tobuf(format=tarfile.PAX_FORMAT) + bytes(bomb.size), mtime=0)
    manifest, blobs = artifact(SimpleNamespace(digest=forged["digest"], archive=None), json.dumps(forged).encode(),
                               layer)

    with fake_registry(serving(manifest, blobs)) as registry:
        with pytest.raises(StoreError, match=rf"holds more than the {100 * len(layer) + (1 << 16)} bytes 100 times "
                                             rf"its own {len(layer)} bytes allow"):
            store.pull(f"oci://{registry.host}/t/x:v1", tmp_path / "p")
    assert not (tmp_path / "p").exists()


def test_a_pull_by_digest_refuses_a_manifest_of_another_digest(tmp_path):
    """A pinned reference pulls exactly that content: a registry answering it with another (valid) bundle
    is refused before any blob is fetched."""
    info = make_bundle(tmp_path / "b", 153)
    manifest, blobs = artifact(info, (info.path / "manifest.json").read_bytes())
    pinned = "sha256:" + hashlib.sha256(manifest + b" ").hexdigest()

    with fake_registry(serving(manifest, blobs)) as registry:
        with pytest.raises(StoreError, match=f"answered {pinned} with a manifest of digest sha256:"):
            store.pull(f"oci://{registry.host}/t/x@{pinned}", tmp_path / "p")
    assert not any("/blobs/" in path for _, path, _ in registry.requests) and not (tmp_path / "p").exists()


@pytest.mark.parametrize("edit", [lambda m: m["annotations"].pop(ANN_DIGEST),
                                  lambda m: m["annotations"].update({ANN_DIGEST: "sha256:abc"}),
                                  lambda m: m["layers"].append(m["layers"][0]),
                                  lambda m: m["layers"].clear()],
                         ids=["no-digest", "bad-digest", "two-layers", "no-layer"])
def test_a_malformed_deepjit_artifact_is_named_before_any_blob_is_fetched(tmp_path, edit):
    info = make_bundle(tmp_path / "b", 154)
    manifest, blobs = artifact(info, (info.path / "manifest.json").read_bytes())
    manifest = json.loads(manifest)
    edit(manifest)

    with fake_registry(serving(json.dumps(manifest).encode(), blobs)) as registry:
        with pytest.raises(StoreError, match=re.escape(f"'v1' is a malformed DeepJIT artifact (needs one "
                                                       f"{LAYER_MEDIA_TYPE} layer and a {ANN_DIGEST} annotation)")):
            store.pull(f"oci://{registry.host}/t/x:v1", tmp_path / "p")
    assert not any("/blobs/" in path for _, path, _ in registry.requests) and not (tmp_path / "p").exists()


def test_a_tag_list_holding_what_is_no_tag_is_refused(tmp_path):
    def answer(method, path, headers):
        return 200, {}, json.dumps({"tags": ["v1", "../../v2/other/manifests/x"]}).encode()

    with fake_registry(answer) as registry:
        with pytest.raises(StoreError, match="the registry's tag list is not a list of tags; refused"):
            store.ls(f"oci://{registry.host}/t/x")
    assert not any("/manifests/" in path for _, path, _ in registry.requests)


def test_a_push_that_lost_the_tag_to_another_is_not_reported_as_pushed(tmp_path):
    """The registry has no compare-and-swap: the tag is read back after the PUT, and content another
    push put there meanwhile makes this push a refusal naming what the tag holds now."""
    mine, theirs = make_bundle(tmp_path / "a", 155), make_bundle(tmp_path / "b", 156)
    other, _ = artifact(theirs, (theirs.path / "manifest.json").read_bytes())
    put: list = []

    def answer(method, path, headers):
        if "/blobs/uploads/" in path:
            return (202, {"Location": "/v2/t/x/blobs/uploads/1"}, b"") if method == "POST" else (201, {}, b"")
        if "/manifests/" in path and method == "PUT":
            return put.append(path) or (201, {}, b"")
        if "/manifests/" in path:  # nothing before this push's PUT, the other push's content after it
            return (200, {"Content-Type": OCI_MANIFEST}, other) if put else (404, {}, b"{}")
        return 404 if "/blobs/" in path else 200, {}, b"{}"

    with fake_registry(answer) as registry:
        with pytest.raises(StoreError, match=f"tag 'v1' was moved to {theirs.digest} by a concurrent push; this "
                                             f"bundle \\({mine.digest}\\) was uploaded but is not tagged"):
            store.push(mine.path, f"oci://{registry.host}/t/x:v1")
    assert put == ["/v2/t/x/manifests/v1"]


def token_registry(me: dict, manifest: bytes, storage: str):
    """A token-auth registry whose realm is itself; its blobs redirect to `storage`, another host."""
    def answer(method, path, headers):
        if path.startswith("/token"):
            return 200, {"Content-Type": "application/json"}, b'{"token": "tok-1"}'
        if headers.get("Authorization") != "Bearer tok-1":
            return 401, {"WWW-Authenticate": f'Bearer realm="http://{me["host"]}/token",service="fake"'}, b"{}"
        if "/manifests/" in path:
            return 200, {"Content-Type": OCI_MANIFEST}, manifest
        if "/blobs/" in path:
            return 307, {"Location": f"http://{storage}/storage/{path.rsplit('/', 1)[1]}"}, b""
        return 200, {}, b"{}"
    return answer


@pytest.mark.parametrize("storage_says", ["here", "log in"])
def test_pull_follows_blob_redirects_to_another_host_without_credentials(tmp_path, monkeypatch, storage_says):
    """Blob storage on another host is normal; one that asks for a token from its own realm (when
    oras renews its token) must get none of the registry's credentials."""
    info = make_bundle(tmp_path / "b", 151)
    manifest, blobs = artifact(info, (info.path / "manifest.json").read_bytes())

    def storage_answer(method, path, headers):
        if storage_says == "here":
            return 200, {}, blobs[path.rsplit("/", 1)[1]]
        return 403, {"WWW-Authenticate": f'Bearer realm="http://{elsewhere(storage)}/token",service="s"'}, b"{}"

    me: dict = {}
    with fake_registry(storage_answer) as storage, \
            fake_registry(token_registry(me, manifest, elsewhere(storage))) as registry:
        me["host"] = registry.host
        credentials_for(monkeypatch, registry.host)
        if storage_says == "here":
            assert read_bundle(store.pull(f"oci://{registry.host}/t/x:v1", tmp_path / "p")).digest == info.digest
        else:
            with pytest.raises(StoreError, match="downloading blob"):
                store.pull(f"oci://{registry.host}/t/x:v1", tmp_path / "p")
    assert any(h.get("Authorization") == f"Basic {ENCODED}" for _, p, h in registry.requests if p.startswith("/token"))
    assert storage.requests and authorized(storage) == []


@pytest.mark.parametrize("scheme", ["http://", ""], ids=["with-scheme", "without-scheme"])
def test_no_credentials_go_to_a_token_realm_on_another_host(scheme, tmp_path, monkeypatch):
    """A realm the registry names on another host (`localhost`, an origin of its own) is not trusted with
    the registry's credentials: it is asked without them. Without a scheme (oras prefixes one) it is
    judged by its host all the same."""
    with fake_registry(lambda method, path, headers: (200, {}, b'{"token": "t"}')) as realm:
        challenge = {"WWW-Authenticate": f'Bearer realm="{scheme}{elsewhere(realm)}/token",service="x"'}
        with fake_registry(lambda method, path, headers: (401, challenge, b"{}")) as registry:
            credentials_for(monkeypatch, registry.host)
            with pytest.raises(StoreError):
                store.pull(f"oci://{registry.host}/t/x:v1", tmp_path / "p")
    assert authorized(realm) == [] and (realm.requests or not scheme)  # asked, anonymously, where it can be
    assert registry.requests and all(f"Basic {ENCODED}" not in h.values() for _, _, h in registry.requests)


def test_no_credentials_go_to_a_token_realm_of_another_scheme(tmp_path, monkeypatch, caplog):
    """An http registry naming an https realm on its own host and port names another origin: not trusted."""
    me: dict = {}

    def answer(method, path, headers):
        return 401, {"WWW-Authenticate": f'Bearer realm="https://{me["host"]}/token",service="x"'}, b"{}"

    with fake_registry(answer) as registry:
        me["host"] = registry.host
        credentials_for(monkeypatch, registry.host)
        with pytest.raises(StoreError):
            store.pull(f"oci://{registry.host}/t/x:v1", tmp_path / "p")
    assert f"the registry sends token requests to https://{registry.host}: no credentials go there" in caplog.text
    assert registry.requests and authorized(registry) == []


def test_orases_own_environment_credentials_are_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("ORAS_USER", "ci-bot")
    monkeypatch.setenv("ORAS_PASS", SECRET)
    with fake_registry(basic_challenge) as registry, pytest.raises(StoreError, match="asks for credentials"):
        store.ls(f"oci://{registry.host}/t/x")
    assert registry.requests and authorized(registry) == []


@pytest.mark.parametrize("ref", [f"oci://deepjit:{SECRET}@127.0.0.1:5000/t/x:v1", f"oci://{SECRET}@127.0.0.1/t/x"])
def test_a_password_inside_a_reference_is_refused_and_never_shown(ref, tmp_path):
    r = run_cli("pull", ref, str(tmp_path / "p"))
    assert r.returncode == 2 and "credentials in a reference are refused" in r.stderr
    assert SECRET not in r.stderr + r.stdout


def test_a_password_inside_the_specs_store_is_refused(write_spec):
    r = run_cli("build", "--dry-run", str(write_spec({"store: file://../build/store": f"store: oci://u:{SECRET}@h.example/r"})))
    assert r.returncode == 2 and "credentials in a store URL are refused" in r.stderr
    assert SECRET not in r.stderr + r.stdout


def test_a_registry_that_stalls_after_v2_is_given_up_on(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPJIT_REGISTRY_TIMEOUT_S", "1")
    with fake_registry(lambda method, path, headers: (200, {}, b"{}") if path == "/v2/" else None) as slow:
        start = time.monotonic()
        with pytest.raises(StoreError, match=f"registry {slow.host} did not answer within 1 s"):
            store.pull(f"oci://{slow.host}/t/x:v1", tmp_path / "p")
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("name", ["DEEPJIT_REGISTRY_TIMEOUT_S", "DEEPJIT_REGISTRY_DEADLINE_S"])
@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", "1e10", "604801"])
def test_a_bad_registry_duration_is_named_before_any_request(tmp_path, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    asked = []
    with fake_registry(lambda method, path, headers: asked.append(path) or (200, {}, b"{}")) as reg:
        with pytest.raises(DeepJITError, match=rf"\${name} is '{value}': a number of seconds above 0 and at most "
                                               r"604800 is allowed") as e:
            store.pull(f"oci://{reg.host}/t/x:v1", tmp_path / "p")
    assert e.value.exit_code == 2 and asked == []
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("body", [b"[1, 2]", b"not json", b"[" * 100_000 + b"]" * 100_000,
                                  json.dumps({"artifactType": ARTIFACT_TYPE, "layers": "x"}).encode(),
                                  json.dumps({"artifactType": ARTIFACT_TYPE, "layers": [{"mediaType": LAYER_MEDIA_TYPE}],
                                              "annotations": []}).encode()])
def test_junk_from_a_registry_is_a_store_error(tmp_path, body):
    def junk(method, path, headers):
        if path.endswith("/tags/list"):
            return 200, {}, b'{"tags": "v1"}'
        return (200, {}, b"{}") if path == "/v2/" else (200, {"Content-Type": OCI_MANIFEST}, body)

    with fake_registry(junk) as registry:
        with pytest.raises(StoreError, match=f"oci://{registry.host}/t/x"):
            store.pull(f"oci://{registry.host}/t/x:v1", tmp_path / "p")
        with pytest.raises(StoreError, match="tags"):
            store.ls(f"oci://{registry.host}/t/x")


def test_a_docker_config_entry_goes_only_to_its_own_host(tmp_path):
    config = tmp_path / "home" / ".docker" / "config.json"
    config.parent.mkdir(parents=True)
    secret = base64.b64encode(f"deepjit:{SECRET}".encode()).decode()
    config.write_text(json.dumps({"auths": {"registry.example:5000": {"auth": secret}}}))
    with fake_registry(basic_challenge) as stranger:
        with pytest.raises(StoreError, match="asks for credentials"):
            store.pull(f"oci://{stranger.host}/t/x:v1", tmp_path / "p")
    assert not any("Authorization" in h for h in stranger.headers_seen())


@pytest.mark.parametrize("source", ["docker config", "environment"])
def test_credentials_are_scrubbed_from_errors(tmp_path, monkeypatch, source):
    """A registry whose error echoes the Authorization it got: the credential (the Docker config's or the
    environment's) is shown as *** (the Docker config's used to be printed whole)."""
    encoded = base64.b64encode(f"deepjit:{SECRET}".encode()).decode()

    def echo(method, path, headers):
        auth = headers.get("Authorization")
        if auth != f"Basic {encoded}":
            return 401, {"WWW-Authenticate": 'Basic realm="fake"'}, b"{}"
        if path == "/v2/":
            return 200, {}, b"{}"
        body = {"errors": [{"code": "DENIED", "message": f"you sent {auth}, password {SECRET}"}]}
        return 400, {"Content-Type": "application/json"}, json.dumps(body).encode()

    config = tmp_path / "home" / ".docker" / "config.json"
    config.parent.mkdir(parents=True)
    with fake_registry(echo) as reg:
        if source == "environment":
            credentials_for(monkeypatch, reg.host)
        else:
            config.write_text(json.dumps({"auths": {reg.host: {"auth": encoded}}}))
        with pytest.raises(StoreError) as e:
            store.pull(f"oci://{reg.host}/t/x:v1", tmp_path / "p")
    assert "you sent Basic ***, password ***" in str(e.value)
    assert SECRET not in str(e.value) and encoded not in str(e.value)
