"""moebench microbench: a shape it cannot build is named before any kernel runs (a zero width was a SIGFPE)."""

from __future__ import annotations

import re

import pytest

from moebench.cli import main
from moebench.errors import MoebenchError
from moebench.tools.microbench import SHAPE_FIELDS, StackShape, run


@pytest.mark.parametrize("field", SHAPE_FIELDS)
@pytest.mark.parametrize("value", [0, -1])
def test_a_shape_field_below_one_is_named(field, value):
    with pytest.raises(MoebenchError, match=re.escape(f"{field} must be an integer >= 1, got {value}")):
        run(StackShape(**{field: value}), tokens=1, repeats=1)


@pytest.mark.parametrize("kwargs, words", [(dict(tokens=0), "tokens must be"), (dict(repeats=-1), "repeats must be"),
                                           (dict(rows=[0]), "rows 0"), (dict(rows=[33]), "rows 33"),
                                           (dict(seed=-1), "seed must be"), (dict(seed=2**64), "seed must be")])
def test_run_settings_out_of_range_are_named(kwargs, words):
    with pytest.raises(MoebenchError, match=re.escape(words)):
        run(StackShape(layers=1, experts=4, top_k=2, hidden=64, dff=64), **kwargs)


@pytest.mark.parametrize("flag", [f"--{f.replace('_', '-')}" for f in SHAPE_FIELDS] + ["--tokens", "--repeats"])
@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_numeric_flags_out_of_range_are_usage_errors(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main(["microbench", flag, value])
    assert exit_.value.code == 2 and f"argument {flag}:" in capsys.readouterr().err


def test_a_small_stack_still_runs():
    report = run(StackShape(layers=1, experts=4, top_k=2, hidden=64, dff=64, group_size=64), tokens=1, repeats=1)
    assert report["arms"][0]["name"] == "fallback" and report["arms"][0]["median_ms"] > 0
