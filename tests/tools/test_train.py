import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import moebench
from moebench.checkpoint.files import read_safetensors_header
from moebench.checkpoint.loader import SHIPPED_MODEL
from moebench.checkpoint.weights import checkpoint_tensors
from moebench.cli import main
from moebench.inspect import stats
from moebench.tools import train as train_module
from moebench.tools.corpus import Document, split_documents
from moebench.tools.eval_tiny import routing_report
from moebench.tools.local_group import run_local_group
from moebench.tools.train import (
    LOG_FILE,
    RouterTap,
    TrainSettings,
    balance_loss,
    domain_separation,
    export_quantized,
    heldout_loss,
    init_model,
    openblas_env,
    rows_per_domain,
    sample_batch,
    train,
    validation_snapshot,
)
from moebench.tools.writer import qwen2_moe_config, save_checkpoint

TINY = qwen2_moe_config(vocab_size=64, num_experts=4, num_experts_per_tok=2)

# Held-out text of each domain (Julius Caesar is a validation play; difflib a validation module).
PROSE = """Antony.
Friends, Romans, countrymen, lend me your ears;
I come to bury Caesar, not to praise him.
The evil that men do lives after them;
The good is oft interred with their bones:
So let it be with Caesar. The noble Brutus
Hath told you Caesar was ambitious.
If it were so, it was a grievous fault;
And grievously hath Caesar answer'd it.
"""


def test_balance_loss_is_one_for_even_routing_and_num_experts_for_collapse():
    even_probs = mx.full((8, 4), 0.25)
    even_ids = mx.array([[0, 1], [2, 3]] * 4)
    assert balance_loss(even_probs, even_ids, 4).item() == pytest.approx(1.0)
    collapsed = mx.array([[1.0, 0, 0, 0]] * 8)
    assert balance_loss(collapsed, mx.zeros((8, 1), dtype=mx.uint32), 4).item() == pytest.approx(4.0)


def test_domain_separation_is_the_js_divergence_of_each_domains_mean_router_probabilities():
    probs = np.random.default_rng(0).dirichlet(np.ones(8), size=40).astype(np.float32)
    code = np.r_[np.ones(15), np.zeros(25)].astype(np.float32)
    got = domain_separation(mx.array(probs), mx.array(code)).item()
    assert got == pytest.approx(stats.js_divergence(probs[:15].mean(0), probs[15:].mean(0)), rel=1e-4)
    same = np.tile(probs[:1], (40, 1))
    assert domain_separation(mx.array(same), mx.array(code)).item() == pytest.approx(0.0, abs=1e-6)
    apart = np.where(code[:, None] == 1, [1.0] * 4 + [0.0] * 4, [0.0] * 4 + [1.0] * 4) / 4
    assert domain_separation(mx.array(apart, dtype=mx.float32), mx.array(code)).item() == pytest.approx(1.0)


def test_a_few_steps_reduce_the_loss():
    model = init_model(TINY, seed=0)
    stream = np.tile(np.arange(1, 40, dtype=np.int32), 50)  # a repeating, learnable sequence
    settings = TrainSettings(steps=12, batch=4, seq_len=32, peak_lr=1e-2, warmup=2, eval_every=100)
    records = []
    losses = train(model, [stream, stream[::-1].copy()], settings, log=records.append)
    assert len(losses) == len(records) == 12
    assert np.mean(losses[-3:]) < losses[0] - 1.0
    assert all(0.5 < r["balance"] < TINY["num_experts"] for r in records)


@pytest.mark.parametrize("change, words", [
    (dict(balance_coef=float("nan")), "balance_coef must be a finite number"),
    (dict(domain_coef=float("inf")), "domain_coef must be a finite number"),
    (dict(steps=-1), "steps must be an integer >= 1"), (dict(steps=0), "steps must be an integer >= 1"),
    (dict(batch=0), "batch must be"), (dict(peak_lr=float("nan")), "peak_lr"),
    (dict(seed=-1), "seed must be an integer from 0 to 2**64 - 1"),
])
def test_settings_that_cannot_train_are_named_before_any_step(change, words):
    with pytest.raises(moebench.MoebenchError, match=re.escape(words)):
        train(None, [], TrainSettings(**change))
    with pytest.raises(moebench.MoebenchError, match=re.escape(words)):
        train_module.train_tiny("/nonexistent/out", TrainSettings(**change))


def test_a_run_whose_loss_turns_non_finite_stops_with_an_error():
    model = init_model(TINY, seed=0)
    stream = np.tile(np.arange(1, 40, dtype=np.int32), 50)
    settings = TrainSettings(steps=6, batch=4, seq_len=32, peak_lr=1e38, warmup=1, eval_every=100)
    with pytest.raises(moebench.NonFiniteError, match=r"training step \d: the cross entropy .* is NaN or Inf"):
        train(model, [stream, stream[::-1].copy()], settings)


@pytest.mark.parametrize("flag, value", [("--steps", "-1"), ("--steps", "0"), ("--balance-coef", "nan"),
                                         ("--domain-coef", "inf"), ("--seed", "-1"), ("--hidden", "0"),
                                         ("--layers", "0"), ("--batch", "0"), ("--processes", "0"),
                                         ("--prose-share", "nan"), ("--top-k", "-2")])
def test_train_tiny_flags_out_of_range_are_usage_errors(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main(["train-tiny", str(tmp_path / "out"), flag, value])
    assert exit_.value.code == 2 and f"argument {flag}:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_batches_take_the_prose_share_from_the_prose_stream():
    code, prose = np.full(200, 1, dtype=np.int32), np.full(200, 2, dtype=np.int32)
    per_stream = rows_per_domain(TrainSettings(batch=8, prose_share=0.625), 2)
    assert per_stream == [3, 5]
    x, y = sample_batch([code, prose], per_stream, 16, np.random.default_rng(0))
    assert x.shape == y.shape == (8, 16)
    assert (np.asarray(x)[:3] == 1).all() and (np.asarray(x)[3:] == 2).all()


@pytest.mark.parametrize("share", [0.0, 0.05, 1.0])
def test_a_batch_keeps_both_domains(share):
    with pytest.raises(ValueError, match=f"prose share {share}"):
        rows_per_domain(TrainSettings(batch=8, prose_share=share), 2)


def test_validation_snapshot_measures_routing_as_eval_tiny_does():
    """The training log's per-layer JS divergence is eval-tiny's, on the log's fewer windows."""
    model = init_model(TINY, seed=0)
    rng = np.random.default_rng(0)
    valid = {"code": rng.integers(1, 32, 600).astype(np.int32), "prose": rng.integers(32, 64, 600).astype(np.int32)}
    s = TrainSettings(num_experts=TINY["num_experts"], seq_len=32, eval_windows=4)
    snapshot = validation_snapshot(model, valid, s)
    ids = {}
    for d, stream in valid.items():
        tap = RouterTap()
        assert snapshot[d] == pytest.approx(heldout_loss(model, stream, 32, 4 * 32, record=tap), abs=1e-5)
        ids[d] = {layer: np.concatenate([np.asarray(a).reshape(-1, a.shape[-1]) for a in v])
                  for layer, v in tap.ids.items()}
    expected = [r["js_code_prose_bits"] for r in routing_report(ids, ids, TINY["num_experts"])]
    assert len(snapshot["js_bits"]) == TINY["num_hidden_layers"]
    assert snapshot["js_bits"] == pytest.approx(expected, abs=1e-4)
    assert max(snapshot["js_bits"]) > 0.01  # disjoint token sets route apart somewhere
    same = validation_snapshot(model, {"code": valid["code"], "prose": valid["code"]}, s)
    assert same["js_bits"] == [0.0] * TINY["num_hidden_layers"]


def test_checkpoint_tensors_round_trip_the_float_model_exactly(tmp_path):
    config = qwen2_moe_config(vocab_size=128)
    model = init_model(config, seed=1)
    save_checkpoint(tmp_path, config, checkpoint_tensors(model))
    again, _ = moebench.load(tmp_path)
    tokens = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]])
    assert mx.allclose(again(tokens), model(tokens), atol=1e-5).item()


def test_export_writes_per_expert_4bit_weights_near_the_float_model(tmp_path):
    config = qwen2_moe_config(vocab_size=128)
    model = init_model(config, seed=1)
    export_quantized(model, config, tmp_path)
    header = read_safetensors_header(tmp_path / "model.safetensors")
    assert "model.layers.0.mlp.experts.7.down_proj.scales" in header
    assert not any("switch_mlp" in name for name in header)
    qmodel, _ = moebench.load(tmp_path)
    assert qmodel.load_info.bits["mlp.switch_mlp.gate_proj"] == "4-bit g64"
    assert qmodel.load_info.bits["mlp.gate"] == "8-bit g64"
    tokens = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]])
    ref, got = model(tokens), qmodel(tokens)
    # Names are checked exactly by the float round trip; here 4-bit noise on random weights gives ~0.37.
    assert (mx.linalg.norm(got - ref) / mx.linalg.norm(ref)).item() < 0.6


def test_openblas_env_preloads_openblas_once_on_linux(monkeypatch):
    monkeypatch.setattr("ctypes.util.find_library", lambda name: "libopenblas.so.0" if name == "openblas" else None)
    env = openblas_env({"LD_PRELOAD": "libfoo.so", "PATH": "/bin"}, platform="linux")
    assert env == {"LD_PRELOAD": "libfoo.so libopenblas.so.0", "OPENBLAS_NUM_THREADS": "1", "PATH": "/bin"}
    assert openblas_env(env, platform="linux") is None  # already preloaded: no second restart
    assert openblas_env({}, platform="darwin") is None
    monkeypatch.setattr("ctypes.util.find_library", lambda name: None)
    assert openblas_env({}, platform="linux") is None


def test_validation_split_holds_out_whole_documents_by_position():
    docs = [Document(f"d{i}", str(i)) for i in range(10)]
    split = split_documents("x", docs, every=4)
    assert [d.name for d in split.valid] == ["d3", "d7"]
    assert len(split.train) == 8 and not {d.name for d in split.train} & {"d3", "d7"}


# --- the shipped model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped():
    return moebench.load(SHIPPED_MODEL)


def test_shipped_model_has_the_promised_architecture(shipped):
    model, tok = shipped
    a = model.args
    assert a.num_hidden_layers >= 4 and all(a.is_moe_layer(i) for i in range(a.num_hidden_layers))
    assert a.num_key_value_heads < a.num_attention_heads
    assert a.num_experts >= 16 and 2 <= a.num_experts_per_tok <= 4 and a.norm_topk_prob is False
    assert a.shared_expert_intermediate_size > 0
    for width in (a.hidden_size, a.moe_intermediate_size, a.shared_expert_intermediate_size, a.intermediate_size):
        assert width % 128 == 0
    assert all(block.shared_expert_gate is not None for block in model.moe_blocks().values())
    assert model.load_info.bits["mlp.switch_mlp.down_proj"] == "4-bit g64"
    assert 4096 <= tok.vocab_size <= 8192 and a.vocab_size == tok.vocab_size


def test_shipped_files_are_small_per_expert_and_logged():
    size = sum(f.stat().st_size for f in SHIPPED_MODEL.iterdir())
    assert size < 12 * 1024 * 1024
    names = read_safetensors_header(SHIPPED_MODEL / "model.safetensors")
    assert any(re.fullmatch(r"model\.layers\.\d+\.mlp\.experts\.\d+\.up_proj\.weight", n) for n in names)
    config = json.loads((SHIPPED_MODEL / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    records = [json.loads(line) for line in (SHIPPED_MODEL / LOG_FILE).read_text().splitlines()]
    steps = [r for r in records if "ce" in r]
    assert len(steps) == records[0]["settings"]["steps"]
    assert steps[-1]["ce"] < steps[0]["ce"] - 2
    # Below the unigram baseline of data/README.md (6.88 nats on code, 6.53 on prose).
    assert all(ce < 6.3 for ce in records[-1]["final_float_valid_ce"].values())


def test_train_tiny_defaults_are_the_shipped_models_settings():
    """data/README.md's rerun command is `moebench train-tiny` with no settings flags."""
    logged = json.loads((SHIPPED_MODEL / LOG_FILE).read_text().splitlines()[0])["settings"]
    assert logged == dataclasses.asdict(TrainSettings())


def test_shipped_tokenizer_round_trips_both_domains(shipped):
    _, tok = shipped
    code = "def f(x):\n    return x + 1\n"
    assert tok.decode(tok.encode(code)) == code
    assert tok.decode(tok.encode(PROSE)) == PROSE


def test_shipped_experts_are_all_used_and_differ_between_code_and_prose(shipped):
    model, tok = shipped
    import difflib

    code = open(difflib.__file__, encoding="utf-8").read()
    usage = {}
    for name, text in (("code", code), ("prose", PROSE * 3)):
        tap = RouterTap()
        model(mx.array(tok.encode(text)[:512])[None], record=tap)
        usage[name] = {i: np.asarray(ids[0]) for i, ids in tap.ids.items()}
    e = model.args.num_experts
    for layer in usage["code"]:
        both = np.concatenate([usage["code"][layer], usage["prose"][layer]])
        assert (stats.expert_counts(both, e) > 0).all(), f"layer {layer} leaves an expert unused"
    js = [stats.js_divergence(stats.expert_counts(usage["code"][i], e), stats.expert_counts(usage["prose"][i], e))
          for i in usage["code"]]
    assert max(js) > 0.2  # the shipped model: 0.41 to 1.00 bits per layer


GROUP_STEPS = Path(__file__).with_name("group_steps.py")


def test_two_processes_take_the_same_steps_as_one(tmp_path):
    """Each rank trains on half of every batch; the averaged gradients and the batch-wide balance shares make
    the steps those of one process, and both ranks end with the same weights."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    subprocess.run([sys.executable, str(GROUP_STEPS), str(one)], check=True, timeout=300)
    assert run_local_group([sys.executable, str(GROUP_STEPS), str(two)], 2, os.environ) == 0
    alone = json.loads((one / "rank0.json").read_text())
    ranks = [json.loads((two / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["losses"] == pytest.approx(alone["losses"], rel=1e-5)
    for term in ("balance", "separation"):  # the log rounds them to 5 decimals
        assert [r[term] for r in ranks[0]["records"]] == pytest.approx(
            [r[term] for r in alone["records"]], rel=1e-4, abs=2e-5)
    assert alone["losses"][-1] < alone["losses"][0]
    assert ranks[1]["records"] == []  # rank 0 alone logs
    assert ranks[0]["domain_grads"] == pytest.approx(alone["domain_grads"], rel=1e-4)
    assert ranks[0]["weights"] == ranks[1]["weights"]
    # k_proj.bias has a near-zero gradient (softmax ignores a shift) that Adam scales up: float order shows at 1e-4
    assert ranks[0]["weights"] == pytest.approx(alone["weights"], rel=1e-3)


def test_train_refuses_a_batch_the_processes_cannot_share():
    class Three:
        def size(self):
            return 3

        def rank(self):
            return 0

    with pytest.raises(ValueError, match="over 3 processes"):
        train(init_model(TINY, seed=0), [np.arange(100, dtype=np.int32)] * 2, TrainSettings(steps=1, batch=8),
              group=Three())


def test_train_tiny_starts_every_rank_with_the_flags_it_was_given(tmp_path, monkeypatch):
    """`--processes 2` re-runs the command once per rank: a flag lost on the way would train ranks apart."""
    started = []
    monkeypatch.delenv("MLX_RANK", raising=False)
    monkeypatch.setattr(train_module, "run_local_group", lambda argv, n, env: started.append((argv, n)) or 0)
    flags = ["train-tiny", str(tmp_path / "out"), "--steps", "7", "--seed", "3", "--experts", "32", "--top-k", "2",
             "--balance-coef", "0.03", "--domain-coef", "0.2", "--batch", "12", "--prose-share", "0.625",
             "--processes", "2",
             "--float-dir", str(tmp_path / "float"), "--cache", str(tmp_path / "cache")]
    assert main(flags) == 0
    [(argv, n)] = started
    assert n == 2 and argv[:3] == [sys.executable, "-m", "moebench.cli"]
    parser = argparse.ArgumentParser()
    train_module.add_train_command(parser.add_subparsers())
    given, passed = (vars(parser.parse_args(a)) for a in (flags, argv[3:]))
    assert passed == given
    assert not (tmp_path / "out").exists()  # the parent process only starts the ranks
