"""Progress counts (log.py): a log line per tenth when stderr is not a terminal, a rich bar when it is."""
from __future__ import annotations

import logging

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
