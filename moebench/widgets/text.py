"""Token text made visible in labels: spaces, newlines and tabs drawn as symbols."""

from __future__ import annotations

VISIBLE = str.maketrans({" ": "\u00b7", "\n": "\u23ce", "\t": "\u21e5"})


def visible(text: str | None) -> str:
    """'·def' for ' def'; '?' when the record has no text (no tokenizer)."""
    return "?" if text is None else text.translate(VISIBLE)


def shown(text: str | None) -> str:
    """visible(), quoted, for use inside a sentence."""
    return f"'{visible(text)}'"
