"""Fixtures for the widget tests: a tiny random model (with and without a shared expert) and its traces."""

from __future__ import annotations

from pathlib import Path

import pytest

import moebench
from moebench.inspect.record import Stepper
from moebench.tools.corpus import Document
from moebench.tools.train import train_tokenizer
from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint

PROMPT = "def add(a, b):"
VOCAB = 320
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on.",
]


def write_tiny_model(folder: Path, shared_expert: bool = True) -> Path:
    """Random 4-bit weights (4 layers, 8 experts, top-2) plus tokenizer.json, in `folder`."""
    config = qwen2_moe_config(vocab_size=VOCAB, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2)
    if not shared_expert:
        config["shared_expert_intermediate_size"] = 0
    write_random_checkpoint(folder, config, seed=1, bits=4, group_size=64)
    docs = [Document(f"text{i}", text) for i, text in enumerate(TEXTS)]
    train_tokenizer(docs, VOCAB).save(str(folder / "tokenizer.json"))
    return folder


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
