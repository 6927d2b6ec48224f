"""`moebench generate`: token ids, text, timings and dispatch counts, the --fused switch, and clean errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import moebench
from moebench.checkpoint.tokenizer import Tokenizer
from moebench.cli import main
from moebench.decode.loop import generate


@pytest.fixture(autouse=True)
def restore_fused_switch():
    """The CLI sets the process-wide fused switch; put it back for the tests that follow."""
    with moebench.fused_moe(moebench.fused_moe_enabled()):
        yield


def run_json(capsys, *argv: str) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_reports_tokens_text_timings_and_dispatch(quantized_checkpoint, capsys):
    out = run_json(capsys, str(quantized_checkpoint), "--prompt", "Hello experts", "--max-tokens", "6")
    tok = Tokenizer(quantized_checkpoint / "tokenizer.json")
    assert out["prompt_ids"] == tok.encode("Hello experts")
    assert len(out["token_ids"]) == 6 and out["text"] == tok.decode(out["token_ids"])
    model, _ = moebench.load(quantized_checkpoint)
    assert out["token_ids"] == generate(model, out["prompt_ids"], 6).token_ids
    assert set(out["timings"]) == {"prompt_seconds", "decode_seconds", "prompt_tps", "decode_tps"}
    assert out["timings"]["prompt_tps"] > 0
    assert sorted(out["dispatch"]) == ["0", "1"]
    for layer in out["dispatch"].values():  # prefill falls back (many tokens), each decode step runs fused
        assert layer["fused"] == {"reference": 5} and layer["fallback"] == 1
        assert list(layer["reasons"]) == ["13 tokens (the kernel runs single-token decode)"]
    assert {layer["fused"].get("reference") for layer in out["attention_dispatch"].values()} == {5}
    assert out["decode_loop"] == "eager"  # the compiled step is the default only on CUDA
    compiled = run_json(capsys, str(quantized_checkpoint), "--prompt", "Hello experts", "--max-tokens", "6",
                        "--compiled", "on")
    assert compiled["decode_loop"] == "compiled" and compiled["token_ids"] == out["token_ids"]


def test_fused_off_falls_back_and_says_why(quantized_checkpoint, capsys):
    out = run_json(capsys, str(quantized_checkpoint), "--prompt", "Hi", "--max-tokens", "4", "--fused", "off")
    for layer in out["dispatch"].values():
        assert layer["fused"] == {} and layer["fallback"] == 4
        assert layer["reasons"]["switched off (MOEBENCH_FUSED_MOE / set_fused_moe)"] == 3


def test_float_experts_report_their_fallback_reason(float_checkpoint, capsys):
    out = run_json(capsys, str(float_checkpoint), "--prompt", "Hi", "--max-tokens", "3")
    assert all(d["reasons"].get("float experts (the kernel needs quantized weights)") == 2
               for d in out["dispatch"].values())


def test_sampling_options_are_reproducible(float_checkpoint, capsys):
    argv = (str(float_checkpoint), "--prompt", "abc", "--max-tokens", "8", "--temperature", "1.2", "--top-p", "0.9",
            "--seed", "5")
    assert run_json(capsys, *argv)["token_ids"] == run_json(capsys, *argv)["token_ids"]


def test_text_mode(float_checkpoint, capsys):
    assert main(["generate", str(float_checkpoint), "--prompt", "Once", "--max-tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert "Once" in captured.out and "float float32" in captured.out
    assert "decode 3 tokens" in captured.err and "MoE dispatch" in captured.err


def test_bad_sampling_option_is_a_clean_error(float_checkpoint, capsys):
    assert main(["generate", str(float_checkpoint), "--prompt", "x", "--top-p", "0", "--temperature", "1"]) == 2
    assert "moebench: error: top_p must be in (0, 1], got 0.0" in capsys.readouterr().err


def test_missing_tokenizer_is_a_clean_error(make_checkpoint, capsys):
    folder = make_checkpoint()
    assert main(["generate", str(folder), "--prompt", "x", "--json"]) == 2
    assert f"{folder}: no tokenizer.json" in capsys.readouterr().err


def test_console_script_reports_a_corrupt_checkpoint_without_crashing(quantized_checkpoint, copy_checkpoint):
    folder = copy_checkpoint(quantized_checkpoint)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    argv = ["generate", str(folder), "--prompt", "hi", "--max-tokens", "2", "--json"]
    console_script = Path(sys.executable).parent / "moebench"  # installed by `pip install -e .`
    proc = subprocess.run([str(console_script), *argv],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"moebench: error: {weights}") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, flag", [
    (["generate", "--prompt", "hi", "--seed", "-1"], "--seed"),
    (["generate", "--prompt", "hi", "--seed", str(2**64)], "--seed"),
    (["generate", "--prompt", "hi", "--seed", "1.5"], "--seed"),
    (["profile", "--seed", "-1"], "--seed"), (["profile", "--steps", "0"], "--steps"),
    (["profile", "--warmup", "-1"], "--warmup"), (["profile", "--prompt-tokens", "0"], "--prompt-tokens"),
    (["make-random", "out", "--seed", "-5"], "--seed"), (["make-random", "out", "--shard-gb", "inf"], "--shard-gb"),
    (["make-random", "out", "--shard-gb", "0"], "--shard-gb"), (["selfcheck", "--repeats", "0"], "--repeats"),
    (["selfcheck", "--gen-tokens", "-1"], "--gen-tokens"),
])
def test_numeric_flags_out_of_range_are_usage_errors_naming_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {flag}:" in err and "Traceback" not in err


def test_the_largest_seed_decodes(float_checkpoint, capsys):
    out = run_json(capsys, str(float_checkpoint), "--prompt", "hi", "--temperature", "1", "--seed", str(2**64 - 1),
                   "--max-tokens", "2")
    assert out["sampling"]["seed"] == 2**64 - 1 and len(out["token_ids"]) == 2
