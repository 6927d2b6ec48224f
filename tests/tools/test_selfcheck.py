"""moebench selfcheck: honest platform report, parity table, dispatch and greedy checks, exit codes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import pytest

import moebench
from moebench.cli import main
from moebench.execution import attention as attention_kernel
from moebench.execution import linear_attention
from moebench.execution import moe as fused_kernel
from moebench.execution import rows as rows_kernel
from moebench.execution.linear_attention import GatedDeltaWeights
from moebench.tools import selfcheck
from moebench.tools.presets import write_random
from moebench.tools.text_table import WIDTH

ARGS = ["--prompt-tokens", "3", "--gen-tokens", "4", "--repeats", "1", "--no-progress"]


def words(text: str) -> str:
    """The report as one line of words: phrases match wherever its lines wrap."""
    return " ".join(text.split())


@pytest.fixture(autouse=True)
def small_reference_shape(monkeypatch):
    """The A2.7B expert shapes cost ~20 s of CPU per run: unit tests check behaviour at a small shape."""
    monkeypatch.setattr(selfcheck, "A27B_SHAPE", ("small experts", 128, 256, 2))
    monkeypatch.setattr(selfcheck, "A27B_SHARED", 192)


def test_selfcheck_passes_and_reports_the_reference_backend_honestly(quantized_checkpoint, tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["selfcheck", str(quantized_checkpoint), "--json", str(out), *ARGS]) == 0
    text = capsys.readouterr().out
    assert max(map(len, text.splitlines())) <= WIDTH  # every table and line fits a terminal of 100 columns
    text = words(text)
    assert "fused backend 'reference'" in text and "no GPU kernel was tested" in text
    assert "parity class" in text and text.rsplit(" PASS ", 1)[-1].startswith("(")
    record = json.loads(out.read_text())
    assert record["schema"] == "moebench.tools.selfcheck/1" and record["passed"] and record["failures"] == []
    assert record["platform"]["backend"] == "reference" and record["platform"]["mlx"] == mx.__version__
    ran = [r for r in record["parity"] if r["status"] == "ran"]
    combos = {(r["case"], r["mode"], r["bits"], r["group_size"]) for r in ran}
    # every supported affine bits / group-size combination and each microscaled mode at both shapes, the model's
    # own experts, the shared expert
    # (every pair of affine widths at group 64, each width at 32 and 128, the microscaled modes)
    assert len(combos) == 2 * (6 * 6 + 2 * 6 + 3) + 1 + 1 + 5  # and gpt-oss's biased, clamped experts in each format
    assert {(r["mode"], r["bits"], r["group_size"]) for r in ran if r["mode"] != "affine"} == {
        ("mxfp4", "4/4/4", 32), ("nvfp4", "4/4/4", 16), ("mxfp8", "8/8/8", 32)}
    assert "| mxfp4 4/4/4 | 32 |" in text and "| nvfp4 4/4/4 | 16 |" in text and "| mxfp8 8/8/8 | 32 |" in text
    assert "small experts + shared expert Dffs 192" in {r["case"] for r in ran}
    assert [r["status"] for r in record["router"]] == ["not applicable"] * len(selfcheck.ROUTER_CASES)
    assert [r["status"] for r in record["rows"]] == ["not applicable"] * len(selfcheck.ROWS_CASES)
    assert {r["status"] for r in record["attention"]} == {"not applicable"} and record["attention"]
    for r in ran:
        assert r["fused_nrms"] < selfcheck.FUSED_NRMS and r["deterministic"] and r["vs_reference_nrms"] is None
    dec = record["decode"]
    assert dec["dispatch"]["passed"] and dec["dispatch"]["fused"] == {"reference": 2 * 3}
    assert dec["dispatch"]["attention_passed"] and dec["dispatch"]["attention"]["fused"] == {"reference": 2 * 3}
    assert dec["greedy"]["parity_class"] == "byte-identical" or dec["greedy"]["margin"] <= selfcheck.CLEAR_DIVERGENCE
    assert set(dec["speed"]["off_tps"]) >= {"median", "min", "max"}


def test_the_model_shape_is_checked_once_when_it_is_the_reference_shape(quantized_checkpoint, monkeypatch):
    monkeypatch.setattr(selfcheck, "A27B_SHAPE", ("same as the model", 128, 128, 2))  # the tiny model's D, Dff, K
    record = selfcheck.selfcheck(quantized_checkpoint, prompt_tokens=2, gen_tokens=2, repeats=1, progress=False)
    assert {r["case"] for r in record["parity"]} == {
        "same as the model D128 Dff128 K2", "model layer 0 experts", "same as the model + shared expert Dffs 192",
        "same as the model + biases + clamped SwiGLU (limit 1, alpha 1.702)"}
    assert len(record["parity"]) == 6 * 6 + 2 * 6 + 3 + 1 + 1 + 5 and record["passed"]


def test_selfcheck_exits_nonzero_when_the_kernel_is_wrong(quantized_checkpoint, tmp_path, monkeypatch, capsys):
    real = fused_kernel.routed

    def off_by_one_percent(*args, **kwargs):
        out, y, ys = real(*args, **kwargs)
        return out * 1.01, y * 1.01, ys

    monkeypatch.setattr(fused_kernel, "routed", off_by_one_percent)
    out = tmp_path / "s.json"
    assert main(["selfcheck", str(quantized_checkpoint), "--json", str(out), *ARGS]) == 1
    assert "FAIL" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert not record["passed"] and any(f.startswith("parity") for f in record["failures"])
    assert all(not r["passed"] for r in record["parity"] if r["status"] == "ran")
    assert record["parity"][0]["fused_nrms"] == pytest.approx(1e-2, rel=0.05)


def test_selfcheck_fails_when_the_kernel_never_dispatches(make_checkpoint, capsys):
    folder = make_checkpoint("float")  # float experts: the fused kernel declines every layer
    assert main(["selfcheck", str(folder), *ARGS]) == 1
    text = capsys.readouterr().out
    assert "declined: float experts" in words(text) and "FAIL: dispatch" in words(text).rsplit("decode of", 1)[-1]


def test_selfcheck_fails_when_the_fused_decode_cannot_run(quantized_checkpoint, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel did not build")

    monkeypatch.setattr(fused_kernel, "routed", broken)  # the parity checks' pair
    monkeypatch.setattr(fused_kernel, "routed_by_router", broken)  # the decode's selection and pair
    assert main(["selfcheck", str(quantized_checkpoint), *ARGS]) == 1
    text = words(capsys.readouterr().out)
    assert "error: RuntimeError: kernel did not build" in text
    assert "decode: FAIL: moebench fused (reference): warm-up failed: RuntimeError: kernel did not build" in text


def test_selfcheck_names_a_missing_model(tmp_path, capsys):
    assert main(["selfcheck", str(tmp_path / "nowhere"), *ARGS]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_bitwise_equality():
    a = mx.array([0.0, 1.5], dtype=mx.bfloat16)
    assert selfcheck.same_bits(a, mx.array([0.0, 1.5], dtype=mx.bfloat16))
    assert not selfcheck.same_bits(a, mx.array([-0.0, 1.5], dtype=mx.bfloat16))  # equal values, other bits
    assert not selfcheck.same_bits(a, a.astype(mx.float32))


def _case_inputs(d=128, f=256, k=2, bits=4, gs=64):
    keys = mx.random.split(mx.random.key(1), 4)
    parts = [selfcheck.random_parts(key, k + 1, out_f, in_f, bits, gs, mx.float32)
             for key, out_f, in_f in ((keys[0], f, d), (keys[1], f, d), (keys[2], d, f))]
    x = mx.random.normal((d,), key=keys[3])
    return x, mx.array([2, 0], dtype=mx.uint32), mx.array([0.6, 0.3]), parts


def test_a_gpu_backend_that_cannot_run_here_is_a_failed_row():
    x, idx, scores, parts = _case_inputs()
    row = selfcheck.parity_case("metal", "case", x, idx, scores, *parts)
    assert row["status"] == "error" and not row["passed"] and "metal" in row["reason"]


def test_a_gpu_backend_is_compared_with_the_cpu_reference(monkeypatch):
    real = fused_kernel.routed
    seen = []

    def as_if_cuda(backend, *args, **kwargs):
        seen.append(backend)
        return real("reference", *args, **kwargs)

    monkeypatch.setattr(fused_kernel, "routed", as_if_cuda)
    x, idx, scores, parts = _case_inputs()
    row = selfcheck.parity_case("cuda", "case", x, idx, scores, *parts)
    assert row["passed"] and row["vs_reference_nrms"] == 0.0
    assert seen == ["cuda"] * selfcheck.determinism_runs("cuda") + ["reference"]


@pytest.mark.parametrize("error,passes", [(0.0, True), (1e-3, False)])
def test_a_gpu_router_kernel_is_compared_with_the_cpu_reference(monkeypatch, error, passes):
    def as_if_cuda(backend, logits, *args):
        probs, inds, scores, gate = fused_kernel.reference_select(logits, *args)
        return probs + error, inds, scores, gate

    monkeypatch.setattr(fused_kernel, "select", as_if_cuda)
    rows = selfcheck.router_parity("cuda", mx.float32)
    assert len(rows) == len(selfcheck.ROUTER_CASES) and all(r["status"] == "ran" for r in rows)
    assert all(r["passed"] == passes and r["same_experts"] for r in rows)


@pytest.mark.parametrize("error,passes", [(0.0, True), (2.0**-5, False)])
def test_a_gpu_rows_kernel_is_compared_with_the_unfused_ops(monkeypatch, error, passes):
    """A kernel whose outputs are within a unit of the last place passes; one further off fails."""
    def as_if_cuda(backend, x, linear, norm=None, residual=None):
        xn, y = rows_kernel.reference_linear(x, linear, norm, residual)
        return xn, y * (1 + error)

    monkeypatch.setattr(rows_kernel, "linear", as_if_cuda)
    rows = selfcheck.rows_parity("cuda", mx.bfloat16)
    assert len(rows) == len(selfcheck.ROWS_CASES) and all(r["status"] == "ran" for r in rows)
    assert all(r["passed"] == passes for r in rows)
    assert {r["case"].split(",")[0] for r in rows} == {"norm + router logits", "o_proj + residual"}


# (output error, slot the emulated in-place write lands on past the token's, whether the rows pass)
@pytest.mark.parametrize("error,shift,passes", [(0.0, 0, True), (1e-2, 0, False), (0.0, 1, False)])
def test_a_gpu_attention_kernel_is_compared_with_the_reference_and_the_truth(quantized_checkpoint, monkeypatch, error,
                                                                             shift, passes):
    def as_if_cuda(backend, qkv, bias, inv_freq, slots, keys, values, heads, block, write=False, qk_norm=None,
                   sinks=None, rope_scale=1.0, counter=None):
        out, k, v = attention_kernel.reference_decode_attention(qkv, bias, inv_freq, slots, keys, values, heads,
                                                                 block, qk_norm, sinks, rope_scale)
        if write:  # as the kernel stores them, into the caller's arrays
            keys[block, :, slots[0].item() + shift] = k[0, :, 0]
            values[block, :, slots[0].item() + shift] = v[0, :, 0]
        return out * (1 + error), k, v

    monkeypatch.setattr(attention_kernel, "gpu_decode_attention", as_if_cuda)
    rows = selfcheck.attention_parity("cuda", moebench.load(quantized_checkpoint)[0])
    assert len(rows) == 3 * len(selfcheck.ATTENTION_CASES) and all(r["status"] == "ran" for r in rows)
    assert sum("q/k norm" in r["case"] for r in rows) == len(selfcheck.ATTENTION_CASES)  # Qwen3-30B-A3B's geometry
    assert any("16 threadgroups a key/value head" in r["case"] for r in rows)
    assert all(r["passed"] == passes for r in rows)
    assert all(r["out_nrms"] == pytest.approx(max(error, r["reference_nrms"]), rel=0.2) for r in rows)


def test_the_shared_expert_case_fails_when_the_kernel_drops_the_shared_term(monkeypatch):
    real = fused_kernel.routed

    def without_shared(backend, x, indices, scores, gate, up, down, shared=None, residual=None):
        return real("reference", x, indices, scores, gate, up, down)

    monkeypatch.setattr(fused_kernel, "routed", without_shared)
    row = selfcheck.shared_expert_parity("reference", mx.float32)
    assert row["status"] == "ran" and not row["passed"] and row["fused_nrms"] > selfcheck.FUSED_NRMS


def test_selfcheck_reads_every_weight_and_fails_on_a_nan(quantized_checkpoint, monkeypatch, capsys):
    """Load samples large float matrices for NaN/Inf; selfcheck reads every value, and a NaN anywhere fails it."""
    real = selfcheck.load

    def load_with_a_nan(path):
        model, tok = real(path)
        proj = model.layers[0].self_attn.o_proj
        proj.scales = mx.where(mx.arange(proj.scales.size).reshape(proj.scales.shape) == 7, mx.nan, proj.scales)
        return model, tok

    monkeypatch.setattr(selfcheck, "load", load_with_a_nan)
    assert main(["selfcheck", str(quantized_checkpoint), *ARGS]) == 1
    out = words(capsys.readouterr().out)
    assert "weights: NaN or Inf in model.layers.0.self_attn.o_proj" in out and "FAIL" in out


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory) -> Path:
    """Read-only: `moebench make-random DIR --preset gpt-oss-tiny --dtype float32`'s folder (a 4-position window
    on layer 0, sinks and YaRN on both layers, mxfp4 experts)."""
    return write_random(tmp_path_factory.mktemp("gpt-oss") / "ckpt", "gpt-oss-tiny", dtype="float32", seed=3,
                        progress=False)


def test_selfcheck_checks_a_hybrids_gated_delta_kernel_and_counts_its_linear_layers(tiny_hybrids, tmp_path,
                                                                                    capsys):
    out = tmp_path / "s.json"
    assert main(["selfcheck", str(tiny_hybrids["qwen3-next-tiny"]), "--json", str(out), *ARGS]) == 0
    text = words(capsys.readouterr().out)
    record = json.loads(out.read_text())
    assert record["passed"] and record["failures"] == []
    [row] = record["gated_delta"]  # float32 model: one dtype
    assert row["case"].startswith("model layer 0 gated delta step: 2 key heads of 32, 4 value heads of 32")
    assert row["status"] == "ran" and row["backend"] == "reference" and row["dtype"] == "float32" and row["passed"]
    assert max(row["out_nrms"], row["state_nrms"]) < selfcheck.GATED_DELTA_F32 and row["vs_reference_nrms"] is None
    assert row["conv_exact"] and row["deterministic"]
    assert "gated delta step kernel vs the float64 truth" in text and "float32 [reference]: output nRMS" in text
    gated = [r for r in record["attention"] if "output gate" in r["case"]]  # the full-attention layer's declaration
    assert len(gated) == len(selfcheck.ATTENTION_CASES) and "rotary on 8 of 32 dims" in gated[0]["case"]
    d = record["decode"]["dispatch"]
    assert d["mixers"] == {"Gated DeltaNet linear attention": 3, "attention": 1}
    assert d["attention_passed"] and d["attention"]["fused"] == {"reference": 4 * 3}  # every layer, 3 decode steps
    assert "4 layers: 3 Gated DeltaNet linear attention, 1 attention; x 3 decode steps" in text


def test_selfcheck_checks_gpt_oss_attention_variants(tiny_gpt_oss, tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["selfcheck", str(tiny_gpt_oss), "--json", str(out), *ARGS]) == 0
    record = json.loads(out.read_text())
    assert record["passed"] and record["gated_delta"] == []
    windowed = [r["case"] for r in record["attention"] if "window 4" in r["case"]]
    assert all("+ bias + window 4 + sinks + scaled rotary (factor 1.347)" in c for c in windowed)
    assert {c.split(" at ")[1] for c in windowed} >= {"position 3 of 256 (1 threadgroups a key/value head)",
                                                       "position 4 of 256 (1 threadgroups a key/value head)",
                                                       "position 4000 of 4352 (1 threadgroups a key/value head)"}
    assert "attention dispatch: 6 fused (2 layers: 2 attention; x 3 decode steps)" in capsys.readouterr().out


@pytest.mark.parametrize("error,passes", [(0.0, True), (1e-2, False)])
def test_a_gpu_attention_kernel_with_variants_is_compared_with_the_reference_and_the_truth(tiny_gpt_oss, tiny_hybrids,
                                                                                            monkeypatch, error,
                                                                                            passes):
    seen = []

    def as_if_cuda(backend, qkv, bias, inv_freq, slots, keys, values, heads, block, write=False, qk_norm=None,
                   sinks=None, rope_scale=1.0, counter=None):
        seen.append((heads, sinks is not None, rope_scale))
        out, k, v = attention_kernel.reference_decode_attention(qkv, bias, inv_freq, slots, keys, values, heads,
                                                                 block, qk_norm, sinks, rope_scale)
        if write:
            keys[block, :, slots[0].item()] = k[0, :, 0]
            values[block, :, slots[0].item()] = v[0, :, 0]
        return out * (1 + error), k, v

    monkeypatch.setattr(attention_kernel, "gpu_decode_attention", as_if_cuda)
    for folder in (tiny_gpt_oss, tiny_hybrids["qwen3-next-tiny"]):
        rows = selfcheck.attention_parity("cuda", moebench.load(folder)[0])
        assert all(r["status"] == "ran" and r["passed"] == passes and r["dtype"] == "float32" for r in rows)
        # the truth of every variant (gate and window included); float32 angles of position 4000 cost ~3e-5
        assert all(r["reference_nrms"] < 1e-4 for r in rows)
    declared = {(h.window, h.output_gate, has_sinks, scale != 1.0) for h, has_sinks, scale in seen}
    assert {(4, False, True, True), (None, False, True, True), (None, True, False, False)} <= declared


# (dtype, kernel vs truth, reference vs truth, kernel vs reference, in-place write exact, whether the row passes)
@pytest.mark.parametrize("dtype,out,reference,vs_reference,written,passes", [
    (mx.float32, 3e-4, 1e-6, 3e-4, True, True),
    (mx.float32, 6e-4, 1e-6, 3e-4, True, False),  # far from the truth
    (mx.float32, 3e-4, 1e-6, 6e-4, True, False),  # far from the reference
    (mx.bfloat16, 5e-3, 4e-3, 3e-4, True, True),  # as near the truth as the reference rounding in bfloat16
    (mx.bfloat16, 8e-3, 4e-3, 3e-4, True, False),  # farther from the truth than the reference is
    (mx.bfloat16, 5e-3, 4e-3, 2e-3, True, False),  # the gate's sigmoid rounded otherwise than the reference's
    (mx.bfloat16, 5e-3, 4e-3, 3e-4, False, False)], ids=str)
def test_an_attention_row_passes_near_the_reference_and_as_near_the_truth(dtype, out, reference, vs_reference,
                                                                          written, passes):
    row = {"out_nrms": out, "reference_nrms": reference, "vs_reference_nrms": vs_reference, "in_place_write": written}
    assert selfcheck.attention_passed(row, dtype) == passes


def _broken(real, error):
    def step(backend, *args):
        out, conv, state = real(backend, *args)
        return out * (1 + error), conv, state

    return step


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
@pytest.mark.parametrize("error,passes", [(0.0, True), (5e-2, False)])
def test_a_gpu_gated_delta_kernel_is_compared_with_the_reference_and_the_truth(tiny_hybrids, monkeypatch, dtype,
                                                                               error, passes):
    """The GPU kernel simulated by the reference, off by `error` (float32's bounds, then the rounded dtypes')."""
    model = moebench.load(tiny_hybrids["qwen3.5-moe-tiny"])[0]
    real = linear_attention.gated_delta_step
    monkeypatch.setattr(linear_attention, "gpu_gated_delta",
                        lambda backend, *args: _broken(real, error)("reference", *args))
    net = model.layers[0].mixer
    row = selfcheck.gated_delta_case("cuda", "case", net.spec, GatedDeltaWeights.of(net.parts()), dtype, seed=0)
    assert row["status"] == "ran" and row["passed"] == passes and row["dtype"] == str(dtype).split(".")[-1]
    assert row["vs_reference_nrms"] == pytest.approx(error, rel=0.2)  # bfloat16 rounds the 5% error


def test_selfcheck_fails_when_the_gated_delta_step_is_wrong(tiny_hybrids, monkeypatch, capsys):
    monkeypatch.setattr(linear_attention, "gated_delta_step", _broken(linear_attention.gated_delta_step, 1e-2))
    assert main(["selfcheck", str(tiny_hybrids["qwen3-next-tiny"]), *ARGS]) == 1
    text = words(capsys.readouterr().out)
    assert "float32 [reference]: output nRMS 1.00e-02" in text and ": FAIL" in text
    assert "parity model layer 0 gated delta step" in text.splitlines()[-1]


def test_selfcheck_shows_its_progress_before_the_first_check_and_counts_every_check(quantized_checkpoint,
                                                                                   monkeypatch, capsys):
    """selfcheck ran 45-70 s before its first line: its bar is on stderr before the model loads, and counts each
    check as it is done (where stderr is no terminal, drawn at its start and end)."""
    real, seen = selfcheck.load, []

    def load(path):
        seen.append(capsys.readouterr().err)
        return real(path)

    monkeypatch.setattr(selfcheck, "load", load)
    record = selfcheck.selfcheck(quantized_checkpoint, prompt_tokens=2, gen_tokens=2, repeats=1)
    assert seen[0].strip().startswith("selfcheck: 0")
    counts = re.findall(r"selfcheck: (\d+)", capsys.readouterr().err)
    checks = 1 + sum(len(record[k]) for k in ("parity", "router", "rows", "attention", "gated_delta"))
    assert int(counts[-1]) == checks
