"""The stepping decoder: recording is faithful and free, steps honour changes made between tokens."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import moebench
from moebench.decode.loop import generate
from moebench.decode.sampling import Sampling
from moebench.errors import MoebenchError
from moebench.execution.executor import executor, fused_moe
from moebench.inspect.interventions import clear_interventions, set_interventions
from moebench.inspect.record import Recorder, Stepper, decode
from moebench.models.hooks import MIXER_HOOKS
from moebench.tools.presets import get_preset
from moebench.tools.writer import write_random_checkpoint

PROMPT = [5, 17, 99, 3, 42]


@pytest.fixture(scope="module")
def tiny(quantized_checkpoint):
    model, tok = moebench.load(quantized_checkpoint)
    yield model, tok
    clear_interventions(model)


@pytest.fixture(autouse=True)
def clean(tiny):
    model, _ = tiny
    executor(model).reset_counts()
    clear_interventions(model)
    yield
    clear_interventions(model)


def all_logits(trace) -> np.ndarray:
    return np.stack([s.logits for s in trace.steps])


@pytest.mark.parametrize("fused", [True, False])
def test_recording_on_or_off_gives_bitwise_identical_tokens_and_logits(tiny, fused):
    model, tok = tiny
    with fused_moe(fused, model):
        plain = Stepper(model, tok, PROMPT, keep_logits=True).run(8)
        recorded = Stepper(model, tok, PROMPT, keep_logits=True, record=True).run(8)
        reference = generate(model, PROMPT, 8)
    assert recorded.token_ids == plain.token_ids == reference.token_ids
    assert np.array_equal(all_logits(recorded), all_logits(plain))
    assert recorded.steps[-1].layers and not plain.steps[-1].layers


def test_sampled_decode_matches_generate_with_the_same_seed(tiny):
    model, _ = tiny
    sampling = Sampling(temperature=1.5, top_p=0.9, seed=7)
    ours = decode(model, None, PROMPT, 10, sampling=sampling)
    assert ours.token_ids == generate(model, PROMPT, 10, sampling).token_ids


@pytest.mark.parametrize("fused", [True, False])
def test_recorded_parts_reproduce_the_block_output(tiny, fused):
    """sum_k score_k * expert_out_k + gate * shared_out == block_out, on the path that ran."""
    model, _ = tiny
    trace = Stepper(model, None, PROMPT, record=True, fused=fused).run(6)
    decode_paths = {r.path.path for s in trace.steps if s.phase == "decode" for r in s.layers.values()}
    assert decode_paths == ({"reference"} if fused else {"fallback"})
    for s in trace.steps:
        for r in s.layers.values():
            weighted = (r.topk_scores[:, None].astype(np.float64) * r.expert_out).sum(axis=0)
            scale = np.abs(r.block_out).max()
            np.testing.assert_allclose(weighted, r.routed_out, rtol=0, atol=4e-7 * scale)
            rebuilt = weighted + r.shared_gate * r.shared_out.astype(np.float64)
            np.testing.assert_allclose(rebuilt, r.block_out, rtol=0, atol=4e-7 * scale)
            np.testing.assert_allclose(r.resid_post, r.resid_mid + r.block_out, rtol=0, atol=1e-6 * scale)


def test_records_hold_what_the_router_chose_ordered_by_score(tiny):
    model, tok = tiny
    k = model.args.num_experts_per_tok
    trace = Stepper(model, tok, PROMPT, record=True, keep_logits=True).run(4)
    for s in trace.steps:
        softmax = np.exp(s.logits.astype(np.float64) - s.logits.max())
        softmax /= softmax.sum()
        top = np.argsort(-softmax, kind="stable")[:5]
        assert [c.token_id for c in s.candidates] == top.tolist()
        np.testing.assert_allclose([c.prob for c in s.candidates], softmax[top], rtol=1e-5)
        assert sorted(s.layers) == sorted(model.moe_blocks())
        for r in s.layers.values():
            assert r.expert_out.shape == (k, model.args.hidden_size)
            assert np.all(np.diff(r.topk_scores) <= 0)
            assert np.array_equal(r.topk_scores, r.router_probs[r.topk_ids])
            assert set(r.topk_ids) == set(np.argsort(-r.router_probs, kind="stable")[:k])
            assert 0 < r.shared_gate < 1 and r.resid_post_norm > 0
        probs = [c.prob for c in s.candidates]
        assert len(probs) == 5 and probs == sorted(probs, reverse=True)
        if s.token_id is not None:  # greedy: the choice is the top candidate
            assert s.candidates[0].token_id == s.token_id and s.token_text == tok.decode([s.token_id])


def test_prefill_records_one_step_per_prompt_token(tiny):
    model, tok = tiny
    trace = Stepper(model, tok, PROMPT, record=True).run(3)
    prefill = trace.prefill
    assert [s.position for s in prefill] == list(range(len(PROMPT)))
    assert [s.input_id for s in prefill] == PROMPT
    assert [s.token_id is None for s in prefill] == [True] * (len(PROMPT) - 1) + [False]
    assert [s.position for s in trace.steps[len(PROMPT):]] == [len(PROMPT), len(PROMPT) + 1]
    assert len(trace.token_ids) == 3 and trace.decode_tps > 0
    for r in prefill[0].layers.values():
        assert not r.path.fused and "tokens" in r.path.reason


def test_dispatch_counters_count_each_token_once_despite_speculation(tiny):
    model, _ = tiny
    Stepper(model, None, PROMPT).run(7)
    stopper = Stepper(model, None, PROMPT, stop_ids=tuple(range(model.args.vocab_size)))
    stopper.run(5)  # every token is a stop token: only prefill runs, the speculative step is taken back
    assert len(stopper.trace.token_ids) == 1
    for counts in moebench.dispatch(model)["moe"].values():
        assert counts == {
            "fused": {"reference": 6}, "fallback": 2,
            "reasons": {f"{len(PROMPT)} tokens (the kernel runs single-token decode)": 2}, "notes": {},
        }


def test_changes_between_tokens_apply_to_the_next_token(tiny):
    """Flip the switch and set an intervention between steps: the pipelined stepper matches an
    unpipelined one bitwise, and the very next record shows the change."""
    model, _ = tiny
    last = max(model.moe_blocks())
    results = []
    for pipeline in (True, False):
        executor(model).reset_counts()
        stepper = Stepper(model, None, PROMPT, record=True, keep_logits=True, pipeline=pipeline)
        stepper.prefill()
        stepper.step()
        with fused_moe(False, model):
            off = stepper.step()
        set_interventions(model, {last: moebench.Intervention(force_experts=(0, 1))})
        forced = stepper.step()
        clear_interventions(model)
        stepper.record = False
        plain = stepper.step()
        stepper.close()
        assert off.layers[last].path.reason.startswith("switched off") and not off.fused_switch
        assert sorted(forced.layers[last].topk_ids) == [0, 1] and forced.layers[last].path.fused
        assert forced.interventions == {last: moebench.Intervention(force_experts=(0, 1))}
        assert plain.layers == {} and plain.interventions == {}
        dispatch = moebench.dispatch(model)
        results.append((stepper.trace.token_ids, all_logits(stepper.trace), dispatch))
    (tokens_a, logits_a, dispatch_a), (tokens_b, logits_b, dispatch_b) = results
    assert tokens_a == tokens_b and np.array_equal(logits_a, logits_b) and dispatch_a == dispatch_b


def test_teacher_forcing_feeds_the_given_token(tiny):
    model, _ = tiny
    stepper = Stepper(model, None, PROMPT)
    stepper.prefill()
    forced = stepper.step(feed=7)
    assert forced.input_id == 7
    reference = Stepper(model, None, PROMPT + [7]).run(2)
    assert forced.token_id == reference.token_ids[0]


def test_iteration_yields_prompt_then_generated_records_until_max_tokens(tiny):
    model, _ = tiny
    records = list(Stepper(model, None, PROMPT, max_tokens=4))
    assert [r.phase for r in records] == ["prefill"] * len(PROMPT) + ["decode"] * 3
    assert [r.index for r in records] == list(range(len(records)))


def test_a_recorder_passed_to_the_model_gets_its_internals_under_the_hook_names(tiny):
    model, _ = tiny
    rec = Recorder()
    logits = model(mx.array([PROMPT]), record=rec)
    mx.eval(logits, *rec.arrays())
    assert "layers.0.moe.topk_ids" in rec.values and rec.values["layers.0.moe.topk_ids"].shape[0] == len(PROMPT)
    assert rec.values["layers.1.resid_post"].shape == (1, len(PROMPT), model.args.hidden_size)
    assert np.array_equal(np.array(model(mx.array([PROMPT]))), np.array(logits))  # recording changes nothing


def test_bad_input_raises_moebench_errors(tiny):
    model, _ = tiny
    with pytest.raises(MoebenchError, match="empty"):
        Stepper(model, None, [])
    with pytest.raises(MoebenchError, match="tokenizer"):
        Stepper(model, None, "text")
    with pytest.raises(MoebenchError, match="vocabulary"):
        Stepper(model, None, [model.args.vocab_size])
    stepper = Stepper(model, None, PROMPT, max_tokens=1)
    with pytest.raises(MoebenchError, match="prefill"):
        stepper.step()
    stepper.prefill()
    with pytest.raises(MoebenchError, match="finished"):
        stepper.step()
    stepper = Stepper(model, None, PROMPT)
    stepper.prefill()
    with pytest.raises(MoebenchError, match="vocabulary"):
        stepper.step(feed=-1)
    stepper.close()


def test_chat_messages_are_a_prompt_and_the_text_leaves_control_tokens_out(tiny):
    model, tok = tiny
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    with pytest.warns(UserWarning, match="built-in ChatML"):
        stepper = Stepper(model, tok, messages, max_tokens=2)
        expected = tok.apply_chat_template(messages)
    assert stepper.trace.prompt_ids == expected
    trace = stepper.run(2)
    special = sorted(tok.special_ids)[0] if tok.special_ids else None
    assert trace.text == "".join(s.token_text for s in trace.generated if s.token_id != special)


def test_a_repetition_penalty_rolls_back_with_the_speculative_step(tiny):
    """The penalty sees every fed token; a step built ahead and rebuilt (teacher forcing) does not leave its
    token in the history: the pipelined stepper matches an unpipelined one."""
    model, _ = tiny
    sampling = Sampling(repetition_penalty=1.3)
    runs = []
    for pipeline in (True, False):
        stepper = Stepper(model, None, PROMPT, sampling=sampling, pipeline=pipeline, keep_logits=True)
        stepper.prefill()
        stepper.step()
        stepper.step(feed=9)  # the speculative step (fed the chosen token) is rolled back
        for _ in range(4):
            stepper.step()
        runs.append((stepper.trace.token_ids, all_logits(stepper.trace)))
    assert runs[0][0] == runs[1][0] and np.array_equal(runs[0][1], runs[1][1])


def test_generate_applies_the_repetition_penalty_as_the_stepper_does(tiny):
    model, _ = tiny
    sampling = Sampling(repetition_penalty=1.5, top_k=20)
    stepped = Stepper(model, None, PROMPT, sampling=sampling, pipeline=False, stop_ids=()).run(12).token_ids
    assert generate(model, PROMPT, 12, sampling).token_ids == stepped


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny Qwen3.5-MoE written by make-random: three Gated DeltaNet layers, then a gated full-attention one."""
    config = {**get_preset("qwen3.5-moe-tiny").config, "torch_dtype": "float32"}
    model, _ = moebench.load(write_random_checkpoint(tmp_path_factory.mktemp("hybrid") / "ckpt", config, seed=2))
    return model


def mixing(trace) -> list:
    """Every recorded token-mixing value of a trace, step by step and layer by layer."""
    return [(layer, r.mixer_kind, *(getattr(r, h) for h in MIXER_HOOKS))
            for s in trace.steps for layer, r in sorted(s.layers.items())]


def test_a_hybrid_layer_record_carries_its_kind_and_its_token_mixing(hybrid):
    trace = Stepper(hybrid, None, PROMPT, record=True).run(3)
    for s in trace.steps:
        kinds = [s.layers[i].mixer_kind for i in range(4)]
        assert kinds == [layer.layer_type for layer in hybrid.layers] == ["linear_attention"] * 3 + ["full_attention"]
        linear, full = s.layers[0], s.layers[3]
        assert linear.decay.shape == linear.beta.shape == linear.output_gate_means.shape == (4,)
        assert np.all((linear.decay > 0) & (linear.decay < 1)) and np.all((linear.beta > 0) & (linear.beta < 1))
        assert np.allclose(linear.output_gate_means, linear.output_gate.mean(axis=-1))
        assert full.decay is None and full.beta is None and full.state_norm is None
        assert full.output_gate.shape == (4, 32) and np.all((full.output_gate > 0) & (full.output_gate < 1))
    # one delta state per forward call: the prompt's last position has its norm, the positions before it none
    assert [s.layers[0].state_norm is None for s in trace.prefill] == [True] * (len(PROMPT) - 1) + [False]
    assert all(s.layers[0].state_norm.shape == (4,) for s in trace.generated)


def test_a_rebuilt_speculative_step_records_the_token_mixing_of_the_token_fed(hybrid):
    """Teacher forcing rolls back the step built ahead (its states written into the cache): the records equal an
    unpipelined decode's."""
    runs = []
    for pipeline in (True, False):
        stepper = Stepper(hybrid, None, PROMPT, record=True, pipeline=pipeline)
        stepper.prefill()
        stepper.step()
        stepper.step(feed=9)
        stepper.step()
        runs.append(mixing(stepper.trace))
    for a, b in zip(*runs, strict=True):
        assert a[:2] == b[:2]
        assert all((x is None and y is None) or np.array_equal(x, y) for x, y in zip(a[2:], b[2:], strict=True))


def test_a_family_without_linear_layers_records_no_token_mixing(tiny):
    model, _ = tiny
    trace = Stepper(model, None, PROMPT, record=True).run(2)
    assert all(v is None for _, kind, *values in mixing(trace) for v in (kind, *values))
