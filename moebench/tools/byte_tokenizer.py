"""A byte-level tokenizer sized to a model's vocabulary, for checkpoints that come without one (make-random's, the
tests'): any text encodes and every id the model can emit decodes to text, so `moebench generate` and the notebooks
run on random weights with nothing to download.

A model's end-of-sequence ids (config.json's eos_token_id) are control tokens, named in tokenizer_config.json, so a
decode stops there and the text leaves them out as it does on published checkpoints. The other ids, in order, are
the 256 bytes in the order of the byte-level alphabet (`tokenizers`' ByteLevel), then BPE merges, every pair of bytes
first, then each of those followed by a byte, and so on, until the vocabulary is full. So without a control token
among them ids 0..255 are the bytes; DeepSeek-V3's eos id 1 is a control token and the bytes are ids 0 and 2..256.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ..checkpoint.tokenizer import TOKENIZER_CONFIG, TOKENIZER_FILE
from ..errors import ConfigError

BYTES = 256


def eos_names(eos_ids: Iterable[int]) -> dict[int, str]:
    """The control token of each end-of-sequence id: `<|eos|>`, then `<|eos_1|>`, `<|eos_2|>` ... for more."""
    ids = list(dict.fromkeys(eos_ids))
    return {i: "<|eos|>" if n == 0 else f"<|eos_{n}|>" for n, i in enumerate(ids)}


def _merged(alphabet: list[str]) -> Iterator[tuple[str, str]]:
    """(left, right) of every merge in rank order: each token of the last length followed by each byte."""
    shorter = alphabet
    while True:
        longer = []
        for left in shorter:
            for right in alphabet:
                longer.append(left + right)
                yield left, right
        shorter = longer


def check_vocabulary(vocab_size: int, eos_ids: Iterable[int] = ()) -> None:
    """ConfigError unless a byte-level tokenizer of `vocab_size` ids can hold the bytes and `eos_ids` (make-random
    asks before it writes any weights)."""
    control = eos_names(eos_ids)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < BYTES + len(control):
        raise ConfigError(f"vocab_size {vocab_size!r}: a byte-level tokenizer needs at least {BYTES} ids (one per "
                          f"byte) besides its {len(control)} end-of-sequence ids")
    wrong = [i for i in control if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size]
    if wrong:
        raise ConfigError(f"eos_token_id {wrong[0]!r}: not an id of the vocabulary (0..{vocab_size - 1})")


def byte_level_tokenizer(vocab_size: int, eos_ids: Iterable[int] = ()) -> Tokenizer:
    """The module's tokenizer of exactly `vocab_size` ids, `eos_ids` among them as control tokens."""
    eos_ids = list(eos_ids)
    check_vocabulary(vocab_size, eos_ids)
    control = eos_names(eos_ids)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    bytes_left, pairs = iter(alphabet), _merged(alphabet)
    vocab, merges = {}, []
    for token_id in range(vocab_size):
        if token_id in control:
            vocab[control[token_id]] = token_id
            continue
        byte = next(bytes_left, None)
        if byte is not None:
            vocab[byte] = token_id
            continue
        left, right = next(pairs)
        vocab[left + right] = token_id
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True) for name in control.values()])
    return tok


def write_byte_tokenizer(folder: str | Path, vocab_size: int = BYTES, eos_ids: Iterable[int] = ()) -> Path:
    """tokenizer.json of byte_level_tokenizer in `folder`, and a tokenizer_config.json naming the generic fast
    tokenizer class (without it transformers, and so mlx_lm.convert, took the model type's own class, whose default
    `<|endoftext|>` it added as an id past the vocabulary) and, with `eos_ids`, the first as eos_token (as
    transformers and mlx-lm read it); returns tokenizer.json's path."""
    eos_ids = list(eos_ids)
    tok = byte_level_tokenizer(vocab_size, eos_ids)
    path = Path(folder) / TOKENIZER_FILE
    tok.save(str(path))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if eos_ids:
        config["eos_token"] = eos_names(eos_ids)[eos_ids[0]]
    (path.parent / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return path
