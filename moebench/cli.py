"""The `moebench` command line. Each subcommand lives beside the code it drives and registers here."""

from __future__ import annotations

import argparse
import sys

from .errors import MoebenchError
from .models.sharding import TENSOR_MODE, init_group, report
from .tools.bench import add_shard_argument
from .tools.bench import register as _add_bench
from .tools.drift import register as _add_drift
from .tools.eval_tiny import add_eval_command
from .tools.flags import SEED
from .tools.json_option import add_json_option, check_json_target, to_stdout, write_json
from .tools.microbench import add_command as _add_microbench
from .tools.notebooks import register as _add_notebooks
from .tools.presets import register as _add_make_random
from .tools.profile import register as _add_profile
from .tools.selfcheck import register as _add_selfcheck
from .tools.train import add_train_command


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="decode a prompt and report tokens, text, timings and dispatch counts")
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: MOEBENCH_MODEL or shipped)")
    p.add_argument("--prompt", required=True,
                   help="the text to continue (with --chat: the user's message)")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user turn through the checkpoint's chat template (chat_template.jinja or "
                        "tokenizer_config.json; moebench's built-in ChatML where the folder has none)")
    p.add_argument("--system", default=None, help="a system message first (implies --chat)")
    p.add_argument("--thinking", choices=("on", "off"), default=None,
                   help="the template's enable_thinking switch (Qwen3; implies --chat; default: the template's)")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="tokens to generate at most (fewer when an eos token ends the decode; default %(default)s)")
    p.add_argument("--sampling", choices=("flags", "model"), default="flags",
                   help="model: start from the checkpoint's generation_config.json (do_sample, temperature, top_p, "
                        "top_k, repetition_penalty); flags given still win. flags: greedy unless set")
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample from the smallest set of tokens whose probabilities reach this (0 < p <= 1)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k likeliest tokens (0: all)")
    p.add_argument("--repetition-penalty", type=float, default=None, help="> 1 discourages tokens already seen")
    p.add_argument("--repetition-context", type=int, default=None,
                   help="how many recent tokens the penalty looks at (default: all, as transformers; mlx-lm uses 20)")
    p.add_argument("--seed", type=SEED, default=None, help="seed of the sampler (a whole number 0..2**64-1)")
    p.add_argument("--fused", choices=("on", "off"), default=None, help="override MOEBENCH_FUSED_MOE")
    p.add_argument("--compiled", choices=("on", "off"), default=None,
                   help="decode through the compiled step (default: on where it was measured faster, the CPU fused or "
                        "not and CUDA with the fused kernels; off on Metal and on CUDA's fallback)")
    add_json_option(p, "the prompt, the token ids, the text, timings and dispatch counts")
    p.add_argument("--verbose", action="store_true",
                   help="under the one-line model summary, its full path and each module kind's quantization")
    add_shard_argument(p)
    p.set_defaults(run=_run_generate)


def _run_generate(a: argparse.Namespace) -> int:
    import warnings
    from dataclasses import asdict, replace

    from .checkpoint.chat import prompt_ids
    from .checkpoint.config import GENERATION_CONFIG, GenerationConfig
    from .checkpoint.loader import load, load_details
    from .checkpoint.tokenizer import stop_ids
    from .decode.loop import generate, use_compiled
    from .decode.sampling import Sampling
    from .execution.executor import dispatch as dispatch_counts
    from .execution.executor import set_fused_moe
    from .execution.plan import launches_line

    check_json_target(a.json)
    if a.fused is not None:
        set_fused_moe(a.fused == "on")
    group = init_group(a.shard) if a.shard else None
    quiet = group is not None and group.rank() != 0  # every rank decodes; rank 0 speaks for them
    text_report = not (to_stdout(a.json) or quiet)
    model, tok = load(a.model, verbose=text_report, shard=group, tensor_parallel=a.shard == TENSOR_MODE)
    if a.verbose and text_report:
        print(load_details(model))
    if tok is None:
        raise MoebenchError(f"{model.load_info.source}: no tokenizer.json, so a text prompt cannot be encoded")
    chat = a.chat or a.system is not None or a.thinking is not None
    variables = {} if a.thinking is None else {"enable_thinking": a.thinking == "on"}
    with warnings.catch_warnings():  # the built-in template's warning: the line below names the template
        warnings.simplefilter("ignore")
        ids = prompt_ids(a.prompt, tok, chat=chat, system=a.system, **variables)
    template = tok.chat_template.source if chat else None
    # --sampling model: the checkpoint's generation_config.json, under any sampling flag given
    sampling = Sampling(seed=a.seed) if a.sampling == "flags" else Sampling.from_generation_config(
        GenerationConfig.from_file(model.load_info.source / GENERATION_CONFIG), a.seed)
    flags = ("temperature", "top_p", "top_k", "repetition_penalty", "repetition_context")
    sampling = replace(sampling, **{k: getattr(a, k) for k in flags if getattr(a, k) is not None})
    stops = stop_ids(model.args.eos_token_id, tok)
    compiled = use_compiled(model, None if a.compiled is None else a.compiled == "on")
    result = generate(model, ids, a.max_tokens, sampling, stop_ids=stops, compiled=compiled)
    text = tok.decode(result.token_ids)  # control tokens (<|im_end|>, ...) left out; token_ids keep them
    counts = dispatch_counts(model)
    dispatch = {str(i): d for i, d in counts["moe"].items()}
    attention = {str(i): d for i, d in counts["attention"].items()}
    launches = counts["launches"]  # what the last decode step's plan launches a layer on the GPU path
    shard = report(model, group) if group is not None else None
    if quiet:
        return 0
    if a.json:
        write_json(a.json, {
            "model": str(model.load_info.source), "quantization": model.load_info.bits, "prompt": a.prompt,
            "system": a.system, "chat_template": template,
            "prompt_ids": result.prompt_ids, "token_ids": result.token_ids, "text": text, "stop_ids": list(stops),
            "sampling": asdict(sampling),
            "timings": {"prompt_seconds": result.prompt_seconds, "decode_seconds": result.decode_seconds,
                        "prompt_tps": result.prompt_tps, "decode_tps": result.decode_tps},
            "decode_loop": "compiled" if compiled else "eager", "dispatch": dispatch, "attention_dispatch": attention,
            "launches": launches, "shard": shard,
        })
    if text_report:
        if template is not None:
            print(f"[chat template: {template}]", file=sys.stderr)
        print(text if chat else a.prompt + text)
        print(f"\n[prompt {len(ids)} tokens, {result.prompt_tps:.1f} tok/s | decode {len(result.token_ids)} tokens, "
              f"{result.decode_tps:.1f} tok/s, {'compiled' if compiled else 'eager'} decode loop]", file=sys.stderr)
        for what, counts in (("MoE", dispatch), ("attention", attention)):
            fused = sum(sum(d["fused"].values()) for d in counts.values())
            fallback = sum(d["fallback"] for d in counts.values())
            reasons = sorted({r for d in counts.values() for r in d["reasons"]})
            print(f"[{what} dispatch: {fused} fused, {fallback} fallback; reasons: {reasons}]", file=sys.stderr)
        if launches is not None:
            print(f"[{launches_line(launches)}]", file=sys.stderr)
        if shard is not None:
            mb = ", ".join(f"{b / 1e6:.2f}" for b in shard["expert_bytes_per_rank"])
            print(f"[sharded over {shard['ranks']} processes; {shard['experts']}; {shard['attention']}; "
                  f"MLPs: {shard['mlps']}; resident experts per rank: {mb} MB]", file=sys.stderr)
    return 0


COMMANDS = [_add_generate, _add_microbench, add_train_command, add_eval_command, _add_bench, _add_make_random,
            _add_selfcheck, _add_profile, _add_drift, _add_notebooks]


DESCRIPTION = """Look inside Mixture-of-Experts decoding on MLX and measure it: decode a prompt with the fused
decode-MoE kernels or the fallback and see which ran and why (generate), compare their speed with mlx-lm's
(bench), check the kernels on this machine (selfcheck), and more below. Given no checkpoint folder, a command
uses MOEBENCH_MODEL or the small trained Qwen2-MoE that ships with moebench."""


class DefaultsShown(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help places it itself (%(default)s) or there is none
    to show (no value, a switch that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        value = action.default
        if "%(default" in text or value in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        return f"{text} (default {shown.replace('%', '%%')})"


class CommandParser(argparse.ArgumentParser):
    """A command's parser: its help shows every default (DefaultsShown)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every command of COMMANDS under one parser."""
    parser = argparse.ArgumentParser(prog="moebench", description=DESCRIPTION)
    sub = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND",
                                parser_class=CommandParser,
                                help="one of these; moebench COMMAND --help describes its options")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.run(a)
    except (MoebenchError, OSError) as e:  # OSError: a file given on the command line (its name is in the message)
        print(f"moebench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
