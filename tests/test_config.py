"""Environment knobs (config.py): where the caches live, their bounds, and bad values named with exit 2."""
from __future__ import annotations

from pathlib import Path

import platformdirs
import pytest

from deepjit_compiler import config
from deepjit_compiler.errors import ConfigError

CACHE_VARS = ("DEEPJIT_CACHE_DIR", "DEEPJIT_CACHE_KEY_FILE", "DEEPJIT_RUNTIME_CACHE_DIR", "DEEPJIT_DUMP_DIR")


def test_cache_folders_follow_deepjit_cache_dir_and_default_to_the_user_dirs(tmp_path, monkeypatch):
    for name in CACHE_VARS:
        monkeypatch.delenv(name, raising=False)
    user_cache = Path(platformdirs.user_cache_dir("deepjit"))
    assert (config.cache_dir(), config.stage_cache_dir(), config.plan_cache_dir(), config.runtime_cache_dir()) == (
        user_cache / "kernels", user_cache / "stages", user_cache / "plans", user_cache / "tensorrt-rtx-runtime")
    assert config.cache_key_file() == Path(platformdirs.user_config_dir("deepjit")) / "cache.key"
    assert config.dump_dir() is None
    monkeypatch.setenv("DEEPJIT_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("DEEPJIT_CACHE_KEY_FILE", str(tmp_path / "k.key"))
    monkeypatch.setenv("DEEPJIT_RUNTIME_CACHE_DIR", str(tmp_path / "rt"))
    monkeypatch.setenv("DEEPJIT_DUMP_DIR", str(tmp_path / "dump"))
    assert (config.cache_dir(), config.stage_cache_dir(), config.plan_cache_dir(), config.runtime_cache_dir()) == (
        tmp_path / "c", tmp_path / "c" / "stages", tmp_path / "c" / "plans", tmp_path / "rt")
    assert config.cache_key_file() == tmp_path / "k.key" and config.dump_dir() == tmp_path / "dump"


def test_size_bounds_default_and_read_megabytes(monkeypatch):
    for name in ("DEEPJIT_STAGE_CACHE_MB", "DEEPJIT_PLAN_CACHE_MB", "DEEPJIT_KERNEL_CACHE_MB"):
        monkeypatch.setenv(name, "  ")  # blank: the default
    assert (config.stage_cache_max_bytes(), config.plan_cache_max_bytes(), config.kernel_cache_max_bytes()) == (
        2048 * 10**6, 8192 * 10**6, 512 * 10**6)
    monkeypatch.setenv("DEEPJIT_PLAN_CACHE_MB", " 1.5e3 ")
    monkeypatch.setenv("DEEPJIT_STAGE_CACHE_MB", "0.25")
    assert (config.plan_cache_max_bytes(), config.stage_cache_max_bytes()) == (1500 * 10**6, 250_000)


def test_registry_durations_default_and_take_up_to_a_week(monkeypatch):
    monkeypatch.delenv("DEEPJIT_REGISTRY_TIMEOUT_S", raising=False)
    monkeypatch.delenv("DEEPJIT_REGISTRY_DEADLINE_S", raising=False)
    assert (config.registry_timeout_s(), config.registry_deadline_s()) == (30.0, 1800.0)
    monkeypatch.setenv("DEEPJIT_REGISTRY_TIMEOUT_S", "604800")
    monkeypatch.setenv("DEEPJIT_REGISTRY_DEADLINE_S", "0.5")
    assert (config.registry_timeout_s(), config.registry_deadline_s()) == (604800.0, 0.5)


@pytest.mark.parametrize("value", ["1e400", "-inf", "ten"])
def test_a_size_bound_that_is_no_finite_positive_number_is_named(monkeypatch, value):
    monkeypatch.setenv("DEEPJIT_PLAN_CACHE_MB", value)
    with pytest.raises(ConfigError, match=rf"\$DEEPJIT_PLAN_CACHE_MB is '{value}': a number of megabytes above 0 "
                                          r"is allowed \(default 8192\)") as e:
        config.plan_cache_max_bytes()
    assert e.value.exit_code == 2


@pytest.mark.parametrize("value, keep", [("", False), ("0", False), ("1", True), ("yes", True)])
def test_keep_run_results_is_on_for_any_value_but_empty_and_0(monkeypatch, value, keep):
    monkeypatch.setenv("DEEPJIT_KEEP_RUN_RESULTS", value)
    assert config.keep_run_results() is keep


def test_log_level_defaults_to_info_and_takes_any_case(monkeypatch):
    monkeypatch.delenv("DEEPJIT_LOG_LEVEL", raising=False)
    assert config.log_level() == "INFO"
    monkeypatch.setenv("DEEPJIT_LOG_LEVEL", "warning")
    assert config.log_level() == "WARNING"
    monkeypatch.setenv("DEEPJIT_LOG_LEVEL", "verbose")
    with pytest.raises(ConfigError, match=r"\$DEEPJIT_LOG_LEVEL is 'verbose': one of DEBUG, INFO, WARNING"):
        config.log_level()


def test_data_dir_finds_the_checkouts_folders_and_names_a_missing_one():
    assert (config.data_dir("kernels") / "yolov8_decode.yaml").is_file()
    with pytest.raises(FileNotFoundError, match="DeepJIT's 'no-such' folder is missing"):
        config.data_dir("no-such")
