"""Kernel settings: the environment's defaults, read when a model is opened, and values that are refused."""

from __future__ import annotations

import pytest

from moebench.errors import ConfigError
from moebench.execution.settings import ENV_MAX_DFF, ENV_ROWS, ENV_SWITCH, KernelSettings, parse_switch


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in (ENV_SWITCH, ENV_ROWS, ENV_MAX_DFF):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("raw, on", [("0", False), ("false", False), (" OFF ", False), ("No", False),
                                     ("FALSE\n", False), ("1", True), ("on", True), ("Yes", True), ("", True)])
def test_switch_words(monkeypatch, raw, on):
    monkeypatch.setenv(ENV_SWITCH, raw)
    assert KernelSettings.from_env().fused is on


def test_defaults_without_the_environment():
    assert KernelSettings.from_env() == KernelSettings(fused=True, rows=8, max_dff=None, attention_kernel=True)


@pytest.mark.parametrize("raw", [None, "1", "true", "on", "yes", " TRUE ", "Yes\n"])
def test_unset_or_an_on_word_leaves_it_on(monkeypatch, raw):
    if raw is not None:
        monkeypatch.setenv(ENV_SWITCH, raw)
    assert KernelSettings.from_env().fused is True


@pytest.mark.parametrize("raw", ["disabled", "nope", "2", "offf"])
def test_a_switch_word_it_does_not_understand_is_an_error_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(ENV_SWITCH, raw)
    with pytest.raises(ConfigError, match=ENV_SWITCH):
        KernelSettings.from_env()


def test_rows_and_cap_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_ROWS, "16")
    monkeypatch.setenv(ENV_MAX_DFF, "64")
    assert KernelSettings.from_env() == KernelSettings(rows=16, max_dff=64)


@pytest.mark.parametrize("raw, rows", [(None, 8), ("", 8), ("1", 1), (" 16 ", 16), ("32", 32)])
def test_rows_per_threadgroup_from_the_environment(monkeypatch, raw, rows):
    """Unset or empty: the default, 8; any value the kernels take, 1 to 32 (spaces around it ignored)."""
    if raw is not None:
        monkeypatch.setenv(ENV_ROWS, raw)
    assert KernelSettings.from_env().rows == rows


@pytest.mark.parametrize("name, raw", [(ENV_ROWS, "0"), (ENV_ROWS, "33"), (ENV_ROWS, "eight"), (ENV_MAX_DFF, "0"),
                                       (ENV_MAX_DFF, "-5"), (ENV_MAX_DFF, "big")])
def test_bad_numbers_are_errors_naming_the_variable(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ConfigError, match=name):
        KernelSettings.from_env()


@pytest.mark.parametrize("value, on", [(True, True), (False, False), ("off", False), ("ON", True)])
def test_parse_switch_takes_bools_and_the_same_words(value, on):
    assert parse_switch(value, "x") is on


@pytest.mark.parametrize("value", ["disabled", 0, 1, None, 0.0])
def test_parse_switch_refuses_anything_else(value):
    with pytest.raises(ConfigError, match="expected True or False"):
        parse_switch(value, "set_fused_moe")


@pytest.mark.parametrize("kwargs", [dict(rows=0), dict(rows=33), dict(rows=True), dict(max_dff=0), dict(fused="maybe")])
def test_settings_refuse_impossible_values(kwargs):
    with pytest.raises(ConfigError):
        KernelSettings(**kwargs)
