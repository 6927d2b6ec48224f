"""Chat prompts: a checkpoint's chat template, rendered the way transformers renders it.

The template is the folder's `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`
(transformers' order). It runs in jinja2's immutable sandbox with the settings, globals and filters
transformers gives chat templates (trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a JSON `tojson`), so the prompt ids equal `tokenizer.apply_chat_template(messages,
add_generation_prompt=True)` in transformers and mlx-lm. A template is text, never code run outside the
sandbox, and nothing outside the checkpoint folder is read.

A folder without a template (the shipped tiny model) gets moebench's built-in ChatML, the turn format
of the Qwen chat models, with no default system prompt; `ChatTemplate.builtin` says so.

    ids = prompt_ids("What is 2+2?", tokenizer, chat=True, system="Be brief.")
    ids = prompt_ids([{"role": "user", "content": "Hi"}], tokenizer, enable_thinking=False)  # Qwen3's switch
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError, MoebenchError

if TYPE_CHECKING:
    import jinja2

    from .tokenizer import Tokenizer

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
# The ChatML turns of the Qwen chat models; moebench's own text, used only where a folder has no template.
BUILTIN_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
BUILTIN_END_OF_TURN = "<|im_end|>"
# transformers fills `reasoning_content` (what Qwen3's template reads) from these older names.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

Message = Mapping[str, Any]


class ChatError(MoebenchError, ValueError):
    """Chat messages a template cannot render, or that the template itself refuses (its raise_exception)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and where it came from (a file of the folder, or moebench's built-in ChatML)."""

    text: str
    source: str
    builtin: bool = False

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt text. `variables` reach the template as transformers passes them: the tokenizer's special
        tokens (bos_token, eos_token, ...) and switches such as Qwen3's `enable_thinking`."""
        import jinja2

        template = _compile(self.text, self.source)
        try:
            return template.render(messages=_plain_messages(messages), tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ChatError(f"{self.source}: the chat template cannot render these messages: {e}") from e
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
            raise ChatError(f"{self.source}: the chat template failed on these messages: {e!r}") from e


def read_chat_template(folder: Path, tokenizer_config: Mapping[str, Any]) -> ChatTemplate | None:
    """The folder's template: chat_template.jinja, else tokenizer_config.json's `chat_template` (one string, or
    named templates of which 'default' is used, as transformers does); None when there is none."""
    path = folder / TEMPLATE_FILE
    if path.exists():
        try:
            return ChatTemplate(path.read_text(encoding="utf-8"), str(path))
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: cannot read the chat template: {e}") from e
    value = tokenizer_config.get("chat_template")
    where = f"{folder / TOKENIZER_CONFIG}: field 'chat_template'"
    if value is None:
        return None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise ConfigError(f"{where} lists templates {sorted(map(str, named))} and none is named 'default'")
        value = named["default"]
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string or a list of named templates, got {type(value).__name__}")
    return ChatTemplate(value, where)


def builtin_chat_template(folder: Path) -> ChatTemplate:
    """moebench's ChatML for a folder without a template; the source says which files were looked for."""
    return ChatTemplate(BUILTIN_CHATML, f"moebench's built-in ChatML ({folder} has no {TEMPLATE_FILE} and no "
                                        f"chat_template in {TOKENIZER_CONFIG})", builtin=True)


def chat_messages(prompt: str | Sequence[Message], system: str | None = None) -> list[dict[str, Any]]:
    """Text (one user turn) or messages, with `system` as the first message when given."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system is None:
        return messages
    if not isinstance(system, str):
        raise ChatError(f"the system prompt must be text, got {type(system).__name__}")
    if messages and messages[0].get("role") == "system":
        raise ChatError("the messages already start with a system message; give the system prompt once")
    return [{"role": "system", "content": system}, *messages]


def is_messages(prompt: Any) -> bool:
    """Whether a prompt is chat messages (a non-empty sequence of mappings) rather than text or token ids."""
    return (isinstance(prompt, Sequence) and not isinstance(prompt, str) and len(prompt) > 0
            and all(isinstance(m, Mapping) for m in prompt))


def prompt_ids(prompt: str | Sequence[int] | Sequence[Message], tokenizer: Tokenizer | None = None, *,
               chat: bool = False, system: str | None = None, **variables: Any) -> list[int]:
    """The token ids of any prompt a user gives: token ids as they are, text encoded as it is (or as one user
    turn of a chat when `chat`), messages through the chat template with the assistant's turn opened.

    `system` and template `variables` (e.g. enable_thinking=False) belong to chats only.
    """
    if is_messages(prompt) or chat:
        if tokenizer is None:
            raise ChatError("a chat prompt needs the checkpoint's tokenizer")
        if not (isinstance(prompt, str) or is_messages(prompt)):
            raise ChatError("a chat prompt is text or a list of messages ({'role': ..., 'content': ...}), not ids")
        return tokenizer.apply_chat_template(chat_messages(prompt, system), **variables)
    if system is not None or variables:
        given = ["system"] * (system is not None) + sorted(variables)
        raise ChatError(f"{', '.join(given)} only apply to chat prompts: pass messages or chat=True")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ChatError("a text prompt needs the checkpoint's tokenizer; pass token ids instead")
        return tokenizer.encode(prompt)
    ids = np.asarray(prompt) if len(prompt) else np.zeros(0, dtype=np.int64)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ChatError("a prompt is text, a list of token ids, or a list of messages ({'role': ..., 'content': ...})")
    return ids.tolist()


def _plain_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as the template may see them: plain JSON data only, keys whose value is None dropped, and
    reasoning under every name templates read (both as transformers prepares them)."""
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatError(f"message {i} must be a mapping like {{'role': 'user', 'content': ...}}, got {message!r}")
        if not isinstance(message.get("role"), str):
            raise ChatError(f"message {i} needs a 'role' string, got {message.get('role')!r}")
        entry = {k: _plain(v, f"message {i} field {k!r}") for k, v in message.items() if v is not None}
        reasoning = next((entry[k] for k in REASONING_FIELDS if k in entry), None)
        if reasoning is not None:
            entry = {"thinking": reasoning, **entry, "reasoning_content": reasoning}
        plain.append(entry)
    return plain


def _plain(value: Any, where: str) -> Any:
    """A copy made of JSON types only, so the sandbox sees no caller objects (and their methods)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    raise ChatError(f"{where}: {type(value).__name__} is not JSON data (text, numbers, lists, mappings)")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson`: plain json.dumps (jinja2's own escapes HTML characters and keeps ASCII only)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=16)
def _compile(text: str, source: str) -> jinja2.Template:
    """A template compiled once in the immutable sandbox; a syntax error names the file and line."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"{source}: chat template line {e.lineno}: {e.message}") from e
