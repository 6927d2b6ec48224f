import os

import pandas as pd

import moebench
from moebench.checkpoint.loader import SHIPPED_MODEL
from moebench.widgets.controls import ModelPicker, PromptControls, model_choices, parse_prompt
from moebench.widgets.exportbar import ExportBar


def test_model_choices_are_moebench_models_folders_then_the_shipped_model():
    assert model_choices({}) == [str(SHIPPED_MODEL)]
    assert model_choices({"MOEBENCH_MODEL": os.pathsep.join(["/a", "/b"])}) == ["/a", "/b", str(SHIPPED_MODEL)]


def test_text_or_chat_messages():
    assert parse_prompt("def f():") == "def f():"
    assert parse_prompt('[{"role": "user", "content": "hi"}]') == [{"role": "user", "content": "hi"}]
    assert parse_prompt("[1, 2] is a list") == "[1, 2] is a list"


def test_picking_another_model_decodes_the_prompt_on_it(tiny, tmp_path):
    model, tokenizer = tiny
    picker = ModelPicker([str(SHIPPED_MODEL)])
    picker._open["tiny"] = (model, tokenizer)
    picker.dropdown.options = [str(SHIPPED_MODEL), "tiny"]
    controls = PromptControls(picker, "def add(a, b):", tokens=3)
    seen = []
    controls.on_decode(seen.append)
    picker.on_change(lambda *_: controls.decode())
    picker.dropdown.value = "tiny"
    assert picker.model is model and seen[-1].prompt_ids == tokenizer.encode("def add(a, b):")
    assert "4 layers, 8 experts, top-2" in picker.info.value
    bar = ExportBar(lambda: controls.trace, [])
    bar.folder.value = str(tmp_path)
    bar.records("csv")
    tokens, vectors = (pd.read_csv(tmp_path / "records" / f"{n}.csv") for n in ("tokens", "vectors"))
    assert len(tokens) == len(seen[-1].steps) and vectors["values"].str.startswith("[").all()


def test_the_picker_names_a_hybrids_linear_and_full_layers(tmp_path):
    from moebench.cli import main
    from moebench.widgets.controls import describe_model, mixing_text

    full, linear = "full_attention", "linear_attention"
    assert mixing_text([full] * 4) == ""
    assert mixing_text([linear, linear, linear, full] * 2) == (
        ", 6 linear attention + 2 full attention (full attention: layers 3, 7)")
    assert mixing_text([linear] * 11 + [full] * 10) == (
        ", 11 linear attention + 10 full attention (full attention: layers 11, 12, 13, 14, 15, 16, 17, 18, ...)")
    folder = tmp_path / "hybrid"
    assert main(["make-random", str(folder), "--preset", "qwen3-next-tiny", "--dtype", "float32"]) == 0
    model, _ = moebench.load(folder)
    text = describe_model(str(folder), model)
    assert "4 layers, 3 linear attention + 1 full attention (full attention: layer 3), 8 experts, top-2" in text
    shipped, _ = moebench.load(SHIPPED_MODEL)
    assert "attention" not in describe_model(str(SHIPPED_MODEL), shipped)
