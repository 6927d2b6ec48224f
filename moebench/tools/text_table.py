"""The tables and lines the commands print, each within WIDTH columns, so a report reads in a terminal of that width
without wrapping.

A table wider than that wraps the words of its headers onto more lines first, then of its widest cells onto
continuation rows (an arm's name over two rows; no column to less than half its width); one that still does not fit
is printed as several tables, each starting with the first column (profile's arms side by side, eval-tiny's
perplexity columns), and a table that cannot be split (two columns) or a part that still does not fit wraps its cells
as far as their words allow. A word longer than its column's room (a path) keeps its width.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable

WIDTH = 100


def wrapped(text: str, width: int = WIDTH) -> list[str]:
    """`text` in lines of at most `width`, the continuations indented two past its own indent."""
    indent = " " * (len(text) - len(text.lstrip()) + 2)
    return textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False) or [""]


def fitted(lines: Iterable[str], width: int = WIDTH) -> list[str]:
    """A report's lines (an item may hold several, split at its newlines) within `width`: text wrapped, table rows
    (markdown_table's, already within it) kept."""
    parts = (part for line in lines for part in line.split("\n"))
    return [out for part in parts for out in ([part] if part.startswith("|") else wrapped(part, width))]


def _table_width(widths: list[int]) -> int:
    return sum(widths) + 3 * len(widths) + 1  # "| " + cells joined by " | " + " |"


def _longest_word(cells: list[str]) -> int:
    return max((len(word) for cell in cells for word in cell.split()), default=0)


def _natural(rows: list[list[str]]) -> list[int]:
    return [max(len(cell) for cell in column) for column in zip(*rows, strict=True)]


def _header_floors(rows: list[list[str]]) -> list[int]:
    """The narrowest each column may be with only its header wrapped: its widest other cell, its longest word."""
    return [max(_longest_word(list(column)), *(len(cell) for cell in column[1:]), 1)
            for column in zip(*rows, strict=True)]


def _cell_floors(rows: list[list[str]], half: bool = True) -> list[int]:
    """The narrowest each column may be with its cells wrapped too: its longest word, and (with `half`) half its
    width."""
    pairs = zip(zip(*rows, strict=True), _natural(rows), strict=True)
    return [max(_longest_word(list(column)), (w + 1) // 2 if half else 1) for column, w in pairs]


def _narrowed(rows: list[list[str]], width: int, deep: bool = False) -> list[int]:
    """Column widths of at most `width` in all where the floors allow it, headers wrapped before cells (and, when
    `deep`, past half a column's width): the widest column above its floor gives a character, until the table
    fits."""
    widths = _natural(rows)
    passes = (_header_floors(rows), _cell_floors(rows), *([_cell_floors(rows, half=False)] if deep else []))
    for floors in passes:
        while _table_width(widths) > width:
            above = [i for i, w in enumerate(widths) if w > floors[i]]
            if not above:
                break
            widths[max(above, key=lambda i: widths[i])] -= 1
    return widths


def _render(rows: list[list[str]], widths: list[int]) -> list[str]:
    """The rows with every cell wrapped to its column's width (a row as high as its tallest cell), a separator under
    the header."""
    lines = []
    for n, row in enumerate(rows):
        cells = [textwrap.wrap(cell, w, break_on_hyphens=False) or [""] for cell, w in zip(row, widths, strict=True)]
        for k in range(max(map(len, cells))):
            parts = [(c[k] if k < len(c) else "").ljust(w) for c, w in zip(cells, widths, strict=True)]
            lines.append("| " + " | ".join(parts) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return lines


def _column_groups(widths: list[int], width: int) -> list[list[int]]:
    """The columns after the first in runs whose `widths` fit `width` beside the first (one column a run at least)."""
    groups: list[list[int]] = [[]]
    for i in range(1, len(widths)):
        if groups[-1] and _table_width([widths[0], *(widths[j] for j in groups[-1]), widths[i]]) > width:
            groups.append([])
        groups[-1].append(i)
    return groups


def markdown_table(rows: list[list[str]], width: int = WIDTH) -> list[str]:
    """Rows of cells as a Markdown table, the first row its header, columns padded to one width, within `width`
    columns where the words allow (see the module docstring)."""
    widths = _narrowed(rows, width)
    if _table_width(widths) <= width:
        return _render(rows, widths)
    if len(widths) <= 2:
        return _render(rows, _narrowed(rows, width, deep=True))
    tables = []
    for group in _column_groups(_header_floors(rows), width):
        part = [[row[0], *(row[i] for i in group)] for row in rows]
        tables += [*([""] if tables else []), *_render(part, _narrowed(part, width, deep=True))]
    return tables
