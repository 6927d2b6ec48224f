"""moebench bench: same token trace for every arm, interleaved repeats, table and JSON, mlx-lm arms."""

from __future__ import annotations

import gc
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from moebench.checkpoint.loader import default_model_path, load
from moebench.cli import main
from moebench.decode.loop import STEPS_AHEAD
from moebench.tools import bench
from moebench.tools.bench import (
    Arm,
    ArmResult,
    Run,
    arm_record,
    bench_record,
    compare_traces,
    length_record,
    mlx_lm_arms,
    model_bytes,
    run_arms,
    summary,
)
from moebench.tools.bench_table import format_table
from moebench.units import byte_size

STAT_KEYS = {"mean", "sd", "median", "min", "max", "values"}


def spy_arm(name: str, calls: list, tokens: list[int]) -> Arm:
    """An arm that records what it was asked to decode and emits fixed tokens with one-hot logits."""

    def stream(ids, n):
        calls.append((name, list(ids), n))
        for t in tokens[:n]:
            yield t, mx.eye(8)[t] * 3.0

    return Arm(name, "test", "test", "none", "float32", stream)


def test_every_arm_gets_the_same_prompt_and_repeats_interleave_with_rotating_order():
    calls = []
    arms = [spy_arm(n, calls, [1, 2, 3, 4]) for n in ("a", "b", "c")]
    results, failures = run_arms(arms, [5, 6, 7], gen_tokens=4, repeats=3, progress=False)
    assert failures == []
    assert [c[0] for c in calls] == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {(tuple(ids), n) for _, ids, n in calls} == {((5, 6, 7), 4)}
    for r in results:
        assert len(r.runs) == 3 and r.trace.logits is not None and all(run.logits is None for run in r.runs)
        assert r.trace.token_ids == [1, 2, 3, 4] and r.deterministic


def test_an_arm_that_fails_is_reported_and_the_others_still_run():
    calls = []

    def broken(ids, n):
        raise RuntimeError("no CUDA back-end")
        yield

    arms = [spy_arm("a", calls, [1, 2]), Arm("gpu", "test", "test", "cuda", "bfloat16", broken)]
    results, failures = run_arms(arms, [3], gen_tokens=2, repeats=2, progress=False)
    assert [r.arm.name for r in results] == ["a"] and len(results[0].runs) == 2
    assert failures == [{"arm": "gpu", "reason": "warm-up failed: RuntimeError: no CUDA back-end"}]


def test_run_timing_fields():
    run = Run(list(range(8)), [1, 2, 3, 4, 5], prompt_seconds=0.5, decode_seconds=2.0, peak_bytes=10, start_bytes=4)
    assert run.prompt_tps == 16.0 and run.decode_tps == 2.0  # tokens after the first, over the time after it
    assert run.working_bytes == 6
    s = summary([1.0, 2.0, 6.0])
    assert s["mean"] == 3.0 and s["median"] == 2.0 and (s["min"], s["max"]) == (1.0, 6.0)
    assert s["sd"] == pytest.approx(np.std([1, 2, 6], ddof=1))


def test_compare_traces_reports_first_divergence_and_reference_margin():
    logits = [np.array([0.0, 5.0, 4.9]), np.array([2.0, 1.0, 0.5]), np.array([0.0, 3.0, 2.5])]
    ref = Run([7], [1, 0, 1], logits=logits)
    same = Run([7], [1, 0, 1], logits=logits)
    assert compare_traces(ref, same) == {"identical": True, "first_divergence": None, "margin": None}
    other = Run([7], [1, 0, 2], logits=[*logits[:2], np.array([0.0, 2.9, 3.0])])
    diff = compare_traces(ref, other)
    assert diff["first_divergence"] == 2 and (diff["reference_token"], diff["token"]) == (1, 2)
    assert diff["margin"] == pytest.approx(0.5) and diff["own_margin"] == pytest.approx(0.1)


def test_bench_cli_on_a_quantized_checkpoint(quantized_checkpoint, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", str(quantized_checkpoint), "--prompt-tokens", "3", "--gen-tokens", "4", "--repeats", "1",
               "--fused", "both", "--compiled", "off", "--compare", "mlx-lm", "--json", str(out), "--no-progress"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "| arm " in table and "| decode tok/s " in table and "| vs baseline |" in table
    assert "baseline: moebench fallback;" in table and "vs ref" not in table
    assert max(map(len, table.splitlines())) <= 100
    record = json.loads(out.read_text())
    assert record["schema"] == "moebench.tools.bench/2" and record["prompt_tokens"] == [3]
    assert record["platform"]["mlx"] == mx.__version__ and record["platform"]["backend"] == "reference"
    (length,) = record["lengths"]
    assert length["reference_arm"] == "moebench fallback" and length["skipped"] == []
    assert len(length["prompt_ids"]) == length["prompt_tokens"] == 3 and record["gen_tokens"] == 4
    names = [a["name"] for a in length["arms"]]
    assert names == ["moebench fallback", "moebench fused (reference)", "mlx-lm stream_generate",
                     "mlx-lm model, moebench loop"]
    moe_layers = 2
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| ")]
    rows = {row[0]: row for row in cells}
    for arm in length["arms"]:
        decode = arm["decode_tps"]
        _, tps, _, memory, _ = rows[arm["name"]]
        assert tps == f"{decode['median']:.1f} [{decode['min']:.1f}-{decode['max']:.1f}]"
        assert memory == byte_size(arm["own_peak_memory_gb"] * 1e9)
        for key in ("prompt_tps", "ttft_ms", "decode_tps"):
            assert set(arm[key]) == STAT_KEYS and len(arm[key]["values"]) == 1 and arm[key]["mean"] > 0
        assert len(arm["tokens"]) == 4 and arm["deterministic"] and arm["dtype"] == "float32"
        # its own model's weights and working memory; the process peak also holds the other engine's model
        assert arm["weights_gb"] > 0 and arm["working_memory_gb"] > 0
        assert arm["own_peak_memory_gb"] == pytest.approx(arm["weights_gb"] + arm["working_memory_gb"])
        assert arm["peak_memory_gb"] > arm["own_peak_memory_gb"]
    fallback, fused, users, loop = length["arms"]
    assert fallback["weights_gb"] == fused["weights_gb"] and users["weights_gb"] == loop["weights_gb"]
    assert fallback["decode_ratio_vs_reference"]["values"] == [1.0]
    assert fused["decode_ratio_vs_reference"]["values"] == [
        pytest.approx(fused["decode_tps"]["values"][0] / fallback["decode_tps"]["values"][0])]
    assert fallback["dispatch"]["fused"] == {} and fallback["dispatch"]["fallback"] == moe_layers * 4
    assert any("switched off" in r for r in fallback["dispatch"]["reasons"])
    assert fused["dispatch"]["fused"] == {"reference": moe_layers * 3} and fused["dispatch"]["fallback"] == moe_layers
    layers = fused["dispatch"]["attention"]["layers"]  # the decode-attention kernel ran at every decode step
    assert fused["dispatch"]["attention"]["fused"] == {"reference": layers * 3}
    off = fallback["dispatch"]["attention"]
    assert off["fused"] == {} and off["fallback"] == layers * 4
    assert users["loop"] == "stream_generate" and users["dispatch"] is None
    assert record["moebench_loop"] == {"steps_ahead": STEPS_AHEAD}
    # mlx-lm's model under moebench's loop decodes what mlx-lm's own loop decodes
    assert loop["tokens"] == users["tokens"]
    assert fallback["greedy_vs_reference"]["identical"]


def test_bench_uses_generate_step_without_a_tokenizer(tmp_path):
    folder = tmp_path / "tiny"
    assert main(["make-random", str(folder), "--preset", "tiny", "--dtype", "float32"]) == 0
    (folder / "tokenizer.json").unlink()  # make-random writes one; a folder of token ids alone is benched too
    arms, skipped = mlx_lm_arms(folder)
    assert skipped == [] and [a.loop for a in arms] == ["generate_step", "moebench"]
    results, _ = run_arms(arms, [1, 2], gen_tokens=3, repeats=1, progress=False)
    assert results[0].trace.token_ids == results[1].trace.token_ids and len(results[0].trace.token_ids) == 3


def test_mlx_lms_model_that_makes_its_own_caches_runs_only_under_mlx_lms_loop(tmp_path):
    folder = tmp_path / "hybrid"
    assert main(["make-random", str(folder), "--preset", "qwen3.5-moe-tiny", "--dtype", "float32"]) == 0
    arms, skipped = mlx_lm_arms(folder)
    assert [a.loop for a in arms] == ["stream_generate"]  # make-random's byte-level tokenizer: as users run it
    assert [s["arm"] for s in skipped] == [bench.OWN_LOOP_ARM]
    assert "makes its own caches (ArraysCache, KVCache)" in skipped[0]["reason"]
    results, failures = run_arms(arms, [1, 2], gen_tokens=3, repeats=1, progress=False)
    assert failures == [] and len(results[0].trace.token_ids) == 3


def test_mlx_lm_skipped_with_a_reason(quantized_checkpoint, tmp_path, monkeypatch, capsys):
    arms, skipped = mlx_lm_arms(tmp_path)  # an empty folder: mlx-lm cannot load it
    assert arms == [] and [s["arm"] for s in skipped] == ["mlx-lm"] and "mlx-lm cannot load" in skipped[0]["reason"]
    monkeypatch.setitem(sys.modules, "mlx_lm.generate", None)  # as if mlx-lm were not installed
    out = tmp_path / "b.json"
    assert main(["bench", str(quantized_checkpoint), "--prompt-tokens", "2", "--gen-tokens", "2", "--repeats", "1",
                 "--fused", "on", "--compiled", "off", "--compare", "mlx-lm", "--json", str(out), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "skipping mlx-lm: mlx-lm is not installed" in captured.err
    (length,) = json.loads(out.read_text())["lengths"]
    assert [a["name"] for a in length["arms"]] == ["moebench fused (reference)"]
    assert length["skipped"][0]["arm"] == "mlx-lm" and "not installed" in length["skipped"][0]["reason"]


def test_bench_rejects_too_few_tokens(quantized_checkpoint, capsys):
    assert main(["bench", str(quantized_checkpoint), "--gen-tokens", "1", "--no-progress"]) == 2
    assert "--gen-tokens 1" in capsys.readouterr().err


def test_platform_info_names_versions(monkeypatch):
    monkeypatch.setenv("MOEBENCH_NORM_KERNELS", "1")
    monkeypatch.setenv("MLX_MAX_OPS_PER_BUFFER", "400")
    info = bench.platform_info()
    assert info["mlx"] == mx.__version__ and info["backend"] in ("reference", "metal", "cuda")
    assert "device_name" in info["device_info"] or "error" in info["device_info"]
    assert info["mlx_environment"]["MLX_MAX_OPS_PER_BUFFER"] == "400"
    assert info["moebench_environment"]["MOEBENCH_NORM_KERNELS"] == "1"  # settings a result depends on


def test_bench_compiled_arms_decode_the_eager_tokens(quantized_checkpoint, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", str(quantized_checkpoint), "--prompt-tokens", "3", "--gen-tokens", "4", "--repeats", "1",
                 "--compiled", "both", "--json", str(out), "--no-progress"]) == 0
    arms = {a["name"]: a for a in json.loads(out.read_text())["lengths"][0]["arms"]}
    assert list(arms) == ["moebench fallback", "moebench fused (reference)", "moebench fallback compiled",
                          "moebench fused (reference) compiled"]
    assert arms["moebench fused (reference) compiled"]["loop"] == "moebench compiled"
    assert arms["moebench fused (reference) compiled"]["dispatch"]["fused"] == {"reference": 2 * 3}
    assert arms["moebench fused (reference) compiled"]["dispatch"]["attention"]["fused"] == {"reference": 2 * 3}
    assert arms["moebench fallback compiled"]["tokens"] == arms["moebench fallback"]["tokens"]


def test_by_default_cuda_and_the_cpu_bench_both_loops_and_metal_the_eager_one(quantized_checkpoint, tmp_path,
                                                                               monkeypatch):
    from moebench.tools import bench

    def arms(out):
        argv = ["bench", str(quantized_checkpoint), "--prompt-tokens", "3", "--gen-tokens", "3", "--repeats", "1",
                "--fused", "off", "--json", str(out), "--no-progress"]
        assert main(argv) == 0
        return [a["name"] for a in json.loads(out.read_text())["lengths"][0]["arms"]]

    both = ["moebench fallback", "moebench fallback compiled"]
    assert arms(tmp_path / "here.json") == both  # this CPU: generate decodes compiled by default
    monkeypatch.setattr(bench, "available_backend", lambda: "cuda")
    assert arms(tmp_path / "cuda.json") == both
    monkeypatch.setattr(bench, "available_backend", lambda: "metal")  # where generate decodes eagerly
    assert arms(tmp_path / "metal.json") == ["moebench fallback"]


def test_a_snapshot_is_measured_against_this_revisions_default_loop(monkeypatch):
    """Each snapshot arm (an earlier revision decoding with its defaults) is set against the arm decoding as generate
    does by default here: on the CPU the compiled step, fused or not; on CUDA compiled when fused; on Metal eager."""
    eager = [timed_result(name, [100.0, 100.0]) for name in ("moebench fallback", "moebench fused (reference)")]
    compiled = [timed_result(name, [150.0, 150.0])
                for name in ("moebench fallback compiled", "moebench fused (reference) compiled")]
    for result in compiled:
        result.arm.loop = "moebench compiled"
    snapshots = [timed_result(name, [50.0, 50.0]) for name in ("snapshot fallback", "snapshot fused")]
    for result in snapshots:
        result.arm.engine = "moebench snapshot"

    def ratios(backend):
        monkeypatch.setattr(bench, "available_backend", lambda: backend)
        return {(r["arm"], r["snapshot"]): r["ratio"]["median"] for r in bench.snapshot_ratios(
            eager + compiled + snapshots)}

    assert ratios("reference") == pytest.approx({("moebench fallback compiled", "snapshot fallback"): 3.0,
                                                 ("moebench fused (reference) compiled", "snapshot fused"): 3.0})
    assert ratios("cuda") == pytest.approx({("moebench fallback", "snapshot fallback"): 2.0,
                                            ("moebench fused (reference) compiled", "snapshot fused"): 3.0})
    assert ratios("metal") == pytest.approx({("moebench fallback", "snapshot fallback"): 2.0,
                                             ("moebench fused (reference)", "snapshot fused"): 2.0})


def test_several_prompt_lengths_bench_every_arm_on_models_loaded_once(quantized_checkpoint, tmp_path, monkeypatch,
                                                                       capsys):
    loads = []

    def counted(name):
        real = getattr(bench, name)

        def call(*args, **kwargs):
            loads.append(name)
            return real(*args, **kwargs)
        return call

    for name in ("load", "mlx_lm_model"):
        monkeypatch.setattr(bench, name, counted(name))
    out = tmp_path / "lengths.json"
    assert main(["bench", str(quantized_checkpoint), "--prompt-tokens", "3", "9", "--gen-tokens", "3", "--repeats", "2",
                 "--fused", "both", "--compiled", "off", "--compare", "mlx-lm", "--json", str(out),
                 "--no-progress"]) == 0
    assert loads == ["load", "mlx_lm_model"]
    record = json.loads(out.read_text())
    assert record["prompt_tokens"] == [3, 9]
    names = ["moebench fallback", "moebench fused (reference)", "mlx-lm stream_generate", "mlx-lm model, moebench loop"]
    for length, n in zip(record["lengths"], (3, 9), strict=True):
        assert length["prompt_tokens"] == len(length["prompt_ids"]) == n
        assert [a["name"] for a in length["arms"]] == names
        for arm in length["arms"]:
            assert len(arm["decode_tps"]["values"]) == 2 and len(arm["tokens"]) == 3
        assert length["arms"][0]["dispatch"]["fallback"] == 2 * 3  # this length's runs, counted afresh
    table = capsys.readouterr().out
    assert "prompt 3 tokens, 3 generated" in table and "prompt 9 tokens, 3 generated" in table
    assert table.index("prompt 3 tokens, 3 generated") < table.index("prompt 9 tokens, 3 generated")
    assert all(table.count(f"| {name} ") == 2 for name in names)  # one table per length


def test_an_arm_starts_without_what_the_arm_before_it_dropped():
    """Arrays an arm leaves to the garbage collector (held by a reference cycle) are freed before the next run
    begins, so they count in neither its working memory nor what was resident when it began."""

    class Cycle:
        pass

    def leaky(ids, n):
        held = Cycle()
        held.me, held.buffer = held, mx.zeros((1 << 20,)) + 1  # 4 MB, unreachable once the run ends
        mx.eval(held.buffer)
        for t in range(n):
            yield t, mx.zeros(4)

    def plain(ids, n):
        for t in range(n):
            yield t, mx.zeros(4)

    arms = [Arm(name, "test", "test", "none", "float32", stream) for name, stream in [("leaky", leaky),
                                                                                      ("plain", plain)]]
    gc.disable()  # only the bench's own collection frees the cycles
    try:
        results, _ = run_arms(arms, [1], gen_tokens=2, repeats=2, progress=False)
    finally:
        gc.enable()
    leaky_result, plain_result = results
    runs = [run for result in results for run in (result.trace, *result.runs)]
    assert len({run.start_bytes for run in runs}) == 1
    assert all(run.working_bytes >= 4 << 20 for run in (leaky_result.trace, *leaky_result.runs))
    assert all(run.working_bytes < 1 << 20 for run in (plain_result.trace, *plain_result.runs))


def test_working_memory_of_two_arms_does_not_depend_on_their_order():
    """On the shipped model: moebench's fallback and mlx-lm's own loop, run in both orders."""
    path = default_model_path()
    model, _ = load(path)
    (ours,) = bench.moebench_arms(model, "off")
    (users, _), skipped = bench.mlx_lm_arms(path)
    assert skipped == []
    ids = bench.prompt_token_ids(model.args.vocab_size, 64)
    working = {}
    for order in ((ours, users), (users, ours)):
        results, failures = run_arms(list(order), ids, gen_tokens=16, repeats=2, progress=False)
        assert failures == []
        for result in results:
            working.setdefault(result.arm.name, []).append(arm_record(result, results[0])["working_memory_gb"])
    for name, (first, second) in working.items():
        assert first > 0 and first == pytest.approx(second, rel=0.1), name  # the decode's own, in either order
    assert ours.weight_bytes == model_bytes(model) and users.weight_bytes == ours.weight_bytes  # one checkpoint


def test_a_length_where_every_arm_fails_is_reported_and_the_others_stand(quantized_checkpoint, tmp_path, monkeypatch,
                                                                         capsys):
    def short_prompts_only(ids, n):
        if len(ids) > 3:
            raise RuntimeError("out of memory")
        for t in range(n):
            yield t, mx.zeros(4)

    arm = Arm("short", "moebench", "test", "none", "float32", short_prompts_only)
    monkeypatch.setattr(bench, "moebench_arms", lambda *args: [arm])
    out = tmp_path / "b.json"
    argv = ["bench", str(quantized_checkpoint), "--gen-tokens", "2", "--repeats", "1", "--json", str(out),
            "--no-progress", "--prompt-tokens"]
    assert main([*argv, "2", "6"]) == 0
    short, long = json.loads(out.read_text())["lengths"]
    assert [a["name"] for a in short["arms"]] == ["short"] and short["reference_arm"] == "short"
    assert long["arms"] == [] and long["reference_arm"] is None
    assert long["skipped"] == [{"arm": "short", "reason": "warm-up failed: RuntimeError: out of memory"}]
    table = capsys.readouterr().out
    assert "prompt 6 tokens, 2 generated, 1 repeats: every arm failed\nskipped short: warm-up failed" in table
    assert main([*argv, "6"]) == 2
    assert "every arm failed: short: warm-up failed: RuntimeError: out of memory" in capsys.readouterr().err


def test_a_run_stopped_inside_a_length_keeps_the_lengths_before_it(quantized_checkpoint, tmp_path, monkeypatch,
                                                                     capsys):
    """A time limit that stops a bench inside its second length leaves the first length's table printed and its
    record saved (a device call's limit kills the process: what was measured must already be out)."""
    def stopped_at_long_prompts(ids, n):
        if len(ids) > 3:
            raise KeyboardInterrupt  # stands in for the limit's signal
        for t in range(n):
            yield t, mx.zeros(4)

    arm = Arm("short", "moebench", "test", "none", "float32", stopped_at_long_prompts)
    monkeypatch.setattr(bench, "moebench_arms", lambda *args: [arm])
    out = tmp_path / "b.json"
    with pytest.raises(KeyboardInterrupt):
        main(["bench", str(quantized_checkpoint), "--gen-tokens", "2", "--repeats", "1", "--json", str(out),
              "--no-progress", "--prompt-tokens", "2", "6"])
    (short,) = json.loads(out.read_text())["lengths"]
    assert short["prompt_tokens"] == 2 and [a["name"] for a in short["arms"]] == ["short"]
    table = capsys.readouterr().out
    assert "prompt 2 tokens, 2 generated" in table and "| short " in table and "prompt 6 tokens" not in table


@pytest.mark.parametrize("init", ["this is not python(", "raise ImportError('half an archive')",
                                  "def load(path):\n    raise RuntimeError('its own bug')\n"])
def test_a_broken_snapshot_folder_is_named_and_forgotten(quantized_checkpoint, tmp_path, capsys, init):
    (tmp_path / "snap" / "moebench").mkdir(parents=True)
    (tmp_path / "snap" / "moebench" / "__init__.py").write_text(init)
    (tmp_path / "snap" / "moebench" / "decode.py").write_text("generate_tokens = None\n")
    argv = ["bench", str(quantized_checkpoint), "--snapshot", str(tmp_path / "snap"), "--gen-tokens", "2",
            "--prompt-tokens", "4", "--repeats", "1", "--no-progress"]
    assert main(argv) == 2
    assert f"--snapshot {tmp_path / 'snap'}: cannot import its moebench or load" in capsys.readouterr().err
    assert not [m for m in sys.modules if m.startswith(bench.SNAPSHOT)]


def test_a_snapshot_runs_its_own_kernel_sources(quantized_checkpoint, tmp_path):
    """An earlier revision's fused arms run the kernels of that revision, not the installed package's."""
    repo = Path(__file__).resolve().parents[2]
    snap = tmp_path / "snap"
    shutil.copytree(repo / "moebench", snap / "moebench", symlinks=True)
    shutil.copytree(repo / "kernels", snap / "kernels")
    try:
        bench.snapshot_arms(snap, quantized_checkpoint, "both")
        kernel_dir = sys.modules[f"{bench.SNAPSHOT}.execution.kernel"].KERNEL_DIR
        assert kernel_dir.resolve() == (snap / "kernels").resolve()
    finally:
        for name in [m for m in sys.modules if m.startswith(bench.SNAPSHOT)]:
            del sys.modules[name]


def test_a_missing_snapshot_is_named_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "load", lambda *a, **k: pytest.fail("loaded the model first"))
    assert main(["bench", "--snapshot", str(tmp_path), "--no-progress"]) == 2
    assert "no moebench/__init__.py there" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--seed", "-1"), ("--seed", str(2**64)), ("--gen-tokens", "0"),
                                         ("--repeats", "0"), ("--prompt-tokens", "-4")])
def test_bench_flags_out_of_range_are_usage_errors(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", flag, value])
    assert exit_.value.code == 2 and f"argument {flag}:" in capsys.readouterr().err


def timed_result(name: str, decode_tps: list[float], weight_bytes: int = 8_812_000) -> ArmResult:
    """An arm whose repeats decoded 3 tokens at the given tok/s (2 tokens after the first), with no stream; its
    experts by the CPU backend when its name says fused."""
    trace = Run([1], [4, 5, 6], 0.01, 0.02, logits=[np.eye(8)[t] for t in (4, 5, 6)])
    runs = [Run([1], [4, 5, 6], 0.01, 2 / tps, peak_bytes=weight_bytes + 3_000_000, start_bytes=weight_bytes)
            for tps in decode_tps]
    experts = "reference" if "fused" in name else "gather_qmm"
    arm = Arm(name, "moebench", "moebench", experts, "float32", stream=None, weight_bytes=weight_bytes)
    return ArmResult(arm, trace, runs)


def report(quantized_checkpoint, speeds: dict[str, list[float]], verbose: bool = False) -> tuple[dict, str]:
    model, _ = load(quantized_checkpoint)
    length = length_record([1], [timed_result(name, tps) for name, tps in speeds.items()], [])
    record = bench_record([length], model, 3, len(next(iter(speeds.values()))), {})
    return record, format_table(record, verbose)


def test_the_table_is_one_row_per_arm_with_median_range_ratio_and_readable_memory(quantized_checkpoint):
    speeds = {"moebench fallback": [100.0, 102.0, 101.0], "moebench fused (reference)": [120.0, 122.4, 121.2]}
    record, table = report(quantized_checkpoint, speeds)  # fused 1.2x the fallback in every round
    assert max(map(len, table.splitlines())) <= 100
    assert "| moebench fallback          | 101.0 [100.0-102.0] | 1.00x       | 11.8 MB | baseline " in table
    assert "| moebench fused (reference) | 121.2 [120.0-122.4] | 1.20x       | 11.8 MB | identical " in table
    assert "0.0088" not in table and "8.8 MB" not in table.split("| arm")[1]  # own peak shown, weights in --verbose
    assert "fused (reference): the CPU backend" in table  # 'reference' names the backend, and only it
    assert "warning" not in table and record["lengths"][0]["unranked"] == []
    _, verbose = report(quantized_checkpoint, speeds, verbose=True)
    assert "weights 8.8 MB + working 3.0 MB = own peak 11.8 MB" in verbose
    assert "time to first token 10.0 [10.0-10.0] ms" in verbose and "vs moebench fallback round by round" in verbose


def test_the_table_of_every_arm_fits_100_columns(quantized_checkpoint):
    """`--compiled both --compare mlx-lm` on the CPU: six arms, the longest name 35 characters (the table was 101
    columns): a header wraps, every arm keeps its row and every line fits."""
    names = ["moebench fallback", "moebench fused (reference)", "moebench fallback compiled",
             "moebench fused (reference) compiled", "mlx-lm stream_generate", "mlx-lm model, moebench loop"]
    _, table = report(quantized_checkpoint, {name: [1000.0 + i, 1500.5 + i, 1200.25] for i, name in enumerate(names)})
    assert max(map(len, table.splitlines())) <= 100
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert set(names) < set(rows) and "1200.2 [" in rows["moebench fused (reference) compiled"]


def test_the_progress_bar_draws_a_line_now_and_then_where_stderr_is_no_terminal(capsys):
    """In a log (stderr captured: no terminal) every redraw stays as a line: the bar is drawn when it starts and
    ends, not at each of its 24 runs."""
    calls = []
    arms = [spy_arm(n, calls, [1, 2]) for n in ("a", "b", "c", "d")]
    run_arms(arms, [3], gen_tokens=2, repeats=5, progress=True)
    draws = [d for d in capsys.readouterr().err.replace("\r", "\n").splitlines() if d.strip()]
    assert len(calls) == 24 and 2 <= len(draws) <= 4 and draws[-1].startswith("bench: 100%")


def test_a_spread_too_wide_to_rank_the_arms_is_a_warning_naming_them_and_the_rule(quantized_checkpoint):
    record, table = report(quantized_checkpoint, {"moebench fallback": [100.0, 140.0, 120.0],
                                                  "moebench fused (reference)": [130.0, 150.0, 135.0],
                                                  "mlx-lm stream_generate": [200.0, 210.0, 205.0]})
    assert record["lengths"][0]["unranked"] == [["moebench fallback", "moebench fused (reference)"]]
    warning = table.split("warning: ")[1].splitlines()
    assert " ".join(line.strip() for line in warning[:-1]).startswith(
        "the spread is too wide to rank 1 pair of arms, as their decode tok/s [min-max] ranges over the repeats "
        "overlap")
    assert warning[-1] == "  moebench fallback  vs  moebench fused (reference)"  # mlx-lm's range stands apart
    _, single = report(quantized_checkpoint, {"moebench fallback": [100.0], "moebench fused (reference)": [101.0]})
    assert "warning: one repeat measures no spread" in single


def test_byte_sizes_read_in_the_unit_that_suits_them():
    assert [byte_size(n) for n in (0, 999, 8_812_000, 99_960_000, 999_600_000, 1.34e9)] == [
        "0 B", "999 B", "8.8 MB", "100 MB", "1.0 GB", "1.3 GB"]
    with pytest.raises(ValueError, match="negative"):
        byte_size(-1)
