"""Fused vs fallback: fused is closer to the float64 truth, and the decode comparison is consistent."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import moebench
from moebench.errors import MoebenchError, UnsupportedKernelConfig
from moebench.inspect.compare import compare_decode, compare_step
from moebench.inspect.record import Stepper

PROMPT = [11, 200, 45, 3, 77, 130]
NEAR_TIE_PROMPT = [104, 244, 226, 133, 31]  # with this checkpoint (seed 3) in bf16 the arms part at a near-tie


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """4-bit experts with bfloat16 scales, as real MLX conversions store them."""
    from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("bf16") / "ckpt", qwen2_moe_config(), seed=3, bits=4,
                                   dtype=mx.bfloat16)


@pytest.fixture(scope="module")
def model(bf16_checkpoint):
    return moebench.load(bf16_checkpoint)[0]  # float32 activations, the CPU default


@pytest.fixture(scope="module")
def step(model):
    return Stepper(model, None, PROMPT, record=True).run(3).steps[-1]


def test_fused_is_closer_to_the_truth_than_the_fallback_in_bfloat16(model, step):
    table = compare_step(model, step, dtype=mx.bfloat16)
    k = model.args.num_experts_per_tok
    assert all(b.shared_expert is not None for b in model.moe_blocks().values())
    assert len(table) == len(model.moe_blocks()) * (1 + k + 1) * 3
    assert set(table["dtype"]) == {"mlx.core.bfloat16"} and set(table["backend"]) == {"reference"}
    wide = table.assign(slot=table["slot"].fillna(-1)).pivot(index=["layer", "part", "slot"], columns="pair",
                                                             values="nrms")
    assert len(wide) == len(model.moe_blocks()) * (1 + k + 1)  # the routed sum, each expert, the shared expert
    assert (wide["fused~truth"] < wide["fallback~truth"] / 3).all(), wide
    shared = table[(table["part"] == "shared") & (table["pair"] == "fused~truth")]
    assert len(shared) == len(model.moe_blocks()) and (shared["nrms"] < 1e-5).all()  # float32 inside the pair
    expert_rows = table[(table["part"] == "expert") & (table["pair"] == "fused~truth")]
    assert (expert_rows["nrms"] < 1e-5).all()  # float32 partials: only float32 rounding
    assert list(expert_rows["expert"][:k]) == list(step.layers[0].topk_ids)


def test_in_float32_both_paths_sit_at_float32_rounding(model, step):
    table = compare_step(model, step, layers=[1])
    assert set(table["layer"]) == {1} and (table["nrms"] < 1e-5).all()


def test_compare_step_says_why_it_cannot_run(model, make_checkpoint):
    with pytest.raises(MoebenchError, match="record=True"):
        compare_step(model, Stepper(model, None, PROMPT).run(2).steps[-1])
    with pytest.raises(MoebenchError, match="layer 7 was not recorded"):
        compare_step(model, Stepper(model, None, PROMPT, record=True).run(2).steps[-1], layers=[7])
    float_experts, _ = moebench.load(make_checkpoint("float"))
    recorded = Stepper(float_experts, None, PROMPT, record=True).run(2).steps[-1]
    with pytest.raises(UnsupportedKernelConfig, match="float experts"):
        compare_step(float_experts, recorded)


def test_decode_comparison_in_bfloat16(model):
    n = 8
    result = compare_decode(model, NEAR_TIE_PROMPT, n, dtype=mx.bfloat16)
    assert result.dtype == "mlx.core.bfloat16"
    assert len(result.on.token_ids) == len(result.off.token_ids) == len(result.kl) == n
    assert result.kl[0] == 0 and (result.kl >= 0).all()  # prefill never runs fused: identical first step
    assert result.jaccard["jaccard"].between(0, 1).all()
    assert (result.jaccard[result.jaccard["step"] == 0]["jaccard"] == 1).all()
    paths = {r.path.path for s in result.on.steps if s.phase == "decode" for r in s.layers.values()}
    assert paths == {"reference"}
    assert {r.path.path for s in result.off.steps for r in s.layers.values()} == {"fallback"}
    # The off arm is fed the on arm's tokens; up to the divergence it is the free-running fallback decode.
    bf16 = moebench.load(model.load_info.source, dtype=mx.bfloat16)[0]
    free_off = Stepper(bf16, None, NEAR_TIE_PROMPT, fused=False).run(n).token_ids
    free_on = Stepper(bf16, None, NEAR_TIE_PROMPT, fused=True).run(n).token_ids
    assert result.on.token_ids == free_on
    assert not result.identical
    first = result.first_divergence
    assert result.on.token_ids[:first] == result.off.token_ids[:first] == free_on[:first]
    assert result.off.token_ids[first] == free_off[first] != result.on.token_ids[first]
    on_logits = result.on.generated[first].logits.astype(np.float64)
    top2 = np.sort(on_logits)[-2:]
    assert result.margins["on"]["logit"] == pytest.approx(top2[1] - top2[0])
    assert set(result.margins["off"]) == {"logit", "prob"}
    on_id, off_id = result.on.token_ids[first], result.off.token_ids[first]  # no tokenizer: the ids
    assert (f"first divergence at generated token {first}: on {on_id} vs off {off_id}; top-1 margin there "
            f"{result.margins['on']['logit']:.3g} (on)") in repr(result)
    frame = result.frame()
    assert list(frame["agree"]) == [a == b for a, b in zip(result.on.token_ids, result.off.token_ids, strict=True)]
    assert frame["kl"].tolist() == result.kl.tolist()
