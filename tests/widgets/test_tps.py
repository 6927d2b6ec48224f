import pytest

from moebench.widgets.tps import TokensPerSecondChart, place_marks, with_gaps


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


def test_mark_labels_never_share_a_place():
    placed = place_marks([(10, "fused OFF"), (11, "recording ON"), (12, "fused ON"), (13, "a"), (14, "b"),
                          (40, "c")], width=5)
    rows = [(x, row) for x, _, row in placed]
    assert [r for _, r in rows] == [0, 1, 2, 3, 0]  # four rows, then the crowded fifth joins a label
    assert "b (14)" in placed[3][1] and placed[-1][:2] == (40, "c")


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
