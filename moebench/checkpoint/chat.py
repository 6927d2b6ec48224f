"""Chat prompts: a checkpoint's chat template, rendered the way transformers renders it.

The template is the folder's `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`
(transformers' order). It runs in jinja2's immutable sandbox with the settings, globals and filters
transformers gives chat templates (trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a JSON `tojson`), so the prompt ids equal `tokenizer.apply_chat_template(messages,
add_generation_prompt=True)` in transformers and mlx-lm. A template is text, never code run outside the
sandbox, and nothing outside the checkpoint folder is read. A template is also untrusted input, so a render has a
budget: RENDER_SECONDS of time (checked at every call, attribute, operator and loop step) and RENDER_CHARS of
text (the output counted as it streams; `*`, `+`, `~`, `%`, `**`, blocks and the filters and methods that
multiply sizes checked before they build anything). Past either, and on recursion, a range too big for the
sandbox or memory running out, the render stops with a ChatError naming the template.

Message content is text, or a list of parts as multimodal templates (Qwen3.5's) take it: text parts pass to the
template; an image, video or audio part is a ChatError (MEDIA), as moebench runs the text model only.

A folder without a template (the shipped tiny model) gets moebench's built-in ChatML, the turn format
of the Qwen chat models, with no default system prompt; `ChatTemplate.builtin` says so.

    ids = prompt_ids("What is 2+2?", tokenizer, chat=True, system="Be brief.")
    ids = prompt_ids([{"role": "user", "content": "Hi"}], tokenizer, enable_thinking=False)  # Qwen3's switch
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache, wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError, MoebenchError
from .files import checkpoint_file, is_present

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
# What a content part holds when it is no text (its `type`, or a key naming it, as Qwen3.5's template reads them):
# moebench runs the text model only, so a medium in a message is refused, never written as placeholder tokens.
MEDIA = ("image", "image_url", "video", "video_url", "audio", "audio_url", "input_audio")
# A render's budget (module settings, so a caller may change them): seconds, and characters of text (or items of a
# list) that the output or any value built on the way may hold: far past any model's context, short of what
# would take a kernel's memory. Integers past MAX_INT_BITS (and so past what str() prints) are refused too.
RENDER_SECONDS = 5.0
RENDER_CHARS = 8_000_000
MAX_INT_BITS = 1 << 16
MAX_DEPTH = 100  # how deeply message content (JSON data) may nest
MAX_JSON_INDENT = 64

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
        tokens (bos_token, eos_token, ...), `tools` (JSON schemas) and `documents`, and switches such as Qwen3's
        `enable_thinking` (a bool, or one of the words MOEBENCH_FUSED_MOE takes; None leaves it to the template:
        it is not passed). Every value is JSON data, copied. The render runs under the module docstring's budget."""
        import jinja2

        template = _compile(self.text, self.source)
        if "enable_thinking" in variables:
            switch = _thinking_switch(variables.pop("enable_thinking"))
            if switch is not None:  # None is no choice: not passed, as GLM's template takes a None for off
                variables["enable_thinking"] = switch
        variables = {"tools": None, "documents": None,
                     **{k: _plain(v, f"template variable {k!r}") for k, v in variables.items()},
                     "messages": _plain_messages(messages), "add_generation_prompt": add_generation_prompt}
        for name in ("tools", "documents"):
            if variables[name] is not None and not (isinstance(variables[name], list)
                                                    and all(isinstance(t, dict) for t in variables[name])):
                raise ChatError(f"{name} must be a list of JSON objects (mappings), as transformers passes them")
        budget = _BUDGET.set(_Budget(time.monotonic() + RENDER_SECONDS, RENDER_SECONDS))
        try:
            # streamed: every piece is counted (_output) as it is produced, so a render past the size budget
            # stops before it is built
            return "".join(template.generate(**variables))
        except _OverBudget as e:
            raise ChatError(f"{self.source}: the chat template was stopped: {e}") from None
        except RecursionError:
            raise ChatError(f"{self.source}: the chat template recursed too deeply (a macro or loop calling itself "
                            "without end?)") from None
        except MemoryError:
            raise ChatError(f"{self.source}: the chat template ran out of memory") from None
        except OverflowError as e:  # the sandbox's range limit, a float past its range
            raise ChatError(f"{self.source}: the chat template overflowed: {e}") from None
        except jinja2.TemplateError as e:
            raise ChatError(f"{self.source}: the chat template cannot render these messages: {e}") from e
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, ArithmeticError) as e:
            raise ChatError(f"{self.source}: the chat template failed on these messages: {e!r}") from e
        finally:
            _BUDGET.reset(budget)


def read_chat_template(folder: Path, tokenizer_config: Mapping[str, Any]) -> ChatTemplate | None:
    """The folder's template: chat_template.jinja, else tokenizer_config.json's `chat_template` (one string, or
    named templates of which 'default' is used, as transformers does); None when there is none."""
    path = folder / TEMPLATE_FILE
    if is_present(path):  # a link that dangles or loops is named, not taken for no template
        try:
            return ChatTemplate(checkpoint_file(path, folder, ConfigError).read_text(encoding="utf-8"), str(path))
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
    if "messages" in variables:
        raise ChatError("'messages' is the chat itself (the prompt), not a template variable")
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
        _refuse_media(message.get("content"), i)  # first: a decoded image is no JSON data, but it is named as one
        entry = {k: _plain(v, f"message {i} field {k!r}") for k, v in message.items() if v is not None}
        reasoning = next((entry[k] for k in REASONING_FIELDS if k in entry), None)
        if reasoning is not None:
            entry = {"thinking": reasoning, **entry, "reasoning_content": reasoning}
        plain.append(entry)
    return plain


def _refuse_media(content: Any, index: int) -> None:
    """A ChatError for an image, video or audio part in message `index`'s content (a list of parts): transformers'
    tokenizer would render the template's placeholder tokens for it (<|image_pad|>, ...), but moebench loads the
    text model only (a multimodal folder's vision weights are left out), so the model could never see it."""
    if not isinstance(content, (list, tuple)):
        return
    for j, part in enumerate(content):
        medium = next((m for m in MEDIA if isinstance(part, Mapping) and (part.get("type") == m or m in part)), None)
        if medium is not None:
            raise ChatError(f"message {index} content part {j} is not text but {medium!r}: moebench runs the text "
                            "model only (a checkpoint's vision or audio weights are not loaded), so give text parts "
                            "only ({'type': 'text', 'text': ...})")


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """A copy made of JSON types only, so the sandbox sees no caller objects (and their methods), nested at most
    MAX_DEPTH deep."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if depth >= MAX_DEPTH:
        raise ChatError(f"{where}: nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, Mapping):
        return {str(k): _plain(v, where, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where, depth + 1) for v in value]
    raise ChatError(f"{where}: {type(value).__name__} is not JSON data (text, numbers, lists, mappings)")


def _thinking_switch(value: Any) -> bool | None:
    """enable_thinking as a bool: True/False, 1/0 or a word of execution.settings.parse_switch (on/off, yes/no,
    true/false); None leaves it to the template. Anything else is a ChatError: a word the template would take
    as truthy ('off' is a non-empty string) must not turn thinking on."""
    from ..execution.settings import parse_switch

    if value is None:
        return None
    try:
        return parse_switch(str(value) if type(value) is int else value, "enable_thinking")
    except ConfigError as e:
        raise ChatError(str(e)) from None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson`: plain json.dumps (jinja2's own escapes HTML characters and keeps ASCII only); an
    indent past MAX_JSON_INDENT (it repeats on every line, times the depth) is refused."""
    width = indent if type(indent) is int else len(indent) if isinstance(indent, str) else 0
    if width > MAX_JSON_INDENT:
        raise _OverBudget(f"tojson indent {width} is past {MAX_JSON_INDENT}")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=16)
def _compile(text: str, source: str) -> jinja2.Template:
    """A template compiled once in the budgeted sandbox (_environment), its loops, `~` and output routed through
    the budget (_budgeted_nodes); a syntax error, or a template too deep or large to compile, names the file."""
    import jinja2

    env = _environment()
    try:
        tree = _budgeted_nodes(env.parse(text), env)
        return env.template_class.from_code(env, env.compile(tree), env.make_globals(None))
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"{source}: chat template line {e.lineno}: {e.message}") from e
    except (RecursionError, MemoryError, ValueError, OverflowError) as e:
        raise ConfigError(f"{source}: the chat template cannot be compiled: {type(e).__name__}: {e}") from None


# -- the render budget -----------------------------------------------------------------------------------------------
class _OverBudget(Exception):
    """A render stopped by its budget (the message says which); ChatTemplate.render words it as a ChatError."""


@dataclass
class _Budget:
    """One render's budget: its deadline, and the characters (at least one per piece) output so far anywhere
    (macro bodies and {% set %} blocks too, so no buffer grows unseen)."""

    deadline: float
    seconds: float
    produced: int = 0


_BUDGET: ContextVar[_Budget | None] = ContextVar("moebench_chat_budget", default=None)  # the render on this thread
# Filters and str / list methods whose arguments size what they build; their numbers are checked before they run.
_SIZING = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap", "truncate", "batch",
                     "slice", "join", "replace", "format", "format_map"})
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*:([^{}]*)\}")


def _tick() -> None:
    """Past the render's deadline: stop (called at every call, attribute, item, operator, loop step and output)."""
    budget = _BUDGET.get()
    if budget is not None and time.monotonic() > budget.deadline:
        raise _OverBudget(f"it ran past its time budget of {budget.seconds:g} s")


def _fits(size: int, what: str) -> None:
    if size > RENDER_CHARS:
        raise _OverBudget(f"{what} would hold {size} characters or items, past the size budget of {RENDER_CHARS}")


def _sized(value: Any) -> Any:
    """`value`, once a text or collection some call or operator returned is within the size budget."""
    if isinstance(value, (str, list, tuple, dict)):
        _fits(len(value), "a value it built")
    return value


def _number(digits: str) -> int:
    return int(digits) if len(digits) < 12 else 10**12  # a longer run is past any budget; int() of it may refuse


def _format_size(fmt: str, values: Any) -> int:
    """Roughly the most that `fmt % values` or `fmt.format(*values)` builds: the text, every width and precision
    it names (and the values' numbers where it takes widths from them), the values' text."""
    values = tuple(values.values()) if isinstance(values, Mapping) else values if isinstance(values, tuple) \
        else (values,)
    widths = [_number(d) for m in _PERCENT_FIELD.finditer(fmt) for d in m.groups() if d]
    widths += [_number(d) for spec in _BRACE_SPEC.findall(fmt) for d in re.findall(r"\d+", spec)]
    size = len(fmt) + sum(widths) + sum(len(v) for v in values if isinstance(v, str))
    if "*" in fmt or ":{" in fmt:
        size += sum(abs(v) for v in values if type(v) is int)
    return size


def _estimate(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Before a filter or str / list method of _SIZING runs on args[0]: its numbers within the size budget, and
    what replace, indent, expandtabs, join, slice and format would build."""
    if name not in _SIZING or not args:
        return
    first, rest = args[0], [*args[1:], *kwargs.values()]
    for value in rest:
        if type(value) is int:
            _fits(abs(value), f"{name}()")
    if name in ("format", "format_map") and isinstance(first, str):
        _fits(_format_size(first, tuple(rest) if name == "format" else (rest or [{}])[0]), f"{name}()")
    elif name == "replace" and len(args) >= 3 and all(isinstance(a, str) for a in args[:3]):
        old, new = args[1], args[2]
        _fits(len(first) + (first.count(old) if old else len(first) + 1) * max(0, len(new) - len(old)), "replace()")
    elif name in ("indent", "expandtabs") and isinstance(first, str):
        width = rest[0] if rest else 4 if name == "indent" else 8
        width = len(width) if isinstance(width, str) else width if type(width) is int else 0
        _fits(len(first) + (first.count("\n" if name == "indent" else "\t") + 1) * width, f"{name}()")
    elif name == "join" and rest:
        items, separator = (rest[0], first) if isinstance(first, str) else (first, rest[0])
        if hasattr(items, "__len__") and isinstance(separator, str):
            _fits(len(items) * len(separator), "join()")
    elif name == "slice" and rest and type(rest[0]) is int:
        _fits(rest[0] * 8, "slice()")  # a list per slice


def _check_operands(operator: str, left: Any, right: Any) -> None:
    """Before `*`, `+`, `%` or `**` runs: what it would build within the size budget, and integers within
    MAX_INT_BITS (Python takes seconds to multiply or raise integers of millions of digits)."""
    if operator == "*":
        for sequence, times in ((left, right), (right, left)):
            if isinstance(sequence, (str, list, tuple)) and type(times) is int:
                _fits(len(sequence) * times, "'*'")
        bits = left.bit_length() + right.bit_length() if type(left) is int and type(right) is int else 0
    elif operator == "**" and type(left) is int and type(right) is int and abs(left) > 1 and right > 0:
        bits = right * left.bit_length()
    else:
        bits = 0
        if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _fits(len(left) + len(right), "'+'")
        elif operator == "%" and isinstance(left, str):
            _fits(_format_size(left, right), "'%'")
    if bits > MAX_INT_BITS:
        raise _OverBudget(f"'{operator}' would build an integer of about {bits} bits, past {MAX_INT_BITS}")


def _steps(items: Iterable[Any]) -> Iterator[Any]:
    """A loop's items, one budget check each."""
    for item in items:
        _tick()
        yield item


def _joined(parts: Iterable[Any]) -> str:
    """`~`, macro bodies and blocks: the pieces joined once their sum is within the size budget."""
    parts = [str(p) for p in parts]
    _fits(sum(map(len, parts)), "a joined text")
    return "".join(parts)


def _output(value: Any) -> str:
    """One piece of output (anywhere: the prompt, a macro's body, a {% set %} block), counted against the size
    budget, at least one character a piece, before it is kept."""
    _tick()
    text = str(value)
    budget = _BUDGET.get()
    if budget is not None:
        budget.produced += max(1, len(text))
        _fits(budget.produced, "its output")
    return text


def _budgeted_filter(name: str, f: Callable) -> Callable:
    """A filter checked against the budget before (_estimate) and after (_sized) it runs; jinja2's pass_context /
    pass_environment marks are kept (wraps copies them)."""
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0

    @wraps(f)
    def run(*args: Any, **kwargs: Any) -> Any:
        _tick()
        _estimate(name, args[skip:], kwargs)
        return _sized(f(*args, **kwargs))

    return run


def _budgeted_lipsum(lipsum: Callable) -> Callable:
    @wraps(lipsum)
    def run(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 -- jinja2's names
        if type(n) is int and type(max) is int:
            _fits(n * max * 16, "lipsum()")
        return lipsum(n, html, min, max)

    return run


def _budgeted_nodes(tree: jinja2.nodes.Template, env: jinja2.Environment) -> jinja2.nodes.Template:
    """The parsed template with every {% for %}'s items, every `~` and every output piece passed through the
    environment's budget methods (moebench_steps, moebench_joined, moebench_output): environment attributes, which
    a template cannot shadow or reach."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def through(method: str, args: list, lineno: int) -> nodes.Call:
        call = nodes.Call(nodes.EnvironmentAttribute(method, lineno=lineno), args, [], None, None, lineno=lineno)
        return call.set_environment(env)

    class Budgeted(NodeTransformer):
        def visit_For(self, node: nodes.For) -> nodes.For:
            node = self.generic_visit(node)
            node.iter = through("moebench_steps", [node.iter], node.lineno)
            return node

        def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
            return through("moebench_joined", self.generic_visit(node).nodes, node.lineno)

        def visit_Output(self, node: nodes.Output) -> nodes.Output:
            node = self.generic_visit(node)
            node.nodes = [through("moebench_output", [child], child.lineno) for child in node.nodes]
            return node

    return Budgeted().visit(tree)


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    """jinja2's immutable sandbox with every protection it has, transformers' settings, globals and filters, and
    the render budget: checked at every call, attribute and item access and intercepted operator, every filter
    wrapped (_budgeted_filter), every block joined within the size budget. One environment for every template:
    a render's budget is its own (_BUDGET, a ContextVar)."""
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BudgetedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "%", "**"})
        concat = staticmethod(_joined)  # macro bodies, {% set %}, {% filter %} and {% call %} blocks

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 -- jinja2's own signature
            _tick()
            if isinstance(__obj, LoopContext) and args:  # loop(children) in a recursive {% for %}
                args = (_steps(args[0]), *args[1:])
            target = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
            if isinstance(getattr(target, "__self__", None), (str, list, tuple)):
                _estimate(getattr(target, "__name__", ""), (target.__self__, *args), kwargs)
            return _sized(super().call(__context, __obj, *args, **kwargs))

        def call_binop(self, context, operator, left, right):
            _tick()
            _check_operands(operator, left, right)
            return _sized(super().call_binop(context, operator, left, right))

        def getattr(self, obj, attribute):
            _tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _tick()
            return super().getitem(obj, argument)

        moebench_steps = staticmethod(_steps)
        moebench_joined = staticmethod(lambda *parts: _joined(parts))
        moebench_output = staticmethod(_output)

    env = BudgetedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.filters.update({name: _budgeted_filter(name, f) for name, f in env.filters.items()})
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["lipsum"] = _budgeted_lipsum(env.globals["lipsum"])
    return env
