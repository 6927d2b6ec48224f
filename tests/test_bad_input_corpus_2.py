"""Issue 37's bad-input corpus (round 2), as tests/test_bad_input_corpus.py runs issue 21's: every case in its own
process with a time limit, which must end by itself, by no signal, with the named moebench error (the Python API:
exit 3 and the error's class and words), argparse's usage error naming the flag (exit 2), the command's one-line
error (exit 2, no traceback), or, where the input is fine, with what the user asked for (no silent wrong result).

The classes: hostile chat templates (time and size budgets, recursion, huge ranges, deeply nested content, tools=
and enable_thinking as transformers passes them), JSON nested past Python's parser, added_tokens_decoder keys that
are no plain integers, links that dangle or loop, eos ids past the vocabulary, seeds past 64 bits, exports and
read_frames on paths and files they cannot use, interventions in another shape, threads and forced experts on
every decode path, and the tools' numeric flags. Round 3 (issue 56): drift's recipes, variants and prompts, the files
a command writes (--out, --json), a hybrid's recurrent states and caches, and gpt-oss's harmony chat template. The
processes run a few at a time (the cases are independent), so the file takes about two minutes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from byte_tokenizer import write_byte_tokenizer
from checkpoint.test_chat_harmony import TOOLS, write_harmony_folder
from test_bad_input_corpus import PRELUDE, _environment, assert_named_error

from moebench.checkpoint.files import INDEX_FILE
from moebench.tools.presets import write_random
from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint

TIMEOUT = 60  # a case that hangs fails here
WORKERS = 3
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}BODY{% endfor %}{% endfor %}"
TOKENIZER = "from moebench.checkpoint.tokenizer import Tokenizer\nfrom moebench.checkpoint.chat import prompt_ids\n" \
            "t = Tokenizer.from_folder(FOLDER)\n"
DEEP = "[" * 100_000 + "]" * 100_000


@dataclass(frozen=True)
class Case:
    """`body` (Python, run inside PRELUDE's try) or `argv` (the moebench command); `setup` prepares the case's
    folder (a copy of a tiny checkpoint with a byte tokenizer, or of `base` 'hybrid', make-random's qwen3-next-tiny,
    or an empty folder); the outcome expected: `error` (a moebench error class, or 'usage' for argparse, or 'command'
    for the command's own error) with `words` in its message, or error None: success, `words` in stdout."""

    error: str | None
    words: str
    body: str = ""
    argv: tuple[str, ...] = ()
    setup: Callable[[Path], None] | None = None
    checkpoint: bool = True
    seconds: float = TIMEOUT
    base: str = "qwen2"


def write(name: str, text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_text(text)


def template(text: str) -> Callable[[Path], None]:
    return write("chat_template.jinja", text)


def json_edit(name: str, **fields) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        path = folder / name
        data = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**data, **fields}))
    return edit


def dangling(name: str) -> Callable[[Path], None]:
    def link(folder: Path) -> None:
        (folder / name).unlink(missing_ok=True)
        (folder / name).symlink_to(folder / "gone.json")
    return link


def fifo(name: str) -> Callable[[Path], None]:
    return lambda folder: os.mkfifo(folder / name)


def harmony(folder: Path) -> None:
    write_harmony_folder(folder / "harmony")  # gpt-oss's tokenizer files and chat template, as published


def variants_dir_a_file(folder: Path) -> None:
    (folder / "prompts.jsonl").write_text('"def f(x):"\n')
    (folder / "variants").write_text("a file where the variants would go")


def broken_snapshot(folder: Path) -> None:
    (folder / "snap" / "moebench").mkdir(parents=True)
    (folder / "snap" / "moebench" / "__init__.py").write_text("from .decode import nothing_here\n")


MODEL = "m, t = moebench.load(FOLDER)\n"
NO_MLX_LM = "sys.modules['mlx_lm.convert'] = None  # as if mlx-lm were not installed\n" \
            "from moebench.tools.drift import make_variant\n"
HARMONY = "from moebench.checkpoint.tokenizer import Tokenizer\nfrom moebench.checkpoint.chat import prompt_ids\n" \
          f"t = Tokenizer.from_folder(FOLDER + '/harmony')\nTOOLS = {TOOLS!r}\n" \
          "Q = [{'role': 'user', 'content': 'hi'}]\n"
CALL = "[*Q, {{'role': 'assistant', 'tool_calls': [{call}]}}]"
DRIFT = ("drift", "{folder}", "{folder}:fallback", "--prompts")
FRAMES = "import pandas as pd\nfrom moebench.inspect.export import read_frames, save_frames, save_trace\n" \
         "F = {'tokens': pd.DataFrame({'a': [1, 2]})}\n"
INTERVENTIONS = MODEL + "from moebench.inspect.interventions import clear_interventions, set_interventions\n"
NESTED = "c = []\nfor _ in range(100000):\n    c = [c]\n"
THINKING = "{{ 'ON' if enable_thinking is not defined or enable_thinking else 'OFF' }}"

CASES = {
    # -- 1. chat templates: untrusted input under a time and size budget --------------------------------------------
    "template: two nested large loops (API)": Case(
        "ChatError", "ran past its time budget of 5 s", TOKENIZER + "prompt_ids('hi', t, chat=True)",
        setup=template(LOOPS.replace("BODY", "")), seconds=30),
    "template: two nested large loops (generate --chat)": Case(
        "command", "ran past its time budget", argv=("generate", "{folder}", "--chat", "--prompt", "hi"),
        setup=template(LOOPS.replace("BODY", "")), seconds=30),
    "template: a Stepper over messages": Case(
        "ChatError", "chat_template.jinja: the chat template was stopped: '*' would hold",
        MODEL + "Stepper(m, t, [{'role': 'user', 'content': 'hi'}])", setup=template("{{ [0] * 10**9 }}")),
    "template: a huge range": Case(
        "ChatError", "overflowed: Range too big", TOKENIZER + "prompt_ids('hi', t, chat=True)",
        setup=template("{{ range(10**12) | list }}")),
    "template: a recursive macro": Case(
        "ChatError", "recursed too deeply", TOKENIZER + "prompt_ids('hi', t, chat=True)",
        setup=template("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}")),
    "template: a 10 GB render": Case(
        "ChatError", "its output would hold", TOKENIZER + "prompt_ids('hi', t, chat=True)",
        setup=template(LOOPS.replace("BODY", "{{ 'x' * 1000 }}")), seconds=20),
    "template: a 20 MB value": Case(
        "ChatError", "'*' would hold 20000000 characters", TOKENIZER + "prompt_ids('hi', t, chat=True)",
        setup=template("{{ 'x' * 20000000 }}"), seconds=10),
    "template: text doubled by ~": Case(
        "ChatError", "a joined text would hold", TOKENIZER + "prompt_ids('hi', t, chat=True)",
        setup=template("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}"), seconds=10),
    "template: an integer squared past its bits": Case(
        "ChatError", "would build an integer", TOKENIZER + "prompt_ids('hi', t, chat=True)",
        setup=template("{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
                       "{% endfor %}"), seconds=10),
    "template: a sandbox escape": Case(
        "ChatError", "is unsafe", TOKENIZER + "prompt_ids('hi', t, chat=True)",
        setup=template("{{ ''.__class__.__mro__[1].__subclasses__() }}")),
    "template: content nested 100000 deep": Case(
        "ChatError", "message 0 field 'content': nested more than 100 levels deep",
        TOKENIZER + NESTED + "prompt_ids([{'role': 'user', 'content': c}], t)", setup=template("{{ messages }}")),
    "template: tools= reaches the template": Case(
        None, "add|hi", TOKENIZER + "tools = [{'type': 'function', 'function': {'name': 'add'}}]\n"
                        "print(t.decode(prompt_ids('hi', t, chat=True, tools=tools)))",
        setup=template("{{ tools[0].function.name }}|{{ messages[0].content }}")),
    "template: enable_thinking 'off', 0, 'false', False": Case(
        None, "OFF OFF OFF OFF ON", TOKENIZER + "print(*[t.decode(prompt_ids('hi', t, chat=True, enable_thinking=v)) "
                                    "for v in ('off', 0, 'false', False, 'on')])", setup=template(THINKING)),
    "template: enable_thinking 'maybe'": Case(
        "ChatError", "enable_thinking: expected True or False",
        TOKENIZER + "prompt_ids('hi', t, chat=True, enable_thinking='maybe')", setup=template(THINKING)),
    "template: a link to itself": Case(
        "ConfigError", "chat_template.jinja: cannot read", MODEL,
        setup=lambda f: (f / "chat_template.jinja").symlink_to("chat_template.jinja")),
    # -- 2. JSON nested past Python's parser --------------------------------------------------------------------------
    **{f"JSON 100000 deep: {name}": Case(error, f"{name}: JSON nested too deeply to read", MODEL,
                                         setup=write(name, '{"a": ' + DEEP + "}"))
       for name, error in (("config.json", "ConfigError"), (INDEX_FILE, "CheckpointError"),
                           ("generation_config.json", "ConfigError"), ("tokenizer_config.json", "ConfigError"),
                           ("special_tokens_map.json", "ConfigError"))},
    # -- 3. added_tokens_decoder keys that are no plain integer ------------------------------------------------------
    **{f"added_tokens_decoder key {key!r}": Case(
        "ConfigError", f"tokenizer_config.json: added_tokens_decoder key {key!r} is not a token id", MODEL,
        setup=json_edit("tokenizer_config.json", added_tokens_decoder={key: {"content": "<x>", "special": True}}))
       for key in ("1.5", "abc", "-3", " 7")},
    # -- 4. links that dangle ------------------------------------------------------------------------------------------
    **{f"a dangling link: {name}": Case(error, f"{name}: a link to", MODEL, setup=dangling(name))
       for name, error in (("generation_config.json", "ConfigError"), ("tokenizer_config.json", "ConfigError"),
                           ("tokenizer.json", "CheckpointError"), (INDEX_FILE, "CheckpointError"))},
    "a dangling generation_config.json, generate --sampling model": Case(
        "command", "generation_config.json: a link to", argv=("generate", "{folder}", "--prompt", "hi", "--sampling",
                                                               "model"), setup=dangling("generation_config.json")),
    # -- 5. eos ids far outside the vocabulary ------------------------------------------------------------------------
    "eos id 1e12 in config.json": Case("ConfigError", "config.json: field 'eos_token_id' names id 1000000000000",
                                       MODEL, setup=json_edit("config.json", eos_token_id=[1, 10**12])),
    "eos id 1e12 in generation_config.json": Case(
        "ConfigError", "generation_config.json: field 'eos_token_id' names id 1000000000000", MODEL,
        setup=json_edit("generation_config.json", eos_token_id=10**12)),
    "eos id 2**70 in generation_config.json, generate": Case(
        "command", "field 'eos_token_id'", argv=("generate", "{folder}", "--prompt", "hi"),
        setup=json_edit("generation_config.json", eos_token_id=2**70)),
    # -- 6. seeds ------------------------------------------------------------------------------------------------------
    "Sampling(seed=-1)": Case("DecodeError", "seed must be an integer from 0 to 2**64 - 1",
                              "moebench.Sampling(temperature=1.0, seed=-1)", checkpoint=False),
    "Sampling(seed=2**64)": Case("DecodeError", "seed must be an integer from 0 to 2**64 - 1",
                                 "moebench.Sampling(seed=2**64)", checkpoint=False),
    "Sampling(seed=2**64 - 1) decodes": Case(
        None, "TOKENS 3", MODEL + "r = moebench.generate(m, [1, 2], 3, moebench.Sampling(temperature=1.0, "
                                  "seed=2**64 - 1))\nprint('TOKENS', len(r.token_ids))"),
    **{f"{command} --seed {seed}": Case("usage", "argument --seed:", argv=(command, *extra, "--seed", seed),
                                       checkpoint=False)
       for command, extra, seed in (("generate", ("--prompt", "hi"), "-1"), ("bench", (), str(2**64)),
                                    ("profile", (), "-1"), ("make-random", ("out",), "-7"),
                                    ("train-tiny", ("out",), "1.5"))},
    # -- 7. exports ---------------------------------------------------------------------------------------------------
    "save_frames into a missing folder makes it": Case(
        None, "MADE True", FRAMES + "[p] = save_frames(F, FOLDER + '/new/deeper', 'json')\nprint('MADE', p.is_file())",
        checkpoint=False),
    "save_frames onto a file": Case("MoebenchError", "cannot make the export folder",
                                    FRAMES + "save_frames(F, FOLDER + '/file', 'json')", setup=write("file", "x"),
                                    checkpoint=False),
    "save_frames where its file is a folder": Case(
        "MoebenchError", "tokens.json: not a regular file", FRAMES + "save_frames(F, FOLDER, 'json')",
        setup=lambda f: (f / "tokens.json").mkdir(), checkpoint=False),
    "save_frames onto a FIFO": Case("MoebenchError", "tokens.json: not a regular file",
                                    FRAMES + "save_frames(F, FOLDER, 'json')", setup=fifo("tokens.json"),
                                    checkpoint=False, seconds=20),
    "save_frames to a path with a NUL byte": Case("MoebenchError", "a path cannot hold a NUL byte",
                                                  FRAMES + "save_frames(F, FOLDER + '/a\\0b', 'json')",
                                                  checkpoint=False),
    "save_frames with a non-frame": Case("MoebenchError", "frame 'tokens': expected a pandas DataFrame, got list",
                                         FRAMES + "save_frames({'tokens': [1, 2]}, FOLDER, 'json')", checkpoint=False),
    "save_frames in an unknown format": Case("MoebenchError", "export format must be one of",
                                             FRAMES + "save_frames(F, FOLDER, 'csv')", checkpoint=False),
    "save_trace of a list": Case("MoebenchError", "to_frames takes a Trace", FRAMES + "save_trace([1], FOLDER)",
                                 checkpoint=False),
    "read_frames on a corrupt parquet": Case("MoebenchError", "cannot read it as an exported parquet frame",
                                             FRAMES + "read_frames(FOLDER)", setup=write("a.parquet", "PAR1 not"),
                                             checkpoint=False),
    "read_frames on corrupt JSON": Case("MoebenchError", "cannot read it as an exported json frame",
                                       FRAMES + "read_frames(FOLDER)", setup=write("a.json", "{\"a\": [1,"),
                                       checkpoint=False),
    "read_frames on a FIFO": Case("MoebenchError", "a.json: not a regular file", FRAMES + "read_frames(FOLDER)",
                                  setup=fifo("a.json"), checkpoint=False, seconds=20),
    # -- 8. interventions ---------------------------------------------------------------------------------------------
    "interventions as a list": Case("InterventionError", "or a mapping {layer: Intervention}, got list",
                                    INTERVENTIONS + "set_interventions(m, [Intervention(top_k=1)])"),
    "interventions None": Case("InterventionError", "got NoneType", INTERVENTIONS + "set_interventions(m, None)"),
    "an intervention on layer True": Case("InterventionError", "layer True is not a MoE layer",
                                          INTERVENTIONS + "set_interventions(m, {True: Intervention(top_k=1)})"),
    "an intervention on layer 99": Case("InterventionError", "layer 99 is not a MoE layer",
                                        INTERVENTIONS + "set_interventions(m, {99: Intervention(top_k=1)})"),
    "clear_interventions(m, 5)": Case("InterventionError", "layers must be a list of MoE layer indices",
                                      INTERVENTIONS + "clear_interventions(m, 5)"),
    "clear_interventions(m, [True])": Case("InterventionError", "layer True is not a MoE layer",
                                           INTERVENTIONS + "clear_interventions(m, [True])"),
    # -- 9. threads and forced experts on every path ---------------------------------------------------------------
    "two threads decode one model, a Stepper and generate": Case(
        None, "SAME True", MODEL + "import threading\nfrom moebench.inspect.record import Stepper\n"
        "want = moebench.generate(m, [1, 2, 3], 6).token_ids\nout = {}\n"
        "def go(i):\n    out[i] = (Stepper(m, None, [1, 2, 3], record=i == 0).run(6) if i < 2 else "
        "moebench.generate(m, [1, 2, 3], 6, compiled=i == 3)).token_ids\n"
        "ts = [threading.Thread(target=go, args=(i,)) for i in range(4)]\n[t.start() for t in ts]\n"
        "[t.join() for t in ts]\nprint('SAME', len(out) == 4 and all(v == want for v in out.values()))"),
    "a Stepper stepped from another thread, then from its own": Case(
        None, "OWN 4", MODEL + "import threading\nfrom moebench.errors import DecodeError\n"
        "s = Stepper(m, None, [1, 2, 3])\ns.prefill()\ns.step()\nseen = []\n"
        "def other():\n    try:\n        s.step()\n    except DecodeError as e:\n        seen.append(str(e))\n"
        "t = threading.Thread(target=other)\nt.start()\nt.join()\nassert 'from the thread that started it' in seen[0]\n"
        "s.step()\ns.step()\nprint('OWN', len(s.trace.generated))"),
    **{f"forced experts, {path}": Case(
        None, "FORCED ok", INTERVENTIONS + f"set_interventions(m, {{0: Intervention(force_experts=(0, 3))}})\n"
        f"with moebench.fused_moe({fused}, model=m):\n    {call}\n"
        "print('FORCED', 'ok' if len(ids) == 4 else ids)")
       for path, fused, call in (
           ("generate eager, fused", True, "ids = moebench.generate(m, [1, 2], 4).token_ids"),
           ("generate compiled, fused", True, "ids = moebench.generate(m, [1, 2], 4, compiled=True).token_ids"),
           ("Stepper without recording, fused", True, "ids = Stepper(m, None, [1, 2]).run(4).token_ids"),
           ("Stepper recording, fallback", False,
            "tr = Stepper(m, None, [1, 2], record=True).run(4)\n    ids = tr.token_ids\n"
            "    assert all(sorted(s.layers[0].topk_ids.tolist()) == [0, 3] for s in tr.generated)"))},
    "forced experts past the layer's experts": Case(
        "InterventionError", "valid ids are 0..",
        INTERVENTIONS + "set_interventions(m, {0: Intervention(force_experts=(0, 10**6))})"),
    "forced experts with top_k": Case(
        "InterventionError", "set force_experts or top_k, not both",
        INTERVENTIONS + "set_interventions(m, {0: Intervention(force_experts=(0, 1), top_k=2)})"),
    "forced experts naming one twice": Case(
        "InterventionError", "names an expert twice",
        INTERVENTIONS + "set_interventions(m, {0: Intervention(force_experts=(2, 2))})"),
    "forced expert ids as floats": Case("InterventionError", "expert id 1.0 is not an integer",
                                        "Intervention(force_experts=(1.0, 2))", checkpoint=False),
    # -- 10. the tools ------------------------------------------------------------------------------------------------
    **{f"microbench {flag} {value}": Case("usage", f"argument {flag}:", argv=("microbench", flag, value),
                                          checkpoint=False)
       for flag, value in (("--hidden", "0"), ("--layers", "0"), ("--group-size", "-64"), ("--tokens", "0"))},
    "microbench --rows 0": Case("command", "rows 0: rows per threadgroup", argv=("microbench", "--rows", "0"),
                                checkpoint=False),
    "train-tiny --steps -1": Case("usage", "argument --steps:", argv=("train-tiny", "out", "--steps", "-1"),
                                  checkpoint=False),
    "train-tiny --balance-coef nan": Case("usage", "argument --balance-coef:", checkpoint=False,
                                          argv=("train-tiny", "out", "--balance-coef", "nan")),
    "train() with balance_coef nan": Case(
        "ConfigError", "train setting balance_coef must be a finite number",
        "from moebench.tools.train import TrainSettings, train\n"
        "train(None, [], TrainSettings(balance_coef=float('nan')))",
        checkpoint=False),
    "bench --snapshot a broken folder": Case(
        "command", "--snapshot", argv=("bench", "{folder}", "--snapshot", "{folder}/snap", "--gen-tokens", "2",
                                       "--prompt-tokens", "4", "--repeats", "1", "--no-progress"),
        setup=broken_snapshot),
    "make-random --shard-gb inf": Case("usage", "argument --shard-gb:", checkpoint=False,
                                       argv=("make-random", "out", "--shard-gb", "inf")),
    # -- 11. drift: recipes, variants, prompts ------------------------------------------------------------------------
    "drift: a recipe of a quantized folder without mlx-lm": Case(
        "MoebenchError", "the 8bit recipe of a quantized folder needs mlx-lm to dequantize it first",
        NO_MLX_LM + "make_variant(FOLDER, '8bit', FOLDER + '/variants')"),
    "drift: mxfp4 without mlx-lm": Case("MoebenchError", "the mxfp4 recipe needs mlx-lm",
                                        NO_MLX_LM + "make_variant(FOLDER, 'mxfp4', FOLDER + '/variants')"),
    "drift: an unknown recipe": Case("MoebenchError", "unknown recipe '9bit'",
                                     NO_MLX_LM + "make_variant(FOLDER, '9bit', FOLDER + '/variants')"),
    "drift: a recipe of a file": Case("MoebenchError", "the 4bit recipe is made from a checkpoint folder",
                                      NO_MLX_LM + "make_variant(FOLDER + '/config.json', '4bit', FOLDER)"),
    "drift --variants-dir a file": Case(
        "command", "variants: cannot keep made variants there",
        argv=("drift", "{folder}", "4bit", "--prompts", "{folder}/prompts.jsonl", "--variants-dir",
              "{folder}/variants"),
        setup=variants_dir_a_file),
    "drift --prompts a FIFO": Case("command", "fifo: the prompts must be a regular file",
                                   argv=(*DRIFT, "{folder}/fifo"), setup=fifo("fifo"), seconds=30),
    "drift: prompt ids past the vocabulary": Case(
        "command", "prompt 1: token id 99999 is outside the vocabulary of variant", argv=(*DRIFT, "{folder}/p.jsonl"),
        setup=write("p.jsonl", "[1, 2]\n[3, 99999]\n")),
    "drift: prompt ids true and false": Case("command", "p.jsonl: prompt 0 must be a text, a list of token ids",
                                             argv=(*DRIFT, "{folder}/p.jsonl"), setup=write("p.jsonl", "[true, 2]\n")),
    "drift: transformers on a quantized folder": Case(
        "command", "MLX-quantized, and transformers runs float checkpoints",
        argv=("drift", "{folder}", "transformers", "--prompts", "{folder}/p.jsonl"),
        setup=write("p.jsonl", "[1, 2]\n")),
    "drift: transformers fed ids past its vocabulary": Case(
        "MoebenchError", "prompt 0: token id 300 is outside",
        "from moebench.inspect.drift import transformers_routing\nimport json, pathlib\n"
        "c = pathlib.Path(FOLDER, 'config.json')\ncfg = json.loads(c.read_text())\ncfg.pop('quantization')\n"
        "c.write_text(json.dumps(cfg))\ntransformers_routing(FOLDER, [[1, 300]])"),
    # -- 12. the files a command writes ---------------------------------------------------------------------------
    "drift --out x.csv (the table would overwrite the frame)": Case(
        "command", "name a .parquet file", argv=(*DRIFT, "{folder}/p.jsonl", "--out", "{folder}/x.csv"),
        setup=write("p.jsonl", "[1, 2]\n")),
    "drift --out a FIFO": Case("command", "--out", argv=(*DRIFT, "{folder}/p.jsonl", "--out", "{folder}/fifo"),
                               setup=lambda f: (write("p.jsonl", "[1, 2]\n")(f), os.mkfifo(f / "fifo")), seconds=30),
    "drift --out under a file": Case(
        "command", "is no folder it may write in", argv=(*DRIFT, "{folder}/p.jsonl", "--out", "{folder}/x/y.parquet"),
        setup=lambda f: (write("p.jsonl", "[1, 2]\n")(f), write("x", "a file")(f))),
    "generate --json a FIFO": Case("command", "--json", argv=("generate", "{folder}", "--prompt", "hi", "--json",
                                                             "{folder}/fifo"), setup=fifo("fifo"), seconds=30),
    # -- 13. a hybrid's recurrent states and caches -----------------------------------------------------------------
    "hybrid: the model called over KV caches": Case(
        "DecodeError", "a linear-attention layer was given a KVCache",
        MODEL + "from moebench.decode.cache import make_cache\nm(mx.array([[1, 2]]), cache=make_cache(len(m.layers)))",
        base="hybrid"),
    "hybrid: a state rewound past what it keeps": Case(
        "DecodeError", "cannot rewind to position 1: it keeps the states at positions [0, 3]",
        MODEL + "from moebench.decode.cache import layer_caches\nc = layer_caches(m, 1)\n"
                "m(mx.array([[1, 2, 3]]), cache=c)\nc[0].rewind_to(1)", base="hybrid"),
    "hybrid: caches keeping no write": Case(
        "DecodeError", "keep must be an integer >= 1, got 0",
        MODEL + "from moebench.decode.cache import layer_caches\nlayer_caches(m, 0)", base="hybrid"),
    "hybrid: a static cache of no positions": Case(
        "DecodeError", "StaticCache: capacity must be an integer >= 1",
        MODEL + "from moebench.decode.cache import StaticCache\nStaticCache.for_model(m, 0, 1)", base="hybrid"),
    "hybrid: a Stepper fed an id past the vocabulary": Case(
        "DecodeError", "feed token id 256 is not an id of the vocabulary",
        MODEL + "s = Stepper(m, t, 'hi')\ns.prefill()\ns.step(feed=256)", base="hybrid"),
    "hybrid: a decode past its positions": Case(
        "DecodeError", "past the model's max_position_embeddings", MODEL + "moebench.generate(m, [1, 2], 10**6)",
        base="hybrid"),
    "hybrid: profile in its default eager mode": Case(
        None, "RC 0", "from moebench.cli import main\nprint('RC', main(['profile', FOLDER, '--steps', '1', '--warmup', "
                      "'0', '--gen-tokens', '2', '--prompt-tokens', '2']))", base="hybrid"),
    "hybrid: make-random's checkpoint decodes text": Case(
        None, "TEXT True", MODEL + "print('TEXT', len(moebench.generate(m, t.encode('def'), 4).token_ids) == 4 and "
                                   "t.decode(t.encode('def f(x):')) == 'def f(x):')", base="hybrid"),
    # -- 14. gpt-oss's harmony chat template --------------------------------------------------------------------------
    "harmony: a role it has no turn for": Case(
        "ChatError", "harmony has no turn for role robot",
        HARMONY + "prompt_ids([{'role': 'robot', 'content': 'hi'}], t)", setup=harmony, checkpoint=False),
    "harmony: a tool call without its function": Case(
        "ChatError", "chat_template.jinja: the chat template cannot render these messages",
        HARMONY + "prompt_ids(" + CALL.format(call="{'type': 'function'}") + ", t, tools=TOOLS)", setup=harmony,
        checkpoint=False),
    "harmony: tool arguments that are no JSON": Case(
        "ChatError", "field 'tool_calls': bytes is not JSON data",
        HARMONY + "prompt_ids(" + CALL.format(call="{'type': 'function', 'function': {'name': 'add', "
                                                   "'arguments': b'x'}}") + ", t, tools=TOOLS)",
        setup=harmony, checkpoint=False),
    "harmony: reasoning_effort a number": Case(
        "ChatError", "the chat template failed on these messages", HARMONY + "prompt_ids(Q, t, reasoning_effort=7)",
        setup=harmony, checkpoint=False),
    "harmony: tools that are no list": Case("ChatError", "tools must be a list of JSON objects",
                                            HARMONY + "prompt_ids(Q, t, tools='add')", setup=harmony,
                                            checkpoint=False),
    "harmony: content past the size budget": Case(
        "ChatError", "past the size budget", HARMONY + "prompt_ids([{'role': 'user', 'content': 'x' * 9_000_000}], t)",
        setup=harmony, checkpoint=False, seconds=30),
    "harmony: a tool call renders as the published template writes it": Case(
        None, "assistant to=functions.add<|channel|>commentary json<|message|>{\"a\": 1}<|call|>",
        HARMONY + "print(t.decode(prompt_ids(" + CALL.format(call="{'type': 'function', 'function': {'name': "
                                                                  "'add', 'arguments': {'a': 1}}}")
        + ", t, tools=TOOLS), skip_special_tokens=False))", setup=harmony, checkpoint=False),
}


def run(case: Case, folder: Path) -> tuple[subprocess.CompletedProcess | None, float]:
    """The case in its own process: (the finished process, or None when it ran past the time limit; seconds)."""
    if case.argv:
        command = [sys.executable, "-m", "moebench.cli", *(a.format(folder=folder) for a in case.argv)]
    else:
        body = textwrap.indent(textwrap.dedent(case.body).strip(), "    ")
        command = [sys.executable, "-c", PRELUDE.format(body=body), str(folder)]
    start = time.monotonic()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=_environment(),
                              cwd=folder)
    except subprocess.TimeoutExpired:
        proc = None
    return proc, time.monotonic() - start


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess | None, float]]:
    """Every selected case, run a few processes at a time."""
    chosen = {item.callspec.params["case"] for item in request.session.items
              if item.path == Path(__file__) and hasattr(item, "callspec") and "case" in item.callspec.params}
    root = tmp_path_factory.mktemp("corpus2")
    bases = {"qwen2": write_random_checkpoint(root / "base", qwen2_moe_config(), seed=3, bits=4)}
    write_byte_tokenizer(bases["qwen2"])
    if any(CASES[name].base == "hybrid" for name in chosen):  # make-random's, its tokenizer included
        bases["hybrid"] = write_random(root / "hybrid", "qwen3-next-tiny", dtype="float32", generator="numpy",
                                       progress=False)
    folders = {}
    for i, name in enumerate(sorted(chosen)):
        case = CASES[name]
        folder = Path(shutil.copytree(bases[case.base], root / f"case{i}")) if case.checkpoint else root / f"case{i}"
        folder.mkdir(exist_ok=True)
        if case.setup is not None:
            case.setup(folder)
        folders[name] = folder
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {name: pool.submit(run, CASES[name], folders[name]) for name in folders}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_ends_named(case, outcomes):
    expected = CASES[case]
    proc, seconds = outcomes[case]
    assert proc is not None, f"the case hung for {TIMEOUT} s"
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}: {proc.stderr[-2000:]}"
    assert seconds < expected.seconds, f"took {seconds:.1f} s"
    if expected.error is None:
        assert proc.returncode == 0 and "NO ERROR" in proc.stdout, proc.stdout + proc.stderr[-2000:]
        assert expected.words in proc.stdout, proc.stdout
    elif expected.error in ("usage", "command"):
        assert proc.returncode == 2, f"rc {proc.returncode}: {proc.stderr[-2000:]}"
        assert "Traceback" not in proc.stderr and expected.words in proc.stderr, proc.stderr[-2000:]
        assert ("moebench: error:" in proc.stderr) is (expected.error == "command"), proc.stderr[-2000:]
    else:
        assert_named_error(proc, expected.error, expected.words)
