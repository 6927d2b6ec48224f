"""Shared test fixtures: tiny checkpoint folders and a byte-level tokenizer.

Every checkpoint here comes from moebench.tools.writer with a tiny config (writer.qwen2_moe_config), so
the whole suite stays fast on two CPU cores. Session-scoped folders are shared between tests and must
never be modified: copy one (`copy_checkpoint`) before corrupting it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from byte_tokenizer import write_byte_tokenizer
from hybrids import HYBRID_PRESETS

from moebench.tools.presets import get_preset
from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint

TINY_VOCAB = 256  # writer.qwen2_moe_config's vocab_size: one token per byte

# moebench's cache (moebench.tools.corpus.CACHE_ENV: drift's made variants, ...) in a folder of this run, removed at
# its end, never the user's ~/.cache/moebench; the notebooks' kernels and JupyterLab inherit it. Set before any test
# module imports moebench.tools.corpus, which reads it (tests/tools/test_drift_command.py checks it did).
TEST_CACHE = Path(tempfile.mkdtemp(prefix="moebench-test-cache-"))
os.environ["MOEBENCH_CACHE"] = str(TEST_CACHE)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(TEST_CACHE, ignore_errors=True)


@dataclass
class RawSafetensors:
    """A safetensors file as its parsed header and raw data bytes: corrupt one part, write it back."""

    header: dict
    data: bytes

    @classmethod
    def read(cls, path: Path) -> RawSafetensors:
        blob = Path(path).read_bytes()
        (n,) = struct.unpack("<Q", blob[:8])
        return cls(json.loads(blob[8 : 8 + n]), blob[8 + n :])

    def header_bytes(self) -> bytes:
        return json.dumps(self.header).encode()

    def write(self, path: Path, header_bytes: bytes | None = None) -> None:
        raw = self.header_bytes() if header_bytes is None else header_bytes
        Path(path).write_bytes(struct.pack("<Q", len(raw)) + raw + self.data)


@pytest.fixture
def raw_safetensors() -> type[RawSafetensors]:
    """The RawSafetensors class, for tests that rewrite headers byte by byte."""
    return RawSafetensors


@pytest.fixture
def make_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """make_checkpoint(name, config=None, tokenizer=False, **writer_kwargs) -> a fresh folder under tmp_path.

    `config` defaults to writer.qwen2_moe_config(); writer_kwargs go to write_random_checkpoint
    (seed, bits, group_size, layout, shard_bytes, dtype).
    """

    def make(name: str = "ckpt", config: dict | None = None, tokenizer: bool = False, **kwargs) -> Path:
        folder = write_random_checkpoint(tmp_path / name, config or qwen2_moe_config(), **kwargs)
        if tokenizer:
            write_byte_tokenizer(folder)
        return folder

    return make


@pytest.fixture(scope="session")
def float_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Read-only: the default tiny config, float32 HF layout, with a tokenizer.json."""
    folder = write_random_checkpoint(tmp_path_factory.mktemp("float") / "ckpt", qwen2_moe_config(), seed=1)
    write_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def quantized_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Read-only: the default tiny config, 4-bit group-64 MLX quantization, per-expert layout, with tokenizer."""
    folder = write_random_checkpoint(tmp_path_factory.mktemp("q4") / "ckpt", qwen2_moe_config(), seed=2, bits=4)
    write_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_hybrids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Read-only: each tiny hybrid of HYBRID_PRESETS as `moebench make-random` writes it (three Gated DeltaNet
    layers, then a gated full-attention layer; float32 activations, 4-bit weights in mlx-lm's stacked layout, so
    the MoE kernels run beside the token mixing)."""
    folders = {}
    for preset in HYBRID_PRESETS:
        config = {**get_preset(preset).config, "torch_dtype": "float32"}
        folders[preset] = write_random_checkpoint(tmp_path_factory.mktemp(preset) / "ckpt", config, seed=7, bits=4,
                                                  layout="stacked")
    return folders


@pytest.fixture
def copy_checkpoint(tmp_path: Path) -> Callable[[Path], Path]:
    """copy_checkpoint(folder) -> a private copy under tmp_path that a test may corrupt."""

    def copy(folder: Path) -> Path:
        return Path(shutil.copytree(folder, tmp_path / f"copy-{folder.parent.name}-{folder.name}"))

    return copy
