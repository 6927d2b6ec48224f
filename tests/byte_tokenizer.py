"""A tokenizer for the tiny test checkpoints, importable from any test folder (tests/ is on sys.path through
its conftest.py): `from byte_tokenizer import write_byte_tokenizer`. Not in conftest.py, since every test
folder's conftest is imported as `conftest` and the last one would shadow it."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def write_byte_tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer.json with no merges: 256 tokens, one per byte, ids in byte-alphabet order.

    Every id the tiny models can emit decodes, and any text encodes, so CLI tests need no download.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    path = Path(folder) / "tokenizer.json"
    tok.save(str(path))
    return path
