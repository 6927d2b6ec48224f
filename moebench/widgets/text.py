"""Text in labels: token text made visible (spaces, newlines and tabs drawn as symbols), errors as HTML."""

from __future__ import annotations

import html

VISIBLE = str.maketrans({" ": "\u00b7", "\n": "\u23ce", "\t": "\u21e5"})


def visible(text: str | None) -> str:
    """'·def' for ' def'; '?' when the record has no text (no tokenizer)."""
    return "?" if text is None else text.translate(VISIBLE)


def shown(text: str | None) -> str:
    """visible(), quoted, for use inside a sentence."""
    return f"'{visible(text)}'"


def error_html(error: BaseException) -> str:
    """An error raised inside a widget callback, for a status line (it would otherwise reach only a log)."""
    return f"<b style='color:#b71c1c'>{html.escape(type(error).__name__)}: {html.escape(str(error))}</b>"
