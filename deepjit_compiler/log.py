"""Logging to stderr, stage timings, a spinner on a TTY for stages over a second, and progress counts
for long steps (a bar on a TTY, a log line per tenth when piped)."""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.filesize import decimal
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

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
    # Imported here, not at the top: GraphSurgeon's logger brings onnx and numpy, which `--help` needs not.
    from onnx_graphsurgeon.logger import G_LOGGER as graphsurgeon_logger
    from polygraphy.logger import G_LOGGER as polygraphy_logger

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


_spinner_stops: list = []  # how to stop the running stage's spinner, so that a progress bar can take its place


@contextlib.contextmanager
def _spinner(name: str):
    """A rich status line, shown only on a TTY and only once the stage has run for a second."""
    if not sys.stderr.isatty():
        yield
        return

    done = threading.Event()
    lock = threading.Lock()
    status_box: list = []

    def show():
        if not done.wait(1.0):
            with lock:
                if not done.is_set():
                    status_box.append(Console(stderr=True).status(f"[bold]{name}[/bold] ..."))
                    status_box[0].start()

    def stop():
        with lock:
            done.set()
            if status_box:
                status_box.pop().stop()

    timer = threading.Thread(target=show, daemon=True)
    _spinner_stops.append(stop)
    timer.start()
    try:
        yield
    finally:
        stop()
        timer.join()
        _spinner_stops.remove(stop)


class Progress:
    """Counts of a long step (samples compared, calibration batches, bytes packed): a rich progress bar
    on stderr when it is a terminal (in place of the stage's spinner), else a log line at every tenth.
    Use as a context manager; `advance(n)` counts."""

    def __init__(self, what: str, total: int, *, unit: str = "", logger: str = "deepjit"):
        self.what, self.total, self.unit, self.done = what, max(int(total), 0), unit, 0
        self._log, self._shown, self._bar = logging.getLogger(logger), 0, None

    def __enter__(self) -> Progress:
        if sys.stderr.isatty() and self.total:
            for stop in list(_spinner_stops):
                stop()
            counts = DownloadColumn() if self.unit == "bytes" else MofNCompleteColumn()
            self._bar = RichProgress(TextColumn(f"[bold]{self.what}[/bold]"), BarColumn(), counts,
                                     TextColumn(self.unit if self.unit != "bytes" else ""), TimeElapsedColumn(),
                                     console=Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.what, total=self.total)
        return self

    def advance(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total) if self.total else self.done + n
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
            return
        tenth = self.done * 10 // self.total if self.total else 0
        if tenth > self._shown and self._log.isEnabledFor(logging.INFO):
            self._shown = tenth
            done, total = (decimal(self.done), decimal(self.total)) if self.unit == "bytes" else \
                (str(self.done), f"{self.total} {self.unit}".rstrip())
            self._log.info("%s: %s of %s (%d%%)", self.what, done, total, self.done * 100 // self.total)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
