"""Environment knobs, declared in one place (Triton's knobs.py, in small)."""
from __future__ import annotations

import math
import os
from pathlib import Path

import platformdirs

from .errors import ConfigError

MAX_DEVICE_BYTES = 1 << 40  # 1 TiB, more than any GPU holds: a larger buffer is a typo or a broken manifest
INT32_MAX = 2**31 - 1       # TensorRT's and Triton's dims


def cache_dir() -> Path:
    """Compile cache root: $DEEPJIT_CACHE_DIR, else the user cache dir (the spec may override)."""
    env = os.environ.get("DEEPJIT_CACHE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir("deepjit")) / "kernels"


def stage_cache_dir() -> Path:
    """Where the build caches its graph and precision stages: `stages/` under $DEEPJIT_CACHE_DIR,
    else under the user cache dir."""
    env = os.environ.get("DEEPJIT_CACHE_DIR")
    return (Path(env) if env else Path(platformdirs.user_cache_dir("deepjit"))) / "stages"


def stage_cache_max_bytes() -> int:
    """$DEEPJIT_STAGE_CACHE_MB: the stage cache's size bound; past it the least recently used entries go
    (default 2048 MB: ~90 fp16 rewrites of YOLOv8s)."""
    return int(_positive("DEEPJIT_STAGE_CACHE_MB", 2048.0, "a number of megabytes") * 1e6)


def plan_cache_max_bytes() -> int:
    """$DEEPJIT_PLAN_CACHE_MB: the plan cache's size bound; past it the least recently used plans go
    (default 8192 MB: plans take minutes to build, so the bound is loose)."""
    return int(_positive("DEEPJIT_PLAN_CACHE_MB", 8192.0, "a number of megabytes") * 1e6)


def kernel_cache_max_bytes() -> int:
    """$DEEPJIT_KERNEL_CACHE_MB: the compile cache's size bound; past it the least recently used kernels go
    (default 512 MB: a kernel's entry is tens of kB, so thousands of them)."""
    return int(_positive("DEEPJIT_KERNEL_CACHE_MB", 512.0, "a number of megabytes") * 1e6)


def cache_key_file() -> Path:
    """$DEEPJIT_CACHE_KEY_FILE: the secret that signs this user's kernel cache entries (default: in the
    user config folder, outside any cache folder a team might share)."""
    env = os.environ.get("DEEPJIT_CACHE_KEY_FILE")
    return Path(env) if env else Path(platformdirs.user_config_dir("deepjit")) / "cache.key"


def plan_cache_dir() -> Path:
    """Built TensorRT/TensorRT-RTX plans, by the digest of what built them: $DEEPJIT_CACHE_DIR/plans, else
    the user cache dir's plans/ (the spec's compile.cache_dir, when given, holds them in its plans/)."""
    env = os.environ.get("DEEPJIT_CACHE_DIR")
    return (Path(env) if env else Path(platformdirs.user_cache_dir("deepjit"))) / "plans"


def runtime_cache_dir() -> Path:
    """TensorRT-RTX's runtime caches (the kernels it compiles for this GPU when it loads a plan), one
    file per plan: $DEEPJIT_RUNTIME_CACHE_DIR, else the user cache dir's tensorrt-rtx-runtime/."""
    env = os.environ.get("DEEPJIT_RUNTIME_CACHE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir("deepjit")) / "tensorrt-rtx-runtime"


def dump_dir() -> Path | None:
    """$DEEPJIT_DUMP_DIR: where rendered kernels and PTX are also written, for debugging."""
    env = os.environ.get("DEEPJIT_DUMP_DIR")
    return Path(env) if env else None


def keep_run_results() -> bool:
    """$DEEPJIT_KEEP_RUN_RESULTS=1: keep Polygraphy's RunResults of every comparison in the build
    report (default: only of those that failed; they are the size of every output of every sample)."""
    return os.environ.get("DEEPJIT_KEEP_RUN_RESULTS", "") not in ("", "0")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level() -> str:
    """$DEEPJIT_LOG_LEVEL: logging level for the deepjit.* loggers (default INFO); another value is a
    ConfigError naming the variable (logging's own ValueError would be a traceback)."""
    level = os.environ.get("DEEPJIT_LOG_LEVEL", "INFO").upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"$DEEPJIT_LOG_LEVEL is {os.environ['DEEPJIT_LOG_LEVEL']!r}: one of {', '.join(LOG_LEVELS)}")
    return level


_PKG = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """The folder `name` ('kernels' or 'templates'), from a checkout or from the installed wheel."""
    for candidate in (_PKG.parent / name, _PKG / "_data" / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"DeepJIT's '{name}' folder is missing from {_PKG.parent} and {_PKG / '_data'}")


WEEK_S = 7 * 24 * 3600.0  # a registry wait past a week is a typo (and past ~1e9 s, time's own limits overflow)


def registry_timeout_s() -> float:
    """$DEEPJIT_REGISTRY_TIMEOUT_S: connect and read timeout of each registry request (default 30)."""
    return _positive("DEEPJIT_REGISTRY_TIMEOUT_S", 30.0, "a number of seconds", WEEK_S)


def registry_deadline_s() -> float:
    """$DEEPJIT_REGISTRY_DEADLINE_S: no registry request of one command starts past this (default 1800)."""
    return _positive("DEEPJIT_REGISTRY_DEADLINE_S", 1800.0, "a number of seconds", WEEK_S)


def _positive(name: str, default: float, what: str, most: float = math.inf) -> float:
    """A quantity from the environment: ConfigError naming the variable unless a finite number above 0
    (and at most `most`)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 < value <= most:
        upto = f" and at most {most:g}" if math.isfinite(most) else ""
        raise ConfigError(f"${name} is {text!r}: {what} above 0{upto} is allowed (default {default:g})")
    return value
