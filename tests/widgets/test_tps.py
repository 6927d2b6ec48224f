import pytest

from moebench.widgets.tps import TokensPerSecondChart, label_extent, place_marks, with_gaps


def test_points_go_to_their_arm_within_one_window_for_all_arms():
    chart = TokensPerSecondChart(window=4, redraw_hz=0)
    for step in range(5):
        chart.add(step, 0.5, recording=step % 2 == 0, fused=step < 3)
    assert chart.points_received == 5
    # the window holds positions 1..4 for every arm: no arm keeps older points than another
    assert list(chart.trace(recording=True, fused=True).x) == [2]
    assert list(chart.trace(recording=False, fused=True).x) == [1]
    assert list(chart.trace(recording=True, fused=False).x) == [4]
    assert list(chart.trace(recording=False, fused=False).x) == [3]
    assert chart.figure.layout.xaxis.range == (0.5, 4.5)
    assert "median 2.0 tok/s" in chart.summary(True, fused=True) or "2.0 tok/s (n 1)" in chart.summary(True, True)


def test_a_line_never_bridges_tokens_of_another_arm():
    assert with_gaps([(0, 1.0), (1, 2.0), (5, 3.0)]) == ([0, 1, None, 5], [1.0, 2.0, None, 3.0])


def test_summary_gives_median_and_spread():
    chart = TokensPerSecondChart(redraw_hz=0)
    for i, s in enumerate((0.1, 0.2, 0.25, 0.5)):
        chart.add(i, s, recording=False)
    assert chart.summary(False) == "fused on, clean: median 4.5 tok/s (IQR 3.5-6.2, n 4)"


def extents(placed, lo, hi):
    return [(row, *label_extent(x, text, lo, hi)[:2]) for x, text, row, _, _ in placed]


def test_mark_labels_never_overlap_and_stay_inside_the_axis():
    lo, hi = -0.5, 60.5
    marks = [(10, "fused OFF"), (11, "recording ON"), (12, "fused ON"), (13, "a"), (14, "b"), (40, "c"),
             (60, "fused OFF")]
    placed = place_marks(marks, lo, hi)
    assert [row for _, _, row, _, _ in placed[:4]] == [0, 1, 2, 3]  # four crowded labels, four rows
    spans = extents(placed, lo, hi)
    for i, (row, left, right) in enumerate(spans):
        assert lo <= left and right <= hi, placed[i]
        assert all(right <= l2 or r2 <= left for row2, l2, r2 in spans[i + 1:] if row2 == row), placed[i]
    # the fifth crowded label had no room: its line stays, the label before it names it on hover
    assert "b" not in [text for _, text, _, _, _ in placed] and "b at token 14" in placed[3][4]
    # a mark at the axis's end is written left of its line, not cut off by the edge
    assert placed[-1][:2] == (60, "fused OFF") and placed[-1][3] == "right"


def test_chart_draws_a_line_for_every_mark_and_labels_inside_the_plot():
    chart = TokensPerSecondChart(window=50, redraw_hz=0)
    for position in range(30):
        chart.add(position, 0.01, recording=False, fused=position < 29)
    chart.mark(29, "fused OFF")  # at the newest token, as a click during a live decode draws it
    assert [a.xanchor for a in chart.figure.layout.annotations] == ["right"]
    assert [s.x0 for s in chart.figure.layout.shapes] == [29]


def test_redraws_are_throttled_until_flush():
    chart = TokensPerSecondChart(redraw_hz=0.001)
    chart.add(0, 0.1, recording=False)  # the first point draws
    chart.add(1, 0.1, recording=False)
    chart.mark(1, "fused OFF")
    assert len(chart.trace(False).x) == 1 and not chart.figure.layout.shapes
    chart.flush()
    assert len(chart.trace(False).x) == 2
    assert [a.text for a in chart.figure.layout.annotations] == ["fused OFF"]


def test_rejects_impossible_timings_and_windows():
    with pytest.raises(ValueError, match="window"):
        TokensPerSecondChart(window=1)
    with pytest.raises(ValueError, match="cannot take 0"):
        TokensPerSecondChart().add(3, 0.0, recording=True)
    assert "no tokens yet" in TokensPerSecondChart().summary(True)
