"""nvidia-pytriton's `tritonserver` on this machine's loopback, for a model repository: how the tests,
the load benchmark and a user trying an export on one machine start a real Triton server.

    with LocalTritonServer(repo) as server:      # ready when the block starts, stopped when it ends
        with tritonclient.http.InferenceServerClient(server.http_url) as client:
            ...  # closed on leaving: open keep-alive connections hold the stop for Triton's 30 s exit timeout

nvidia-pytriton (Linux, glibc >= 2.35) ships tritonserver and its Python backend; the backend's stub for
this interpreter's Python version sits in its python_backend_stubs/3.X/, so the server gets a backend
folder of its own (in a temporary folder: links to the backend library, its utils and that stub; the
stub finds its libraries through its real path). The stub links the system's libpython3.X.so, which
breaks multiprocessing when its patch release differs from this interpreter's, so LD_LIBRARY_PATH leads
with this interpreter's own lib folder. The server binds 127.0.0.1 only, on free ports. What the Python
backend leaves behind when a server is killed, its shared memory regions (/dev/shm) and its
/tmp/python_env_* folder, is removed on stop: the regions by the prefix this server was given, the
folder only when it appeared while this server ran and is empty. A run killed before it could stop
its server leaves regions of a prefix naming a process that is gone: the next start removes those
(`remove_stale_regions`), never a region of another prefix or of a process still running.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from ..errors import MissingDependency, ServeError

SHM = Path("/dev/shm")
ENV_DIRS = Path("/tmp")                    # where the Python backend makes python_env_XXXXXX (fixed there)
REGION_PREFIX = "deepjit_"                # + pid + "_" + a random tag: the prefix each server's regions get
PYTRITON = "nvidia-pytriton (Linux x86_64/aarch64, glibc >= 2.35: pip install nvidia-pytriton)"


def pytriton_root() -> Path:
    """pytriton's tritonserver folder (bin/, backends/, python_backend_stubs/); MissingDependency if absent."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency(f"starting a local Triton server needs {PYTRITON}")
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise MissingDependency(f"{root}: no bin/tritonserver in this pytriton; install {PYTRITON}")
    return root


def stub_for_this_python(root: Path) -> Path:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (root / "python_backend_stubs").iterdir()) if \
            (root / "python_backend_stubs").is_dir() else []
        raise MissingDependency(f"pytriton has no Python-backend stub for Python {version} (it has "
                                f"{', '.join(have) or 'none'})")
    return stub


def remove_stale_regions(shm: Path = SHM) -> list[Path]:
    """Remove the shared memory regions of LocalTritonServers whose process is gone; the ones removed."""
    removed = []
    for region in shm.glob(f"{REGION_PREFIX}*_*"):
        pid = region.name[len(REGION_PREFIX):].split("_", 1)[0]
        if not pid.isdigit() or _running(int(pid)):
            continue
        region.unlink(missing_ok=True)
        removed.append(region)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        pass
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def statistics_after(read, before: dict, more: dict[str, int], timeout_s: float = 10.0) -> dict:
    """A model's statistics, as `read()` returns them (one entry of Triton's model_stats), once each
    count named in `more` has risen by at least that much over `before`, or as they are at the timeout.
    A backend sends an execution's responses before it reports the requests' statistics and then the
    batch's, so a client holding its answers can read counts that miss them; the statistics are read
    once more 0.2 s after the counts arrive, so an execution reported just after is counted too."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = read()
        if all(int(stats.get(k, 0)) - int(before.get(k, 0)) >= n for k, n in more.items()):
            time.sleep(0.2)
            return read()
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


class LocalTritonServer:
    """tritonserver over `repo` on 127.0.0.1; `start()` waits until it and its models are ready."""

    def __init__(self, repo: Path | str, *, log_file: Path | str | None = None, ready_timeout_s: float = 120.0,
                 extra_args: tuple[str, ...] = ()):
        self.repo, self.ready_timeout_s, self.extra_args = Path(repo).absolute(), ready_timeout_s, extra_args
        self.root = pytriton_root()
        self.stub = stub_for_this_python(self.root)
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.shm_prefix = f"{REGION_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        self._tmp = tempfile.TemporaryDirectory(prefix="deepjit-triton-")
        self.log_file = Path(log_file) if log_file else Path(self._tmp.name) / "tritonserver.log"
        self.proc: subprocess.Popen | None = None
        self._env_dirs_before: set[str] = set()

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def _backends(self) -> Path:
        python = Path(self._tmp.name) / "backends" / "python"
        python.mkdir(parents=True, exist_ok=True)
        backend = self.root / "backends" / "python"
        for src in (backend / "libtriton_python.so", backend / "triton_python_backend_utils.py", self.stub):
            if not (python / src.name).is_symlink():
                (python / src.name).symlink_to(src)
        return python.parent

    def command(self) -> list[str]:
        # --exit-on-error=false: a model that fails to load leaves the server up (live, not ready), so
        # a model's failure is told apart from a server that cannot start here.
        return [str(self.root / "bin" / "tritonserver"), f"--model-repository={self.repo}",
                f"--backend-directory={self._backends()}", "--exit-on-error=false",
                f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
                "--http-address=127.0.0.1", f"--http-port={self.http_port}",
                "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
                "--metrics-address=127.0.0.1", f"--metrics-port={self.metrics_port}", *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
        return env

    def start(self) -> LocalTritonServer:
        remove_stale_regions()
        self._env_dirs_before = {p.name for p in ENV_DIRS.glob("python_env_*")}
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline, live = time.monotonic() + self.ready_timeout_s, False
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self._get("/v2/health/ready") == 200:
                return self
            live = live or self._get("/v2/health/live") == 200
            time.sleep(0.2)
        exited = self.proc.poll()
        self.stop()
        if not live:  # the server itself cannot run here (libraries, glibc, the stub)
            how = f"exit code {exited}" if exited is not None else f"not live after {self.ready_timeout_s:.0f} s"
            raise MissingDependency(f"tritonserver did not start here ({how}):\n" + self.log_tail())
        raise ServeError(f"tritonserver started but its models were not ready after {self.ready_timeout_s:.0f} s "
                         "(a model failed to load):\n" + self.log_tail())

    def _get(self, path: str) -> int | None:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self._get("/v2/health/live") == 200

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (Triton unloads its models and removes what its backend made), SIGKILL after
        `timeout_s`; then what a killed server would have left, as the module docstring says."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the server and its stubs
                self.proc.wait()
        for region in SHM.glob(self.shm_prefix + "*"):
            region.unlink(missing_ok=True)
        for folder in ENV_DIRS.glob("python_env_*"):
            if folder.name not in self._env_dirs_before and folder.is_dir() and not any(folder.iterdir()):
                try:
                    folder.rmdir()
                except OSError:
                    pass  # another server's, filled meanwhile

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> LocalTritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
