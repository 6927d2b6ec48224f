"""`moebench generate`: token ids, text, timings and dispatch counts, the --fused switch, and clean errors; the
command line as a whole: help on every option, the one-line model summary, paths that are missing or no checkpoint."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import moebench
from moebench import cli
from moebench.checkpoint.loader import model_bytes
from moebench.checkpoint.tokenizer import Tokenizer
from moebench.cli import build_parser, main
from moebench.decode.loop import generate
from moebench.units import byte_size


@pytest.fixture(autouse=True)
def restore_fused_switch():
    """The CLI sets the process-wide fused switch; put it back for the tests that follow."""
    with moebench.fused_moe(moebench.fused_moe_enabled()):
        yield


def run_json(capsys, *argv: str) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_reports_tokens_text_timings_and_dispatch(quantized_checkpoint, capsys):
    out = run_json(capsys, str(quantized_checkpoint), "--prompt", "Hello experts", "--max-tokens", "6")
    tok = Tokenizer(quantized_checkpoint / "tokenizer.json")
    assert out["prompt_ids"] == tok.encode("Hello experts")
    assert len(out["token_ids"]) == 6 and out["text"] == tok.decode(out["token_ids"])
    model, _ = moebench.load(quantized_checkpoint)
    assert out["token_ids"] == generate(model, out["prompt_ids"], 6).token_ids
    assert set(out["timings"]) == {"prompt_seconds", "decode_seconds", "prompt_tps", "decode_tps"}
    assert out["timings"]["prompt_tps"] > 0
    assert sorted(out["dispatch"]) == ["0", "1"]
    for layer in out["dispatch"].values():  # prefill falls back (many tokens), each decode step runs fused
        assert layer["fused"] == {"reference": 5} and layer["fallback"] == 1
        assert list(layer["reasons"]) == ["13 tokens (the kernel runs single-token decode)"]
    assert {layer["fused"].get("reference") for layer in out["attention_dispatch"].values()} == {5}
    assert out["decode_loop"] == "compiled"  # the default on CUDA and the CPU (decode.loop.COMPILED_BY_DEFAULT)
    # the decode plan's launches a layer on the GPU path: the compiled step's cache is written by the kernel in place
    # (a CPU plan keeps the attention's combine launch, as Metal does; on CUDA the kernel joins its partials: 7)
    assert out["launches"]["per_layer"] == 8 and out["launches"]["not_declared"] == {}
    assert [layer["count"] for layer in out["launches"]["layers"].values()] == [8, 8]
    eager = run_json(capsys, str(quantized_checkpoint), "--prompt", "Hello experts", "--max-tokens", "6",
                     "--compiled", "off")
    assert eager["decode_loop"] == "eager" and eager["token_ids"] == out["token_ids"]
    assert eager["launches"]["per_layer"] == 10  # and the eager step's KVCache by two slice updates a layer


def test_fused_off_falls_back_and_says_why(quantized_checkpoint, capsys):
    out = run_json(capsys, str(quantized_checkpoint), "--prompt", "Hi", "--max-tokens", "4", "--fused", "off")
    for layer in out["dispatch"].values():
        assert layer["fused"] == {} and layer["fallback"] == 4
        assert layer["reasons"]["switched off (MOEBENCH_FUSED_MOE / set_fused_moe)"] == 3


def test_float_experts_report_their_fallback_reason(float_checkpoint, capsys):
    out = run_json(capsys, str(float_checkpoint), "--prompt", "Hi", "--max-tokens", "3")
    assert all(d["reasons"].get("float experts (the kernel needs quantized weights)") == 2
               for d in out["dispatch"].values())


def test_sampling_options_are_reproducible(float_checkpoint, capsys):
    argv = (str(float_checkpoint), "--prompt", "abc", "--max-tokens", "8", "--temperature", "1.2", "--top-p", "0.9",
            "--seed", "5")
    assert run_json(capsys, *argv)["token_ids"] == run_json(capsys, *argv)["token_ids"]


def test_text_mode(float_checkpoint, capsys):
    assert main(["generate", str(float_checkpoint), "--prompt", "Once", "--max-tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert "Once" in captured.out and "float float32" in captured.out
    assert "decode 3 tokens" in captured.err and "MoE dispatch" in captured.err
    assert "[launches/layer (plan, GPU path) not declared; 2 layers not declared: " in captured.err  # float experts


def test_bad_sampling_option_is_a_clean_error(float_checkpoint, capsys):
    assert main(["generate", str(float_checkpoint), "--prompt", "x", "--top-p", "0", "--temperature", "1"]) == 2
    assert "moebench: error: top_p must be in (0, 1], got 0.0" in capsys.readouterr().err


def test_missing_tokenizer_is_a_clean_error(make_checkpoint, capsys):
    folder = make_checkpoint()
    assert main(["generate", str(folder), "--prompt", "x", "--json"]) == 2
    assert f"{folder}: no tokenizer.json" in capsys.readouterr().err


def test_console_script_reports_a_corrupt_checkpoint_without_crashing(quantized_checkpoint, copy_checkpoint):
    folder = copy_checkpoint(quantized_checkpoint)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    argv = ["generate", str(folder), "--prompt", "hi", "--max-tokens", "2", "--json"]
    console_script = Path(sys.executable).parent / "moebench"  # installed by `pip install -e .`
    proc = subprocess.run([str(console_script), *argv],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"moebench: error: {weights}") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, flag", [
    (["generate", "--prompt", "hi", "--seed", "-1"], "--seed"),
    (["generate", "--prompt", "hi", "--seed", str(2**64)], "--seed"),
    (["generate", "--prompt", "hi", "--seed", "1.5"], "--seed"),
    (["profile", "--seed", "-1"], "--seed"), (["profile", "--steps", "0"], "--steps"),
    (["profile", "--warmup", "-1"], "--warmup"), (["profile", "--prompt-tokens", "0"], "--prompt-tokens"),
    (["make-random", "out", "--seed", "-5"], "--seed"), (["make-random", "out", "--shard-gb", "inf"], "--shard-gb"),
    (["make-random", "out", "--shard-gb", "0"], "--shard-gb"), (["selfcheck", "--repeats", "0"], "--repeats"),
    (["selfcheck", "--gen-tokens", "-1"], "--gen-tokens"),
])
def test_numeric_flags_out_of_range_are_usage_errors_naming_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {flag}:" in err and "Traceback" not in err


def test_the_largest_seed_decodes(float_checkpoint, capsys):
    out = run_json(capsys, str(float_checkpoint), "--prompt", "hi", "--temperature", "1", "--seed", str(2**64 - 1),
                   "--max-tokens", "2")
    assert out["sampling"]["seed"] == 2**64 - 1 and len(out["token_ids"]) == 2


def every_parser() -> list[tuple[str, argparse.ArgumentParser]]:
    """The top-level parser and each command's, walked from the parser main() runs."""
    top = build_parser()
    found, stack = [], [("moebench", top)]
    while stack:
        name, parser = stack.pop()
        found.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack += [(f"{name} {command}", sub) for command, sub in action.choices.items()]
    return found


def test_every_option_of_every_command_has_help():
    parsers = every_parser()
    commands = {name for name, _ in parsers}
    assert {"moebench generate", "moebench bench", "moebench microbench", "moebench selfcheck", "moebench profile",
            "moebench make-random", "moebench train-tiny", "moebench eval-tiny"} <= commands
    missing = [f"{name} {'/'.join(action.option_strings) or action.dest}" for name, parser in parsers
               for action in parser._actions if not (action.help or "").strip()]
    assert missing == []
    top = build_parser()
    (listing,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    assert all(choice.help for choice in listing._choices_actions)  # each command's line in `moebench --help`


def test_the_top_level_help_speaks_to_users(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0
    assert cli.__doc__.strip() not in text  # the module docstring is for developers
    for command in ("generate", "bench", "selfcheck", "MOEBENCH_MODEL", "Mixture-of-Experts"):
        assert command in text


def test_a_missing_path_is_named_as_missing(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert main(["generate", str(missing), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip() == f"moebench: error: {missing}: does not exist"


def test_what_is_there_but_no_checkpoint_keeps_its_own_message(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["generate", str(empty), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"{empty / 'config.json'}" in err and "does not exist" not in err
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    assert main(["bench", str(a_file), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == f"moebench: error: {a_file}: not a checkpoint folder"


def test_the_loaded_line_is_one_short_line_and_verbose_adds_the_details(quantized_checkpoint, capsys):
    model, _ = moebench.load(quantized_checkpoint)
    argv = ["generate", str(quantized_checkpoint), "--prompt", "Hi", "--max-tokens", "2"]
    assert main(argv) == 0
    (loaded,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("loaded ")]
    a = model.args
    assert loaded.startswith(f"loaded {quantized_checkpoint.name}: {a.model_type}, {a.num_hidden_layers} layers, "
                             f"{a.num_experts} experts top-{a.num_experts_per_tok}, ")
    assert model.load_info.bits["mlp.switch_mlp.gate_proj"] in loaded
    assert loaded.endswith(f", {byte_size(model_bytes(model))}")  # its weights, in a unit that suits them
    assert len(loaded) <= 120 and str(quantized_checkpoint.parent) not in loaded
    assert main([*argv, "--verbose"]) == 0
    out = capsys.readouterr().out
    assert str(quantized_checkpoint) in out  # the full path and every module kind's quantization
    assert all(kind in out for kind in model.load_info.bits)
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quantization"] == model.load_info.bits


def shown_default(action: argparse.Action) -> str | None:
    """The text of an option's default as its help must show it, or None when it has none to show."""
    value = action.default
    if not action.option_strings or value in (None, False, argparse.SUPPRESS):
        return None
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def test_every_option_with_a_default_shows_it_in_its_commands_help():
    """bench --prompt-tokens/--gen-tokens, profile --steps/--warmup, microbench --tokens/--repeats and the rest: the
    rendered help of each option says 'default' and the value."""
    unshown, seen = [], set()
    for name, parser in every_parser():
        formatter = parser._get_formatter()
        for action in parser._actions:
            value = shown_default(action)
            if value is None:
                continue
            seen.add(f"{name} {action.option_strings[-1]}")
            text = " ".join(formatter._expand_help(action).split())
            if "default" not in text or value not in text:
                unshown.append(f"{name} {action.option_strings[-1]} (default {value}): {text!r}")
    assert unshown == []
    assert {"moebench bench --prompt-tokens", "moebench bench --gen-tokens", "moebench profile --steps",
            "moebench profile --warmup", "moebench microbench --tokens", "moebench microbench --repeats"} <= seen


def test_generate_help_gives_the_cpus_compiled_default_and_generate_decodes_so(float_checkpoint, capsys):
    """On the CPU generate decodes through the compiled step unless told: its help says so, and it does."""
    generate_parser = dict(every_parser())["moebench generate"]
    (compiled,) = [a for a in generate_parser._actions if "--compiled" in a.option_strings]
    assert "the CPU fused or not" in compiled.help.split("default:")[1].split(";")[0]  # among those on by default
    assert moebench.available_backend() == "reference"
    for fused in ("on", "off"):
        out = run_json(capsys, str(float_checkpoint), "--prompt", "hi", "--max-tokens", "2", "--fused", fused)
        assert out["decode_loop"] == "compiled"


@pytest.mark.parametrize("command", ["generate", "bench", "selfcheck", "profile", "microbench", "eval-tiny", "drift"])
def test_every_json_option_takes_a_file_and_dash_for_stdout(command):
    """One convention: --json FILE; '-' (or no FILE) is stdout."""
    parser = dict(every_parser())[f"moebench {command}"]
    (json_option,) = [a for a in parser._actions if "--json" in a.option_strings]
    assert (json_option.metavar, json_option.nargs, json_option.const, json_option.default) == ("FILE", "?", "-", None)


def test_generate_json_to_a_file_keeps_the_text_report_and_dash_prints_json_alone(float_checkpoint, tmp_path,
                                                                                  capsys):
    argv = ["generate", str(float_checkpoint), "--prompt", "Once", "--max-tokens", "3"]
    record = tmp_path / "generate.json"
    assert main([*argv, "--json", str(record)]) == 0
    out = capsys.readouterr().out
    written = json.loads(record.read_text())
    assert out.startswith("loaded ") and out.rstrip().endswith(written["text"])  # the prompt and its continuation
    assert main([*argv, "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == written["token_ids"]


def test_a_json_file_that_cannot_be_written_is_named_before_the_command_runs(float_checkpoint, tmp_path, capsys):
    target = tmp_path / "no-such-folder" / "out.json"
    assert main(["generate", str(float_checkpoint), "--prompt", "hi", "--json", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (f"moebench: error: --json {target}: cannot write a file there ({target.parent} "
                                    "is no folder it may write in)")
    assert "loaded" not in captured.out
    os.mkfifo(tmp_path / "fifo")  # where a write would block
    assert main(["generate", str(float_checkpoint), "--prompt", "hi", "--json", str(tmp_path / "fifo")]) == 2
    assert "--json" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["missing", "file", "no config"])
def test_a_bad_moebench_model_is_named_by_the_variable(tmp_path, monkeypatch, capsys, kind):
    """A command given no folder reads MOEBENCH_MODEL: a folder there that is no checkpoint names the variable."""
    folder = tmp_path / kind.replace(" ", "-")
    if kind == "file":
        folder.write_text("not a folder")
    elif kind == "no config":
        folder.mkdir()
    monkeypatch.setenv("MOEBENCH_MODEL", os.pathsep.join([str(folder), str(tmp_path)]))
    why = {"missing": "does not exist", "file": "is not a folder", "no config": "holds no config.json"}[kind]
    for argv in (["generate", "--prompt", "hi"], ["profile"], ["bench", "--no-progress"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"moebench: error: MOEBENCH_MODEL='{folder}{os.pathsep}{tmp_path}': {folder} {why}")
    with pytest.raises(moebench.ConfigError, match="MOEBENCH_MODEL"):
        moebench.load()


ROOT = Path(__file__).resolve().parents[1]


def without_site_packages(code: str, *folders: Path) -> subprocess.CompletedProcess:
    """`code` in a Python that sees moebench (this checkout) and `folders` but no site-packages: no MLX."""
    path = [str(f) for f in (*folders, ROOT)]
    return subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path[:0] = {path!r}\n{code}"],
                          capture_output=True, text=True, timeout=120)


def test_without_mlx_the_command_names_the_extra_to_install_in_one_line():
    """A plain `pip install moebench` has no MLX: the console script's first import says which extra installs it."""
    done = without_site_packages("from moebench.cli import main")
    assert done.returncode == 1 and "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith("moebench: error: moebench needs MLX, which is not installed in this Python")
    assert "pip install 'moebench[cpu]'" in done.stderr and "'moebench[cuda]' with an NVIDIA GPU" in done.stderr


def test_an_mlx_that_does_not_import_is_named_and_catchable_as_an_import_error(tmp_path):
    """Linux's plain `mlx` installs without a back end; `import moebench` raises BackendUnavailable, an ImportError
    (and a MoebenchError), before any other module meets it."""
    (tmp_path / "mlx").mkdir()
    (tmp_path / "mlx" / "__init__.py").write_text("")  # a package `mlx` without its compiled `mlx.core`
    done = without_site_packages("try:\n    import moebench\nexcept ImportError as e:\n"
                                 "    print(type(e).__name__, type(e).__mro__[1].__name__, e)", tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("BackendUnavailable MoebenchError moebench needs MLX, "
                                                           "which is installed but does not import")
    assert "moebench[cpu]" in done.stdout and "moebench." not in done.stdout.split("(")[0]


@pytest.mark.parametrize(("system", "extras"), [("Darwin", ["moebench[apple]"]),
                                                ("Linux", ["moebench[cpu]", "moebench[cuda]"])])
def test_the_extra_named_is_the_one_for_the_system(system, extras):
    from moebench.backend import install_hint

    assert all(extra in install_hint(system) for extra in extras)
    assert "macOS and Linux" in install_hint("Windows")
