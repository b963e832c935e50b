"""Progress counts (log.py): a log line per tenth when stderr is not a terminal, a rich bar when it is."""
from __future__ import annotations

import logging
import time

import pytest

from deepjit_compiler import log as logmod
from deepjit_compiler.log import Progress


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "deepjit.test"]


def test_piped_progress_logs_a_line_per_tenth(caplog):
    with caplog.at_level(logging.INFO, logger="deepjit.test"), \
            Progress("calibration", 40, unit="samples", logger="deepjit.test") as p:
        for _ in range(40):
            p.advance()
    lines = _lines(caplog)
    assert len(lines) == 10 and lines[0] == "calibration: 4 of 40 samples (10%)"
    assert lines[-1] == "calibration: 40 of 40 samples (100%)"


def test_few_steps_log_each_and_bytes_read_as_sizes(caplog):
    with caplog.at_level(logging.INFO, logger="deepjit.test"):
        with Progress("graph level", 2, unit="samples", logger="deepjit.test") as p:
            p.advance()
            p.advance()
        with Progress("packing b", 200_000_000, unit="bytes", logger="deepjit.test") as p:
            p.advance(100_000_000)
            p.advance(100_000_000)
        with Progress("nothing to count", 0, logger="deepjit.test") as p:
            p.advance(5)
    assert _lines(caplog) == ["graph level: 1 of 2 samples (50%)", "graph level: 2 of 2 samples (100%)",
                              "packing b: 100.0 MB of 200.0 MB (50%)", "packing b: 200.0 MB of 200.0 MB (100%)"]


def test_a_terminal_gets_a_bar_with_counts_instead_of_lines(monkeypatch, caplog):
    made = []

    class FakeBar:
        def __init__(self, *columns, **kwargs):
            self.columns, self.updates, self.running = columns, [], False
            made.append(self)

        def start(self):
            self.running = True

        def stop(self):
            self.running = False

        def add_task(self, what, total):
            self.total = total
            return 0

        def update(self, task, completed):
            self.updates.append(completed)

    monkeypatch.setattr(logmod, "RichProgress", FakeBar)
    monkeypatch.setattr(logmod.sys.stderr, "isatty", lambda: True)
    with caplog.at_level(logging.INFO, logger="deepjit.test"), \
            Progress("precision level", 3, unit="samples", logger="deepjit.test") as p:
        for _ in range(3):
            p.advance()
        assert made[0].running
    (bar,) = made
    assert bar.total == 3 and bar.updates == [1, 2, 3] and not bar.running
    assert any(isinstance(c, logmod.MofNCompleteColumn) for c in bar.columns)
    assert _lines(caplog) == []


def test_setup_logs_to_stderr_once_at_the_level_asked(monkeypatch, capsys):
    saved = logmod.log.handlers[:], logmod.log.level
    try:
        monkeypatch.setenv("DEEPJIT_LOG_LEVEL", "error")
        for _ in range(2):
            logmod.setup()
        assert logmod.log.level == logging.ERROR and len(logmod.log.handlers) == 1
        logging.getLogger("deepjit.test").error("disk full")
        assert capsys.readouterr() == ("", "[ERROR] deepjit.test: disk full\n")
        logmod.setup(quiet=True)
        assert logmod.log.level == logging.WARNING
        logmod.setup(verbose=True, quiet=True)
        assert logmod.log.level == logging.DEBUG
        logmod.set_level("quiet")
        assert logmod.log.level == logging.WARNING
        logmod.set_level("verbose")
        assert logmod.log.level == logging.DEBUG
    finally:
        logmod.log.handlers[:] = saved[0]
        logmod.log.setLevel(saved[1])


def test_stage_times_count_seconds_and_name_a_cached_stage_once(caplog):
    times = logmod.StageTimes()
    times.mark_cached("graph")
    times.mark_cached("graph")
    with caplog.at_level(logging.INFO, logger="deepjit.graph"), times.stage("graph"):
        time.sleep(0.2)
    assert times.cached == ["graph"] and 0.2 <= times.seconds["graph"] < 5
    assert caplog.records[-1].getMessage().startswith("finished graph in 0.") and "(cached)" in caplog.text


def test_counts_past_the_total_stop_at_it_and_a_negative_total_counts_nothing(monkeypatch, caplog):
    monkeypatch.setattr(logmod, "RichProgress", lambda *a, **k: pytest.fail("no bar for nothing to count"))
    monkeypatch.setattr(logmod.sys.stderr, "isatty", lambda: True)
    with Progress("empty", -3, logger="deepjit.test") as p:
        p.advance(2)
    assert p.total == 0 and p.done == 2
    monkeypatch.setattr(logmod.sys.stderr, "isatty", lambda: False)
    with caplog.at_level(logging.INFO, logger="deepjit.test"), Progress("packing", 4, logger="deepjit.test") as p:
        p.advance(3)
        p.advance(3)
    assert p.done == 4 and _lines(caplog)[-1] == "packing: 4 of 4 (100%)"


class _NoBar:
    def start(self):
        pass

    def stop(self):
        pass

    def update(self, task, completed):
        pass

    def add_task(self, what, total):
        return 0


def test_a_terminal_bar_of_bytes_shows_sizes(monkeypatch):
    made = []
    monkeypatch.setattr(logmod, "RichProgress", lambda *columns, **kwargs: made.append(columns) or _NoBar())
    monkeypatch.setattr(logmod.sys.stderr, "isatty", lambda: True)
    with Progress("packing b", 5_000_000, unit="bytes", logger="deepjit.test") as p:
        p.advance(5_000_000)
    assert any(isinstance(c, logmod.DownloadColumn) for c in made[0])
    assert not any(isinstance(c, logmod.MofNCompleteColumn) for c in made[0])


class _Status:
    def __init__(self, events: list):
        self.events = events

    def start(self):
        self.events.append("spinner shown")

    def stop(self):
        self.events.append("spinner stopped")


class _Console:
    events: list = []

    def __init__(self, **kwargs):
        pass

    def status(self, text):
        return _Status(self.events)


@pytest.mark.parametrize("tty", [True, False])
def test_a_spinner_shows_only_on_a_terminal_after_a_second_and_gives_way_to_a_bar(monkeypatch, tty):
    events = _Console.events = []
    monkeypatch.setattr(logmod, "Console", _Console)
    monkeypatch.setattr(logmod, "RichProgress", lambda *columns, **kwargs: events.append("bar") or _NoBar())
    monkeypatch.setattr(logmod.sys.stderr, "isatty", lambda: tty)
    times = logmod.StageTimes()
    with times.stage("graph"):
        time.sleep(0.2)  # a short stage: no spinner
    assert events == []
    with times.stage("calibration"):
        deadline = time.monotonic() + (10 if tty else 1.4)  # the spinner's thread may start late on a busy machine
        while not events and time.monotonic() < deadline:
            time.sleep(0.05)
        with Progress("calibration", 2, logger="deepjit.test") as p:
            p.advance(2)
    assert events == (["spinner shown", "spinner stopped", "bar"] if tty else [])
