"""moebench drift: which experts run, per token and layer, across variants of one model (moebench.inspect.drift).

    moebench drift FLOAT_FOLDER 8bit 4bit mxfp4 --prompts prompts.jsonl
    moebench drift FOLDER FOLDER:fallback --held-out code --tokens 1000
    moebench drift FOLDER transformers server_routing.b64 --prompts p.txt

Each variant after the first is a checkpoint folder, a routing file (read_routing), `transformers` (HF's PyTorch
model of the first folder, float32), a folder with `:fused` / `:fallback` (its fused switch), or a recipe name that
is made from the first folder: with mlx-lm installed through `mlx_lm.convert` (its recipes, named as mlx-lm names
them: 2bit..8bit affine group 64, mixed_2_6 / mixed_3_4 / mixed_3_6 / mixed_4_6, mxfp4 / mxfp8 / nvfp4 by q_mode;
`float` dequantizes a quantized folder, and a quantized reference is dequantized first so that every recipe starts
from float weights), else the affine bit widths of a float folder through moebench's own writer. Made variants are
kept in --variants-dir by the content of the folder they were made from (source_digest), and reused.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

from ..checkpoint.config import read_json_object, read_model_args
from ..checkpoint.files import TensorStore
from ..errors import MoebenchError
from ..inspect.drift import TIE_MARGIN, Variant, as_variant, drift, transformers_routing
from .corpus import DEFAULT_CACHE, DOMAINS
from .flags import at_least, finite
from .json_option import add_json_option, check_json_target, check_output_file, report
from .progress import Progress
from .text_table import WIDTH

AFFINE = re.compile(r"^([2-8])-?bit$")
MIXED = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")  # mlx_lm.convert's QUANT_RECIPES
FP_MODES = ("mxfp4", "mxfp8", "nvfp4")  # mlx_lm.convert's q_mode choices besides affine
GROUP_SIZE = 64
SUFFIXES = {"fused": True, "fallback": False}
DIGESTS = "digests.json"  # in a variants folder: source_digest's memo


def is_recipe(name: str) -> bool:
    return bool(AFFINE.match(name)) or name in MIXED or name in FP_MODES or name == "float"


def recipe_name(name: str) -> str:
    """The name mlx-lm's converted folders carry ('4bit', 'mixed_3_6', 'mxfp4', 'float')."""
    m = AFFINE.match(name)
    return f"{m.group(1)}bit" if m else name


def source_digest(source: Path, memo: Path | None = None) -> str:
    """A short digest of a checkpoint folder's content: each file's name and bytes. The same weights anywhere (a
    copy, another path to them, the installed package's shipped model) share their variants; other weights, or a
    folder rewritten, get their own. Reading a large checkpoint takes a while, so with `memo` (a JSON file) the
    digest is remembered under the folder's path and its files' sizes and modification times, and read again only
    when one of them changes."""
    files = sorted(p for p in source.iterdir() if p.is_file())
    stamp = json.dumps([str(source.resolve()), *((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)])
    known = _read_memo(memo)
    if stamp in known:
        return known[stamp]
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}:".encode())
        with f.open("rb") as data:
            while chunk := data.read(1 << 24):
                h.update(chunk)
    digest = h.hexdigest()[:16]
    if memo is not None:
        memo.parent.mkdir(parents=True, exist_ok=True)
        partial = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps({**known, stamp: digest}))
        partial.replace(memo)  # whole or not at all, should another process read it meanwhile
    return digest


def _read_memo(memo: Path | None) -> dict[str, str]:
    """source_digest's memo; a cache, so one unreadable or not of its making counts as empty (it is rewritten)."""
    try:
        known = json.loads(memo.read_text()) if memo is not None else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return known if isinstance(known, dict) and all(isinstance(v, str) for v in known.values()) else {}


def _mlx_lm_convert():
    """mlx_lm.convert.convert, or None without mlx-lm."""
    try:
        from mlx_lm.convert import convert
    except ImportError:
        return None
    return convert


def make_variant(source: Path, recipe: str, out_dir: Path) -> Path:
    """`source` converted by `recipe` into out_dir/<source name>-<digest>-<recipe> (source_digest, remembered in
    out_dir), reused when a folder of that digest and recipe is there under any name. mlx-lm makes every recipe from
    float weights (a quantized source is dequantized first, the float variant); without it moebench's writer makes
    2bit..8bit from a float folder, and anything else is an error naming the recipe asked for."""
    recipe = recipe_name(recipe)
    if not is_recipe(recipe):
        raise MoebenchError(f"unknown recipe {recipe!r}: 2bit..8bit, {', '.join(MIXED)}, {', '.join(FP_MODES)} "
                            "or float")
    source, out_dir = Path(source), Path(out_dir)
    if not source.is_dir():
        raise MoebenchError(f"{source}: the {recipe} recipe is made from a checkpoint folder, and this is none")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, no permission
        raise MoebenchError(f"{out_dir}: cannot keep made variants there: {e}") from e
    quantized = read_model_args(source / "config.json").quantization is not None
    key = f"{source_digest(source, out_dir / DIGESTS)}-{recipe}"
    made = sorted(p for p in out_dir.glob(f"*-{key}") if (p / "config.json").exists())
    if made:
        return made[0]
    out = out_dir / f"{source.name}-{key}"
    convert = _mlx_lm_convert()
    if convert is None and not AFFINE.match(recipe):
        raise MoebenchError(f"the {recipe} recipe needs mlx-lm (pip install mlx-lm); without it moebench's writer "
                            "makes 2bit..8bit from a float folder")
    if convert is None and quantized:
        raise MoebenchError(f"{source}: the {recipe} recipe of a quantized folder needs mlx-lm to dequantize it first "
                            "(pip install mlx-lm); without it moebench's writer quantizes float folders only")
    if recipe != "float" and quantized:
        source = make_variant(source, "float", out_dir)  # quantize from float weights, never re-quantize
    if convert is None:
        return _write_affine(source, recipe, out)
    if recipe == "float":
        options = dict(dequantize=True)
    elif recipe in MIXED:
        options = dict(quantize=True, quant_predicate=recipe, q_group_size=GROUP_SIZE)
    elif recipe in FP_MODES:
        options = dict(quantize=True, q_mode=recipe)
    else:
        options = dict(quantize=True, q_bits=int(recipe[0]), q_group_size=GROUP_SIZE)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # mlx-lm's progress lines; stdout stays the report's
            convert(str(source), str(out), **options)
    except Exception as e:  # mlx-lm raises what its loaders raise; name the folder and the recipe
        raise MoebenchError(f"{source}: mlx_lm.convert could not make the {recipe} variant: {e}") from e
    return out


def _write_affine(source: Path, recipe: str, out: Path) -> Path:
    """Without mlx-lm: a float folder's tensors (read as moebench reads a checkpoint, each file checked) quantized by
    moebench.tools.writer in an affine recipe."""
    from .writer import quantize_tensors, save_checkpoint

    config = read_json_object(source / "config.json")
    args = read_model_args(source / "config.json")
    store = TensorStore(source, progress=False)
    bits = int(recipe[0])
    tensors = ((name, store.peek(name)) for name in sorted(store.names()))
    quantized = quantize_tensors(tensors, GROUP_SIZE, bits, "per-expert", args.num_experts)
    try:
        save_checkpoint(out, {**config, "quantization": {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}},
                        quantized)
        for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (source / extra).exists():
                (out / extra).write_bytes((source / extra).read_bytes())
    except OSError as e:  # a full disk
        raise MoebenchError(f"{out}: cannot write the {recipe} variant: {e}") from e
    return out


def read_prompts(path: Path) -> list:
    """A prompts file: .json / .jsonl (texts, token-id lists, or objects with 'prompt'), else one text. Only a
    regular file is read (a FIFO would block); a token id must be an integer (true and false are none)."""
    if not path.is_file():
        raise MoebenchError(f"{path}: the prompts must be a regular file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MoebenchError(f"{path}: cannot read the prompts: {e}") from e
    if path.suffix not in (".json", ".jsonl"):
        if not text.strip():
            raise MoebenchError(f"{path}: the prompts file is empty")
        return [text]
    try:
        items = json.loads(text) if path.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x.strip()]
    except json.JSONDecodeError as e:
        raise MoebenchError(f"{path}: not valid JSON: {e}") from e
    items = items if isinstance(items, list) else [items]
    out = []
    for i, item in enumerate(items):
        item = item.get("prompt") if isinstance(item, dict) else item
        if not (isinstance(item, str) or (isinstance(item, list) and all(type(t) is int for t in item))):
            raise MoebenchError(f"{path}: prompt {i} must be a text, a list of token ids or {{'prompt': ...}}")
        out.append(item)
    if not out:
        raise MoebenchError(f"{path}: no prompts")
    return out


def held_out(tokenizer, domain: str, tokens: int, cache: Path = DEFAULT_CACHE) -> list[int]:
    """The first `tokens` tokens of the shipped model's held-out `domain` stream (eval-tiny's validation text)."""
    from .corpus import load_corpus
    from .train import token_stream

    if tokenizer is None:
        raise MoebenchError("--held-out needs a tokenizer: the first variant's folder has no tokenizer.json")
    return token_stream(tokenizer, load_corpus(cache)[domain].valid)[:tokens].tolist()


def windows(ids: list[int], window: int) -> list[list[int]]:
    return [ids[i:i + window] for i in range(0, len(ids), window)]


def _split(spec: str) -> tuple[str, bool | None]:
    """'FOLDER:fallback' -> ('FOLDER', False); a word without a switch suffix -> (word, None)."""
    base, _, suffix = spec.rpartition(":")
    return (base, SUFFIXES[suffix]) if base and suffix in SUFFIXES else (spec, None)


def build_variants(specs: list[str], variants_dir: Path) -> list[Variant | None]:
    """The command line's variant words as Variants, made and loaded in order under a progress bar; None stands
    for 'transformers' (its routing needs the prompts: transformers_routing)."""
    first = Path(_split(specs[0])[0])
    arms: list[Variant | None] = []
    with Progress(specs, desc="variants", unit="variant") as bar:  # closed, its line ended, on an error
        for spec in bar:
            word, fused = _split(spec)
            if word == "transformers":
                arms.append(None)
            elif not Path(word).exists() and is_recipe(word):
                arms.append(as_variant(make_variant(first, word, variants_dir), recipe_name(word), fused))
            else:
                arms.append(as_variant(word, None, fused))
            if fused is not None:
                arms[-1].name = f"{arms[-1].name}:{'fused' if fused else 'fallback'}"
    return arms


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drift", help="routing drift: which experts run, per token and layer, across variants of one "
                                     "model (quantizations, kernels, engines, routing files)")
    p.add_argument("variants", nargs="+", metavar="VARIANT",
                   help="the reference (a checkpoint folder), then each variant: a folder, a routing file, a recipe "
                        "made from the reference (4bit, 8bit, mixed_3_6, mxfp4, float, ...), 'transformers', or "
                        "FOLDER:fused / FOLDER:fallback")
    p.add_argument("--prompts", type=Path, default=None,
                   help="prompts file: .json/.jsonl (texts or token-id lists), else the whole file as one text")
    p.add_argument("--held-out", choices=DOMAINS, action="append", default=None,
                   help="use the shipped model's held-out text of this domain (repeatable; instead of --prompts)")
    p.add_argument("--tokens", type=at_least(1), default=1000,
                   help="tokens per --held-out domain, and the most of each prompt fed (default %(default)s)")
    p.add_argument("--window", type=at_least(1), default=256,
                   help="feed held-out text in sequences of this many tokens (default %(default)s)")
    p.add_argument("--tie-margin", type=finite(0.0), default=TIE_MARGIN,
                   help="router-probability margin below which a change is a near-tie (default %(default)s)")
    p.add_argument("--variants-dir", type=Path, default=DEFAULT_CACHE / "variants",
                   help="where made variants are written and reused (default %(default)s)")
    p.add_argument("--out", type=Path, default=None,
                   help="write the per-token-and-layer frame here (parquet) and the per-layer table beside it (.csv)")
    add_json_option(p, "the variants, the per-layer table and the timings")
    p.set_defaults(run=_run)


def _run(a: argparse.Namespace) -> int:
    if len(a.variants) < 2:
        raise MoebenchError("drift needs a reference and at least one variant")
    if (a.prompts is None) == (a.held_out is None):
        raise MoebenchError("give exactly one of --prompts FILE and --held-out DOMAIN")
    check_json_target(a.json)
    if a.out is not None:
        if a.out.suffix == ".csv":  # the table would be written over the frame
            raise MoebenchError(f"--out {a.out}: the frame is parquet and the per-layer table goes beside it as .csv: "
                                "name a .parquet file")
        for path in (a.out, a.out.with_suffix(".csv")):
            check_output_file("--out", path, make_folder=True)
    start = time.perf_counter()
    arms = build_variants(a.variants, a.variants_dir)
    made = time.perf_counter() - start
    tokenizer = next((v.tokenizer for v in arms if v.tokenizer is not None), None)
    if a.held_out:
        prompts = [w for d in a.held_out for w in windows(held_out(tokenizer, d, a.tokens), a.window)]
    else:
        prompts = [p[:a.tokens] if isinstance(p, list) else tokenizer_cut(tokenizer, p, a.tokens)
                   for p in read_prompts(a.prompts)]
    for i, arm in enumerate(arms):
        if arm is None:
            if arms[0] is None or arms[0].model is None:
                raise MoebenchError("'transformers' needs the reference to be a checkpoint folder")
            arms[i] = Variant("transformers", routing=transformers_routing(arms[0].model.load_info.source, prompts))
    start = time.perf_counter()
    result = drift(arms, prompts, tokenizer, a.tie_margin)
    result.frame()
    seconds = time.perf_counter() - start
    table = result.by_layer()
    if a.out is not None:
        try:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            result.frame().to_parquet(a.out)
            table.to_csv(a.out.with_suffix(".csv"), index=False)
        except OSError as e:  # a full disk
            raise MoebenchError(f"--out {a.out}: cannot write the frame and its table: {e}") from e
    report(a.json, f"{result}\n{table.to_string(index=False, line_width=WIDTH)}",
           {"variants": result.names, "tokens": int(len(result.tokens)), "seconds": seconds, "made_seconds": made,
            "by_layer": table.to_dict(orient="records")})
    print(f"[{len(result.tokens)} tokens through {len(arms)} variants in {seconds:.1f} s; variants made/loaded in "
          f"{made:.1f} s]", file=sys.stderr)
    return 0


def tokenizer_cut(tokenizer, text: str, tokens: int) -> list[int]:
    if tokenizer is None:
        raise MoebenchError("text prompts need a tokenizer: the variants' folders have no tokenizer.json")
    return list(np.asarray(tokenizer.encode(text))[:tokens].tolist())
