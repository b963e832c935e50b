"""Atomic writes, folder replacement, output locks and the removal of DeepJIT's own leftovers (files.py)."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
import threading
import tracemalloc
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from deepjit_compiler.errors import BundleError, OutputError
from deepjit_compiler.files import (
    MARK,
    atomic_file,
    atomic_write,
    output_lock,
    read_regular,
    remove_leftovers,
    remove_old_temporaries,
    replace_dir,
    staging_dir,
)


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _deepjit_leftovers(folder: Path, name: str) -> list[Path]:
    """What DeepJIT's writers of `name` leave when killed: marked staging folders and folders set aside (of the
    bundle and of its report), and a 0600 temporary file."""
    made = []
    for prefix in (f".{name}.tmp-", f".{name}.old-", f".{name}.report.tmp-", f".{name}.report.old-"):
        made.append(Path(tempfile.mkdtemp(dir=folder, prefix=prefix)))
        (made[-1] / MARK).touch()
    fd, half = tempfile.mkstemp(dir=folder, prefix=f".{name}.tar.gz.tmp-")
    os.close(fd)
    return [*made, Path(half)]


# ---------------------------------------------------------------------------- reading
def test_read_regular_takes_exactly_limit_bytes_and_stops_reading_past_it(tmp_path):
    data = np.random.default_rng(40).bytes(1000)
    (tmp_path / "small").write_bytes(data)
    assert read_regular(tmp_path / "small", limit=1000) == data
    with pytest.raises(ValueError, match="over 999 bytes"):
        read_regular(tmp_path / "small", limit=999)
    with open(tmp_path / "sparse", "wb") as f:  # 64 MB that take no disk
        f.truncate(64 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="over 1000 bytes"):
            read_regular(tmp_path / "sparse", limit=1000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


# ---------------------------------------------------------------------------- atomic writes
def test_a_file_further_up_the_output_path_is_named(tmp_path):
    (tmp_path / "afile").write_text("a user's")
    with pytest.raises(OutputError, match=r"afile/sub/out\.bin: cannot write \(.*/afile is a file, not a folder\); "
                                          "nothing was left half-written"):
        atomic_write(tmp_path / "afile" / "sub" / "out.bin", b"data")
    assert (tmp_path / "afile").read_text() == "a user's"


def test_atomic_writes_are_readable_by_all_whatever_the_umask(tmp_path):
    data = np.random.default_rng(41).bytes(300)
    old = os.umask(0o077)
    try:
        atomic_write(tmp_path / "new" / "out.bin", data)
    finally:
        os.umask(old)
    assert (tmp_path / "new" / "out.bin").read_bytes() == data
    assert (tmp_path / "new" / "out.bin").stat().st_mode & 0o777 == 0o644


def test_a_failed_atomic_write_keeps_the_previous_file_and_leaves_nothing(tmp_path, monkeypatch):
    rng = np.random.default_rng(42)
    before = rng.bytes(200)
    (tmp_path / "out.bin").write_bytes(before)
    with pytest.raises(RuntimeError, match="interrupted"), atomic_file(tmp_path / "out.bin") as f:
        f.write(rng.bytes(100))
        raise RuntimeError("interrupted")
    assert _names(tmp_path) == ["out.bin"] and (tmp_path / "out.bin").read_bytes() == before

    def disk_full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OutputError, match=r"out\.bin: cannot write \(No space left on device\)"):
        atomic_write(tmp_path / "out.bin", rng.bytes(100))
    assert _names(tmp_path) == ["out.bin"] and (tmp_path / "out.bin").read_bytes() == before


def test_staging_dir_makes_the_missing_parent_and_removes_itself(tmp_path):
    dest = tmp_path / "new" / "deeper" / "b"
    with staging_dir(dest) as stage:
        assert stage.parent == dest.parent and stage.name.startswith(".b.tmp-") and stage.is_dir()
        (stage / "half.bin").write_bytes(np.random.default_rng(43).bytes(50))
    assert _names(dest.parent) == []


# ---------------------------------------------------------------------------- replace_dir
@pytest.mark.parametrize("kind", ["file", "symlink to a folder", "dangling symlink"])
def test_replace_dir_never_replaces_what_is_not_a_folder(tmp_path, kind):
    src, dest, target = tmp_path / "new", tmp_path / "dest", tmp_path / "target"
    src.mkdir()
    (src / "a").write_bytes(np.random.default_rng(44).bytes(30))
    if kind == "file":
        dest.write_text("a user's")
    elif kind == "symlink to a folder":
        target.mkdir()
        (target / "notes.txt").write_text("a user's")
        dest.symlink_to(target)
    else:
        dest.symlink_to(target)
    with pytest.raises(BundleError, match=r"dest: exists and is not a folder; refusing to replace it"):
        replace_dir(src, dest)
    assert dest.is_symlink() == (kind != "file") and (src / "a").exists()
    if kind == "file":
        assert dest.read_text() == "a user's"
    if kind == "symlink to a folder":
        assert (dest / "notes.txt").read_text() == "a user's"


@pytest.mark.parametrize("error, raised", [(OSError(errno.ENOSPC, "No space left on device"), OutputError),
                                           (KeyboardInterrupt(), KeyboardInterrupt)])
def test_a_failed_replace_dir_puts_the_previous_folder_back(tmp_path, monkeypatch, error, raised):
    rng = np.random.default_rng(45)
    src, dest = tmp_path / "new", tmp_path / "dest"
    src.mkdir()
    dest.mkdir()
    before = rng.bytes(80)
    (dest / "a").write_bytes(before)
    (src / "a").write_bytes(rng.bytes(80))
    real = os.replace

    def fail_on_src(a, b):
        if Path(a) == src:
            raise error
        return real(a, b)

    monkeypatch.setattr(os, "replace", fail_on_src)
    with pytest.raises(raised):
        replace_dir(src, dest)
    assert (dest / "a").read_bytes() == before and _names(tmp_path) == ["dest", "new"]


# ---------------------------------------------------------------------------- leftovers and locks
def test_what_only_looks_like_a_leftover_is_kept(tmp_path):
    """A user's private (0600) files named like DeepJIT's temporaries, a FIFO, a symlink and a folder whose
    mark is no file stay; DeepJIT's own leftovers beside them go."""
    ours = _deepjit_leftovers(tmp_path, "b")
    private = [".b.tar.gz.tmp-mine", ".b.tmp-abcd12345", ".b.report.tmp-abcd1234.bak"]  # not tempfile's 8 characters
    for name in private:
        (tmp_path / name).write_text("a user's")
        os.chmod(tmp_path / name, 0o600)
    os.mkfifo(tmp_path / ".b.tar.gz.tmp-abcd1234", 0o600)
    (tmp_path / ".b.tmp-efgh5678").symlink_to(tmp_path / private[0])
    (tmp_path / ".b.old-ijkl9012" / MARK).mkdir(parents=True)
    kept = _names(tmp_path)
    remove_leftovers(tmp_path / "b")
    assert _names(tmp_path) == sorted(set(kept) - {p.name for p in ours})
    assert all((tmp_path / name).read_text() == "a user's" for name in private)


def test_old_temporaries_go_even_of_a_name_holding_tmp_and_one_that_cannot_be_removed_is_skipped(tmp_path,
                                                                                                  monkeypatch):
    old = [Path(tempfile.mkstemp(dir=tmp_path, prefix=prefix)[1]) for prefix in (".v1.tmp-", ".a.tmp-b.tmp-", ".c.tmp-")]
    for path in old:
        os.utime(path, (0, 0))
    real = Path.unlink

    def refuse(self, missing_ok=False):
        if self == old[2]:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    remove_old_temporaries(tmp_path, min_age_s=60)
    assert _names(tmp_path) == [old[2].name]


def test_leftovers_of_another_user_are_kept(tmp_path, monkeypatch):
    left = _names(tmp_path) + [p.name for p in _deepjit_leftovers(tmp_path, "b")]
    monkeypatch.setattr(os, "getuid", lambda: os.geteuid() + 1)
    remove_leftovers(tmp_path / "b")
    assert _names(tmp_path) == sorted(left)


def test_each_time_the_lock_is_taken_it_removes_leftovers(tmp_path):
    dest = tmp_path / "b"
    for _ in range(2):
        _deepjit_leftovers(tmp_path, "b")
        with output_lock(dest):
            assert _names(tmp_path) == []


LOCKER = ("import sys\nfrom pathlib import Path\nfrom deepjit_compiler.files import output_lock\n"
          "print('ready', flush=True)\nwith output_lock(Path(sys.argv[1])):\n    print('in', flush=True)\n")


def test_a_writer_of_the_same_output_given_relatively_waits_for_the_lock(tmp_path):
    (tmp_path / "out").mkdir()
    with output_lock(tmp_path / "out" / "b"):
        child = subprocess.Popen([sys.executable, "-c", LOCKER, "out/b"], cwd=tmp_path, stdout=subprocess.PIPE,
                                 text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert child.stdout.readline() == "ready\n"
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=2)
    assert child.communicate(timeout=60)[0] == "in\n" and child.returncode == 0


def test_locks_of_many_outputs_and_of_one_output_again_are_held_at_once(tmp_path):
    def hold_all():
        with ExitStack() as stack:
            for i in range(40):
                stack.enter_context(output_lock(tmp_path / f"out{i}"))
                stack.enter_context(output_lock(tmp_path / f"out{i}"))  # re-entrant within the process

    worker = threading.Thread(target=hold_all, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive()


def test_the_lock_lands_in_a_folder_of_this_users_alone_not_beside_the_output(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with output_lock(tmp_path / "out" / "b"):
        assert _names(tmp_path / "out") == []
    (folder,) = (tmp_path / "tmp").iterdir()
    assert folder.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("plant", ["others can write it", "a symlink to a folder"])
def test_a_lock_folder_others_could_tamper_with_is_refused(tmp_path, monkeypatch, plant):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    folder = tmp_path / "tmp" / f"deepjit-locks-{os.getuid()}"
    if plant == "others can write it":
        folder.mkdir(parents=True)
        folder.chmod(0o777)
    else:
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "tmp").mkdir()
        folder.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OutputError, match=rf"out/b: cannot take its lock: .*deepjit-locks-{os.getuid()} is not a "
                                          "folder of this user's"), output_lock(tmp_path / "out" / "b"):
        pass
    assert list(folder.iterdir()) == []
