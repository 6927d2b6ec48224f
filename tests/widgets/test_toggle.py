from types import SimpleNamespace

import moebench
from moebench.execution.plan import Decision
from moebench.inspect.record import Stepper
from moebench.widgets.toggle import FusedToggle, describe_paths


def test_clicking_flips_the_runtime_switch_and_calls_back():
    moebench.set_fused_moe(True)
    flips = []
    toggle = FusedToggle(on_change=flips.append)
    toggle.button.value = False  # what a click does
    assert not moebench.fused_moe_enabled() and flips == [False]
    assert "OFF" in toggle.button.description
    toggle.set(True)
    assert moebench.fused_moe_enabled() and flips == [False, True]


def test_label_reports_the_recorded_path_and_the_decline_reason(tiny):
    model, tokenizer = tiny
    toggle = FusedToggle()
    stepper = Stepper(model, tokenizer, "hello", record=True)
    stepper.prefill()
    toggle.set(True)
    toggle.show(stepper.step())
    assert f"fused {moebench.available_backend()} kernel on 4 of 4 MoE layers" in toggle.label.value
    assert f"attention: the {moebench.available_backend()} decode-attention kernel on 4 of 4" in toggle.label.value
    toggle.set(False)
    record = stepper.step()
    toggle.show(record)
    assert "fallback (gather_qmm) on 4 of 4 MoE layers: switched off" in toggle.label.value
    assert "attention: MLX ops on 4 of 4: switched off" in toggle.label.value
    assert describe_paths(record) in toggle.label.value


def test_an_unrecorded_step_says_the_path_is_unknown(tiny):
    model, tokenizer = tiny
    toggle = FusedToggle()
    toggle.show(Stepper(model, tokenizer, "hello").run(1).generated[0])
    assert "path not recorded" in toggle.label.value


def test_a_fused_step_that_ran_part_of_the_block_beside_the_kernels_says_so():
    note = "shared expert beside the kernels: its down_proj is 8-bit g64 affine (bfloat16 scales), ..."
    layers = {i: SimpleNamespace(path=Decision("cuda", None, note if i else None)) for i in range(2)}
    text = describe_paths(SimpleNamespace(layers=layers))
    assert text == f"fused cuda kernel on 1 of 2 MoE layers: {note}; fused cuda kernel on 1 of 2 MoE layers" or \
        text == f"fused cuda kernel on 1 of 2 MoE layers; fused cuda kernel on 1 of 2 MoE layers: {note}"
