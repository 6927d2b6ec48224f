"""Fixtures for the widget tests: a tiny random model (with and without a shared expert) and its traces, a tiny
hybrid's trace, the shipped model's routing drift against a router-swapped copy, and a page of Chromium with
plotly.js to draw figures in."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from widget_inputs import DRIFT_TEXTS, HYBRID_LAYER_TYPES

import moebench
from moebench.checkpoint.loader import SHIPPED_MODEL
from moebench.inspect.drift import drift
from moebench.inspect.record import Stepper
from moebench.tools.corpus import Document
from moebench.tools.presets import get_preset
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


@pytest.fixture(scope="session")
def hybrid_trace(tmp_path_factory):
    """A tiny Qwen3-Next written by make-random whose layers are full, linear, linear, full (config layer_types)."""
    config = {**get_preset("qwen3-next-tiny").config, "torch_dtype": "float32", "layer_types": HYBRID_LAYER_TYPES}
    model, _ = moebench.load(write_random_checkpoint(tmp_path_factory.mktemp("hybrid") / "ckpt", config, seed=8,
                                                     bits=4, layout="stacked"))
    assert [layer.layer_type for layer in model.layers] == HYBRID_LAYER_TYPES
    return Stepper(model, None, [4, 8, 15, 16], record=True).run(3)


@pytest.fixture(scope="session")
def shipped():
    return moebench.load(SHIPPED_MODEL)


@pytest.fixture(scope="session")
def swapped(shipped, tmp_path_factory):
    """(Drift of the shipped model against its swapped copy, the last layer, the two swapped experts)."""
    model, tokenizer = shipped
    prompts = [tokenizer.encode(t) for t in DRIFT_TEXTS]
    itself = drift([model, model], prompts, names=["shipped", "same"])
    last = itself.layers[-1]
    ids = itself.routings["shipped"].ids[:, -1]
    counts = np.bincount(ids[:, 0], minlength=model.args.num_experts)
    pair = [int(np.argmax(counts)), int(np.argmin(np.bincount(ids.ravel(), minlength=model.args.num_experts)))]
    folder = tmp_path_factory.mktemp("swapped") / "tiny-swapped"
    shutil.copytree(SHIPPED_MODEL, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    for part in ("weight", "scales", "biases"):  # the router is quantized: swap whole rows of each part
        t = tensors[f"model.layers.{last}.mlp.gate.{part}"]
        t[pair] = t[pair[::-1]]
    save_file(tensors, str(folder / "model.safetensors"))
    other, _ = moebench.load(folder)
    return drift([model, other], prompts, names=["shipped", "swapped"]), last, pair


CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def plotly_page():
    """A blank page of headless Chromium with plotly.js, the version plotly's widget bundles (both come with the
    plotly package); skips without playwright or Debian's chromium."""
    playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: install Debian's chromium (scripts/setup.sh does)")
    from plotly_replay import PLOTLY_JS

    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                    args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        page.add_script_tag(path=str(PLOTLY_JS))
        yield page
        browser.close()
