"""moebench bench's printed report, from its JSON record: one row per arm in the form llama-bench and mlx-lm users
know (decode tok/s as median [min-max], the ratio to one named baseline, memory in readable units), a warning
when the spread is too wide to rank the arms, and with `verbose` the rest of the record arm by arm.

Three words are kept apart: the *baseline* is the arm every ratio and greedy comparison is against (moebench's
fallback when it ran); the *fallback* is moebench's unfused path (gather_qmm, what mlx-lm computes); the
*reference* backend is the fused kernels' arithmetic run as MLX ops, on a machine with neither Metal nor CUDA.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.loader import quantization_details, quantization_text
from ..execution.plan import launches_line
from ..units import byte_size
from .text_table import markdown_table, wrapped

SPREAD_RULE = "their decode tok/s [min-max] ranges over the repeats overlap"
CPU_BACKEND = "reference"  # kernel.available_backend()'s name for the fused arithmetic as MLX ops


def overlapping_arms(arms: list[dict]) -> list[list[str]]:
    """Pairs of arms (by name) whose decode tok/s [min-max] over the repeats overlap: pairs the repeats do not
    rank, whichever median is higher."""
    return [[a["name"], b["name"]] for i, a in enumerate(arms) for b in arms[i + 1:]
            if a["decode_tps"]["min"] <= b["decode_tps"]["max"] and b["decode_tps"]["min"] <= a["decode_tps"]["max"]]


def spread(s: dict, digits: int = 1, unit: str = "") -> str:
    """median [min-max], as the table prints every repeated measurement."""
    return f"{s['median']:.{digits}f}{unit} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def _greedy(g: dict, detail: bool = False) -> str:
    """An arm's greedy tokens against the baseline's; with `detail` the baseline's logit margin at the divergence
    (a near-tie when small)."""
    if g["identical"]:
        return "identical"
    if g["margin"] is None:
        return f"length differs at {g['first_divergence']}"
    margin = f" (the baseline's logit margin there {g['margin']:.3g})" if detail else ""
    return f"differs at {g['first_divergence']}{margin}"


def _dispatch(d: dict | None) -> str:
    if d is None:
        return "not counted (not a moebench model)"
    fused = ", ".join(f"{n} {b}" for b, n in sorted(d["fused"].items())) or "0 fused"
    notes = "".join(f"; {n} layers: {note}" for note, n in sorted(d.get("notes", {}).items()))
    attention = d.get("attention")
    if attention:
        notes += "; attention " + (", ".join(f"{n} {b}" for b, n in sorted(attention["fused"].items())) or "0 fused")
        notes += f", {attention['fallback']} fallback"
    if d.get("launches"):
        notes += f"; {launches_line(d['launches'])}"
    return f"MoE {fused}; {d['fallback']} fallback{notes}"


def _own_peak(a: dict) -> str:
    return byte_size(a["own_peak_memory_gb"] * 1e9)


def _arm_details(a: dict, baseline: str) -> list[str]:
    """--verbose: everything the record holds about one arm, a few lines."""
    g = "the baseline" if a["name"] == baseline else _greedy(a["greedy_vs_reference"], detail=True)
    lines = [f"{a['name']}: {a['engine']}, loop {a['loop']}, experts by {a['experts']}, {a['dtype']}"
             + (f"; {a['note']}" if a["note"] else ""),
             f"prompt {spread(a['prompt_tps'])} tok/s, time to first token {spread(a['ttft_ms'])} ms",
             f"decode {spread(a['decode_tps'])} tok/s (mean {a['decode_tps']['mean']:.1f}, sd "
             f"{a['decode_tps']['sd']:.1f}); vs {baseline} round by round "
             f"{spread(a['decode_ratio_vs_reference'], 3, 'x')}",
             f"memory: weights {byte_size(a['weights_gb'] * 1e9)} + working {byte_size(a['working_memory_gb'] * 1e9)}"
             f" = own peak {_own_peak(a)}; the process's peak {byte_size(a['peak_memory_gb'] * 1e9)} (every loaded "
             "model)",
             f"dispatch (last repeat): {_dispatch(a['dispatch'])}",
             f"greedy tokens: {g}" + ("" if a["deterministic"] else "; NOT the same in every repeat")]
    return ["", lines[0], *(part for line in lines[1:] for part in wrapped("  " + line))]


def _warnings(record: dict, length: dict) -> list[str]:
    arms = length["arms"]
    found = []
    if record["repeats"] < 2 and len(arms) > 1:
        found.append("one repeat measures no spread: the order of the arms is one sample's (use --repeats 5)")
    found += [f"{a['name']} decoded different tokens in different repeats" for a in arms if not a["deterministic"]]
    lines = [line for text in found for line in wrapped("warning: " + text)]
    pairs = length["unranked"] if record["repeats"] > 1 else []
    if pairs:
        lines += wrapped(f"warning: the spread is too wide to rank {len(pairs)} pair{'s' if len(pairs) > 1 else ''} "
                          f"of arms, as {SPREAD_RULE} (more --repeats or a quieter machine may separate them):")
        lines += [f"  {a}  vs  {b}" for a, b in pairs]
    return lines


def _length_table(record: dict, length: dict, verbose: bool) -> str:
    arms = length["arms"]
    title = f"prompt {length['prompt_tokens']} tokens, {record['gen_tokens']} generated, {record['repeats']} repeats"
    tail = [f"{s['arm']} / {s['snapshot']}, round by round: {spread(s['ratio'], 3, 'x')}"
            for s in length["snapshot_ratios"]]
    tail += [f"skipped {s['arm']}: {s['reason']}" for s in length["skipped"]]
    if not arms:
        return "\n".join([title + ": every arm failed", *tail])
    baseline = length["reference_arm"]
    rows = [["arm", "decode tok/s", "vs baseline", "memory", "greedy tokens"]]
    for a in arms:
        rows.append([a["name"], spread(a["decode_tps"]), f"{a['decode_ratio_vs_reference']['median']:.2f}x",
                     _own_peak(a), "baseline" if a["name"] == baseline else _greedy(a["greedy_vs_reference"])])
    legend = [f"baseline: {baseline}; vs baseline: median of the per-round decode tok/s ratios; decode tok/s: "
              "median [min-max] of the repeats; memory: the arm's own peak (its weights + working memory)"]
    if any(a["experts"] == CPU_BACKEND for a in arms):
        legend.append(f"fused ({CPU_BACKEND}): the CPU backend, the fused kernels' arithmetic as MLX ops (no Metal "
                      "or CUDA here)")
    details = [line for a in arms for line in _arm_details(a, baseline)] if verbose else []
    return "\n".join([title, *markdown_table(rows), *(line for text in legend for line in wrapped(text)),
                      *_warnings(record, length), *tail, *details])


def _header(record: dict, verbose: bool) -> list[str]:
    m, p = record["model"], record["platform"]
    lines = [f"{Path(m['path']).name}: {m['model_type']}, {m['layers']} layers, {m['experts']} experts "
             f"top-{m['top_k']}, {quantization_text(m['quantization'])}, {byte_size(m['weights_bytes'])}",
             f"MLX {p['mlx']} on {p['device']} (backend {p['backend']})"]  # each length's table says its shape
    settings = [f"{k}={v}" for key in ("mlx_environment", "moebench_environment") for k, v in p.get(key, {}).items()]
    if settings:
        lines.append("settings for every arm: " + ", ".join(settings))
    if record.get("shard"):
        s = record["shard"]
        lines.append(f"sharded over {s['ranks']} processes (rank 0 reports: {s['experts']}; {s['attention']}; "
                     f"MLPs: {s['mlps']}); resident experts per rank "
                     f"{', '.join(byte_size(b) for b in s['expert_bytes_per_rank'])}, process peak per rank "
                     f"{', '.join(byte_size(b) for b in s['peak_bytes_per_rank'])}")
    if verbose:
        lines += [f"  {m['path']}", *(f"  {line}" for line in quantization_details(m["quantization"])),
                  f"  python {p['python']}, mlx-lm {p['mlx_lm']}, {p['host']}; moebench loops queue "
                  f"{record['moebench_loop']['steps_ahead']} steps ahead"]
    return [part for line in lines for part in wrapped(line)]


def format_header(record: dict, verbose: bool = False) -> str:
    """The model and platform the record's lengths were measured on."""
    return "\n".join(_header(record, verbose))


def format_length(record: dict, length: dict, verbose: bool = False) -> str:
    """One prompt length of the record: one row per arm (the rest of the record per arm with `verbose`)."""
    return _length_table(record, length, verbose)


def format_table(record: dict, verbose: bool = False) -> str:
    """The header, then every prompt length's table."""
    return "\n\n".join([format_header(record, verbose),
                        *(format_length(record, length, verbose) for length in record["lengths"])])
