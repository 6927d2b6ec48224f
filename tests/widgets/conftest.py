"""Fixtures for the widget tests: a tiny random model (with and without a shared expert) and its traces."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import moebench
from moebench.record import Stepper

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import write_tiny_model  # noqa: E402

PROMPT = "def add(a, b):"


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(model, tokenizer) of a 4-layer, 8-expert, top-2 random 4-bit Qwen2-MoE with a shared expert."""
    return moebench.load(write_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def tiny_no_shared(tmp_path_factory):
    return moebench.load(write_tiny_model(tmp_path_factory.mktemp("tiny-no-shared"), shared_expert=False))


@pytest.fixture(scope="session")
def trace(tiny):
    model, tokenizer = tiny
    return Stepper(model, tokenizer, PROMPT, record=True).run(4)


@pytest.fixture(autouse=True)
def restore_fused_switch():
    """Widgets flip the process-wide fused switch; put it back after every test."""
    before = moebench.fused_moe_enabled()
    yield
    moebench.set_fused_moe(before)
