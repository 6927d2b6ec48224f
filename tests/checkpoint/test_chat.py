"""Chat prompts and published tokenizer folders: moebench's prompt ids equal mlx-lm's (transformers') for a
Qwen1.5-Chat and a Qwen3 tokenizer folder, with and without a system message, over several turns.

The folders are written here the way the published ones are laid out: tokenizer.json with the control
tokens, tokenizer_config.json (added_tokens_decoder, eos_token, the Qwen1.5 template inline),
special_tokens_map.json, added_tokens.json, and Qwen3's template in chat_template.jinja. The templates
(chat_templates/) reproduce the published ones' structure: Qwen1.5's default system prompt, Qwen3's
tool-call and <think> handling and its enable_thinking switch.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from moebench.checkpoint import chat
from moebench.checkpoint.chat import ChatError, ChatTemplate, builtin_chat_template, chat_messages, prompt_ids
from moebench.checkpoint.tokenizer import Tokenizer as MoebenchTokenizer
from moebench.checkpoint.tokenizer import stop_ids
from moebench.errors import CheckpointError, ConfigError

TEMPLATES = Path(__file__).parent / "chat_templates"
BYTES = 256
# Control tokens after the byte alphabet, in Qwen's order; <think> and </think> are not special in Qwen3.
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_EXTRA = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
SPECIAL = set(CONTROL)


def added_token_entry(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": content in SPECIAL}


def write_tokenizer_folder(folder: Path, family: str, lacking: tuple[str, ...] = ()) -> Path:
    """A byte-level tokenizer folder laid out like the published Qwen1.5-Chat or Qwen3 ones.

    `lacking` tokens are left out of tokenizer.json (the other files still declare them, at their ids).
    """
    folder.mkdir(parents=True, exist_ok=True)
    tokens = CONTROL + (QWEN3_EXTRA if family == "qwen3" else [])
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    for text in tokens:
        if text not in lacking:
            tok.add_tokens([AddedToken(text, special=text in SPECIAL, normalized=False)])
    tok.save(str(folder / "tokenizer.json"))
    ids = {text: BYTES + i for i, text in enumerate(tokens)}
    config = {
        "added_tokens_decoder": {str(i): added_token_entry(t) for t, i in ids.items()},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    if family == "qwen1.5":
        config["chat_template"] = (TEMPLATES / "qwen1.5-chat.jinja").read_text()
    else:
        (folder / "chat_template.jinja").write_text((TEMPLATES / "qwen3.jinja").read_text())
        (folder / "added_tokens.json").write_text(json.dumps(ids, indent=2))
        (folder / "special_tokens_map.json").write_text(json.dumps({
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "eos_token": {k: v for k, v in added_token_entry("<|im_end|>").items() if k != "special"},
            "pad_token": {k: v for k, v in added_token_entry("<|endoftext|>").items() if k != "special"},
        }, indent=2))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    return {"qwen1.5": write_tokenizer_folder(root / "qwen1.5", "qwen1.5"),
            "qwen3": write_tokenizer_folder(root / "qwen3", "qwen3", lacking=("</think>",))}


QUESTION = [{"role": "user", "content": "What is 2+2?"}]
SYSTEM = [{"role": "system", "content": "You are terse."}, *QUESTION]
TURNS = [*SYSTEM, {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? (ünïcode)"}]
QWEN3_THINKING = [*QUESTION, {"role": "assistant", "content": "<think>\n2 and 2\n</think>\n\n4"},
                  {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes.",
                                                         "reasoning_content": "Check: 2+2=4."},
                  {"role": "user", "content": "Thanks"}]
QWEN3_TOOLS = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": "ü"}}}]},
    {"role": "tool", "content": "4"}, {"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "ok"}]
# After the last user turn the reasoning is rendered; "thinking" is an older name transformers reads as
# reasoning_content.
QWEN3_AGENT = [*SYSTEM, {"role": "assistant", "content": "Let me add.", "thinking": "Use the tool.", "tool_calls": [
    {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
    {"role": "tool", "content": "4"}]
CASES = [("qwen1.5", QUESTION, {}), ("qwen1.5", SYSTEM, {}), ("qwen1.5", TURNS, {}),
         ("qwen3", QUESTION, {}), ("qwen3", SYSTEM, {}), ("qwen3", TURNS, {}),
         ("qwen3", TURNS, {"enable_thinking": False}), ("qwen3", QUESTION, {"enable_thinking": True}),
         ("qwen3", QWEN3_THINKING, {}), ("qwen3", QWEN3_TOOLS, {}), ("qwen3", QWEN3_AGENT, {})]


@pytest.mark.parametrize("family,messages,variables", CASES,
                         ids=[f"{f}-{len(m)}msg-{v or 'default'}" for f, m, v in CASES])
def test_chat_prompt_ids_equal_mlx_lm(folders, family, messages, variables):
    from mlx_lm.tokenizer_utils import load as load_mlx_lm_tokenizer

    expected = load_mlx_lm_tokenizer(folders[family]).apply_chat_template(
        messages, add_generation_prompt=True, **variables)
    tok = MoebenchTokenizer.from_folder(folders[family])
    assert prompt_ids(messages, tok, **variables) == list(expected)
    assert not tok.chat_template.builtin


def test_what_the_templates_render(folders):
    """The fixtures say what the published templates say: Qwen1.5's default system prompt, Qwen3's empty think."""
    qwen15 = MoebenchTokenizer.from_folder(folders["qwen1.5"])
    assert qwen15.decode(prompt_ids("What is 2+2?", qwen15, chat=True), skip_special_tokens=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n")
    qwen3 = MoebenchTokenizer.from_folder(folders["qwen3"])
    ids = prompt_ids("What is 2+2?", qwen3, chat=True, system="Be brief.", enable_thinking=False)
    assert qwen3.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen3.token_to_id("</think>") in ids  # declared by added_tokens.json, absent from tokenizer.json
    agent = qwen3.decode(prompt_ids(QWEN3_AGENT, qwen3))
    assert "assistant\n<think>\nUse the tool.\n</think>\n\nLet me add.\n<tool_call>\n{\"name\": \"add\"" in agent


def test_published_folder_special_tokens_and_stop_ids(folders):
    tok = MoebenchTokenizer.from_folder(folders["qwen3"])
    assert tok.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert tok.special_ids == {256, 257, 258}
    assert tok.eos_token_ids == (258,)
    assert stop_ids((256,), tok) == (256, 258)
    ids = tok.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\n4<|im_end|>")
    assert tok.decode(ids) == "assistant\n<think>\nhm\n</think>\n\n4"  # control tokens dropped, <think> kept
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>")


def test_declared_id_disagreeing_with_tokenizer_json_is_named(folders, tmp_path):
    folder = write_tokenizer_folder(tmp_path / "bad", "qwen3")
    (folder / "added_tokens.json").write_text(json.dumps({"<|im_end|>": 300}))
    with pytest.raises(CheckpointError, match=r"added_tokens.json: token '<\|im_end\|>' has id 300 but 258"):
        MoebenchTokenizer.from_folder(folder)
    folder = write_tokenizer_folder(tmp_path / "gap", "qwen3", lacking=("<think>", "</think>"))
    (folder / "added_tokens.json").write_text(json.dumps({"</think>": 262}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {}}))
    with pytest.raises(CheckpointError, match="'</think>' has id 262, but tokenizer.json lacks it.*free id is 261"):
        MoebenchTokenizer.from_folder(folder)


@pytest.mark.parametrize("file,content,field", [
    ("tokenizer_config.json", {"chat_template": 7}, "chat_template"),
    ("tokenizer_config.json", {"chat_template": [{"name": "tool_use", "template": "x"}]}, "chat_template"),
    ("tokenizer_config.json", {"eos_token": 5}, "eos_token"),
    ("tokenizer_config.json", {"added_tokens_decoder": {"x": {"content": "a"}}}, "added_tokens_decoder"),
    *[("tokenizer_config.json", {"added_tokens_decoder": {key: {"content": "a"}}},
       re.escape(f"added_tokens_decoder key {key!r} is not a token id")) for key in ("1.5", "abc", "-3", " 7", "+7",
                                                                                    "1_0", "²", "٣", "")],
    ("special_tokens_map.json", {"additional_special_tokens": "<|im_end|>"}, "additional_special_tokens"),
    ("added_tokens.json", {"<x>": "5"}, "'<x>'"),
    ("added_tokens.json", [1], "JSON object"),
])
def test_bad_tokenizer_files_are_named(tmp_path, file, content, field):
    folder = write_tokenizer_folder(tmp_path / "t", "qwen1.5")
    (folder / file).write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=rf"{file}.*{field}"):
        MoebenchTokenizer.from_folder(folder)


def test_template_errors_name_the_file(folders, tmp_path):
    folder = write_tokenizer_folder(tmp_path / "t", "qwen3")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ConfigError, match=r"chat_template.jinja: chat template line 1"):
        prompt_ids(QUESTION, MoebenchTokenizer.from_folder(folder))
    (folder / "chat_template.jinja").write_text("{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(ChatError, match="chat_template.jinja.*roles must alternate"):
        prompt_ids(QUESTION, MoebenchTokenizer.from_folder(folder))
    (folder / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatError, match="chat_template.jinja"):  # the sandbox refuses
        prompt_ids(QUESTION, MoebenchTokenizer.from_folder(folder))


def test_named_templates_use_default(tmp_path):
    folder = write_tokenizer_folder(tmp_path / "t", "qwen1.5")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "D{{ messages[0].content }}"},
                               {"name": "tool_use", "template": "T"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = MoebenchTokenizer.from_folder(folder)
    assert tok.decode(prompt_ids(QUESTION, tok)) == "DWhat is 2+2?"


def test_folder_without_template_uses_builtin_chatml_and_says_so(tmp_path):
    from byte_tokenizer import write_byte_tokenizer

    write_byte_tokenizer(tmp_path)
    tok = MoebenchTokenizer.from_folder(tmp_path)
    assert tok.chat_template.builtin and "has no chat_template.jinja" in tok.chat_template.source
    with pytest.warns(UserWarning, match="built-in ChatML"):
        ids = prompt_ids("Hi", tok, chat=True, system="S")
    assert tok.decode(ids) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_ids == ()  # <|im_end|> is no single token here


def test_prompt_forms():
    """Wherever a prompt is accepted: ids as they are, text encoded, messages or chat=True through the template."""

    class Echo:
        def encode(self, text):
            return [len(text)]

        def apply_chat_template(self, messages, **variables):
            return [len(messages), *sorted(variables)]

    import numpy as np

    assert prompt_ids([3, 4]) == prompt_ids(np.array([3, 4])) == [3, 4]
    assert prompt_ids("abc", Echo()) == [3]
    assert prompt_ids("abc", Echo(), chat=True, system="s") == [2]
    assert prompt_ids(QUESTION, Echo(), enable_thinking=False) == [1, "enable_thinking"]
    assert chat_messages("q", system="s") == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    for bad, kwargs in [("abc", dict(system="s")), ([1, 2], dict(enable_thinking=False)), ([1.5], {}),
                        ([1, 2], dict(chat=True)), (SYSTEM, dict(system="again"))]:
        with pytest.raises(ChatError):
            prompt_ids(bad, Echo(), **kwargs)
    with pytest.raises(ChatError, match="needs the checkpoint's tokenizer"):
        prompt_ids(QUESTION)
    with pytest.raises(ChatError, match="message 0 needs a 'role'"):
        builtin_chat_template(Path(".")).render([{"content": "x"}])
    with pytest.raises(ChatError, match="not JSON data"):
        builtin_chat_template(Path(".")).render([{"role": "user", "content": object()}])


def test_vocab_larger_or_smaller_than_the_model_is_reported(folders, capsys):
    with pytest.warns(UserWarning, match=r"ids up to 262 but the model's vocabulary is 256"):
        MoebenchTokenizer.from_folder(folders["qwen3"], model_vocab=256)
    MoebenchTokenizer.from_folder(folders["qwen3"], model_vocab=300, verbose=True)
    assert "the model's last 37 ids" in capsys.readouterr().out
    MoebenchTokenizer.from_folder(folders["qwen3"], model_vocab=263, verbose=True)
    assert capsys.readouterr().out == ""


# -- `moebench generate --chat` ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_chat_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE with the Qwen3 tokenizer folder and a generation_config.json like the published one."""
    from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint

    config = qwen2_moe_config(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=64,
                              shared_expert_intermediate_size=0, qkv_bias=False, norm_topk_prob=True,
                              vocab_size=272, eos_token_id=258)
    folder = write_random_checkpoint(tmp_path_factory.mktemp("qwen3chat") / "ckpt", config, seed=7, bits=4)
    write_tokenizer_folder(folder, "qwen3")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 256, "do_sample": True, "eos_token_id": [258, 256], "pad_token_id": 256,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95}))
    return folder


def generate_json(capsys, *argv: str) -> dict:
    from moebench.cli import main

    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_chat_on_qwen3(qwen3_chat_checkpoint, capsys):
    from mlx_lm.tokenizer_utils import load as load_mlx_lm_tokenizer

    folder = str(qwen3_chat_checkpoint)
    out = generate_json(capsys, folder, "--chat", "--prompt", "What is 2+2?", "--max-tokens", "6")
    reference = load_mlx_lm_tokenizer(qwen3_chat_checkpoint)
    assert out["prompt_ids"] == reference.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert out["chat_template"].endswith("chat_template.jinja")
    assert out["stop_ids"] == [258, 256]  # config.json's, then generation_config.json's
    tok = MoebenchTokenizer.from_folder(qwen3_chat_checkpoint)
    assert out["text"] == tok.decode(out["token_ids"]) and "<|im_end|>" not in out["text"]
    out = generate_json(capsys, folder, "--system", "Be brief.", "--thinking", "off", "--prompt", "2+2?",
                        "--max-tokens", "2")
    assert out["prompt_ids"] == reference.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        add_generation_prompt=True, enable_thinking=False)


def test_generate_sampling_model_takes_generation_config(qwen3_chat_checkpoint, capsys):
    folder = str(qwen3_chat_checkpoint)
    out = generate_json(capsys, folder, "--chat", "--prompt", "Hi", "--sampling", "model", "--seed", "3",
                        "--max-tokens", "4")
    assert out["sampling"] == {"temperature": 0.6, "top_p": 0.95, "seed": 3, "top_k": 20, "repetition_penalty": 1.0,
                               "repetition_context": None}
    again = generate_json(capsys, folder, "--chat", "--prompt", "Hi", "--sampling", "model", "--seed", "3",
                          "--max-tokens", "4")
    assert again["token_ids"] == out["token_ids"]
    greedy = generate_json(capsys, folder, "--chat", "--prompt", "Hi", "--sampling", "model", "--temperature", "0")
    assert greedy["sampling"]["temperature"] == 0 and greedy["sampling"]["top_k"] == 20


def test_generate_chat_on_the_shipped_model_uses_builtin_chatml(capsys):
    out = generate_json(capsys, "--chat", "--prompt", "What is 2+2?", "--max-tokens", "4")
    assert "built-in ChatML" in out["chat_template"] and "has no chat_template.jinja" in out["chat_template"]
    tok = MoebenchTokenizer.from_folder(out["model"])
    assert out["prompt_ids"] == tok.encode("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    from moebench.cli import main

    assert main(["generate", "--chat", "--system", "Be brief.", "--prompt", "Hi", "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "[chat template: moebench's built-in ChatML" in err and "UserWarning" not in err


# -- issue 37: a template is untrusted input: bounded in time and size; tools and enable_thinking as transformers ------
def render(text: str, messages=QUESTION, **variables) -> str:
    return ChatTemplate(text, "/ckpt/chat_template.jinja").render(messages, **variables)


LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{{ body }}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("text, words", [
    (LOOPS.replace("{{ body }}", ""), "time budget of 0.3 s"),
    ("{% set moebench_steps = none %}{% set environment = none %}" + LOOPS.replace("{{ body }}", ""), "time budget"),
    ("{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}", "time budget"),
    ("{% macro m() %}" + LOOPS.replace("{{ body }}", "{{ '' }}") + "{% endmacro %}{{ m() }}", "budget"),
    ("{% set r = range(100000) %}{% for x in [r] recursive %}{% for y in r %}{% endfor %}{{ loop([r]) }}{% endfor %}",
     "time budget"),
    (LOOPS.replace("{{ body }}", "x" * 64), "its output would hold"),
    ("{{ 'x' * 10**10 }}", "'*' would hold 10000000000 characters or items, past the size budget of 1000000"),
    ("{{ [0] * 10**9 }}", "'*' would hold"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "joined text"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "'+'"),
    ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}", "bits"),
    ("{{ (10 ** 100000000) > 1 }}", "'**' would build an integer"),
    ("{{ 'a' | center(10**10) }}", "center()"), ("{{ 'a'.ljust(10**10) }}", "ljust()"),
    ("{{ ('a' * 1000000) | replace('a', 'b' * 1000) }}", "replace()"),
    ("{{ ('\n' * 1000000) | indent('x' * 1000) }}", "indent()"),
    ("{{ '%0900000000d' % 1 }}", "'%'"), ("{{ '{:>900000000}'.format(1) }}", "format()"),
    ("{{ '%0900000000d' | format(1) }}", "format()"), ("{{ range(100000) | join('x' * 100000) }}", "join()"),
    ("{{ messages | tojson(indent=100000) }}", "tojson indent"), ("{{ lipsum(n=10000000) }}", "lipsum()"),
    ("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}", "recursed too deeply"),
    ("{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}", "recursed too deeply"),
    ("{{ range(10**12) | list }}", "overflowed: Range too big"),
    ("{{ 10.0 ** 400 }}", "overflowed"),
])
def test_a_hostile_template_is_stopped_and_named(monkeypatch, text, words):
    # a short time budget ends the loops quickly; recursion must be caught as recursion and a growing output by its
    # size, which on a busy machine can take longer than that to reach Python's limit or the size budget
    caught_by_what_it_is = "recursed" in words or "output would hold" in words
    monkeypatch.setattr(chat, "RENDER_SECONDS", chat.RENDER_SECONDS if caught_by_what_it_is else 0.3)
    monkeypatch.setattr(chat, "RENDER_CHARS", 1_000_000)
    start = time.monotonic()
    with pytest.raises(ChatError, match=r"/ckpt/chat_template.jinja: the chat template") as error:
        render(text)
    assert words in str(error.value)
    assert time.monotonic() - start < 10
    assert render("{{ messages[0].content }}") == "What is 2+2?"  # the next render has its own budget


@pytest.mark.parametrize("text", [
    "{{ messages.__class__.__mro__ }}", "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}", "{{ messages.append(1) }}", "{{ range.__self__ }}",
    "{{ self.__init__.__globals__ }}", "{{ raise_exception.__globals__ }}", "{{ lipsum.__globals__.os }}",
    "{{ strftime_now.__globals__ }}", "{{ environment }}", "{{ moebench_steps }}", "{{ config }}"])
def test_every_sandbox_protection_stays(text):
    """An escape is refused (a ChatError) or reaches nothing (jinja2's sandbox renders an unsafe attribute as
    undefined); neither the environment nor the budget is reachable from a template."""
    try:
        assert render(text) == ""
    except ChatError as e:
        assert "unsafe" in str(e) or "undefined" in str(e)


def test_a_template_too_deep_to_compile_names_the_file():
    with pytest.raises(ConfigError, match="chat_template.jinja: the chat template cannot be compiled"):
        render("{{ " + "[" * 100000 + "]" * 100000 + " }}")


def test_message_content_nested_too_deeply_is_named():
    content: list = []
    for _ in range(100_000):
        content = [content]
    with pytest.raises(ChatError, match=r"message 0 field 'content': nested more than 100 levels deep"):
        render("{{ messages }}", [{"role": "user", "content": content}])


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]


def test_tools_reach_the_template_as_transformers_passes_them(folders):
    from mlx_lm.tokenizer_utils import load as load_mlx_lm_tokenizer

    tok = MoebenchTokenizer.from_folder(folders["qwen3"])
    ids = prompt_ids(QUESTION, tok, tools=TOOLS)
    assert ids == list(load_mlx_lm_tokenizer(folders["qwen3"]).apply_chat_template(
        QUESTION, add_generation_prompt=True, tools=TOOLS))
    assert '"name": "add"' in tok.decode(ids) and ids != prompt_ids(QUESTION, tok)
    for bad in ({"name": "add"}, [lambda a, b: a + b], "add"):
        with pytest.raises(ChatError, match="tools"):
            prompt_ids(QUESTION, tok, tools=bad)
    with pytest.raises(ChatError, match="'messages' is the chat itself"):
        prompt_ids(QUESTION, tok, **{"messages": []})


@pytest.mark.parametrize("value, on", [(False, False), ("off", False), ("OFF", False), (0, False), ("0", False),
                                       ("false", False), ("no", False), (True, True), ("on", True), (1, True),
                                       ("true", True), ("yes", True)])
def test_enable_thinking_words(folders, value, on):
    tok = MoebenchTokenizer.from_folder(folders["qwen3"])
    assert prompt_ids(QUESTION, tok, enable_thinking=value) == prompt_ids(QUESTION, tok, enable_thinking=on)
    assert prompt_ids(QUESTION, tok, enable_thinking=None) == prompt_ids(QUESTION, tok)


@pytest.mark.parametrize("value", ["maybe", "", 2, -1, 0.0, [], "offf"])
def test_enable_thinking_that_is_no_clear_yes_or_no_is_named(folders, value):
    with pytest.raises(ChatError, match="enable_thinking: expected True or False"):
        prompt_ids(QUESTION, MoebenchTokenizer.from_folder(folders["qwen3"]), enable_thinking=value)
