"""The kernel sources as MLX receives them: compacted, since MLX hashes a custom kernel's whole source each time it
encodes a launch, and with only the helper files a body calls."""

from __future__ import annotations

import re

import pytest

from moebench.execution import attention, linear_attention, moe, rows
from moebench.execution.kernel import JOIN, KERNEL_DIR, PRELUDES, QUANT, SELECT, compact, kernel_source

STAGES = [moe.ROUTER, moe.GATE_UP, moe.DOWN, rows.ROWS, attention.ATTENTION, attention.COMBINE,
          linear_attention.GATED_DELTA]


def test_compact_drops_comments_indentation_and_blank_lines_and_keeps_literals_and_macros():
    code = ('// a header comment, with an apostrophe: Metal\'s\n'
            '#define MB_UNROLL _Pragma("unroll")  // unroll the next loop\n'
            '#define TWICE(x) \\\n'
            '\n'
            '  ((x) + (x))\n'
            '\n'
            '    float a = 1.0f; /* half // of it */ float b = a / 2.0f;\n'
            '    const char* s = "not // a comment"; char c = \'/\';\n')
    assert compact(code) == ('#define MB_UNROLL _Pragma("unroll")\n'
                             '#define TWICE(x) \\\n'
                             '\n'
                             '((x) + (x))\n'
                             'float a = 1.0f;  float b = a / 2.0f;\n'
                             'const char* s = "not // a comment"; char c = \'/\';\n')


@pytest.mark.parametrize("backend", sorted(PRELUDES))
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_mlx_receives_each_kernel_without_comments_or_indentation(backend, stage):
    """Every byte MLX receives is hashed again at each launch: no comment, indentation or blank line reaches it."""
    header, source = kernel_source(backend, stage)
    lines = (header + source).splitlines()
    assert "//" not in header + source and "/*" not in header + source
    assert all(line == line.strip() for line in lines) and all(lines)
    assert all((KERNEL_DIR / f).read_text().count("//") > 0 for f in (*PRELUDES[backend], stage.body))


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_each_kernel_carries_exactly_the_helper_files_its_body_calls(stage):
    """A helper file rides with a kernel only when its body names something the file defines."""
    body = (KERNEL_DIR / stage.body).read_text()
    for helper in (QUANT, SELECT, JOIN):
        text = compact((KERNEL_DIR / helper).read_text())
        defined = set(re.findall(r"(?:MB_FN \w+|#define|struct) (\w+)", text))
        defined |= set(re.findall(r"MB_FN [\w<>, ]+? (mb_\w+)\(", text))
        calls = {name for name in defined if re.search(rf"\b{name}\b", compact(body))}
        assert bool(calls) == (helper in stage.helpers), f"{stage.body} and {helper}: {sorted(calls)}"
