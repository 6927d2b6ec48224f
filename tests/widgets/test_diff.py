from moebench.inspect.compare import compare_decode, compare_step
from moebench.widgets.diff import DiffView, relation


def test_step_errors_per_layer_and_per_expert(tiny, trace):
    model, _ = tiny
    frame = compare_step(model, trace.generated[1])
    view = DiffView()
    view.show_step(frame)
    layers = [str(i) for i in sorted(model.moe_blocks())]
    assert all(list(bar.x) == layers for bar in view.figure.data[:3])
    k = model.args.num_experts_per_tok
    assert len(view.figure.data[3].x) == len(view.figure.data[4].x) == k * len(layers)
    assert view.figure.data[3].x[0].startswith("L0 #1 e")
    assert "errors under identical routing" in view.summary.value
    assert "match the truth to float32 rounding" in view.summary.value  # float32 on CPU: both are exact
    assert "Shared expert (unweighted output)" in view.summary.value
    routed, partial = (frame[(frame["part"] == part) & (frame["pair"] == "fused~truth")]["nrms"].median()
                       for part in ("routed", "expert"))
    assert f"per-layer error (left, {routed:.1e}) is {relation(routed, partial)} its per-expert" in view.summary.value


def test_relation_says_what_the_numbers_say():
    assert relation(3.0e-7, 3.2e-7) == "about the same as"  # issue 40: not "far above"
    assert relation(4e-3, 1e-4) == "40x larger than" and relation(1e-4, 4e-3) == "40x smaller than"
    assert relation(0.0, 1e-7) == "smaller than" and relation(2e-7, 2e-7) == "equal to"


def test_half_precision_names_the_closer_path(tiny, trace):
    import mlx.core as mx

    view = DiffView()
    view.show_step(compare_step(tiny[0], trace.generated[1], dtype=mx.bfloat16))
    assert "bfloat16 activations" in view.summary.value and "closer to the truth" in view.summary.value


def test_decode_agreement_and_identical_tokens(tiny):
    model, tokenizer = tiny
    comparison = compare_decode(model, "hello", 4, tokenizer)
    view = DiffView()
    view.show_decode(comparison)
    assert list(view.figure.data[5].x) == [str(i) for i in sorted(model.moe_blocks())]
    assert all(0 <= y <= 1 for y in view.figure.data[5].y)
    if comparison.identical:
        assert "all 4 greedy tokens identical" in view.summary.value
    else:
        assert "tokens first differ" in view.summary.value


def test_log_axes_always_show_labelled_ticks_around_the_errors():
    from moebench.widgets.diff import log_ticks

    for values in ([5e-8, 3e-7], [1.8e-7, 2e-7], [1e-7, 1.6e-2], [0.0, 1e-9]):
        ticks = log_ticks(values)
        assert len(ticks) >= 2 and ticks[0] <= max(min(values), 1e-12) and ticks[-1] >= max(values)
    assert log_ticks([5e-8, 3e-7]) == [5e-8, 1e-7, 2e-7, 5e-7]  # under two decades: 1, 2, 5 steps
