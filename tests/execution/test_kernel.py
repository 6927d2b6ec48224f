"""The kernel sources as MLX receives them: compacted, since MLX hashes a custom kernel's whole source each time it
encodes a launch, and with the MoE helpers only where a body calls them."""

from __future__ import annotations

import pytest

from moebench.execution import attention, linear_attention, moe, rows
from moebench.execution.kernel import KERNEL_DIR, PRELUDES, compact, kernel_source


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
@pytest.mark.parametrize("stage", [moe.ROUTER, moe.GATE_UP, moe.DOWN, rows.ROWS, attention.ATTENTION, attention.COMBINE,
                                   linear_attention.GATED_DELTA], ids=lambda s: s.name)
def test_mlx_receives_each_kernel_without_comments_or_indentation(backend, stage):
    """Every byte MLX receives is hashed again at each launch: no comment, indentation or blank line reaches it,
    and a body that calls none of moe_common.inc's helpers goes without them."""
    header, source = kernel_source(backend, stage)
    lines = (header + source).splitlines()
    assert "//" not in header + source and "/*" not in header + source
    assert all(line == line.strip() for line in lines) and all(lines)
    assert all((KERNEL_DIR / f).read_text().count("//") > 0 for f in (*PRELUDES[backend], stage.body))
    assert ("mb_select" in header) == stage.common and ("MB_AFFINE" in header) == stage.common
