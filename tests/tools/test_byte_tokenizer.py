"""The byte-level tokenizer make-random writes: sized to the model's vocabulary, every id decodes, any text encodes, the
model's eos ids are control tokens; and random checkpoints decode text from the command line."""

from __future__ import annotations

import json

import pytest

from moebench.checkpoint.tokenizer import Tokenizer
from moebench.cli import main
from moebench.errors import ConfigError
from moebench.tools.byte_tokenizer import byte_level_tokenizer, write_byte_tokenizer
from moebench.tools.presets import PRESETS
from moebench.tools.writer import write_random_checkpoint

QWEN_VOCAB, QWEN_EOS = 151936, 151643  # Qwen1.5-MoE-A2.7B's (the qwen1.5-moe-a2.7b preset's)


def test_the_256_byte_tokenizer_gives_each_byte_its_id_in_the_alphabets_order(tmp_path):
    """The tests' tiny models have 256 ids: one a byte, so every id decodes and no merge exists."""
    tok = Tokenizer(write_byte_tokenizer(tmp_path))
    assert tok.id_count == 256 and not tok.special_ids
    text = "def f(x):\n    return 'é'"
    assert len(tok.encode(text)) == len(text.encode()) and tok.decode(tok.encode(text)) == text


def test_a_real_vocabulary_is_filled_with_merges_and_its_eos_is_a_control_token(tmp_path):
    write_byte_tokenizer(tmp_path, QWEN_VOCAB, [QWEN_EOS])
    tok = Tokenizer.from_folder(tmp_path, model_vocab=QWEN_VOCAB)
    assert tok.id_count == QWEN_VOCAB and tok.vocab_mismatch(QWEN_VOCAB) is None
    assert all(tok.has_id(i) for i in (0, 255, 256, 70000, QWEN_VOCAB - 1))
    assert tok.special_ids == {QWEN_EOS} and tok.eos_token_ids == (QWEN_EOS,)
    text = "def fibonacci(n):\n    return n"
    ids = tok.encode(text)
    assert len(ids) < len(text) and tok.decode(ids) == text  # merged, and back
    assert tok.decode([QWEN_EOS]) == "" and tok.decode([70000, 151935]) != ""
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "<|eos|>"


@pytest.mark.parametrize("eos", [(), (300,)])
def test_transformers_reads_the_folder_as_the_same_vocabulary_whatever_the_model_type(tmp_path, eos):
    """mlx_lm.convert re-saves the tokenizer through transformers' AutoTokenizer, which picks its class by config.json's
    model_type unless tokenizer_config.json names one: Qwen's class then added its `<|endoftext|>` as id 256, past a
    256-id vocabulary."""
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "vocab_size": 320}))
    write_byte_tokenizer(tmp_path, 320, eos)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 320 and tok.eos_token_id == (eos[0] if eos else None)
    assert tok.decode(tok.encode("def f(x): é")) == "def f(x): é"


@pytest.mark.parametrize(("vocab", "eos", "named"), [(255, (), "vocab_size 255"), (300, (7,), "eos_token_id 7"),
                                                     (300, (300,), "eos_token_id 300"), (True, (), "vocab_size")])
def test_a_vocabulary_the_bytes_do_not_fit_is_named(vocab, eos, named):
    with pytest.raises(ConfigError, match=named):
        byte_level_tokenizer(vocab, eos)


@pytest.mark.parametrize("preset", ["tiny", "qwen3.5-moe-tiny"])
def test_make_random_then_generate_decodes_text_from_the_command_line(tmp_path, capsys, preset):
    folder = tmp_path / preset
    assert main(["make-random", str(folder), "--preset", preset, "--dtype", "float32", "--generator", "numpy"]) == 0
    capsys.readouterr()
    assert main(["generate", str(folder), "--prompt", "def add(a, b):", "--max-tokens", "5", "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    tok = Tokenizer(folder / "tokenizer.json")
    assert len(out["token_ids"]) == 5 and out["text"] == tok.decode(out["token_ids"]) != ""
    assert out["prompt_ids"] == tok.encode("def add(a, b):")


def test_a_checkpoint_of_a_real_vocabulary_decodes_text_from_the_command_line(tmp_path, capsys):
    """The qwen1.5-moe-a2.7b preset's vocabulary and eos on the tiny preset's layers (the real preset writes GBs): its
    tokenizer as make-random writes it, and `generate` decodes text with it."""
    config = {**PRESETS["tiny"].config, "vocab_size": QWEN_VOCAB, "eos_token_id": QWEN_EOS}
    folder = write_random_checkpoint(tmp_path / "ckpt", config, bits=4)
    write_byte_tokenizer(folder, QWEN_VOCAB, [QWEN_EOS])
    assert main(["generate", str(folder), "--prompt", "Once upon", "--max-tokens", "4", "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stop_ids"] == [QWEN_EOS] and out["text"] == Tokenizer(folder / "tokenizer.json").decode(
        out["token_ids"])
    assert len(out["token_ids"]) == 4 and out["text"]
