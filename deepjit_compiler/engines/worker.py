"""Plans are built in a child process whose environment tells Polygraphy which flavour to drive.

Polygraphy 0.53 picks TensorRT or TensorRT-RTX once per process: `POLYGRAPHY_USE_TENSORRT_RTX` is read
when `polygraphy.config` is imported, and its TensorRT modules bind `tensorrt` or `tensorrt_rtx` when
they are first imported. A DeepJIT process may need either (a T4 build here with TensorRT-RTX, a
`materialize` with TensorRT there, tests of both), and has imported Polygraphy long before it knows
which, so `build_in_child` runs tensorrt.build_plan in `python -c ...` with the variable set. The
child also keeps a native crash of the library from taking the build down with it, and keeps
Polygraphy's and TensorRT's log (which Polygraphy writes to stdout) off DeepJIT's stdout: it is logged
at debug level, and its tail goes into the error when the build fails.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import errors
from ..files import atomic_write
from .base import EngineSettings
from .flavours import Flavour, flavour
from .tensorrt import build_plan

log = logging.getLogger("deepjit.engines.worker")

_CHILD = "import sys; from deepjit_compiler.engines.worker import child_main; sys.exit(child_main(sys.argv[1]))"
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # what holds deepjit_compiler/, for the child's sys.path
LOG_TAIL = 40  # lines of the child's log an error quotes


def build_in_child(segment_path: str | Path, settings: EngineSettings, flavour_: Flavour, *,
                   timing_cache: str | Path | None = None, segment_name: str | None = None) -> tuple[bytes, dict, float]:
    """(plan bytes, network summary, build seconds) of one segment, built by `flavour_` in a child process.
    Errors the child raises come back as the same DeepJITError class; a crash is an EngineError."""
    path = Path(segment_path).resolve()
    name = segment_name or path.stem
    with tempfile.TemporaryDirectory(prefix="deepjit-plan-") as tmp:
        request = {"segment": str(path), "settings": settings.to_dict(), "flavour": flavour_.name, "name": name,
                   "timing_cache": str(timing_cache) if timing_cache is not None else None,
                   "plan": str(Path(tmp) / "plan"), "result": str(Path(tmp) / "result.json")}
        atomic_write(Path(tmp) / "request.json", json.dumps(request).encode())
        env = {**os.environ, "POLYGRAPHY_USE_TENSORRT_RTX": "1" if flavour_.polygraphy_rtx else "0",
               "PYTHONPATH": os.pathsep.join(p for p in (str(_PACKAGE_ROOT), os.environ.get("PYTHONPATH")) if p)}
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(Path(tmp) / "request.json")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        seconds = time.perf_counter() - start
        tail = "\n".join(proc.stdout.splitlines()[-LOG_TAIL:])
        log.debug("%s build of segment %s (%.1f s):\n%s", flavour_.title, name, seconds, proc.stdout)
        result_path = Path(request["result"])
        if proc.returncode != 0 or not result_path.is_file():
            raise errors.EngineError(f"segment '{name}': the {flavour_.title} build process exited with "
                                     f"{proc.returncode} (a crash in the library?); its log ends:\n{tail}")
        result = json.loads(result_path.read_text())
        if not result["ok"]:
            cls = getattr(errors, result["error"], errors.EngineError)
            cls = cls if isinstance(cls, type) and issubclass(cls, errors.DeepJITError) else errors.EngineError
            raise cls(result["message"] + (f"\n{flavour_.title}'s log ends:\n{tail}" if tail.strip() else ""))
        return Path(request["plan"]).read_bytes(), result["network"], result["seconds"]


def child_main(request_path: str) -> int:
    """The child: build the requested plan with tensorrt.build_plan, write it and a result record."""
    request = json.loads(Path(request_path).read_text())
    result_path = Path(request["result"])
    try:
        settings = EngineSettings.from_dict(request["settings"])
        start = time.perf_counter()
        plan, network = build_plan(request["segment"], settings, flavour(request["flavour"]),
                                   timing_cache=request["timing_cache"], segment_name=request["name"])
        seconds = time.perf_counter() - start
        atomic_write(Path(request["plan"]), plan)
        result = {"ok": True, "network": network, "seconds": seconds}
    except errors.DeepJITError as e:
        result = {"ok": False, "error": type(e).__name__, "message": str(e)}
    atomic_write(result_path, json.dumps(result).encode())
    return 0
