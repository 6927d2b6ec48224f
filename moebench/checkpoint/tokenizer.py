"""The tokenizer of a checkpoint folder as checkpoints publish it.

tokenizer.json (Hugging Face `tokenizers`) holds the vocabulary; tokenizer_config.json,
special_tokens_map.json and added_tokens.json, when present, name the special tokens (eos_token, ...),
declare added tokens (with their ids) and carry the chat template. They are read the way transformers
reads them: a token they declare that tokenizer.json lacks is added, an id that disagrees with
tokenizer.json is an error naming the file, and special_tokens_map.json's names win over
tokenizer_config.json's.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError, DecodeError
from .chat import BUILTIN_END_OF_TURN, ChatTemplate, Message, builtin_chat_template, read_chat_template
from .config import read_json_object
from .files import checkpoint_file

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
ADDED_TOKENS = "added_tokens.json"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ADDED_TOKEN_FLAGS = ("lstrip", "rstrip", "normalized", "single_word")
UNKNOWN_ID = "<id {} not in the tokenizer>"  # how decode shows an id without text, never as nothing


class Tokenizer:
    """A tokenizer.json loaded with the `tokenizers` library; `from_folder` adds what the other files declare.

    `special_tokens` maps transformers' names (eos_token, ...) to token text; `chat_template` is the
    folder's template, or moebench's built-in ChatML when it has none (`chat_template.builtin`).
    """

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        try:
            self._tok = HFTokenizer.from_file(str(checkpoint_file(path, path.parent)))
        except FileNotFoundError as e:
            raise CheckpointError(f"{path}: no tokenizer file here") from e
        except CheckpointError:
            raise
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise CheckpointError(f"{path}: cannot load tokenizer: {e}") from e
        self.path = path
        self.special_tokens: dict[str, str] = {}
        self.additional_special_tokens: list[str] = []
        self.chat_template: ChatTemplate = builtin_chat_template(path.parent)
        self._special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    @classmethod
    def from_folder(cls, folder: str | Path, model_vocab: int | None = None, verbose: bool = False) -> Tokenizer:
        """tokenizer.json plus the folder's tokenizer_config.json, special_tokens_map.json and added_tokens.json.

        With `model_vocab` (config.json's vocab_size) the ids are compared with the model's: more ids than
        the model embeds is a warning, fewer (published Qwen pads its vocabulary) a printed note when verbose.
        """
        folder = Path(folder)
        tok = cls(folder / TOKENIZER_FILE)
        config = _optional_json(folder / TOKENIZER_CONFIG)
        special_map = _optional_json(folder / SPECIAL_TOKENS_MAP)
        declared = _declared_tokens(folder / TOKENIZER_CONFIG, config) + _declared_tokens(
            folder / ADDED_TOKENS, _optional_json(folder / ADDED_TOKENS))
        for where, content, token_id, flags in sorted(declared, key=lambda d: d[2]):
            tok._declare(where, content, token_id, flags)
        for where, source in ((folder / TOKENIZER_CONFIG, config), (folder / SPECIAL_TOKENS_MAP, special_map)):
            tok._name_special_tokens(where, source)
        tok.chat_template = read_chat_template(folder, config) or tok.chat_template  # never a FIFO or a file elsewhere
        note = tok.vocab_mismatch(model_vocab) if model_vocab is not None else None
        if note is not None and tok.id_count > model_vocab:
            warnings.warn(note, stacklevel=2)
        elif note is not None and verbose:
            print(note)
        return tok

    # -- the vocabulary ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def id_count(self) -> int:
        """One past the largest id the tokenizer can produce (what must fit the model's embedding)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @property
    def special_ids(self) -> frozenset[int]:
        """Control tokens (eos, <|im_start|>, ...): kept in records, dropped from displayed text."""
        return frozenset(self._special_ids)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Where a turn ends for this tokenizer: its eos_token (mlx-lm stops there too), and <|im_end|> when the
        built-in ChatML template is in use and the vocabulary has it as one token."""
        names = [self.special_tokens.get("eos_token")]
        if self.chat_template.builtin:
            names.append(BUILTIN_END_OF_TURN)
        ids = (self._tok.token_to_id(n) for n in names if n is not None)
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def vocab_mismatch(self, model_vocab: int) -> str | None:
        """A sentence when the tokenizer's ids and the model's vocabulary (config.json vocab_size) differ."""
        n = self.id_count
        if n > model_vocab:
            extra = f"id {model_vocab}" if n - 1 == model_vocab else f"ids {model_vocab}..{n - 1}"
            return (f"{self.path}: the tokenizer has ids up to {n - 1} but the model's vocabulary is {model_vocab}: "
                    f"{extra} cannot be embedded and the model never predicts them")
        if n < model_vocab:
            return (f"{self.path}: the tokenizer has {n} ids, the model's vocabulary {model_vocab}: the model's "
                    f"last {model_vocab - n} ids (padding in published Qwen checkpoints) decode to no text")
        return None

    # -- text ------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise DecodeError(f"{self.path}: encode takes text, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text for display: control tokens (special_ids) left out unless asked for; ids stay in records. An id
        the tokenizer does not have (a model's padding ids past its vocabulary) shows as UNKNOWN_ID, where
        tokenizers would decode it to nothing; a negative or non-integer id is a DecodeError."""
        try:
            ids = [operator.index(i) for i in ids]
        except TypeError as e:
            raise DecodeError(f"{self.path}: token ids must be integers: {e}") from e
        if any(i < 0 for i in ids):
            raise DecodeError(f"{self.path}: token id {min(ids)} is negative")
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        parts, run = [], []
        for i in ids:
            if self.has_id(i):
                run.append(i)
                continue
            parts += [self._tok.decode(run, skip_special_tokens=False), UNKNOWN_ID.format(i)]
            run = []
        return "".join(parts) + self._tok.decode(run, skip_special_tokens=False)

    def has_id(self, token_id: int) -> bool:
        """Whether `token_id` has text (an id of tokenizer.json or one the folder added)."""
        return 0 <= token_id < 2**32 and self._tok.id_to_token(token_id) is not None

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            **variables: Any) -> list[int]:
        """Prompt ids of a chat, as transformers' apply_chat_template(..., tokenize=True): the template sees the
        special tokens by name (bos_token, ...) and `variables` (e.g. enable_thinking=False)."""
        if self.chat_template.builtin:
            warnings.warn(f"chat prompt through {self.chat_template.source}", stacklevel=2)
        names = {**self.special_tokens, "additional_special_tokens": self.additional_special_tokens}
        text = self.chat_template.render(messages, add_generation_prompt, **{**names, **variables})
        return self.encode(text)

    # -- reading the folder's declarations -------------------------------------------------------------
    def _declare(self, where: Path, content: str, token_id: int | None, flags: dict[str, Any]) -> None:
        """A token another file declares: checked against tokenizer.json, added when tokenizer.json lacks it."""
        from tokenizers import AddedToken

        have = self._tok.token_to_id(content)
        if have is None:
            token = AddedToken(content, special=bool(flags.get("special")),
                               **{k: bool(flags[k]) for k in ADDED_TOKEN_FLAGS if k in flags})
            self._tok.add_tokens([token])
            have = self._tok.token_to_id(content)
            if token_id is not None and have != token_id:
                raise CheckpointError(f"{where}: token {content!r} has id {token_id}, but tokenizer.json lacks it "
                                      f"and the next free id is {have}")
        elif token_id is not None and have != token_id:
            raise CheckpointError(f"{where}: token {content!r} has id {token_id} but {have} in tokenizer.json")
        if flags.get("special"):
            self._special_ids.add(have)

    def _name_special_tokens(self, where: Path, source: Mapping[str, Any]) -> None:
        """eos_token and the like (text or an AddedToken object), made special and added when missing."""
        for key in SPECIAL_TOKEN_KEYS:
            if source.get(key) is not None:
                self.special_tokens[key] = _token_text(source[key], where, key)
                self._declare(where, self.special_tokens[key], None, {"special": True})
        extra = source.get("additional_special_tokens")
        if extra is not None:
            if not isinstance(extra, list):
                raise ConfigError(f"{where}: field 'additional_special_tokens' must be a list")
            self.additional_special_tokens = [_token_text(t, where, "additional_special_tokens") for t in extra]
            for text in self.additional_special_tokens:
                self._declare(where, text, None, {"special": True})


def stop_ids(eos_token_id: Iterable[int], tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """Where decoding stops: the model's eos ids (config.json with generation_config.json, ModelArgs.eos_token_id)
    and the tokenizer's end of turn, as mlx-lm stops on its tokenizer's eos_token too."""
    extra = tokenizer.eos_token_ids if tokenizer is not None else ()
    return tuple(dict.fromkeys((*eos_token_id, *extra)))


def _optional_json(path: Path) -> dict[str, Any]:
    try:
        return read_json_object(path)
    except FileNotFoundError:
        return {}


def _token_text(value: Any, where: Path, key: str) -> str:
    """A special token as transformers saves one: its text, or an AddedToken object with `content`."""
    text = value.get("content") if isinstance(value, dict) else value
    if not isinstance(text, str) or not text:
        raise ConfigError(f"{where}: field {key!r} must be token text or an object with 'content', got {value!r}")
    return text


def _declared_tokens(where: Path, data: Mapping[str, Any]) -> list[tuple[Path, str, int, dict[str, Any]]]:
    """(file, text, id, flags) of each added token a file declares: tokenizer_config.json's added_tokens_decoder
    ({"151643": {"content": ..., "special": true, ...}}) or added_tokens.json ({"<|im_end|>": 151645})."""
    if where.name == ADDED_TOKENS:
        entries = [(text, token_id, {}) for text, token_id in data.items()]
    else:
        decoder = data.get("added_tokens_decoder", {})
        if not isinstance(decoder, dict):
            raise ConfigError(f"{where}: field 'added_tokens_decoder' must be an object")
        entries = []
        for key, entry in decoder.items():
            if not (key.isascii() and key.isdigit()):  # int() would also take ' 7', '-3', '+3', '1_0' and '٣'
                raise ConfigError(f"{where}: added_tokens_decoder key {key!r} is not a token id (digits 0-9 only)")
            if not isinstance(entry, dict):
                raise ConfigError(f"{where}: added_tokens_decoder[{key!r}] must map an id to a token object")
            entries.append((entry.get("content"), int(key), entry))
    for text, token_id, _ in entries:
        if not isinstance(text, str) or not text or isinstance(token_id, bool) or not isinstance(token_id, int) \
                or token_id < 0:
            raise ConfigError(f"{where}: added token {text!r} with id {token_id!r} is not token text with an id >= 0")
    return [(where, text, token_id, flags) for text, token_id, flags in entries]
