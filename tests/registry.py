"""A real OCI registry on loopback for the tests: Debian's `docker-registry` (distribution).

`running_registry(workdir)` is a context manager that writes a config (filesystem storage under
`workdir`, http on 127.0.0.1:<free port>, deletes enabled, optional htpasswd users), starts
`docker-registry serve`, waits for `GET /v2/` and stops the server afterwards. The fixtures
`registry_server` (anonymous) and `auth_registry_server` (one bcrypt htpasswd user) wrap it and
skip with a reason when the binary is missing; `.ci/run` installs it with apt. tests/conftest.py
makes both fixtures available to every test module: ask for them by argument name.
"""
from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

BINARY = "docker-registry"
_START_TIMEOUT_S = 20


@dataclass(frozen=True)
class RegistryServer:
    host: str  # "127.0.0.1:PORT"
    root: Path  # the registry's storage folder
    log: Path
    users: Mapping[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"oci://{self.host}"

    def blob_path(self, digest: str) -> Path:
        """Where distribution keeps the bytes of a blob (to tamper with them in tests)."""
        hexd = digest.split(":", 1)[1]
        return self.root / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


def registry_binary() -> str | None:
    return shutil.which(BINARY)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _htpasswd(users: Mapping[str, str]) -> str:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt  # bcrypt via libxcrypt; the module is gone in Python 3.13

    if crypt.METHOD_BLOWFISH not in crypt.methods:
        raise RuntimeError("this libc's crypt has no bcrypt")
    return "".join(f"{u}:{crypt.crypt(p, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))}\n" for u, p in users.items())


def _config(root: Path, port: int, htpasswd: Path | None) -> str:
    auth = (f"auth:\n  htpasswd:\n    realm: deepjit-test\n    path: {htpasswd}\n" if htpasswd else "")
    return (f"version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {root}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{port}\n  secret: deepjit-test-secret\n{auth}")


def _wait_ready(proc: subprocess.Popen, host: str, log: Path) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{BINARY} exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            if requests.get(f"http://{host}/v2/", timeout=1).status_code in (200, 401):
                return
        except requests.RequestException:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{BINARY} did not answer on {host} within {_START_TIMEOUT_S} s:\n{log.read_text()[-2000:]}")


@contextmanager
def running_registry(workdir: Path, *, users: Mapping[str, str] | None = None) -> Iterator[RegistryServer]:
    """Start a registry storing under `workdir`; with `users`, only they may use it (htpasswd)."""
    binary = registry_binary()
    if binary is None:
        raise FileNotFoundError(f"{BINARY} is not installed")
    workdir = Path(workdir)
    root = workdir / "storage"
    root.mkdir(parents=True, exist_ok=True)
    htpasswd = None
    if users:
        htpasswd = workdir / "htpasswd"
        htpasswd.write_text(_htpasswd(users))
    last_error: Exception | None = None
    for _ in range(3):  # a free port can be taken between probing and binding
        port = _free_port()
        host, log, config = f"127.0.0.1:{port}", workdir / f"registry-{port}.log", workdir / f"config-{port}.yml"
        config.write_text(_config(root, port, htpasswd))
        with log.open("wb") as out:
            proc = subprocess.Popen([binary, "serve", str(config)], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        try:
            _wait_ready(proc, host, log)
        except RuntimeError as e:
            last_error = e
            _stop(proc)
            continue
        try:
            yield RegistryServer(host, root, log, dict(users or {}))
        finally:
            _stop(proc)
        return
    raise RuntimeError(f"could not start {BINARY}: {last_error}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _skip_without_binary() -> None:
    if registry_binary() is None:
        pytest.skip(f"'{BINARY}' is not installed (Debian package docker-registry; .ci/run installs it)")


@pytest.fixture(scope="session")
def registry_server(tmp_path_factory) -> Iterator[RegistryServer]:
    """An anonymous registry on loopback, shared by the session (use a fresh repository per test)."""
    _skip_without_binary()
    with running_registry(tmp_path_factory.mktemp("registry")) as server:
        yield server


@pytest.fixture(scope="session")
def auth_registry_server(tmp_path_factory) -> Iterator[RegistryServer]:
    """A registry that needs HTTP basic auth; its one user and password are in `.users`."""
    _skip_without_binary()
    users = {"deepjit": "pw-" + secrets.token_hex(12)}
    try:
        _htpasswd(users)
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"cannot make a bcrypt htpasswd file here ({e})")
    with running_registry(tmp_path_factory.mktemp("auth-registry"), users=users) as server:
        yield server


# ---------------------------------------------------------------------------- a scripted fake registry
@dataclass
class FakeRegistry:
    """A loopback HTTP server that answers as `answer(method, path, headers)` says: (status, headers,
    body), or None to stall (hold the connection, answer nothing). Every request is logged."""

    host: str
    requests: list = field(default_factory=list)

    def headers_seen(self) -> list[dict[str, str]]:
        return [h for _, _, h in self.requests]


@contextmanager
def fake_registry(answer) -> Iterator[FakeRegistry]:
    import http.server
    import threading

    stop = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _any(self):
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            server.requests.append((self.command, self.path, dict(self.headers)))
            got = answer(self.command, self.path, dict(self.headers))
            if got is None:
                stop.wait(30)  # stall until the test ends
                return
            status, headers, body = got
            self.send_response(status)
            for k, v in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = _any

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    server = FakeRegistry(f"127.0.0.1:{httpd.server_address[1]}")
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        httpd.shutdown()
        httpd.server_close()
