"""moebench profile: exact primitive counts from the dot export, per-arm timings and MoE path, CLI and JSON."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from moebench.checkpoint.loader import load
from moebench.cli import main
from moebench.errors import DeviceMemoryError, MoebenchError
from moebench.execution.executor import fused_moe_enabled
from moebench.execution.kernel import available_backend
from moebench.tools import profile
from moebench.tools.profile import ProfileArm, count_primitives, graph_nodes, moebench_profile_arms, run_profile

FAST = ["--prompt-tokens", "8", "--steps", "2", "--gen-tokens", "4", "--warmup", "1"]
ARM_KEYS = {"name", "engine", "fused", "build_ms", "eval_ms", "sync_ms", "graph", "dispatch", "launches",
            "pipelined_ms_per_token", "pipelined_decode_tps"}
SWITCHED_OFF = ("attention by MLX ops: switched off (MOEBENCH_FUSED_MOE / set_fused_moe); MoE block by MLX ops: "
                "switched off (MOEBENCH_FUSED_MOE / set_fused_moe)")


@pytest.fixture(scope="module")
def shipped():
    model, _ = load()
    return model


def test_node_counts_of_a_tiny_graph_are_exact():
    g = graph_nodes(mx.exp(mx.array([1.0]) + 1))  # the scalar 1 is broadcast to the array's shape first
    assert g == {"total": 3, "by_primitive": {"Add": 1, "Broadcast": 1, "Exp": 1}, "error": None}


def test_arrays_are_not_nodes_and_a_multi_output_primitive_counts_once():
    a, b = mx.split(mx.arange(4.0) * 2, 2)
    g = graph_nodes(a, b)
    assert g["by_primitive"] == {"Arange": 1, "Broadcast": 1, "Multiply": 1, "Split": 1} and g["total"] == 4
    dot = 'digraph {\n{ rank=source; "A"; }\n{ 7 [label ="Exp", shape=rectangle]; }\n"A" -> 7\n{ rank=sink; "B"; }\n}'
    assert count_primitives(dot) == {"Exp": 1}


def test_an_export_that_raises_is_reported_not_raised(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no dot for CustomKernel")

    monkeypatch.setattr(mx, "export_to_dot", broken)
    assert graph_nodes(mx.array([1.0]) + 1) == {"total": None, "by_primitive": {},
                                               "error": "RuntimeError: no dot for CustomKernel"}


def test_profile_of_the_shipped_model_times_both_paths_and_counts_nodes(shipped):
    before = fused_moe_enabled()
    arms = moebench_profile_arms(shipped, "both")
    records, failures = run_profile(arms, list(range(1, 9)), steps=2, gen_tokens=4, warmup=1)
    assert failures == [] and fused_moe_enabled() == before
    fused, fallback = records
    assert fused["name"] == f"moebench fused ({available_backend()})" and fallback["name"] == "moebench fallback"
    assert fused["dispatch"]["path"] == available_backend() and fused["dispatch"]["reasons"] == []
    assert fallback["dispatch"]["path"] == "fallback" and fallback["dispatch"]["layers"] == 4
    assert fused["dispatch"]["attention"] == {"path": available_backend(), "reasons": [], "layers": 4}
    assert fallback["dispatch"]["attention"]["path"] == "fallback"
    # the plan's GPU path: a Qwen2-MoE layer's 10 launches over the eager step's KVCache; the fallback declares none
    assert fused["launches"] == {"per_layer": 10, "not_declared": {}}
    assert fallback["launches"] == {"per_layer": None, "not_declared": {SWITCHED_OFF: 4}}
    for r in records:
        assert set(r) == ARM_KEYS
        assert r["build_ms"]["median"] > 0 and r["eval_ms"]["median"] > 0 and len(r["eval_ms"]["values"]) == 2
        assert r["sync_ms"]["min"] >= r["build_ms"]["min"] + r["eval_ms"]["min"] - 1e-9
        assert r["pipelined_ms_per_token"] > 0
        g = r["graph"]
        assert g["error"] is None and g["layers"] == 4 and g["per_layer"] == g["total"] / 4 > 0
        assert sum(g["by_primitive"].values()) == g["total"]
        assert list(g["by_primitive"].values()) == sorted(g["by_primitive"].values(), reverse=True)
    assert fallback["graph"]["by_primitive"].get("GatherQMM", 0) > 0  # gather_qmm runs the fallback's experts


def test_profile_through_the_compiled_step_times_the_step_the_plan_fuses(shipped):
    """--compiled on profiles moebench's arms through the compiled decode step: named as such, its dispatch the
    fused plan's, its pipelined time measured."""
    (arm,) = moebench_profile_arms(shipped, "on", "on")
    records, failures = run_profile([arm], list(range(1, 9)), steps=2, gen_tokens=4, warmup=1)
    assert failures == []
    (record,) = records
    assert record["name"] == f"moebench fused ({available_backend()}) compiled"
    assert record["dispatch"]["path"] == available_backend() and record["dispatch"]["reasons"] == []
    assert record["pipelined_ms_per_token"] > 0 and record["build_ms"]["median"] > 0
    assert record["launches"] == {"per_layer": 8, "not_declared": {}}  # its static cache written by the kernel


@pytest.mark.parametrize("compiled", ["off", "on"])
def test_profile_of_a_hybrid_runs_its_linear_attention_layers_eager_and_compiled(tiny_hybrids, compiled):
    """The default eager arms over the decode loop's caches (a hybrid's Gated DeltaNet layers carry their recurrent
    state), and the compiled step: every arm profiles, its token mixing fused on every layer."""
    for folder in tiny_hybrids.values():
        model, _ = load(folder)
        records, failures = run_profile(moebench_profile_arms(model, "both", compiled), list(range(1, 9)), steps=2,
                                        gen_tokens=4, warmup=1)
        assert failures == [] and len(records) == 2
        fused = records[0]
        assert fused["dispatch"]["attention"] == {"path": available_backend(), "reasons": [], "layers": 4}
        assert fused["graph"]["error"] is None and fused["pipelined_ms_per_token"] > 0


def test_a_named_condition_fails_its_arm_and_anything_else_raises(shipped, monkeypatch):
    """A MoebenchError (a backend or memory this machine lacks) is reported as the arm's failure; any other
    exception is a bug and raises, never a 'failed' arm."""
    arms = [ProfileArm("x", "moebench", shipped, False)]

    def out_of_memory(*args, **kwargs):
        raise DeviceMemoryError("a decode needs more than the device has")

    monkeypatch.setattr(profile, "profile_arm", out_of_memory)
    assert run_profile(arms, [1, 2], 1, 2, 0) == ([], [{"arm": "x", "reason": "DeviceMemoryError: a decode needs "
                                                                               "more than the device has"}])

    def broken(*args, **kwargs):
        raise AttributeError("'KVCache' object has no attribute 'conv'")

    monkeypatch.setattr(profile, "profile_arm", broken)
    with pytest.raises(AttributeError, match="conv"):
        run_profile(arms, [1, 2], 1, 2, 0)


def test_bad_settings_are_errors(shipped):
    arms = [ProfileArm("x", "moebench", shipped, False)]
    for steps, gen_tokens, warmup in ((0, 4, 1), (1, 1, 1), (1, 4, -1)):
        with pytest.raises(MoebenchError):
            run_profile(arms, [1, 2], steps, gen_tokens, warmup)


def test_cli_prints_the_table_and_writes_the_record(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["profile", *FAST, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for row in ("build ms", "eval ms", "sync ms/token", "pipelined ms/token", "graph nodes/token", "nodes/layer",
                "| launches/layer (plan, GPU path) | 10.0", "primitive", "moebench fallback",
                "launches not declared for moebench fallback: 4 layers: attention by MLX ops: switched off"):
        assert row in text
    record = json.loads(out.read_text())
    assert set(record) == {"schema", "date", "arguments", "platform", "model", "prompt_tokens", "steps", "warmup",
                           "gen_tokens", "prompt_ids", "arms", "skipped"}
    assert record["schema"] == profile.SCHEMA and record["steps"] == 2 and len(record["prompt_ids"]) == 8
    assert [a["name"] for a in record["arms"]] == [f"moebench fused ({available_backend()})", "moebench fallback"]
    assert all(set(a) == ARM_KEYS for a in record["arms"]) and record["skipped"] == []


def test_cli_compare_mlx_lm_adds_its_model(tmp_path, capsys):
    pytest.importorskip("mlx_lm")
    out = tmp_path / "profile.json"
    assert main(["profile", *FAST, "--compiled", "both", "--compare", "mlx-lm", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mlx-lm model" in text
    tables = [line for line in text.splitlines() if line.startswith("|")]  # five arms side by side did not fit
    assert tables and max(map(len, tables)) <= 100
    arms = {a["name"]: a for a in json.loads(out.read_text())["arms"]}
    assert list(arms)[-1] == "mlx-lm model" and len(arms) == 5
    other = arms["mlx-lm model"]
    assert other["engine"] == "mlx-lm" and other["dispatch"] is None and other["launches"] is None
    assert other["fused"] is None
    assert other["graph"]["per_layer"] > 0 and other["build_ms"]["median"] > 0 and other["pipelined_ms_per_token"] > 0
