"""Issue 21's bad-input corpus, as a careful user and an adversary would try it: every case that could crash (SIGSEGV
kills a Jupyter kernel) or hang runs in its own process, which must end by itself with the named moebench error;
the CLI's cases run the `moebench` command. The rest runs in this process. Neighbouring cases, per package, are in
tests/checkpoint/test_bad_input.py, tests/decode/test_decode_bad_input.py, tests/inspect/test_stepper_failures.py
and the hypothesis test tests/checkpoint/test_fuzz_checkpoint.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pandas as pd
import pytest
from byte_tokenizer import write_byte_tokenizer

import moebench
from moebench.checkpoint.files import INDEX_FILE
from moebench.checkpoint.loader import SHIPPED_MODEL
from moebench.errors import ConfigError, MoebenchError
from moebench.execution.steps import ROUTE_NOTE
from moebench.inspect.export import save_frames
from moebench.inspect.interventions import clear_interventions, set_interventions
from moebench.inspect.record import decode
from moebench.models.routing import InterventionError
from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint

SHIPPED_CONFIG = json.loads((SHIPPED_MODEL / "config.json").read_text())
EXPERTS, TOP_K = SHIPPED_CONFIG["num_experts"], SHIPPED_CONFIG["num_experts_per_tok"]  # in each of its layers
TIMEOUT = 120  # a case that hangs fails here instead of blocking the suite
PRELUDE = """
import sys
import mlx.core as mx
import numpy as np
import moebench
from moebench import Intervention
from moebench.errors import MoebenchError
from moebench.inspect.record import Stepper
FOLDER = sys.argv[1]
try:
{body}
except MoebenchError as e:
    print(f"MOEBENCH-ERROR {{type(e).__name__}}: {{e}}")
    sys.exit(3)
print("NO ERROR")
"""


def _environment() -> dict[str, str]:
    """This process's environment without moebench's settings (the cases set their own), but for its cache folder,
    which tests/conftest.py points away from the user's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEBENCH_") or k == "MOEBENCH_CACHE"}
    return {**env, "PYTHONPATH": str(Path(moebench.__file__).parents[1])}


def run_case(body: str, folder: Path | str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    code = PRELUDE.format(body=textwrap.indent(textwrap.dedent(body).strip(), "    "))
    try:
        return subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True,
                              timeout=TIMEOUT, env={**_environment(), **(env or {})})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the case hung for {TIMEOUT} s: {body}\n{e.stdout}\n{e.stderr}")


def assert_named_error(proc: subprocess.CompletedProcess, error: str, fragment: str) -> None:
    """The process survived (no signal) and stopped at the named moebench error, whose message holds `fragment`."""
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.returncode == 3, f"rc {proc.returncode}: {proc.stdout[-1000:]} {proc.stderr[-2000:]}"
    assert f"MOEBENCH-ERROR {error}:" in proc.stdout, proc.stdout
    assert fragment in proc.stdout, proc.stdout


@pytest.fixture(scope="module")
def unbounded(tmp_path_factory) -> Path:
    """The tiny 4-bit model with no max_position_embeddings: only the memory check stands between a huge request
    and an allocation MLX cannot make."""
    folder = write_random_checkpoint(tmp_path_factory.mktemp("unbounded") / "ckpt", qwen2_moe_config(), seed=3, bits=4)
    write_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("sharded") / "ckpt", qwen2_moe_config(), seed=4, bits=4,
                                   shard_bytes=100_000)


# -- crashes: allocations past the device's memory and ids past the tables ------------------------------------------
MEMORY_CASES = {
    "compiled generate, max_tokens 1e8, shipped model": (
        "m, _ = moebench.load(); moebench.generate(m, [1, 2], 10**8, compiled=True)",
        "shipped", "DecodeError", "past the model's max_position_embeddings of 4096"),
    "eager generate, max_tokens 1e8, shipped model": (
        "m, _ = moebench.load(); moebench.generate(m, [1, 2], 10**8, compiled=False)",
        "shipped", "DecodeError", "max_position_embeddings of 4096"),
    "default generate, max_tokens 1e8, shipped model": (
        "m, _ = moebench.load(); moebench.generate(m, [1, 2], 10**8)",
        "shipped", "DecodeError", "max_position_embeddings of 4096"),
    "compiled generate, max_tokens 1e8, no max_position_embeddings": (
        "m, _ = moebench.load(FOLDER); moebench.generate(m, [1, 2], 10**8, compiled=True)",
        "unbounded", "DeviceMemoryError", "a decode of 100000001 positions"),
    "eager generate, max_tokens 1e8, no max_position_embeddings": (
        "m, _ = moebench.load(FOLDER); moebench.generate(m, [1, 2], 10**8, compiled=False)",
        "unbounded", "DeviceMemoryError", "GiB of available system memory left"),
    "a 2M-token prompt, no max_position_embeddings": (  # a chunk's attention scores over 2M keys: 131 GB
        "m, _ = moebench.load(FOLDER); moebench.generate(m, [1] * 2_000_000, 1)",
        "unbounded", "DeviceMemoryError", "a prefill of 2000000 tokens"),
    "a Stepper over a 300k-token prompt, no max_position_embeddings": (
        "m, t = moebench.load(FOLDER); Stepper(m, t, [1] * 300_000)",
        "unbounded", "DeviceMemoryError", "a prefill of 300000 tokens"),
    "a Stepper over a 4200-token prompt on a max-4096 model": (
        "m, t = moebench.load(); Stepper(m, t, [1] * 4200)",
        "shipped", "DecodeError", "feed 4200 positions"),
    "a compiled step of 1e9 positions made directly": (
        "from moebench.decode.compiled import CompiledForward\n"
        "from moebench.execution.executor import executor\n"
        "m, _ = moebench.load(FOLDER); CompiledForward(executor(m), 10**9)",
        "unbounded", "DeviceMemoryError", "static cache of 1000000000 positions"),
}
ID_CASES = {
    "model call with id 1e6": ("m(mx.array([[10**6]]))", "token id 1000000 is outside"),
    "model call with id -1": ("m(mx.array([[-1]]))", "token id -1 is outside"),
    "model call with id 2**31-1": ("m(mx.array([[2**31 - 1]]))", "token id 2147483647"),
    "model call with a uint32 id 2**32-1": ("m(mx.array([[2**32 - 1]], dtype=mx.uint32))", "token id 4294967295"),
    "model call with one good and one bad id": ("m(mx.array([[3, 4], [5, 4096]]))", "token id 4096"),
    "model call with float tokens": ("m(mx.array([[3.0]]))", "integer mx.array"),
    "model call with a list": ("m([[3, 4]])", "integer mx.array"),
    "generate from a numpy prompt past the vocabulary": ("moebench.generate(m, np.array([5, 70000]), 2)",
                                                        "token id 70000"),
    "Stepper fed id 1e6": ("s = Stepper(m, t, 'hi'); s.prefill(); s.step(feed=10**6)", "feed token id 1000000"),
}
INTERVENTION_CASES = {
    "block.intervention force_experts (1e7,)": "b.intervention = Intervention(force_experts=(10**7,))",
    "block.intervention ablate (2**31-1,)": "b.intervention = Intervention(ablate=(2**31 - 1,))",
    f"block.intervention force_experts ({EXPERTS},) on {EXPERTS} experts":
        f"b.intervention = Intervention(force_experts=({EXPERTS},))",
    "block.intervention force_experts (-1,)": "b.intervention = Intervention(force_experts=(-1,))",
    f"block.intervention top_k {EXPERTS + 1} on {EXPERTS} experts":
        f"b.intervention = Intervention(top_k={EXPERTS + 1})",
    f"block.intervention ablating all {EXPERTS}":
        f"b.intervention = Intervention(ablate=tuple(range({EXPERTS})), top_k=1)",
    f"block.intervention ablating {EXPERTS - TOP_K + 1} of {EXPERTS} at top-{TOP_K}":
        f"b.intervention = Intervention(ablate=tuple(range({EXPERTS - TOP_K + 1})))",
    "block.intervention a dict": "b.intervention = {'force_experts': (1,)}",
    "set_interventions force_experts (99,)": (
        "from moebench.inspect.interventions import set_interventions\n"
        "set_interventions(m, Intervention(force_experts=(99,)))"),
}


@pytest.mark.parametrize("case", sorted(MEMORY_CASES))
def test_memory_asked_for_up_front_is_checked(case, unbounded):
    body, folder, error, fragment = MEMORY_CASES[case]
    assert_named_error(run_case(body, unbounded if folder == "unbounded" else ""), error, fragment)


@pytest.mark.parametrize("case", sorted(ID_CASES))
def test_token_ids_past_the_tables_are_refused(case):
    body, fragment = ID_CASES[case]
    assert_named_error(run_case("m, t = moebench.load()\n" + body), "DecodeError", fragment)


@pytest.mark.parametrize("case", sorted(INTERVENTION_CASES))
def test_interventions_are_checked_however_they_are_set(case):
    body = "m, t = moebench.load(); b = m.moe_blocks()[0]\n" + INTERVENTION_CASES[case] + \
        "\nmoebench.generate(m, [1, 2], 4, compiled=False); print(b.intervention)"
    assert_named_error(run_case(body), "InterventionError", "")


# -- hangs: files that are not regular files ------------------------------------------------------------------------
FIFO_CASES = {  # (file made a FIFO, the error, a fragment)
    "a shard the index names": ("model-fifo.safetensors", "CheckpointError", "not a regular file"),
    "model.safetensors": ("model.safetensors", "CheckpointError", "not a regular file"),
    "the shard index": (INDEX_FILE, "CheckpointError", "not a regular file"),
    "config.json": ("config.json", "ConfigError", "not a regular file"),
    "generation_config.json": ("generation_config.json", "ConfigError", "not a regular file"),
    "tokenizer.json": ("tokenizer.json", "CheckpointError", "not a regular file"),
    "tokenizer_config.json": ("tokenizer_config.json", "ConfigError", "not a regular file"),
    "chat_template.jinja": ("chat_template.jinja", "ConfigError", "not a regular file"),
}


@pytest.mark.parametrize("case", sorted(FIFO_CASES))
def test_a_fifo_in_the_folder_never_blocks_the_loader(case, sharded, tmp_path):
    name, error, fragment = FIFO_CASES[case]
    folder = Path(shutil.copytree(sharded, tmp_path / "ckpt"))
    write_byte_tokenizer(folder)
    if name == "model-fifo.safetensors":
        index = json.loads((folder / INDEX_FILE).read_text())
        index["weight_map"]["model.norm.weight"] = name
        (folder / INDEX_FILE).write_text(json.dumps(index))
    elif name == "model.safetensors":
        for shard in folder.glob("*.safetensors*"):
            shard.unlink()
    else:
        (folder / name).unlink(missing_ok=True)
    os.mkfifo(folder / name)
    assert_named_error(run_case("moebench.load(FOLDER)", folder), error, fragment)


# -- silently wrong: NaN weights ------------------------------------------------------------------------------------
def test_nan_weights_stop_the_load_and_the_decode(float_checkpoint, tmp_path):
    folder = Path(shutil.copytree(float_checkpoint, tmp_path / "ckpt"))
    path = folder / "model.safetensors"
    tensors = dict(mx.load(str(path)))
    tensors["model.norm.weight"] = mx.full(tensors["model.norm.weight"].shape, mx.nan)
    mx.save_safetensors(str(path), tensors)
    assert_named_error(run_case("moebench.load(FOLDER)", folder), "NonFiniteError", "model.norm.weight holds NaN")
    assert_named_error(run_case("m, _ = moebench.load(FOLDER, check_finite=False); moebench.generate(m, [1, 2], 3)",
                                folder), "NonFiniteError", "the logits at position 1 hold NaN or Inf")


def test_an_unknown_switch_word_in_the_environment_is_named():
    proc = run_case("m, _ = moebench.load(); moebench.generate(m, [1, 2], 2)", env={"MOEBENCH_FUSED_MOE": "disabled"})
    assert_named_error(proc, "ConfigError", "MOEBENCH_FUSED_MOE")


# -- the command line: rc 2 and one line, never a traceback --------------------------------------------------------
def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "moebench.cli", *argv], capture_output=True, text=True,
                          timeout=TIMEOUT, env={**_environment(), **(env or {})})
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}: {proc.stderr[-2000:]}"
    return proc


@pytest.mark.parametrize("argv, fragment", [
    (["generate", "--prompt", "hi", "--compiled", "on", "--max-tokens", "100000000"], "max_position_embeddings"),
    (["generate", "--prompt", "hi", "--max-tokens", "0"], "max_tokens must be at least 1"),
    (["generate", "--prompt", "hi", "--max-tokens", "-5"], "max_tokens must be at least 1"),
    (["generate", "--prompt", "hi", "--temperature", "1e-45"], "below 1e-06"),
    (["generate", "--prompt", "hi", "--top-p", "0"], "top_p"),
    (["generate", "/nonexistent/folder", "--prompt", "hi"], "/nonexistent/folder: does not exist"),
])
def test_cli_errors_are_one_line(argv, fragment):
    proc = run_cli(*argv)
    assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_cli_writes_that_fail_are_errors(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("in the way")
    bench = run_cli("bench", "--prompt-tokens", "4", "--gen-tokens", "2", "--repeats", "1", "--fused", "off",
                    "--no-progress", "--json", str(blocker / "out.json"))
    assert bench.returncode == 2 and "--json" in bench.stderr and "loaded" not in bench.stdout  # before the run
    made = run_cli("make-random", str(blocker), "--preset", "tiny")
    assert made.returncode == 2 and "exists and is not an empty folder" in made.stderr
    for proc in (bench, made):
        assert "Traceback" not in proc.stderr


def test_cli_generate_on_a_nan_checkpoint(float_checkpoint, tmp_path):
    folder = Path(shutil.copytree(float_checkpoint, tmp_path / "ckpt"))
    path = folder / "model.safetensors"
    tensors = dict(mx.load(str(path)))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"] * mx.inf
    mx.save_safetensors(str(path), tensors)
    proc = run_cli("generate", str(folder), "--prompt", "hi")
    assert proc.returncode == 2 and "model.embed_tokens.weight holds NaN or Inf" in proc.stderr


# -- in this process: what cannot crash ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shipped():
    return moebench.load(SHIPPED_MODEL)


@pytest.mark.parametrize("word, on", [("off", False), ("OFF", False), ("0", False), ("no", False), ("on", True),
                                      (False, False), (True, True)])
def test_the_switch_reads_its_words(shipped, word, on):
    model, _ = shipped
    with moebench.fused_moe(word, model):
        assert moebench.fused_moe_enabled(model) is on


@pytest.mark.parametrize("word", ["disabled", "", 2, None, "of"])
def test_the_switch_refuses_other_words(shipped, word):
    with pytest.raises(ConfigError, match="expected True or False"):
        moebench.set_fused_moe(word, shipped[0])


def test_an_intervention_on_a_fused_step_says_routing_left_the_router_kernel(shipped):
    model, tok = shipped
    set_interventions(model, moebench.Intervention(ablate=(0, 1)))
    try:
        trace = decode(model, tok, "def add(a, b):", 3, record=True)
    finally:
        clear_interventions(model)
    decoded = [s for s in trace.steps if s.phase == "decode"]
    assert decoded and all(r.path.fused and ROUTE_NOTE in r.path.note for s in decoded for r in s.layers.values())


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("renormalize", [False, True])
def test_ablated_experts_are_never_selected(shipped, fused, renormalize):
    model, tok = shipped
    ablated = tuple(range(EXPERTS - TOP_K))  # TOP_K left for the layer's top-k
    set_interventions(model, moebench.Intervention(ablate=ablated, renormalize_ablation=renormalize))
    try:
        trace = decode(model, tok, "def add(a, b):", 4, record=True, fused=fused)
    finally:
        clear_interventions(model)
    chosen = {int(e) for s in trace.steps for r in s.layers.values() for e in r.topk_ids}
    assert chosen == set(range(EXPERTS - TOP_K, EXPERTS))
    for limit in (tuple(range(EXPERTS - TOP_K + 1)), tuple(range(EXPERTS))):
        with pytest.raises(InterventionError):
            set_interventions(model, moebench.Intervention(ablate=limit))


def test_ids_the_tokenizer_lacks_are_shown_not_dropped(tmp_path):
    folder = write_random_checkpoint(tmp_path / "ckpt", qwen2_moe_config(vocab_size=300), seed=6)
    write_byte_tokenizer(folder)  # 256 ids for a model of 300
    model, tok = moebench.load(folder)
    (h,), (i,) = tok.encode("H"), tok.encode("i")
    assert tok.decode([h, 280, i]) == "H<id 280 not in the tokenizer>i"
    with pytest.raises(MoebenchError, match="token id -1 is negative"):
        tok.decode([-1])
    trace = decode(model, tok, [h, 290], 2, top=40)
    assert trace.steps[1].input_text == "<id 290 not in the tokenizer>"
    assert all(c.text for s in trace.steps for c in s.candidates)


@pytest.mark.parametrize("where", ["under a file", "a file"])
def test_exports_to_paths_that_cannot_be_written(tmp_path, where):
    blocker = tmp_path / "a_file"
    blocker.write_text("in the way")
    target = blocker / "frames" if where == "under a file" else blocker
    with pytest.raises(MoebenchError, match=str(target)):
        save_frames({"tokens": pd.DataFrame({"a": [1]})}, target, "json")
