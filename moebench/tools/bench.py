"""moebench bench: decode speed of moebench fused vs fallback vs mlx-lm on one checkpoint, side by side.

Every arm decodes greedily from the same prompt ids for the same number of tokens. One untimed pass per
arm warms it up and records its greedy trace with logits; then the timed repeats run interleaved (the
arm order rotates each repeat) so machine noise hits every arm alike; several prompt lengths run one after
the other on the same loaded models, each such a bench of every arm. Per arm: prompt tok/s, time to first
token, decode tok/s (tokens after the first over the time after the first), memory (its model's weights, its
working memory beyond what was resident when it began, and the two together: every arm's own, although the
process holds every arm's model), the MoE dispatch counts, and whether its greedy tokens equal the baseline
arm's (first divergence and the baseline's logit margin there otherwise). The printed report is bench_table's;
selfcheck reuses this timing code.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..checkpoint.loader import default_model_path, load, model_bytes
from ..decode.loop import COMPILED_BY_DEFAULT, STEPS_AHEAD, GenerationResult, compiled_by_default, generate_tokens
from ..decode.sampling import check_seed
from ..errors import MoebenchError
from ..execution.executor import executor, fused_moe
from ..execution.kernel import available_backend
from ..models.sharding import MODES, TENSOR_MODE, init_group, report
from .bench_table import format_header, format_length, overlapping_arms
from .flags import SEED, at_least
from .json_option import add_json_option, check_json_target, to_stdout, write_json
from .progress import Progress

SCHEMA = "moebench.tools.bench/2"  # /2: a block per prompt length (lengths[]); weights and own peak per arm
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
TokenStream = Callable[[list[int], int], Iterator[tuple[int, mx.array]]]
T = TypeVar("T")


@dataclass
class Arm:
    """One way of decoding: a token stream (token id, logits or log-probabilities of that step)."""

    name: str
    engine: str  # 'moebench' or 'mlx-lm'
    loop: str  # 'moebench' (decode.generate_tokens), 'stream_generate' or 'generate_step'
    experts: str  # what computes the routed experts: a fused backend or 'gather_qmm'
    dtype: str
    stream: TokenStream
    model: object = None  # a moebench model, whose dispatch counts are read per run
    note: str = ""
    weight_bytes: int = 0  # its engine's model's weights (model_bytes): what it keeps resident between runs


@dataclass
class Run(GenerationResult):
    """One timed decode: GenerationResult's timings (prompt_seconds is the time to the first token) plus
    memory, dispatch counts and, in the untimed trace pass, every step's logits."""

    peak_bytes: int = 0  # MLX's peak over the run, every resident array included
    start_bytes: int = 0  # MLX's active memory when the run began (weights of every loaded model)
    dispatch: dict | None = None
    logits: list[np.ndarray] | None = None

    @property
    def working_bytes(self) -> int:
        """The run's own memory: its peak beyond what was resident when it began."""
        return self.peak_bytes - self.start_bytes


@dataclass
class ArmResult:
    arm: Arm
    trace: Run  # the untimed warm-up pass, with logits
    runs: list[Run] = field(default_factory=list)

    @property
    def deterministic(self) -> bool:
        """Every timed repeat decoded the warm-up pass's tokens."""
        return all(r.token_ids == self.trace.token_ids for r in self.runs)


def summary(values: list[float]) -> dict:
    """mean, sample sd, median, min, max and the values themselves."""
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def float_dtype(model) -> str:
    """The dtype of a model's first floating-point parameter (its activation dtype in both engines)."""
    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return str(value.dtype).replace("mlx.core.", "")
    return "none"


def settled_memory() -> int:
    """MLX's active memory once what earlier runs dropped is freed (arrays held only by reference cycles, the
    buffer cache), with the peak counter reset: so a run's peak counts none of another arm's memory."""
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    return mx.get_active_memory()


def timed_run(arm: Arm, prompt_ids: list[int], gen_tokens: int, keep_logits: bool = False) -> Run:
    """Decode once and time it; with keep_logits (the untimed trace pass) keep every step's logits."""
    if arm.model is not None:
        executor(arm.model).reset_counts()
    start_bytes = settled_memory()
    tokens, logits, first = [], [] if keep_logits else None, None
    start = time.perf_counter()
    for tid, step_logits in arm.stream(prompt_ids, gen_tokens):
        if first is None:
            first = time.perf_counter()
        tokens.append(int(tid))
        if keep_logits:
            logits.append(np.array(step_logits.reshape(-1).astype(mx.float32)))
    end = time.perf_counter()
    mx.synchronize()
    first = end if first is None else first
    return Run(list(prompt_ids), tokens, first - start, end - first, mx.get_peak_memory(), start_bytes,
               executor(arm.model).summary() if arm.model is not None else None, logits)


def rounds(arms: list[T], repeats: int) -> Iterator[tuple[int, T]]:
    """(round, arm) for `repeats` rounds of every arm, the order rotating one place a round, so slow drifts of the
    machine and whatever an arm leaves behind fall on every arm alike."""
    for r in range(repeats):
        for i in range(len(arms)):
            yield r, arms[(i + r) % len(arms)]


def run_arms(arms: list[Arm], prompt_ids: list[int], gen_tokens: int, repeats: int,
             progress: bool = True, desc: str = "bench") -> tuple[list[ArmResult], list[dict]]:
    """Warm up each arm with its trace pass, then `repeats` timed rounds, arms interleaved, order rotating.

    Returns (results, failures): an arm whose warm-up raises (say, a GPU kernel that does not build on this
    machine) is left out of the rounds and reported as {'arm', 'reason'}, so the other arms still run."""
    if gen_tokens < 2:
        raise MoebenchError(f"--gen-tokens {gen_tokens}: need at least 2 (decode speed counts tokens after the first)")
    if repeats < 1:
        raise MoebenchError(f"--repeats {repeats}: need at least 1")
    bar = Progress(total=len(arms) * (repeats + 1), unit="run", desc=desc, disable=not progress)
    results, failures = [], []
    for arm in arms:
        bar.set_postfix_str(f"warm-up {arm.name}")
        try:
            results.append(ArmResult(arm, timed_run(arm, prompt_ids, gen_tokens, keep_logits=True)))
        except Exception as e:  # reported with its reason; the remaining arms still run
            failures.append({"arm": arm.name, "reason": f"warm-up failed: {type(e).__name__}: {e}"})
            print(f"arm {arm.name} failed: {type(e).__name__}: {e}", file=sys.stderr)
        bar.update()
    bar.total = len(arms) + repeats * len(results)
    bar.refresh()
    for r, result in rounds(results, repeats):
        bar.set_postfix_str(f"repeat {r + 1} {result.arm.name}")
        result.runs.append(timed_run(result.arm, prompt_ids, gen_tokens))
        bar.update()
    bar.close()
    return results, failures


def compare_traces(reference: Run, other: Run) -> dict:
    """Whether `other`'s greedy tokens equal `reference`'s; else the first divergence and the margin there:
    reference logit of its own token minus reference logit of the other's token (a near-tie when small)."""
    n = min(len(reference.token_ids), len(other.token_ids))
    for i in range(n):
        a, b = reference.token_ids[i], other.token_ids[i]
        if a != b:
            ref = reference.logits[i]
            own = other.logits[i] if other.logits is not None else None
            return {"identical": False, "first_divergence": i, "reference_token": a, "token": b,
                    "margin": float(ref[a] - ref[b]),
                    "own_margin": float(own[b] - own[a]) if own is not None else None}
    if len(reference.token_ids) != len(other.token_ids):
        return {"identical": False, "first_divergence": n, "reference_token": None, "token": None,
                "margin": None, "own_margin": None}
    return {"identical": True, "first_divergence": None, "margin": None}


def moebench_arms(model, fused: str, compiled: str = "off") -> list[Arm]:
    """The moebench arms: fallback (gather_qmm) and/or fused (the machine's backend: metal, cuda, reference),
    each eager and/or through the compiled decode step (`fused` and `compiled` are 'on', 'off' or 'both')."""
    dtype, weights = float_dtype(model), model_bytes(model)
    backend = available_backend()

    def stream(on: bool, compile_step: bool) -> TokenStream:
        def run(ids: list[int], n: int) -> Iterator[tuple[int, mx.array]]:
            with fused_moe(on, model):
                yield from generate_tokens(model, ids, n, compiled=compile_step)
        return run

    arms = []
    for compile_step in [c for c in (False, True) if compiled == "both" or compiled == ("on" if c else "off")]:
        loop, suffix = ("moebench compiled", " compiled") if compile_step else ("moebench", "")
        for on in [f for f in (False, True) if fused == "both" or fused == ("on" if f else "off")]:
            name, experts = (f"moebench fused ({backend})", backend) if on else ("moebench fallback", "gather_qmm")
            arms.append(Arm(name + suffix, "moebench", loop, experts, dtype, stream(on, compile_step), model,
                            weight_bytes=weights))
    return arms


SNAPSHOT = "moebench_snapshot"  # the module name an earlier revision's package is imported under


def snapshot_init(root: Path) -> Path:
    """The earlier revision's moebench/__init__.py under `root`; a MoebenchError naming --snapshot when it has none."""
    init = Path(root) / "moebench" / "__init__.py"
    if not init.is_file():
        raise MoebenchError(f"--snapshot {root}: no moebench/__init__.py there (git archive REV moebench kernels)")
    return init


def snapshot_arms(root: Path, path: Path, fused: str) -> list[Arm]:
    """Arms of an earlier revision of moebench (`root`/moebench, with its kernels/ beside it, as `git archive
    REV moebench kernels` writes them) on the same checkpoint, decoding through its own top-level API (load,
    fused_moe, decode.generate_tokens) with its defaults, so a change is measured side by side with the code
    before it in one interleaved run. Imported as SNAPSHOT: its imports inside the package are relative."""
    init = snapshot_init(root)
    try:  # an earlier revision is code of its own: any failure to import or load it is named, and forgotten
        spec = importlib.util.spec_from_file_location(SNAPSHOT, init, submodule_search_locations=[str(init.parent)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[SNAPSHOT] = package
        spec.loader.exec_module(package)
        decode = importlib.import_module(f"{SNAPSHOT}.decode")
        generate_tokens_before = getattr(decode, "generate_tokens", None) or importlib.import_module(
            f"{SNAPSHOT}.decode.loop").generate_tokens
        model, _ = package.load(path)
        dtype = float_dtype(model)
    except Exception as e:  # noqa: BLE001 -- SyntaxError, ImportError, its own errors: all mean it cannot run
        for name in [m for m in sys.modules if m == SNAPSHOT or m.startswith(SNAPSHOT + ".")]:
            del sys.modules[name]
        raise MoebenchError(f"--snapshot {root}: cannot import its moebench or load {path} with it: "
                            f"{type(e).__name__}: {e}") from e

    def stream(on: bool) -> TokenStream:
        def run(ids: list[int], n: int) -> Iterator[tuple[int, mx.array]]:
            with package.fused_moe(on):
                yield from generate_tokens_before(model, ids, n)
        return run

    return [Arm(f"snapshot {'fused' if on else 'fallback'}", "moebench snapshot", "moebench snapshot",
                package.available_backend() if on else "gather_qmm", dtype, stream(on), note=f"{root}, its defaults",
                weight_bytes=model_bytes(model))
            for on in (False, True) if fused == "both" or fused == ("on" if on else "off")]


def mlx_lm_model(path: Path, group: mx.distributed.Group | None = None) -> tuple[object | None, str | None]:
    """mlx-lm's own model for a checkpoint folder (mlx_lm.utils.load_model), or (None, why it cannot); over
    `group` sharded as mlx-lm shards it (its model's shard(): tensor-parallel attention and experts)."""
    try:
        from mlx_lm.utils import load_model
    except ImportError as e:
        return None, f"mlx-lm is not installed ({e})"
    try:
        model, _ = load_model(Path(path), lazy=group is not None)
    except Exception as e:  # mlx-lm raises many kinds; any of them means it cannot run this folder
        return None, f"mlx-lm cannot load {path}: {type(e).__name__}: {e}"
    if group is not None:
        if not hasattr(model, "shard"):
            return None, f"mlx-lm's {type(model).__module__} has no shard()"
        model.shard(group)
        mx.eval(model.parameters())
    return model, None


OWN_LOOP_ARM = "mlx-lm model, moebench loop"


def mlx_lm_arms(path: Path, group: mx.distributed.Group | None = None) -> tuple[list[Arm], list[dict]]:
    """mlx-lm on the same folder as its users run it (stream_generate when the folder has a tokenizer mlx-lm
    loads, else generate_step), and its model under moebench's decode loop: (the arms, the arms skipped as
    {"arm", "reason"}). moebench's loop gives a foreign model key/value caches, so a model that makes its own
    (mlx-lm's hybrids' recurrent states, gpt-oss's rotating windows) runs only under mlx-lm's loop."""
    try:
        from mlx_lm.generate import generate_step, stream_generate
        from mlx_lm.sample_utils import make_sampler
        from mlx_lm.utils import load_tokenizer
    except ImportError as e:
        return [], [{"arm": "mlx-lm", "reason": f"mlx-lm is not installed ({e})"}]
    model, reason = mlx_lm_model(path, group)
    if model is None:
        return [], [{"arm": "mlx-lm", "reason": reason}]
    dtype = float_dtype(model)
    greedy = make_sampler(temp=0.0)
    tokenizer, why = None, "generate_step with a greedy sampler (no tokenizer files: stream_generate needs one)"
    if any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        try:
            tokenizer = load_tokenizer(Path(path))
            tokenizer.eos_token_ids = []  # every arm decodes the same number of tokens
        except Exception as e:
            why = f"generate_step with a greedy sampler (mlx-lm cannot load the tokenizer: {type(e).__name__})"

    if tokenizer is not None:
        def users(ids: list[int], n: int) -> Iterator[tuple[int, mx.array]]:
            for response in stream_generate(model, tokenizer, mx.array(ids), max_tokens=n, sampler=greedy):
                yield response.token, response.logprobs
        loop, why = "stream_generate", "stream_generate with a greedy sampler, EOS stop off"
    else:
        def users(ids: list[int], n: int) -> Iterator[tuple[int, mx.array]]:
            yield from generate_step(mx.array(ids), model, max_tokens=n, sampler=greedy)
        loop = "generate_step"

    def own_loop(ids: list[int], n: int) -> Iterator[tuple[int, mx.array]]:
        yield from generate_tokens(model, ids, n)

    weights = model_bytes(model)
    arms = [Arm(f"mlx-lm {loop}", "mlx-lm", loop, "gather_qmm", dtype, users, note=why, weight_bytes=weights)]
    if hasattr(model, "make_cache"):
        kinds = sorted({type(c).__name__ for c in model.make_cache()})
        return arms, [{"arm": OWN_LOOP_ARM, "reason": f"mlx-lm's {type(model).__module__} makes its own caches "
                       f"({', '.join(kinds)}); moebench's loop gives a foreign model key/value caches only"}]
    return arms + [Arm(OWN_LOOP_ARM, "mlx-lm", "moebench", "gather_qmm", dtype, own_loop,
                       note="mlx-lm's model under moebench.decode.loop.generate_tokens", weight_bytes=weights)], []


def prompt_token_ids(vocab_size: int, n: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random prompt: bench works on token ids, so random checkpoints need no tokenizer."""
    if n < 1:
        raise MoebenchError(f"--prompt-tokens {n}: need at least 1")
    return np.random.default_rng(check_seed(seed)).integers(0, vocab_size, size=n).tolist()


def platform_info() -> dict:
    """MLX version, device and backend, host, and the versions a result depends on."""
    info = {"mlx": mx.__version__, "device": str(mx.default_device()), "backend": available_backend(),
            "python": platform.python_version(), "host": platform.platform(), "machine": platform.machine()}
    try:
        info["device_info"] = {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))}
    except (AttributeError, RuntimeError) as e:
        info["device_info"] = {"error": str(e)}
    try:
        from importlib.metadata import version
        info["mlx_lm"] = version("mlx-lm")
    except Exception:
        info["mlx_lm"] = None
    # MLX runtime settings from the environment (say, MLX_MAX_OPS_PER_BUFFER): they apply to every arm
    info["mlx_environment"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")}
    # and moebench's own (say, MOEBENCH_NORM_KERNELS): they apply to every moebench arm
    info["moebench_environment"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("MOEBENCH_")}
    return info


def reference_arm(results: list[ArmResult]) -> ArmResult:
    """moebench's fallback when it ran (mlx-lm mirrors it), else the first arm."""
    return next((r for r in results if r.arm.name == "moebench fallback"), results[0])


def arm_record(result: ArmResult, reference: ArmResult) -> dict:
    runs = result.runs
    last = runs[-1]
    working = max(r.working_bytes for r in runs)
    return {
        "name": result.arm.name, "engine": result.arm.engine, "loop": result.arm.loop,
        "experts": result.arm.experts, "dtype": result.arm.dtype, "note": result.arm.note,
        "prompt_tps": summary([r.prompt_tps for r in runs]),
        "ttft_ms": summary([1e3 * r.prompt_seconds for r in runs]),
        "decode_tps": summary([r.decode_tps for r in runs]),
        # round by round (the arms of one round ran back to back), so slow drifts of the machine cancel
        "decode_ratio_vs_reference": summary([r.decode_tps / ref.decode_tps if ref.decode_tps else 0.0
                                              for r, ref in zip(runs, reference.runs, strict=True)]),
        "weights_gb": result.arm.weight_bytes / 1e9,
        "working_memory_gb": working / 1e9,
        "own_peak_memory_gb": (result.arm.weight_bytes + working) / 1e9,  # its own model's weights, not the others'
        "peak_memory_gb": max(r.peak_bytes for r in runs) / 1e9,  # the process's: every loaded model's weights
        "dispatch": last.dispatch,
        "tokens": result.trace.token_ids,
        "deterministic": result.deterministic,
        "greedy_vs_reference": compare_traces(reference.trace, result.trace),
    }


def snapshot_ratios(results: list[ArmResult]) -> list[dict]:
    """Per snapshot arm, this revision's arm decoding the same way by default (fused or not; compiled where
    generate compiles by default) over it, round by round (the two ran back to back in each round)."""
    backend = available_backend()
    rows = []
    for snap in (r for r in results if r.arm.engine == "moebench snapshot"):
        fused = snap.arm.experts != "gather_qmm"
        loop = "moebench compiled" if compiled_by_default(backend, fused) else "moebench"
        head = next((r for r in results if r.arm.engine == "moebench" and r.arm.loop == loop
                     and (r.arm.experts != "gather_qmm") == fused), None)
        if head is not None:
            rows.append({"arm": head.arm.name, "snapshot": snap.arm.name, "ratio": summary(
                [h.decode_tps / s.decode_tps for h, s in zip(head.runs, snap.runs, strict=True) if s.decode_tps])})
    return rows


def length_record(prompt_ids: list[int], results: list[ArmResult], skipped: list[dict]) -> dict:
    """One prompt length's bench: every arm that ran (none when each failed) and those skipped, with why."""
    reference = reference_arm(results) if results else None
    arms = [arm_record(r, reference) for r in results]
    return {"prompt_tokens": len(prompt_ids), "prompt_ids": prompt_ids,
            "reference_arm": reference.arm.name if reference else None,  # the baseline of ratios and greedy
            "arms": arms, "unranked": overlapping_arms(arms), "skipped": skipped,
            "snapshot_ratios": snapshot_ratios(results)}


def bench_record(lengths: list[dict], model, gen_tokens: int, repeats: int, arguments: dict,
                 shard: dict | None = None) -> dict:
    """The whole run: the platform, the model (with `shard`, sharding.report's, where it is sharded), and each
    prompt length's length_record."""
    a = model.args
    return {
        "schema": SCHEMA, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "arguments": arguments, "platform": platform_info(),
        "model": {"path": str(model.load_info.source), "model_type": a.model_type, "layers": a.num_hidden_layers,
                  "hidden_size": a.hidden_size, "experts": a.num_experts, "top_k": a.num_experts_per_tok,
                  "expert_width": a.moe_intermediate_size, "vocab_size": a.vocab_size,
                  "quantization": model.load_info.bits, "weights_bytes": model_bytes(model)},
        "prompt_tokens": [length["prompt_tokens"] for length in lengths], "gen_tokens": gen_tokens,
        "repeats": repeats,
        "moebench_loop": {"steps_ahead": STEPS_AHEAD},  # the 'moebench' loops queue this many steps ahead
        "lengths": lengths, "shard": shard,
    }


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="decode speed: moebench fused vs fallback (vs mlx-lm), interleaved repeats",
                       description="Decode speed of moebench with the fused kernels and with its fallback (and "
                                   "mlx-lm with --compare) on one checkpoint: every arm decodes the same random "
                                   "prompt greedily, the timed repeats interleaved. One row per arm: decode tok/s "
                                   "as median [min-max], the ratio to the baseline arm (moebench fallback when it "
                                   "runs, else the first), its "
                                   "own peak memory and whether its greedy tokens match the baseline's; a warning "
                                   "when the spread is too wide to rank the arms.")
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: MOEBENCH_MODEL or shipped)")
    p.add_argument("--prompt-tokens", type=at_least(1), nargs="+", default=[64], metavar="N",
                   help="prompt length; several (64 2048 4096) run one after the other on the models loaded once, "
                        "each a full interleaved bench of every arm")
    p.add_argument("--gen-tokens", type=at_least(1), default=128,
                   help="tokens each arm decodes greedily (at least 2: decode speed counts those after the first)")
    p.add_argument("--repeats", type=at_least(1), default=3,
                   help="timed rounds, arms interleaved, after one untimed warm-up each; the table gives median "
                        "[min-max] over them and warns when the arms' ranges overlap (default %(default)s; 5+ to rank "
                        "close arms)")
    p.add_argument("--fused", choices=("on", "off", "both"), default="both",
                   help="moebench arms with the fused kernels (on), the fallback (off) or both")
    p.add_argument("--compiled", choices=("on", "off", "both", "auto"), default="auto",
                   help="moebench arms through the mx.compile'd decode step (on), eager (off) or both; auto: "
                        "both where generate decodes compiled by default (CUDA, the CPU), else off")
    p.add_argument("--compare", choices=("mlx-lm",), default=None, help="also run mlx-lm on the same checkpoint")
    p.add_argument("--snapshot", metavar="DIR", default=None,
                   help="also run an earlier revision of moebench on the same checkpoint, interleaved: DIR holds "
                        "its moebench/ and kernels/ (git archive REV moebench kernels | tar -x -C DIR)")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the prompt's token ids")
    add_json_option(p, "the full record (every repeat's timings, memory, dispatch, tokens)")
    p.add_argument("--verbose", action="store_true",
                   help="after the table, every arm's detail: prompt tok/s, time to first token, mean and sd, memory "
                        "split, dispatch counts, greedy divergence margin; the model's path and quantization per "
                        "module")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_shard_argument(p)
    p.set_defaults(run=_run)


def add_shard_argument(p: argparse.ArgumentParser) -> None:
    """--shard, as generate and bench take it."""
    p.add_argument("--shard", choices=MODES, default=None,
                   help="experts: split every MoE block's experts over the processes mlx.launch started (each loads "
                        "only its own; rank 0 reports), e.g. mlx.launch -n 2 --backend ring -- moebench ...; "
                        "experts+tensor: every layer's attention heads and every shared expert's and dense MLP's "
                        "width too (tensor-parallel, as mlx-lm's shard())")


def _run(a: argparse.Namespace) -> int:
    check_json_target(a.json)
    if a.snapshot:
        snapshot_init(Path(a.snapshot))  # before the model loads
    path = Path(a.model) if a.model else default_model_path()
    group = init_group(a.shard) if a.shard else None
    quiet = group is not None and group.rank() != 0  # every rank runs every arm in step; rank 0 reports
    model, _ = load(path, shard=group, tensor_parallel=a.shard == TENSOR_MODE)  # the report opens with the model
    prompts = [prompt_token_ids(model.args.vocab_size, n, a.seed) for n in a.prompt_tokens]
    compiled = a.compiled if a.compiled != "auto" else ("both" if available_backend() in COMPILED_BY_DEFAULT else "off")
    arms, skipped = moebench_arms(model, a.fused, compiled), []
    if a.compare == "mlx-lm":
        extra, skips = mlx_lm_arms(path, group)
        arms += extra
        skipped += skips
        for skip in skips:
            print(f"skipping {skip['arm']}: {skip['reason']}", file=sys.stderr)
    if a.snapshot and group is not None:
        skipped.append({"arm": "snapshot", "reason": "--snapshot runs an earlier revision unsharded: not with --shard"})
    elif a.snapshot:
        arms += snapshot_arms(Path(a.snapshot), path, a.fused)
    lengths, arguments = [], {k: v for k, v in vars(a).items() if k != "run"}
    for ids in prompts:
        results, failures = run_arms(arms, ids, a.gen_tokens, a.repeats, progress=not (a.no_progress or quiet),
                                     desc=f"bench {len(ids)} tokens")
        lengths.append(length_record(ids, results, skipped + failures))
        shard = report(model, group) if group is not None else None  # every rank takes part
        record = bench_record(lengths, model, a.gen_tokens, a.repeats, arguments, shard)
        if quiet or to_stdout(a.json):
            continue
        # each length as soon as it is measured: a run stopped later keeps it
        print(*([format_header(record, a.verbose)] if len(lengths) == 1 else []),
              format_length(record, lengths[-1], a.verbose), sep="\n\n", end="\n\n", flush=True)
        if a.json:
            write_json(a.json, record)
    if to_stdout(a.json) and not quiet:
        write_json(a.json, record)
    if not any(length["arms"] for length in lengths):
        raise MoebenchError("every arm failed: " + "; ".join(f"{f['arm']}: {f['reason']}" for f in failures))
    return 0
