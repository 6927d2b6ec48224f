import pytest

from moebench.widgets.tps import TokensPerSecondChart


def test_points_go_to_their_trace_within_the_window():
    chart = TokensPerSecondChart(window=3, redraw_hz=0)
    for step in range(5):
        chart.add(step, 0.5, instrumented=step % 2 == 0)
    assert chart.points_received == 5
    assert list(chart.trace(True).x) == [0, 2, 4] and list(chart.trace(True).y) == [2.0, 2.0, 2.0]
    assert list(chart.trace(False).x) == [1, 3]
    chart.add(5, 0.25, instrumented=True)
    assert list(chart.trace(True).x) == [2, 4, 5]
    assert "mean of last 3" in chart.trace(True).name


def test_redraws_are_throttled_until_flush():
    chart = TokensPerSecondChart(redraw_hz=0.001)
    chart.add(0, 0.1, instrumented=False)  # the first point draws
    chart.add(1, 0.1, instrumented=False)
    chart.mark(1, "fused OFF")
    assert len(chart.trace(False).x) == 1 and not chart.figure.layout.shapes
    chart.flush()
    assert len(chart.trace(False).x) == 2
    assert [a.text for a in chart.figure.layout.annotations] == ["fused OFF"]


def test_rejects_impossible_timings_and_windows():
    with pytest.raises(ValueError, match="window"):
        TokensPerSecondChart(window=1)
    with pytest.raises(ValueError, match="cannot take 0"):
        TokensPerSecondChart().add(3, 0.0, instrumented=True)
    assert "no tokens yet" in TokensPerSecondChart().summary(True)
