from moebench.widgets.stepper import TokenStepper
from moebench.widgets.text import visible


def test_steps_are_the_generated_tokens_after_the_prompt(trace):
    seen = []
    stepper = TokenStepper(trace, on_step=seen.append)
    assert stepper.records == trace.generated
    assert stepper.strip.before == [visible(s.input_text) for s in trace.prefill[:-1]]
    assert [s["chosen"] for s in stepper.strip.steps] == [visible(r.token_text) for r in trace.generated]
    assert stepper.slider.max == stepper.play.max == len(trace.generated) - 1
    assert seen == [trace.generated[0]]
    stepper.go(2)
    assert stepper.current is trace.generated[2] and seen[-1] is trace.generated[2]
    stepper.go(99)
    assert stepper.index == len(trace.generated) - 1


def test_prompt_records_have_no_chosen_token_but_keep_candidates(trace):
    stepper = TokenStepper(trace.prefill[:-1])
    assert all(s["chosen"] is None for s in stepper.strip.steps)
    assert all(len(s["candidates"]) == 5 for s in stepper.strip.steps)
    assert stepper.strip.before == []


def test_buttons_move_one_step_and_append_keeps_the_position(trace):
    stepper = TokenStepper(trace.generated[:2])
    stepper.next.click()
    assert stepper.index == 1
    stepper.prev.click()
    stepper.prev.click()
    assert stepper.index == 0
    stepper.append(trace.generated[2])
    assert stepper.index == 0 and stepper.slider.max == 2 and len(stepper.strip.steps) == 3
