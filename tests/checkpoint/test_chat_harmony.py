"""gpt-oss's harmony chat format: moebench's prompt ids equal transformers' `apply_chat_template` ids.

The tokenizer folder is laid out like the published openai/gpt-oss-* ones (harmony's control tokens as added
special tokens, eos <|return|>, the template in chat_template.jinja, or inline in tokenizer_config.json as older
conversions keep it). The template (chat_templates/harmony.jinja) writes harmony's turns the way the published
one does, and leans on what transformers gives a template: `strftime_now` for today's date, `raise_exception`,
`namespace`, a `tojson` that keeps non-ASCII text, and the messages' `thinking` filled from reasoning_content.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from moebench.checkpoint.chat import ChatError, prompt_ids
from moebench.checkpoint.tokenizer import Tokenizer as MoebenchTokenizer

TEMPLATE = Path(__file__).parent / "chat_templates" / "harmony.jinja"
HARMONY = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
           "<|message|>", "<|call|>"]


def write_harmony_folder(folder: Path, inline: bool = False) -> Path:
    """A byte-level tokenizer with harmony's control tokens after the 256 bytes, and a gpt_oss config.json."""
    folder.mkdir(parents=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY])
    tok.save(str(folder / "tokenizer.json"))
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    config = {"added_tokens_decoder": {str(256 + i): {"content": t, **entry} for i, t in enumerate(HARMONY)},
              "bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
              "clean_up_tokenization_spaces": False, "model_max_length": 131072,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if inline:
        config["chat_template"] = TEMPLATE.read_text()
    else:
        (folder / "chat_template.jinja").write_text(TEMPLATE.read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "vocab_size": 256 + len(HARMONY)}))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("harmony")
    return {"file": write_harmony_folder(root / "file"), "inline": write_harmony_folder(root / "inline", True)}


QUESTION = [{"role": "user", "content": "What is 2+2?"}]
SYSTEM = [{"role": "system", "content": "Answer in one word (ünïcode ok)."}, *QUESTION]
DEVELOPER = [{"role": "developer", "content": "Be terse."}, *QUESTION]
TURNS = [*SYSTEM, {"role": "assistant", "content": "Four.", "thinking": "2 and 2 make 4."},
         {"role": "user", "content": "And 3+3?"}]
CLOSED = [*TURNS, {"role": "assistant", "content": "Six.", "reasoning_content": "3 and 3 make 6."}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number", "description": "first"}, "b": {"type": "number"},
                                     "unit": {"type": "string", "enum": ["m", "km"], "default": "m"}},
    "required": ["a", "b"]}}}]
CALLING = [*QUESTION, {"role": "assistant", "thinking": "Use the tool.", "tool_calls": [
    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2, "unit": "ü"}}}]},
    {"role": "tool", "content": "4"}]
ANSWERED = [*CALLING, {"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "Thanks"}]
CASES = {
    "user": (QUESTION, {}),
    "system": (SYSTEM, {}),
    "developer": (DEVELOPER, {}),
    "turns": (TURNS, {}),
    "effort-high": (SYSTEM, {"reasoning_effort": "high", "model_identity": "You are a tiny test model."}),
    "no-generation-prompt": (CLOSED, {"add_generation_prompt": False}),
    "no-generation-prompt-user": (SYSTEM, {"add_generation_prompt": False}),
    "tool-call": (CALLING, {"tools": TOOLS}),
    "tool-answered": (ANSWERED, {"tools": TOOLS, "builtin_tools": ["browser"]}),
}


def transformers_ids(folder: Path, messages, variables) -> list[int]:
    from transformers import AutoTokenizer

    variables = {"add_generation_prompt": True, **variables}
    out = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=True, return_dict=False,
                                                                    **variables)
    return list(out)


@pytest.mark.parametrize("layout", ["file", "inline"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_harmony_prompt_ids_equal_transformers(folders, layout, case):
    pytest.importorskip("transformers")
    messages, variables = CASES[case]
    tok = MoebenchTokenizer.from_folder(folders[layout])
    assert not tok.chat_template.builtin
    assert prompt_ids(messages, tok, **variables) == transformers_ids(folders[layout], messages, variables)


def test_what_the_harmony_prompt_says(folders):
    """The turns a gpt-oss model reads: harmony's system turn with today's date and the reasoning effort, the system
    message as the developer's instructions, past reasoning dropped, the assistant's turn opened."""
    from datetime import date

    tok = MoebenchTokenizer.from_folder(folders["file"])
    text = tok.decode(prompt_ids(TURNS, tok, reasoning_effort="low"), skip_special_tokens=False)
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert f"Current date: {date.today():%Y-%m-%d}" in text and "Reasoning: low\n" in text
    assert "<|start|>developer<|message|># Instructions\n\nAnswer in one word (ünïcode ok).\n\n<|end|>" in text
    assert "<|start|>assistant<|channel|>final<|message|>Four.<|end|>" in text and "2 and 2" not in text
    assert text.endswith("<|start|>user<|message|>And 3+3?<|end|><|start|>assistant")
    assert tok.eos_token_ids == (tok.token_to_id("<|return|>"),)
    closed = tok.decode(prompt_ids(CLOSED, tok, add_generation_prompt=False), skip_special_tokens=False)
    assert closed.endswith("<|channel|>analysis<|message|>3 and 3 make 6.<|end|>"
                           "<|start|>assistant<|channel|>final<|message|>Six.<|return|>")
    called = tok.decode(prompt_ids(CALLING, tok, tools=TOOLS), skip_special_tokens=False)
    assert ('<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 2, "unit": "ü"}'
            '<|call|><|start|>functions.add to=assistant<|channel|>commentary<|message|>"4"<|end|>') in called
    assert 'unit?: "m" | "km", // default: "m",\n' in called


@pytest.mark.parametrize("messages, words", [
    ([{"role": "assistant", "content": "<|channel|>final<|message|>4"}], "holds <|channel|> tags"),
    ([*QUESTION, {"role": "tool", "content": "4"}], "follows no assistant tool call"),
    ([{"role": "narrator", "content": "Once"}], "no turn for role narrator"),
])
def test_harmony_template_refusals_are_chat_errors(folders, messages, words):
    """The template's own raise_exception reaches the user as a ChatError naming the template file."""
    tok = MoebenchTokenizer.from_folder(folders["file"])
    with pytest.raises(ChatError, match="chat_template.jinja") as e:
        prompt_ids(messages, tok)
    assert words in str(e.value)
