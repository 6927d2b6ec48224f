import ast
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from moebench.checkpoint.loader import SHIPPED_MODEL
from moebench.checkpoint.tokenizer import Tokenizer
from moebench.cli import main
from moebench.tools.eval_tiny import (
    PROMPTS,
    format_measurements,
    known_word_share,
    parsable_lines,
    spelled_bytes,
    words,
)
from moebench.tools.train import TrainSettings, tiny_architecture, windows

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def notebook_strings() -> set[str]:
    """Every string literal in the notebooks' code cells."""
    found = set()
    for path in NOTEBOOKS.glob("*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                tree = ast.parse("".join(cell["source"]))
                found |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return found


def test_the_notebook_prompts_are_the_ones_the_notebooks_open_with():
    in_notebooks = notebook_strings()
    assert [name for name, text in PROMPTS.items() if text in in_notebooks] == [
        "add", "fibonacci", "winter", "fox", "once"]


def test_words_are_letter_runs_and_the_share_counts_the_known_ones():
    text = "self._name = get_t2(x)  # Enter PO, lour'd."
    assert words(text) == ["self", "_name", "get_t", "x", "enter", "po", "lour'd"]
    assert known_word_share("The King, the kinge.", {"the", "king"}) == (3, 4)
    assert known_word_share("  12 == 3 ", {"the"}) == (0, 0)


def test_parsable_lines_keep_the_first_lines_that_compile_after_the_prompt():
    assert parsable_lines("def add(a, b):\n    return", " a + b\n\nx = (\ny = 2") == (2, 4)
    assert parsable_lines("def f(x):\n    return", " x\ndef g(n, n):\n    pass") == (1, 3)  # compile-time error
    assert parsable_lines("class P:\n    def f(self):\n        self.", "name = 1\n") == (1, 1)
    assert parsable_lines("class P:\n    def f(self):\n        self.", "(]") == (0, 1)


def test_spelled_bytes_count_what_the_validation_targets_spell():
    tok = Tokenizer(SHIPPED_MODEL / "tokenizer.json")
    eos = tok.token_to_id("<|endoftext|>")
    docs = ["def f(x):\n    return x + 1\n", "Friends, Romans, countrymen — lend me your ears;\n", "é" * 7]
    stream = np.asarray([i for d in docs for i in [*tok.encode(d), eos]], dtype=np.int32)
    seq_len = 8
    n = len(windows(stream, seq_len, 10_000))
    assert n * seq_len < len(stream) - 1  # the last window is cut short of the stream's end
    targets = windows(stream, seq_len, 10_000)[:, 1:].ravel()  # what measure() scores
    assert np.array_equal(targets, stream[1 : n * seq_len + 1])
    # Byte-level BPE: each character of a token's string stands for one byte.
    raw = HFTokenizer.from_file(str(SHIPPED_MODEL / "tokenizer.json"))
    assert spelled_bytes(tok, targets, eos) == sum(len(raw.id_to_token(int(i))) for i in targets if i != eos)


def test_the_report_shows_bits_per_byte_beside_perplexity_and_each_prompts_known_words():
    r = {"perplexity": {"code": {"unigram": 900.0, "model": 100.0}},
         "bits_per_byte": {"code": {"unigram": 3.0, "model": 2.0}},
         "valid_tokens": {"code": 16}, "valid_bytes": {"code": 50}, "num_experts": 16,
         "routing": [], "samples": {"add": " a + b"}, "prompts": {"add": "def add(a, b):\n    return"},
         "known_words": {"add": (2, 2)}, "known_word_share": 1.0, "python_lines": {"add": (1, 1)}}
    text = format_measurements(r)
    assert "| code | 16 | 50 | 900.00 | 100.00 | 3.000 | 2.000 |" in " ".join(text.split())
    assert "add (2 of 2 words known; its first 1 of 1 lines compile as Python)" in text
    assert "100.0% over all prompts" in text


def test_the_reports_tables_fit_100_columns_with_the_float_model_beside():
    """data/README.md's tables with the float model's columns and the routing table: each split or wrapped to fit,
    every value still there."""
    r = {"perplexity": {d: {"unigram": 912.5, "float": 10.25, "model": 11.5} for d in ("code", "prose")},
         "bits_per_byte": {d: {"unigram": 3.125, "float": 1.5, "model": 1.625} for d in ("code", "prose")},
         "valid_tokens": {"code": 123456, "prose": 654321}, "valid_bytes": {"code": 500000, "prose": 2500000},
         "num_experts": 64, "samples": {}, "prompts": {}, "known_words": {}, "known_word_share": 1.0,
         "python_lines": {},
         "routing": [{"layer": i, "experts_used": 64, "min_share": 0.001, "max_share": 0.052, "load_entropy_bits": 5.9,
                      "load_cv": 0.41, "router_entropy_bits": 3.2, "js_code_prose_bits": 0.21} for i in range(4)]}
    text = format_measurements(r)
    assert max(map(len, text.splitlines())) <= 100
    for value in ("912.50", "10.25", "11.50", "3.125", "1.500", "1.625", "654321", "0.001 / 0.052", "0.410", "0.210"):
        assert value in text
    assert text.count("| prose ") == 2  # the quality table split in two, each starting with the domain


def test_train_tiny_settings_shape_the_architecture_within_the_kernels_widths():
    c = tiny_architecture(4096, 0, TrainSettings(hidden_size=256, num_layers=6, num_experts=32, top_k=2))
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_experts"], c["num_experts_per_tok"]) == (256, 6, 32, 2)
    assert (c["num_attention_heads"], c["num_key_value_heads"]) == (8, 4)  # heads of 32, GQA 2:1
    shipped = json.loads((SHIPPED_MODEL / "config.json").read_text())
    shipped.pop("quantization")
    assert tiny_architecture(4096, 0) == shipped  # the defaults are the shipped model


@pytest.mark.parametrize("flags, named", [(["--hidden", "192"], "--hidden 192"),
                                          (["--experts", "4", "--top-k", "5"], "--top-k 5"),
                                          (["--prose-share", "1"], "--prose-share"),
                                          (["--batch", "1"], "--batch"),
                                          (["--batch", "9", "--processes", "2"], "--processes 2")])
def test_train_tiny_refuses_widths_the_kernels_do_not_run_before_it_starts(tmp_path, capsys, flags, named):
    assert main(["train-tiny", str(tmp_path / "out"), *flags]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
