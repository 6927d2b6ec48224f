"""The commands' tables within 100 columns: a table that fits is left as it is, a wider one wraps its headers, then
its widest cells, and one with too many columns is split, each part starting with the first column."""

from __future__ import annotations

from moebench.tools.text_table import WIDTH, fitted, markdown_table


def cells(lines: list[str]) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines if not line.startswith("|-")]


def test_a_table_that_fits_is_plain_markdown():
    assert markdown_table([["arm", "tok/s"], ["fused", "12.5"]]) == [
        "| arm   | tok/s |", "|-------|-------|", "| fused | 12.5  |"]


def test_a_wide_table_wraps_headers_before_cells_and_keeps_every_word():
    header = ["arm", "decode tok/s", "vs baseline", "memory", "greedy tokens against the baseline"]
    rows = [header, ["moebench fused (reference) compiled", "156.8 [145.8-167.7]", "0.93x", "9.6 MB", "identical"]]
    lines = markdown_table(rows)
    assert max(map(len, lines)) <= WIDTH and len(lines) > 3
    assert lines[-1].split("|")[1].strip() == "moebench fused (reference) compiled"  # one row: its header wrapped
    assert " ".join(" ".join(row[4] for row in cells(lines[:-2])).split()) == "greedy tokens against the baseline"


def test_a_cell_wraps_onto_continuation_rows_when_headers_are_not_enough():
    note = "the reason this arm fell back, which is long enough to need three or four lines of its own " * 2
    lines = markdown_table([["arm", "note"], ["moebench fused (reference) compiled", note]])
    assert max(map(len, lines)) <= WIDTH and len(lines) > 3
    assert " ".join(row[1] for row in cells(lines[2:])).split() == note.split()


def test_too_many_columns_split_into_tables_each_starting_with_the_first_column():
    """profile with eight arms: even wrapped, its columns do not fit beside each other."""
    arms = [f"moebench fused (reference) compiled {i}" for i in range(8)]
    rows = [["per token", *arms], *[[f"metric {m}", *(f"{m}.{i}45 (min 10.000)" for i in range(8))] for m in range(3)]]
    lines = markdown_table(rows)
    assert max(map(len, lines)) <= WIDTH
    tables = "\n".join(lines).split("\n\n")
    assert len(tables) > 1 and all(t.startswith("| per token ") for t in tables)
    found = [c for t in tables for c in cells(t.splitlines()[-3:])[0][1:]]  # metric 0's cells, table by table
    assert found == [f"0.{i}45 (min 10.000)" for i in range(8)]


def test_fitted_wraps_text_and_keeps_table_rows():
    row = "| " + "x" * 120 + " |"  # a cell with no space to wrap at keeps its width
    out = fitted([f"\nword {'y ' * 80}", row])
    assert out[0] == "" and max(map(len, out[1:-1])) <= WIDTH and out[-1] == row
