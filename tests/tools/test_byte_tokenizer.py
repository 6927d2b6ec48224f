"""The byte-level tokenizer make-random writes: sized to the model's vocabulary, every id decodes, any text encodes, the
model's eos ids are control tokens; and random checkpoints decode text from the command line."""

from __future__ import annotations

import json

import pytest
from tokenizers import pre_tokenizers

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


def test_an_eos_id_among_the_first_256_is_a_control_token_and_the_bytes_move_past_it(tmp_path):
    """DeepSeek-V3's eos id is 1 (make-random's deepseek-v3-12l preset failed on it after writing 45 GB of weights):
    the bytes take ids 0 and 2..256, and every byte still encodes and decodes."""
    write_byte_tokenizer(tmp_path, 300, [1])
    tok = Tokenizer.from_folder(tmp_path, model_vocab=300)
    assert tok.id_count == 300 and tok.special_ids == {1} and tok.eos_token_ids == (1,)
    text = bytes(range(256)).decode("latin-1")
    ids = tok.encode(text)
    assert 1 not in ids and tok.decode(ids) == text and tok.decode([1]) == ""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    assert sorted(byte_level_tokenizer(300, [1]).token_to_id(ch) for ch in alphabet) == [0, *range(2, 257)]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_vocabulary_holds_the_bytes_and_its_eos_ids(preset):
    config = PRESETS[preset].config
    eos = config.get("eos_token_id")
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    tok = byte_level_tokenizer(config["vocab_size"], eos_ids)
    assert tok.get_vocab_size() == config["vocab_size"]
    assert {tok.id_to_token(i) for i in eos_ids} <= {t.content for t in tok.get_added_tokens_decoder().values()}


@pytest.mark.parametrize(("vocab", "eos", "named"), [(255, (), "vocab_size 255"), (300, (-1,), "eos_token_id -1"),
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
