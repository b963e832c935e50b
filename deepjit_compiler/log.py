"""Logging to stderr, stage timings, and a progress spinner on a TTY for stages over a second."""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from dataclasses import dataclass, field

from onnx_graphsurgeon.logger import G_LOGGER as graphsurgeon_logger
from polygraphy.logger import G_LOGGER as polygraphy_logger
from rich.console import Console

from . import config

log = logging.getLogger("deepjit")


def setup(verbose: bool = False, quiet: bool = False) -> None:
    level = logging.DEBUG if verbose else logging.WARNING if quiet else config.log_level()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(levelname)s] %(name)s: %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    # Polygraphy and GraphSurgeon print their own logs; without the optional `colored` module they
    # first print a warning about it. Their lines go to stderr (cli.working); colors are not wanted.
    polygraphy_logger.colors = graphsurgeon_logger.colors = False


def set_level(name: str) -> None:
    """`verbose` or `quiet`: what -v / -q after a subcommand ask for."""
    log.setLevel(logging.DEBUG if name == "verbose" else logging.WARNING)


@dataclass
class StageTimes:
    """Seconds per build stage, and which stages a cache answered, for build-report.json (never in
    the manifest: it must not change)."""

    seconds: dict[str, float] = field(default_factory=dict)
    cached: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def stage(self, name: str):
        logger = logging.getLogger(f"deepjit.{name}")
        logger.info("starting %s", name)
        start = time.perf_counter()
        with _spinner(name):
            yield
        self.seconds[name] = round(time.perf_counter() - start, 3)
        logger.info("finished %s in %.2f s%s", name, self.seconds[name], " (cached)" if name in self.cached else "")

    def mark_cached(self, name: str) -> None:
        if name not in self.cached:
            self.cached.append(name)


@contextlib.contextmanager
def _spinner(name: str):
    """A rich status line, shown only on a TTY and only once the stage has run for a second."""
    if not sys.stderr.isatty():
        yield
        return

    done = threading.Event()
    status_box: list = []

    def show():
        if not done.wait(1.0):
            status_box.append(Console(stderr=True).status(f"[bold]{name}[/bold] ..."))
            status_box[0].start()

    timer = threading.Thread(target=show, daemon=True)
    timer.start()
    try:
        yield
    finally:
        done.set()
        timer.join()
        if status_box:
            status_box[0].stop()
