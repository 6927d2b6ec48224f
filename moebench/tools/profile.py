"""moebench profile: where one decode token's time goes, and how big the graph behind it is.

Decode speed (bench) is one number; this splits it per token, to tell Python-bound from compute-bound:

- build ms: Python time to call the forward and argmax for one token, nothing evaluated (MLX only records
  the graph), so this is moebench's / mlx-lm's layer code, routing and dispatch decisions;
- eval ms: `mx.eval(next_token)` of that graph, synchronously (the device's compute plus launch overheads);
- sync ms/token: build + eval of one step; pipelined ms/token: `decode.generate`, which builds step n+1
  while step n evaluates, so where build < eval it approaches eval alone;
- with --compiled on (both: beside the eager arms), moebench's arms run through the compiled decode step
  (moebench.decode.compiled, generate's default on CUDA and the CPU): build ms is then the host's call of the
  traced step, and its graph the few nodes that replay it;
- graph nodes/token: primitives in the unevaluated graph of one decode step (from mx.export_to_dot, which
  names each primitive; array nodes are not counted), per decoder layer (the embedding, final norm, lm_head and
  argmax spread over the layers with them) and by primitive name;
- launches/layer (plan, GPU path): the nodes the arm's decode plan declares a layer builds on the GPU path
  (moebench.execution.plan.Launches; a layer running a part as MLX ops the execution layer does not build declares
  none, and the record says why), beside the measured nodes/layer.

On CPU the mx.fast ops (rms_norm, rope, scaled_dot_product_attention) decompose into several primitives at
graph build, whereas on a GPU each is one node, so node counts compare arms on the same device only; and the
plan's count is the GPU path's: on a CPU the measured nodes differ from it (the mx.fast ops decompose, and the
reference backend runs each kernel as MLX ops). A GPU custom kernel (mx.fast.metal_kernel / cuda_kernel) is one
'CustomKernel' node; should MLX's dot export refuse some primitive, the arm records MLX's error text instead of
its counts.

moebench's eager arms decode over the caches the decode loop makes (decode.cache.layer_caches: a hybrid's
linear-attention layers get their recurrent state), so every family profiles as it decodes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ..checkpoint.loader import default_model_path, load
from ..decode.cache import layer_caches
from ..decode.compiled import CompiledForward
from ..decode.loop import generate
from ..errors import MoebenchError
from ..execution.executor import executor, fused_moe
from ..execution.kernel import available_backend
from .bench import mlx_lm_model, platform_info, prompt_token_ids, summary
from .flags import SEED, at_least
from .json_option import add_json_option, check_json_target, report, to_stdout
from .progress import Progress
from .text_table import markdown_table, wrapped

SCHEMA = "moebench.tools.profile/1"
TOP_PRIMITIVES = 15  # rows of the primitive table (the JSON keeps every count)
_LABEL = re.compile(r'\[label\s*="(.*?)",\s*shape=rectangle\]')  # primitive nodes; arrays are bare "A", "B", ...
Step = Callable[[mx.array], mx.array]  # token ids [L] -> greedy next token [1], not evaluated


@dataclass
class ProfileArm:
    """One model under one setting: fused True/False switches moebench's MoE kernel; None for mlx-lm's model."""

    name: str
    engine: str  # 'moebench' or 'mlx-lm'
    model: object
    fused: bool | None = None
    compiled: bool = False  # moebench's compiled decode step instead of the eager forward


def count_primitives(dot: str) -> Counter:
    """Primitive nodes of an mx.export_to_dot graph by name (a multi-output primitive is one node)."""
    return Counter(_LABEL.findall(dot))


def graph_nodes(*outputs: mx.array) -> dict:
    """{'total', 'by_primitive' (descending), 'error'} of the unevaluated graph behind `outputs`."""
    buffer = io.StringIO()
    try:
        mx.export_to_dot(buffer, *outputs)
    except (RuntimeError, ValueError) as e:  # MLX refusing a primitive: reported, the arm's timings still stand
        return {"total": None, "by_primitive": {}, "error": f"{type(e).__name__}: {e}"}
    counts = count_primitives(buffer.getvalue())
    ordered = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return {"total": sum(counts.values()), "by_primitive": ordered, "error": None}


def compiled_greedy_step(model, capacity: int) -> Step:
    """A greedy one-step function through moebench's compiled decode step over a fresh static cache of `capacity`
    positions (each step's plan counted)."""
    ex = executor(model)
    fast = CompiledForward(ex, capacity)

    def step(ids: mx.array) -> mx.array:
        logits, plan = fast(ids.reshape(-1), ex.settings)
        ex.count(plan)
        return mx.argmax(logits, axis=-1, keepdims=True)
    return step


def greedy_step(model) -> Step:
    """A greedy one-step function over fresh caches: moebench's model over the decode loop's (layer_caches; nothing
    is rolled back here) through its executor (each step's plan counted), or mlx-lm's over its own."""
    if hasattr(model, "moe_blocks"):
        cache, ex = layer_caches(model, keep=1), executor(model)

        def step(ids: mx.array) -> mx.array:
            plan = ex.plan(ids.size, cache)
            ex.count(plan)
            return mx.argmax(ex.forward(ids[None], cache, plan), axis=-1)
        return step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    return lambda ids: mx.argmax(model(ids[None], cache=cache)[:, -1], axis=-1)


def _paths(decisions: list) -> dict:
    return {"path": ", ".join(sorted({d.path for d in decisions})) or None,
            "reasons": sorted({d.reason for d in decisions if d.reason}), "layers": len(decisions)}


def moe_path(model) -> dict | None:
    """The paths the MoE blocks and the attention layers took on the last call (fused backend or 'fallback')
    and why; None for mlx-lm."""
    if not hasattr(model, "moe_blocks"):
        return None
    last = executor(model).last
    layers = last.layers if last is not None else ()
    return {**_paths([lp.moe for lp in layers if lp.moe is not None]),
            "attention": _paths([lp.attention for lp in layers])}


def plan_launches(model) -> dict | None:
    """What the plan of the last decode step declares a layer launches on the GPU path (the per-layer mean and the
    layers not declared, by reason; moebench.execution.plan.Plan.launches); None for mlx-lm."""
    if not hasattr(model, "moe_blocks"):
        return None
    launches = executor(model).launches()
    return None if launches is None else {k: v for k, v in launches.items() if k != "layers"}


def profile_steps(model, prompt_ids: list[int], steps: int, warmup: int = 3, compiled: bool = False) -> dict:
    """Prefill, then `warmup` + `steps` synchronous one-token steps (through the compiled step with `compiled`):
    build and eval time of each timed step, the graph of the first decode step (exported between its build
    and its eval, outside both timers), and the launches its plan declares."""
    step = compiled_greedy_step(model, len(prompt_ids) + warmup + steps) if compiled else greedy_step(model)
    token = step(mx.array(prompt_ids, dtype=mx.uint32))
    mx.eval(token)
    build, evals, graph = [], [], None
    for i in range(warmup + steps):
        start = time.perf_counter()
        nxt = step(token)
        built = time.perf_counter()
        if graph is None:
            graph = graph_nodes(nxt)
        before_eval = time.perf_counter()
        mx.eval(nxt)
        end = time.perf_counter()
        if i >= warmup:
            build.append(1e3 * (built - start))
            evals.append(1e3 * (end - before_eval))
        token = nxt
    layers = len(model.layers)
    graph["layers"] = layers
    graph["per_layer"] = graph["total"] / layers if graph["total"] is not None else None
    return {"build_ms": summary(build), "eval_ms": summary(evals),
            "sync_ms": summary([b + e for b, e in zip(build, evals, strict=True)]), "graph": graph,
            "dispatch": moe_path(model), "launches": plan_launches(model)}


def pipelined_ms(model, prompt_ids: list[int], gen_tokens: int, compiled: bool = False) -> dict:
    """ms/token of decode.generate's loop, eager or through the compiled step (evaluation steps ahead of graph
    building; the graph the steps profile measured), after one untimed run."""
    generate(model, prompt_ids, gen_tokens, compiled=compiled)
    result = generate(model, prompt_ids, gen_tokens, compiled=compiled)
    tps = result.decode_tps
    return {"ms_per_token": 1e3 / tps if tps else None, "decode_tps": tps}


def profile_arm(arm: ProfileArm, prompt_ids: list[int], steps: int, gen_tokens: int, warmup: int = 3) -> dict:
    """The steps profile and the pipelined time of one arm, its fused switch set for both."""
    switch = fused_moe(arm.fused, arm.model) if arm.fused is not None else contextlib.nullcontext()
    with switch:
        record = profile_steps(arm.model, prompt_ids, steps, warmup, arm.compiled)
        pipelined = pipelined_ms(arm.model, prompt_ids, gen_tokens, arm.compiled)
    return {"name": arm.name, "engine": arm.engine, "fused": arm.fused, **record,
            "pipelined_ms_per_token": pipelined["ms_per_token"], "pipelined_decode_tps": pipelined["decode_tps"]}


def moebench_profile_arms(model, fused: str, compiled: str = "off") -> list[ProfileArm]:
    """The moebench arms `fused` and `compiled` ('on', 'off' or 'both') ask for: fused first, eager first."""
    arms = []
    for step in [c for c in (False, True) if compiled == "both" or compiled == ("on" if c else "off")]:
        suffix = " compiled" if step else ""
        if fused in ("on", "both"):
            arms.append(ProfileArm(f"moebench fused ({available_backend()}){suffix}", "moebench", model, True, step))
        if fused in ("off", "both"):
            arms.append(ProfileArm(f"moebench fallback{suffix}", "moebench", model, False, step))
    return arms


def run_profile(arms: list[ProfileArm], prompt_ids: list[int], steps: int, gen_tokens: int,
                warmup: int = 3, progress: bool = True) -> tuple[list[dict], list[dict]]:
    """(arm records, failures), arm by arm under a bar on stderr (`progress`): an arm that meets a named moebench
    condition (a MoebenchError: a backend this MLX build lacks, more memory than the device has) is reported as
    failed; anything else raises."""
    if steps < 1:
        raise MoebenchError(f"--steps {steps}: need at least 1")
    if warmup < 0:
        raise MoebenchError(f"--warmup {warmup}: need 0 or more")
    if gen_tokens < 2:
        raise MoebenchError(f"--gen-tokens {gen_tokens}: need at least 2 (decode speed counts tokens after the first)")
    records, failures = [], []
    with Progress(arms, desc="profile", unit="arm", disable=not progress) as bar:  # its line ended on an error
        for arm in bar:
            bar.set_postfix_str(arm.name)
            try:
                records.append(profile_arm(arm, prompt_ids, steps, gen_tokens, warmup))
            except MoebenchError as e:
                failures.append({"arm": arm.name, "reason": f"{type(e).__name__}: {e}"})
                print(f"arm {arm.name} failed: {type(e).__name__}: {e}", file=sys.stderr)
    return records, failures


def profile_record(arms: list[dict], model, prompt_ids: list[int], steps: int, warmup: int, gen_tokens: int,
                   skipped: list[dict], arguments: dict) -> dict:
    a = model.args
    return {
        "schema": SCHEMA, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "arguments": arguments, "platform": platform_info(),
        "model": {"path": str(model.load_info.source), "model_type": a.model_type, "layers": a.num_hidden_layers,
                  "experts": a.num_experts, "top_k": a.num_experts_per_tok, "vocab_size": a.vocab_size},
        "prompt_tokens": len(prompt_ids), "steps": steps, "warmup": warmup, "gen_tokens": gen_tokens,
        "prompt_ids": prompt_ids, "arms": arms, "skipped": skipped,
    }


def format_table(record: dict) -> str:
    """The per-token table (one column per arm), then primitive counts by name x arm."""
    arms = record["arms"]

    def ms(s: dict) -> str:
        return f"{s['median']:.3f} (min {s['min']:.3f})"

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    def path(d: dict | None) -> str:
        return "-" if d is None else d["path"] + (f": {'; '.join(d['reasons'])}" if d["reasons"] else "")

    rows = [["per token", *(a["name"] for a in arms)],
            ["MoE path", *(path(a["dispatch"]) for a in arms)],
            ["attention path", *(path(a["dispatch"] and a["dispatch"]["attention"]) for a in arms)],
            ["build ms, median", *(ms(a["build_ms"]) for a in arms)],
            ["eval ms, median", *(ms(a["eval_ms"]) for a in arms)],
            ["sync ms/token (build+eval)", *(ms(a["sync_ms"]) for a in arms)],
            ["pipelined ms/token", *(num(a["pipelined_ms_per_token"], ".3f") for a in arms)],
            ["graph nodes/token", *(num(a["graph"]["total"], "d") for a in arms)],
            ["nodes/layer", *(num(a["graph"]["per_layer"], ".1f") for a in arms)],
            ["launches/layer (plan, GPU path)", *(num(a["launches"] and a["launches"]["per_layer"], ".1f")
                                                  for a in arms)]]
    totals = Counter()
    for a in arms:
        totals.update(a["graph"]["by_primitive"])
    names = sorted(totals, key=lambda n: (-totals[n], n))
    prim = [["primitive", *(a["name"] for a in arms)]]
    prim += [[n, *(str(a["graph"]["by_primitive"].get(n, 0)) for a in arms)] for n in names[:TOP_PRIMITIVES]]
    m, p = record["model"], record["platform"]
    head = (f"model {m['path']} ({m['model_type']}, {m['layers']} layers, {m['experts']} experts top-{m['top_k']}); "
            f"prompt {record['prompt_tokens']} tokens, {record['steps']} timed steps after {record['warmup']} "
            f"warm-up, pipelined over {record['gen_tokens']} tokens; MLX {p['mlx']} on {p['device']} "
            f"(backend {p['backend']}), mlx-lm {p['mlx_lm'] or '-'}")
    tail = [f"graph export failed for {a['name']}: {a['graph']['error']}" for a in arms if a["graph"]["error"]]
    tail += [f"launches not declared for {a['name']}: " + "; ".join(f"{n} layers: {reason}" for reason, n in
                                                                     a["launches"]["not_declared"].items())
             for a in arms if a["launches"] and a["launches"]["not_declared"]]
    if len(names) > TOP_PRIMITIVES:
        tail.append(f"({len(names) - TOP_PRIMITIVES} more primitives in --json)")
    if "cpu" in p["device"]:
        tail.append("note: on CPU mx.fast ops (rms_norm, rope, sdpa) decompose into several primitives; "
                    "compare node counts between arms on one device only (launches/layer is the GPU path's)")
    tail += [f"skipped {s['arm']}: {s['reason']}" for s in record["skipped"]]
    return "\n".join([*wrapped(head), "", *markdown_table(rows), "", *markdown_table(prim),
                      *(line for text in tail for line in wrapped(text))])


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="per-token decode profile: graph build vs eval time, graph nodes per layer")
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: MOEBENCH_MODEL or shipped)")
    p.add_argument("--prompt-tokens", type=at_least(1), default=64,
                   help="length of the random prompt decoded from (default %(default)s)")
    p.add_argument("--steps", type=at_least(1), default=32, help="timed synchronous decode steps")
    p.add_argument("--warmup", type=at_least(0), default=3, help="untimed decode steps before them")
    p.add_argument("--gen-tokens", type=at_least(1), default=64, help="tokens of the pipelined decode")
    p.add_argument("--fused", choices=("on", "off", "both"), default="both",
                   help="profile moebench with the fused kernels (on), the fallback (off) or both")
    p.add_argument("--compiled", choices=("on", "off", "both"), default="off",
                   help="moebench's arms eager (off, the graph the host builds every token), through the compiled "
                        "decode step (on; generate's default on CUDA and the CPU) or both")
    p.add_argument("--compare", choices=("mlx-lm",), default=None, help="also profile mlx-lm's model of the folder")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the prompt's token ids")
    add_json_option(p, "the full record (every primitive count)")
    p.set_defaults(run=_run)


def _run(a: argparse.Namespace) -> int:
    check_json_target(a.json)
    path = Path(a.model) if a.model else default_model_path()
    model, _ = load(path, verbose=not to_stdout(a.json))
    prompt_ids = prompt_token_ids(model.args.vocab_size, a.prompt_tokens, a.seed)
    arms, skipped = moebench_profile_arms(model, a.fused, a.compiled), []
    if a.compare == "mlx-lm":
        other, reason = mlx_lm_model(path)
        if other is None:
            skipped.append({"arm": "mlx-lm model", "reason": reason})
            print(f"skipping mlx-lm: {reason}", file=sys.stderr)
        else:
            arms.append(ProfileArm("mlx-lm model", "mlx-lm", other))
    records, failures = run_profile(arms, prompt_ids, a.steps, a.gen_tokens, a.warmup)
    skipped += failures
    if not records:
        raise MoebenchError("every arm failed: " + "; ".join(f"{f['arm']}: {f['reason']}" for f in failures))
    arguments = {k: v for k, v in vars(a).items() if k != "run"}
    record = profile_record(records, model, prompt_ids, a.steps, a.warmup, a.gen_tokens, skipped, arguments)
    report(a.json, format_table(record), record)
    return 0
