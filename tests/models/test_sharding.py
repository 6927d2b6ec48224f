"""Expert parallelism (and tensor parallelism): each rank loads only its span of experts (and of heads and MLP
widths; a hybrid's linear-attention key heads with their value heads, conv channels and gates), and two processes under
mlx.launch (the ring backend over 127.0.0.1) decode as one process does, fused kernels on and off, with the same
records: Qwen2-MoE, Qwen3-MoE, gpt-oss, and the hybrids Qwen3-Next and Qwen3.5-MoE in both projection layouts."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from sharded_run import RECORDED

from moebench.checkpoint.config import read_model_args
from moebench.checkpoint.files import TensorStore
from moebench.checkpoint.loader import SHIPPED_MODEL, load
from moebench.checkpoint.weights import load_weights
from moebench.errors import CheckpointError, ConfigError, MoebenchError
from moebench.models import family
from moebench.models.gated_delta import FUSED_QKVZ
from moebench.models.layers import ColumnShard, RowShard
from moebench.models.sharding import (
    TENSOR_MODE,
    conv_rows,
    expert_span,
    resident_attention_bytes,
    resident_expert_bytes,
    resident_mlp_bytes,
    shard_experts,
    shard_heads,
    shard_mlps,
    split_mlps,
)
from moebench.models.switch import ExpertShard
from moebench.tools.local_group import free_ports
from moebench.tools.presets import write_random
from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint

RUN = Path(__file__).with_name("sharded_run.py")
PROMPT = [40, 69, 12, 7, 230, 18, 91, 3]
TOKENS = 16
SHIPPED_EXPERTS = read_model_args(SHIPPED_MODEL / "config.json").num_experts
NEAR_TIE = 1e-3  # a top-two logit margin this small may flip under a different float32 summation order


class Ranks:
    """Stands in for an mx.distributed group of `size` processes seen from rank `rank` (loading needs no
    collective call)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.fixture(scope="module")
def qwen3_stacked(tmp_path_factory) -> Path:
    config = qwen2_moe_config(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=64,
                              shared_expert_intermediate_size=0, qkv_bias=False, num_experts=16,
                              num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])
    return write_random_checkpoint(tmp_path_factory.mktemp("qwen3") / "ckpt", config, seed=3, bits=4,
                                   layout="stacked", shard_bytes=400_000)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Path:
    """make-random's gpt-oss-tiny (mlx-lm's layout: mxfp4 experts with biases, 8-bit router, 4-bit attention with
    biases and sinks, a window of 4 on layer 0) in float32."""
    return write_random(tmp_path_factory.mktemp("gpt-oss") / "ckpt", "gpt-oss-tiny", dtype="float32", group_size=32,
                        generator="numpy", progress=False)


def hybrid(tmp_path_factory, preset: str) -> Path:
    """make-random's tiny hybrid (mlx-lm's layout: 4-bit but for the 8-bit router and shared-expert gate; three
    Gated DeltaNet layers of 2 key and 4 value heads, then gated full attention of 4 query and 2 key/value heads; 8
    experts top-2 and a shared expert of width 128) in float32."""
    return write_random(tmp_path_factory.mktemp(preset) / "ckpt", preset, dtype="float32", group_size=32,
                        generator="numpy", progress=False)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory) -> Path:
    """Qwen3-Next's fused linear projections (in_proj_qkvz, in_proj_ba: rows grouped per key head)."""
    return hybrid(tmp_path_factory, "qwen3-next-tiny")


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory) -> Path:
    """Qwen3.5's split linear projections (in_proj_qkv as [q | k | v], in_proj_z, in_proj_b, in_proj_a)."""
    return hybrid(tmp_path_factory, "qwen3.5-moe-tiny")


def hub(tmp_path_factory, model_type: str) -> Path:
    """transformers' tiny float folder of the family as the hub lays it out (test_qwen3_next's: Qwen3-Next's experts
    one by one, Qwen3.5's multimodal folder with fused experts; norms as offsets from 1, conv weights [C, 1, K]),
    with the heads of the make-random ones."""
    pytest.importorskip("torch", reason="the hub folders are written by transformers (dev dependency torch)")
    from test_qwen3_next import HUB, save, torch_model

    return save(torch_model(model_type, 1), tmp_path_factory.mktemp(model_type) / "hub", HUB[model_type])


@pytest.fixture(scope="module")
def qwen3_next_hub(tmp_path_factory) -> Path:
    return hub(tmp_path_factory, "qwen3_next")


@pytest.fixture(scope="module")
def qwen3_5_hub(tmp_path_factory) -> Path:
    return hub(tmp_path_factory, "qwen3_5_moe")


TOTALS = {"shipped": SHIPPED_EXPERTS, "qwen3": 16, "gpt_oss": 8, "qwen3_next": 8, "qwen3_5": 8}
HYBRIDS = ("qwen3_next", "qwen3_5")


@pytest.mark.parametrize("total", [7, 16, 60, 128])
@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_expert_spans_cover_every_expert_once(total, size):
    spans = [expert_span(total, r, size) for r in range(size)]
    assert spans[0][0] == 0 and spans[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    held = [end - first for first, end in spans]
    assert max(held) - min(held) <= 1


def test_a_rank_left_without_experts_is_a_config_error():
    model = family("qwen2_moe").model(read_model_args(SHIPPED_MODEL / "config.json"))
    ranks = SHIPPED_EXPERTS + 4
    with pytest.raises(ConfigError, match=f"{ranks} ranks for layer 0's {SHIPPED_EXPERTS} experts: rank 0 would hold "
                                          "none"):
        shard_experts(model, Ranks(0, ranks))


def test_load_takes_only_an_mx_distributed_group():
    with pytest.raises(ConfigError, match="shard must be an mx.distributed.Group"):
        load(SHIPPED_MODEL, shard=Ranks(0, 2))


def _loaded(folder: Path, group: Ranks | None, tensor: bool = False):
    args = read_model_args(folder / "config.json")
    store = TensorStore(folder)
    if family(args.model_type).stored_layout is not None:  # gpt-oss's names, as load renames them
        args = family(args.model_type).stored_layout(store, args)
    model = family(args.model_type).model(args)
    if group is not None:
        shard_experts(model, group)
        if tensor:
            shard_heads(model, group)
            shard_mlps(model, group)
    load_weights(model, store, mx.float32, args.quantization)
    store.check_all_used()
    return model


@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
def test_each_rank_loads_exactly_its_span_of_experts(layout, qwen3_stacked):
    folder = SHIPPED_MODEL if layout == "per-expert" else qwen3_stacked
    whole = _loaded(folder, None)
    size = 3  # uneven spans of 16 experts (5, 5, 6), of 32 (10, 11, 11), of 64 (21, 21, 22)
    shards = [_loaded(folder, Ranks(r, size)) for r in range(size)]
    assert sum(resident_expert_bytes(m) for m in shards) == resident_expert_bytes(whole)
    for r, model in enumerate(shards):
        for i, block in model.moe_blocks().items():
            experts, full = block.switch_mlp, whole.moe_blocks()[i].switch_mlp
            assert isinstance(experts, ExpertShard)
            total = full.num_experts
            first, end = expert_span(total, r, size)
            assert (experts.first, experts.num_experts, experts.total) == (first, end - first, total)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for part in ("weight", "scales", "biases"):
                    mine, theirs = getattr(experts, proj)[part], getattr(full, proj)[part][first:end]
                    assert mine.dtype == theirs.dtype and mx.array_equal(mine, theirs).item(), (r, i, proj, part)
        # everything but the routed experts is whole on every rank
        assert mx.array_equal(model.layers[0].mlp.gate["weight"], whole.layers[0].mlp.gate["weight"]).item()


@pytest.mark.parametrize("model", ["shipped", "qwen3"])
def test_each_rank_loads_exactly_its_heads(model, qwen3_stacked):
    folder = SHIPPED_MODEL if model == "shipped" else qwen3_stacked
    whole = _loaded(folder, None)
    shards = [_loaded(folder, Ranks(r, 2), tensor=True) for r in range(2)]
    norms = sum(n.weight.nbytes for layer in whole.layers for n in (layer.self_attn.get("q_norm"),
                                                                     layer.self_attn.get("k_norm")) if n is not None)
    assert sum(resident_attention_bytes(m) for m in shards) == resident_attention_bytes(whole) + norms
    for r, sharded in enumerate(shards):
        for mine, full in zip(sharded.layers, whole.layers, strict=True):
            a, b = mine.self_attn, full.self_attn
            assert (a.n_heads, a.n_kv_heads) == (b.n_heads // 2, b.n_kv_heads // 2)
            for proj in ("q_proj", "k_proj", "v_proj"):
                shard, rows = a[proj], b[proj].shape[0] // 2
                assert isinstance(shard, RowShard) and (shard.first, shard.total) == (r * rows, 2 * rows)
                for part in ("weight", "scales", "biases", "bias"):
                    if part in b[proj]:
                        theirs = b[proj][part][r * rows:(r + 1) * rows]
                        assert mx.array_equal(shard[part], theirs).item(), (r, proj, part)
            out, width = a.o_proj, b.o_proj.shape[1] // 2
            assert isinstance(out, ColumnShard) and out.shape == (b.o_proj.shape[0], width)
            parts, full_parts = out.quantized_parts(), b.o_proj.quantized_parts()
            words, groups = parts.weight.shape[1], parts.scales.shape[1]
            assert mx.array_equal(parts.weight, full_parts.weight[:, r * words:(r + 1) * words]).item()
            assert mx.array_equal(parts.scales, full_parts.scales[:, r * groups:(r + 1) * groups]).item()
            assert mx.array_equal(parts.biases, full_parts.biases[:, r * groups:(r + 1) * groups]).item()


def test_each_gpt_oss_rank_loads_its_experts_biases_heads_and_sinks(gpt_oss):
    """gpt-oss under experts+tensor: a rank's experts with their biases rows, its heads' q/k/v bias rows, o_proj's
    bias whole (added once, after the all_sum) and the sinks whole (each rank attends with its heads' span)."""
    whole = _loaded(gpt_oss, None)
    shards = [_loaded(gpt_oss, Ranks(r, 2), tensor=True) for r in range(2)]
    assert sum(resident_expert_bytes(m) for m in shards) == resident_expert_bytes(whole)
    for r, sharded in enumerate(shards):
        for i, block in sharded.moe_blocks().items():
            experts, full = block.switch_mlp, whole.moe_blocks()[i].switch_mlp
            assert isinstance(experts, ExpertShard) and (experts.first, experts.num_experts) == (4 * r, 4)
            assert (experts.limit, experts.alpha) == (full.limit, full.alpha)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for part in ("weight", "scales", "bias"):
                    mine, theirs = experts[proj][part], full[proj][part][4 * r:4 * r + 4]
                    assert mx.array_equal(mine, theirs).item(), (r, i, proj, part)
        for mine, full in zip(sharded.layers, whole.layers, strict=True):
            a, b = mine.self_attn, full.self_attn
            for proj, rows in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
                assert mx.array_equal(a[proj]["bias"], b[proj]["bias"][r * rows:(r + 1) * rows]).item()
            assert mx.array_equal(a.o_proj["bias"], b.o_proj["bias"]).item()
            assert mx.array_equal(a.head_sinks(), b["sinks"][2 * r:2 * r + 2]).item()
            assert a.window == b.window


def _held(full: mx.array, spans) -> mx.array:
    """The rows of `spans` ([first, end) each) of `full`, in order."""
    return mx.concatenate([full[first:end] for first, end in spans])


def _assert_rows(mine, full, spans, where: str) -> None:
    """A projection holds exactly `spans` of the whole one's rows: weight, scales, biases and bias alike."""
    for part in ("weight", "scales", "biases", "bias"):
        assert (part in mine) == (part in full), (where, part)
        if part in full:
            assert mx.array_equal(mine[part], _held(full[part], spans)).item(), (where, part)


def _assert_columns(mine, full, r: int, where: str) -> None:
    """An output projection is a ColumnShard holding rank r's half of the whole one's input columns."""
    parts, full_parts = mine.quantized_parts() or mine, full.quantized_parts() or full  # float: the weight alone
    assert isinstance(mine, ColumnShard) and mine.shape == (full.shape[0], full.shape[1] // 2), where
    for part in ("weight", "scales", "biases") if full.mode else ("weight",):
        width = getattr(parts, part).shape[1]
        assert mx.array_equal(getattr(parts, part), getattr(full_parts, part)[:, r * width:(r + 1) * width]).item(), \
            (where, part)


@pytest.mark.parametrize("name", [*HYBRIDS, "qwen3_next_hub", "qwen3_5_hub"])
def test_each_hybrid_rank_loads_its_heads_and_linear_attention_share(name, request):
    """A hybrid under experts+tensor over 2 ranks: the gated full attention's query heads (each head's query and
    output-gate rows together) and key/value heads; each Gated DeltaNet's key head and the two value heads it
    serves: Qwen3-Next's fused projection rows (grouped per key head), Qwen3.5's [q | k | v] rows in three spans and
    z/b/a rows, the conv channels of its q, k and v, A_log and dt_bias of its value heads, out_proj's input columns;
    the norms whole. The experts and the shared expert split as for every family. In mlx-lm's layout (make-random,
    4-bit) and in transformers' (float; the conv weights turned and the norms offset as the loader reads them)."""
    folder = request.getfixturevalue(name)
    whole = _loaded(folder, None)
    shards = [_loaded(folder, Ranks(r, 2), tensor=True) for r in range(2)]
    assert {layer.layer_type for layer in whole.layers} == {"linear_attention", "full_attention"}
    assert sum(resident_expert_bytes(m) for m in shards) == resident_expert_bytes(whole)
    assert sum(resident_mlp_bytes(m) for m in shards) == resident_mlp_bytes(whole)
    norms = sum(layer.mixer[n].weight.nbytes for layer in whole.layers for n in ("q_norm", "k_norm", "norm")
                if n in layer.mixer)
    assert sum(resident_attention_bytes(m) for m in shards) == resident_attention_bytes(whole) + norms
    for r, sharded in enumerate(shards):
        for i, (mine, full) in enumerate(zip(sharded.layers, whole.layers, strict=True)):
            a, b, where = mine.mixer, full.mixer, (name, r, i)
            if mine.layer_type == "full_attention":
                assert (a.n_heads, a.n_kv_heads) == (2, 1)
                for proj, rows in (("q_proj", 2 * 64), ("k_proj", 32), ("v_proj", 32)):  # q: per head 32 + 32 gate
                    assert isinstance(a[proj], RowShard), where
                    _assert_rows(a[proj], b[proj], [(r * rows, (r + 1) * rows)], (*where, proj))
                for norm in ("q_norm", "k_norm"):
                    assert mx.array_equal(a[norm].weight, b[norm].weight).item(), where
                _assert_columns(a.o_proj, b.o_proj, r, where)
                continue
            lin = a.linear
            assert (lin.num_key_heads, lin.num_value_heads, lin.layout) == (1, 2, b.linear.layout), where
            channels = [(32 * r, 32 * r + 32), (64 + 32 * r, 96 + 32 * r), (128 + 64 * r, 192 + 64 * r)]  # q, k, v
            assert conv_rows(b.linear, lin, r).spans == tuple(channels)
            if lin.layout == FUSED_QKVZ:  # per key head: q 32, k 32, v 2 x 32, z 2 x 32; b 2, a 2
                _assert_rows(a.in_proj_qkvz, b.in_proj_qkvz, [(192 * r, 192 * r + 192)], (*where, "qkvz"))
                _assert_rows(a.in_proj_ba, b.in_proj_ba, [(4 * r, 4 * r + 4)], (*where, "ba"))
            else:
                _assert_rows(a.in_proj_qkv, b.in_proj_qkv, channels, (*where, "qkv"))
                _assert_rows(a.in_proj_z, b.in_proj_z, [(64 * r, 64 * r + 64)], (*where, "z"))
                for proj in ("in_proj_b", "in_proj_a"):
                    _assert_rows(a[proj], b[proj], [(2 * r, 2 * r + 2)], (*where, proj))
            assert mx.array_equal(a.conv1d.weight, _held(b.conv1d.weight, channels)).item(), where
            for gate in ("A_log", "dt_bias"):
                assert mx.array_equal(a[gate], b[gate][2 * r:2 * r + 2]).item() and a[gate].dtype == b[gate].dtype
            assert mx.array_equal(a.norm.weight, b.norm.weight).item(), where
            _assert_columns(a.out_proj, b.out_proj, r, where)


def test_hybrid_heads_that_do_not_split_evenly_are_a_config_error_naming_the_layer(qwen3_5):
    args = read_model_args(qwen3_5 / "config.json")  # linear attention: 2 key heads; full attention: 4 and 2
    with pytest.raises(ConfigError, match=r"layer 0's linear attention's 2 key heads \(serving 4 value heads\) do "
                                          "not split evenly over 4 ranks"):
        shard_heads(family(args.model_type).model(args), Ranks(0, 4))
    wide = dataclasses.replace(args, linear_num_key_heads=4, linear_num_value_heads=4)  # linear layers split
    with pytest.raises(ConfigError, match="layer 3's 4 query and 2 key/value heads do not split evenly over 4 ranks"):
        shard_heads(family(args.model_type).model(wide), Ranks(0, 4))


def test_heads_that_do_not_split_evenly_are_a_config_error():
    model = family("qwen2_moe").model(read_model_args(SHIPPED_MODEL / "config.json"))  # 4 heads, 2 key/value
    with pytest.raises(ConfigError, match="layer 0's 4 query and 2 key/value heads do not split evenly over 4 ranks"):
        shard_heads(model, Ranks(0, 4))


@pytest.mark.parametrize("model", ["shipped", "qwen3"])
def test_each_rank_loads_exactly_its_share_of_every_mlp(model, qwen3_stacked):
    """The shipped model's shared experts and the Qwen3 checkpoint's dense layer 1: gate/up rows, down columns."""
    folder = SHIPPED_MODEL if model == "shipped" else qwen3_stacked
    whole = _loaded(folder, None)
    shards = [_loaded(folder, Ranks(r, 2), tensor=True) for r in range(2)]
    mlps = split_mlps(whole)
    assert len(mlps) == (len(whole.layers) if model == "shipped" else 1)
    assert sum(resident_mlp_bytes(m) for m in shards) == resident_mlp_bytes(whole)
    for r, sharded in enumerate(shards):
        for where, full in mlps.items():
            mine = split_mlps(sharded)[where]
            rows = full.gate_proj.shape[0] // 2
            for proj in ("gate_proj", "up_proj"):
                assert isinstance(mine[proj], RowShard) and (mine[proj].first, mine[proj].total) == (r * rows, 2 * rows)
                for part in ("weight", "scales", "biases"):
                    theirs = full[proj][part][r * rows:(r + 1) * rows]
                    assert mx.array_equal(mine[proj][part], theirs).item(), (r, where, proj, part)
            down, parts, full_parts = mine.down_proj, mine.down_proj.quantized_parts(), full.down_proj.quantized_parts()
            assert isinstance(down, ColumnShard) and down.shape == (full.down_proj.shape[0], rows)
            words, groups = parts.weight.shape[1], parts.scales.shape[1]
            assert mx.array_equal(parts.weight, full_parts.weight[:, r * words:(r + 1) * words]).item()
            assert mx.array_equal(parts.scales, full_parts.scales[:, r * groups:(r + 1) * groups]).item()
            assert mx.array_equal(parts.biases, full_parts.biases[:, r * groups:(r + 1) * groups]).item()


def test_an_mlp_width_that_does_not_split_evenly_is_a_config_error():
    model = family("qwen2_moe").model(read_model_args(SHIPPED_MODEL / "config.json"))
    with pytest.raises(ConfigError, match="layer 0's shared expert of width 128 does not split evenly over 3 ranks"):
        shard_mlps(model, Ranks(0, 3))


def test_heads_cut_inside_a_quantization_group_are_a_checkpoint_error(tmp_path):
    config = qwen2_moe_config(num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2)
    folder = write_random_checkpoint(tmp_path / "ckpt", config, seed=1, bits=4, group_size=64)  # heads of 32 columns
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.o_proj: this rank's input columns 32..63 "
                                              "cut its 4-bit groups of 64"):
        _loaded(folder, Ranks(1, 4), tensor=True)


def test_load_splits_heads_only_over_a_group():
    with pytest.raises(ConfigError, match="tensor_parallel needs a shard"):
        load(SHIPPED_MODEL, tensor_parallel=True)


def test_compare_refuses_a_sharded_model():
    from moebench.inspect.compare import compare_step
    from moebench.inspect.record import Stepper

    whole, sharded = _loaded(SHIPPED_MODEL, None), _loaded(SHIPPED_MODEL, Ranks(1, 2))
    step = Stepper(whole, None, PROMPT[:3], record=True).prefill()[-1]
    with pytest.raises(MoebenchError, match="compare needs every expert in one process; "
                       f"this one holds experts {SHIPPED_EXPERTS // 2}-{SHIPPED_EXPERTS - 1}"):
        compare_step(sharded, step)


def launch(*command: str, n: int = 2) -> subprocess.CompletedProcess:
    """`command` (a python script or -m module and its arguments) in n processes over 127.0.0.1."""
    launcher = Path(sys.executable).with_name("mlx.launch")
    launcher = str(launcher) if launcher.exists() else shutil.which("mlx.launch")
    done = subprocess.run([launcher, "-n", str(n), "--backend", "ring", "--starting-port", str(free_ports(n)[0]),
                           "--python", sys.executable, "--", *command], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


MODES = ("experts", TENSOR_MODE)


@pytest.fixture(scope="module")
def decodes(qwen3_stacked, gpt_oss, qwen3_next, qwen3_5, tmp_path_factory) -> dict:
    """{(model, mode): (one process's record, [each rank's record of two])}."""
    out = {}
    for name, folder in (("shipped", SHIPPED_MODEL), ("qwen3", qwen3_stacked), ("gpt_oss", gpt_oss),
                         ("qwen3_next", qwen3_next), ("qwen3_5", qwen3_5)):
        alone = tmp_path_factory.mktemp(f"{name}-one")
        args = [str(TOKENS), *map(str, PROMPT)]
        subprocess.run([sys.executable, str(RUN), str(folder), str(alone), "experts", *args], check=True, timeout=300)
        for mode in MODES:
            pair = tmp_path_factory.mktemp(f"{name}-two")
            launch(str(RUN), str(folder), str(pair), mode, *args)
            out[name, mode] = (json.loads((alone / "rank0.json").read_text()),
                               [json.loads((pair / f"rank{r}.json").read_text()) for r in range(2)])
    return out


def _agree(one: dict, two: dict) -> None:
    """Greedy tokens equal, or parting only where one process's top-two margin was a near-tie."""
    a, b = one["tokens"], two["tokens"]
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    if first is not None:
        assert one["margins"][first] < NEAR_TIE, f"tokens part at {first}, margin {one['margins'][first]}"


@pytest.mark.parametrize("name", sorted(TOTALS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fused", ["on", "off", "forced on", "forced off", "ablated on", "ablated off"])
def test_two_processes_decode_as_one(decodes, name, mode, fused):
    one, (rank0, rank1) = decodes[name, mode][0][fused], [r[fused] for r in decodes[name, mode][1]]
    spans = {"notes": None, "attention_notes": None}  # each rank names its own experts and heads
    assert {**rank0, **spans} == {**rank1, **spans}  # every rank holds every slot's output
    _agree(one, rank0)
    for loop in ("generate_tokens", "compiled_tokens"):
        _agree({**one, "tokens": one[loop]}, {"tokens": rank0[loop]})
    assert len(set(one["tokens"])) > 1  # a decode that says something
    if rank0["tokens"] != one["tokens"]:
        return
    worst = 0.0
    for step_one, step_two in zip(one["records"], rank0["records"], strict=True):
        assert step_one.keys() == step_two.keys()
        for layer, rec in step_one.items():
            for part in RECORDED:
                if rec[part] is None:
                    assert step_two[layer][part] is None
                    continue
                a, b = np.array(rec[part]), np.array(step_two[layer][part])
                worst = max(worst, float(np.abs(a - b).max() / (np.abs(a).max() + 1e-12)))
    # the fallback joins expert outputs, each slot non-zero on one rank: exact; the fused pair, and attention split
    # by heads, join partial sums
    assert worst == 0.0 if (fused.split()[-1], mode) == ("off", "experts") else worst < 1e-4, worst


@pytest.mark.parametrize("fused", ["on", "off"])
def test_forced_and_ablated_experts_hold_on_every_rank(decodes, fused):
    """The interventions sharded_run.py sets (experts forced from both ends of the range, expert 0 ablated) are what
    every rank's records show at every step, fused or not."""
    for (name, mode), (one, ranks) in decodes.items():
        total = TOTALS[name]
        for run in (one, *ranks):
            forced = [sorted(rec["topk_ids"]) for step in run[f"forced {fused}"]["records"] for rec in step.values()]
            top_k = len(forced[0])
            assert all(ids == sorted({0, total - 1, *range(1, top_k - 1)}) for ids in forced), (name, mode)
            ablated = [rec["topk_ids"] for step in run[f"ablated {fused}"]["records"] for rec in step.values()]
            assert ablated and not any(0 in ids for ids in ablated), (name, mode)
            assert run[f"forced {fused}"]["tokens"] != run[fused]["tokens"], (name, mode)


def test_each_rank_holds_half_the_experts_and_says_which(decodes):
    for (name, mode), (one, (rank0, rank1)) in decodes.items():
        whole = one["shard"]["expert_bytes_per_rank"][0]
        assert rank0["shard"]["expert_bytes_per_rank"] == [whole // 2, whole // 2], name
        spans = {k: rank0["shard"][k] for k in ("experts", "attention", "linear_attention", "mlps")}
        assert rank0["shard"] == rank1["shard"] | spans
        total = TOTALS[name]
        half = total // 2
        shared = ["", ""] if name in ("qwen3", "gpt_oss") or mode == "experts" else [  # shared experts of 128
            f"; shared expert width {r * 64}-{r * 64 + 63} of 128 on rank {r} of 2 (the other ranks' by all_sum)"
            for r in range(2)]
        assert [r["on"]["notes"] for r in (rank0, rank1)] == [
            [f"experts 0-{half - 1} of {total} on rank 0 of 2 (the other ranks' by all_sum){shared[0]}"],
            [f"experts {half}-{total - 1} of {total} on rank 1 of 2 (the other ranks' by all_sum){shared[1]}"]], name
        assert [r["off"]["notes"] for r in (rank0, rank1)] == [r["on"]["notes"] for r in (rank0, rank1)], name
        attention = [r["on"]["attention_notes"] for r in (rank0, rank1)]
        whole_attention, whole_mlps = (one["shard"][k][0] for k in ("attention_bytes_per_rank", "mlp_bytes_per_rank"))
        linear = [r["shard"]["linear_attention"] for r in (rank0, rank1)]
        if name not in HYBRIDS:
            assert linear == ["no linear attention"] * 2, name
        elif mode == "experts":
            assert linear == ["every key and value head in this process"] * 2, name
        else:  # 2 key heads, each serving 2 value heads
            assert linear == [f"key heads {r} of 2, value heads {2 * r}-{2 * r + 1} of 4 on rank {r} of 2 (the other "
                              "ranks' by all_sum)" for r in range(2)], name
        if mode == "experts":
            assert attention == [[], []] and rank0["shard"]["attention_bytes_per_rank"] == [whole_attention] * 2
            assert rank0["shard"]["mlps"] == ("no shared expert or dense MLP" if name == "gpt_oss" else
                                              "every MLP's whole width in this process")
            assert rank0["shard"]["mlp_bytes_per_rank"] == [whole_mlps] * 2
            continue
        if name == "gpt_oss":  # no shared expert, no dense layer
            assert rank0["shard"]["mlps"] == "no shared expert or dense MLP"
            assert rank0["shard"]["mlp_bytes_per_rank"] == [0, 0]
        else:
            width = 256 if name == "qwen3" else 128  # the Qwen3 checkpoint's dense layer, the others' shared experts
            assert [r["shard"]["mlps"] for r in (rank0, rank1)] == [
                f"width {r * width // 2}-{(r + 1) * width // 2 - 1} of {width} on rank {r} of 2 (the other ranks' by "
                "all_sum)" for r in range(2)], name
            assert rank0["shard"]["mlp_bytes_per_rank"] == [whole_mlps // 2] * 2, name
        heads = [f"query heads {2 * r}-{2 * r + 1} of 4, key/value heads {r} of 2 on rank {r} of 2 (the other "
                 "ranks' by all_sum)" for r in range(2)]  # every model: 4 query heads, 2 key/value heads
        o_proj = "; o_proj and the residual add as their own launches: o_proj sharded over ranks (its partial sums " \
                 "joined by all_sum)"  # the fused decode steps'; the prompt's fallback notes the heads alone
        assert attention == [[h, h + o_proj] for h in heads], name
        assert max(rank0["shard"]["attention_bytes_per_rank"]) < 0.51 * whole_attention, name


@pytest.mark.parametrize("mode", MODES)
def test_generate_under_mlx_launch_prints_rank_zeros_decode(mode):
    command = ["-m", "moebench.cli", "generate", str(SHIPPED_MODEL), "--prompt", "def fibonacci(n):", "--max-tokens",
               "8", "--json"]
    alone = json.loads(subprocess.run([sys.executable, *command], capture_output=True, text=True, check=True,
                                      timeout=300).stdout)
    printed = launch(*command, "--shard", mode).stdout
    pair = json.loads(printed[printed.index("{"):])  # rank 0's object; the other rank prints nothing
    assert pair["token_ids"] == alone["token_ids"] and pair["text"] == alone["text"]
    assert pair["shard"]["ranks"] == 2 and len(pair["shard"]["expert_bytes_per_rank"]) == 2
    assert pair["shard"]["attention"].startswith("query heads 0-1 of 4") == (mode == TENSOR_MODE)
    assert alone["shard"] is None


def test_bench_under_mlx_launch_reports_each_ranks_experts(tmp_path):
    record = tmp_path / "bench.json"
    launch("-m", "moebench.cli", "bench", str(SHIPPED_MODEL), "--shard", "experts", "--prompt-tokens", "8",
           "--gen-tokens", "4", "--repeats", "1", "--no-progress", "--json", str(record))
    bench = json.loads(record.read_text())
    assert bench["shard"]["ranks"] == 2 and len(set(bench["shard"]["expert_bytes_per_rank"])) == 1
    (length,) = bench["lengths"]
    arms = {arm["name"]: arm for arm in length["arms"]}
    # the CPU decodes through the compiled step by default, so bench's --compiled auto runs both loops
    assert set(arms) == {f"moebench {kind}{loop}" for kind in ("fallback", "fused (reference)")
                         for loop in ("", " compiled")}
    assert all(arm["greedy_vs_reference"]["identical"] for arm in arms.values())
