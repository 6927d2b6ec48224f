"""What tests/models/test_sharding.py compares: one decode of a checkpoint, alone or as one rank under mlx.launch.

    python sharded_run.py MODEL OUT_DIR MODE N_TOKENS PROMPT_ID...

Loads MODEL with its experts (MODE experts) or its experts, attention heads and MLP widths (MODE experts+tensor)
split over the processes mlx.launch started (one process alone: all of them), then, with the fused kernels on and off,
decodes N_TOKENS greedily through the Stepper (recording every MoE layer) and through moebench.generate, eager
and compiled, then the same with experts forced (one from each end of the expert range, so every rank holds one) and
with one expert ablated on every MoE layer, and writes OUT_DIR/rank{r}.json: tokens, each step's top-two logit
margin, the records, the plan's notes and the sharding report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

import moebench
from moebench.execution.executor import dispatch
from moebench.inspect.interventions import intervene
from moebench.inspect.record import Stepper
from moebench.models.routing import Intervention
from moebench.models.sharding import TENSOR_MODE, report

RECORDED = ("topk_ids", "topk_scores", "expert_out", "routed_out", "shared_out", "block_out", "resid_post")


def margin(logits: np.ndarray) -> float:
    top = np.sort(logits.astype(np.float64))[-2:]
    return float(top[1] - top[0])


def decode(model, prompt: list[int], n: int, fused: bool) -> dict:
    """One greedy decode of n tokens three ways (recorded Stepper, generate eager and compiled) with `fused`."""
    trace = Stepper(model, None, prompt, record=True, fused=fused, max_tokens=n, keep_logits=True).run(n)
    steps = trace.prefill[-1:] + trace.generated
    with moebench.fused_moe(fused, model=model):
        generated = moebench.generate(model, prompt, n, compiled=False).token_ids
        compiled = moebench.generate(model, prompt, n, compiled=True).token_ids
    return {
        "tokens": trace.token_ids, "generate_tokens": generated, "compiled_tokens": compiled,
        "margins": [margin(s.logits) for s in steps if s.logits is not None],
        "notes": sorted({s.layers[i].path.note or "" for s in steps for i in s.layers}),
        "attention_notes": sorted({n for layer in dispatch(model)["attention"].values() for n in layer["notes"]}),
        "records": [{str(i): {k: None if getattr(r, k) is None else np.asarray(getattr(r, k), np.float64).tolist()
                              for k in RECORDED} for i, r in s.layers.items()} for s in steps],
    }


def interventions(model) -> dict[str, Intervention]:
    """Forced: the first and last experts (held by the first and last rank) then the next ones up to the layer's
    top-k; ablated: expert 0, the one every rank-0 span holds."""
    block = next(iter(model.moe_blocks().values()))
    last = block.num_experts - 1
    forced = (0, last, *range(1, block.top_k - 1))
    return {"forced": Intervention(force_experts=forced), "ablated": Intervention(ablate=(0,))}


def main(model_path: str, out: str, mode: str, n: int, prompt: list[int]) -> None:
    group = mx.distributed.init()
    model, _ = moebench.load(model_path, shard=group, tensor_parallel=mode == TENSOR_MODE)
    result = {}
    for fused in (True, False):
        result["on" if fused else "off"] = decode(model, prompt, n, fused)
        for name, intervention in interventions(model).items():
            with intervene(model, intervention):
                result[f"{name} {'on' if fused else 'off'}"] = decode(model, prompt, n, fused)
    result["shard"] = report(model, group)
    Path(out, f"rank{group.rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), [int(t) for t in sys.argv[5:]])
