"""The tokenizer of a checkpoint folder: tokenizer.json (Hugging Face `tokenizers`), as Qwen checkpoints ship it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..errors import CheckpointError


class Tokenizer:
    """A tokenizer.json loaded with the `tokenizers` library."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise CheckpointError(f"{path}: cannot load tokenizer: {e}") from e
        self.path = path

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
