"""Chat prompts on the GLM-4.5 / 4.6 and DeepSeek-V3 families (issue 55): a tiny Glm4MoeForCausalLM and a tiny
DeepseekV3ForCausalLM saved by transformers, with tokenizer folders laid out like the published ones; moebench's
prompt ids equal transformers' `apply_chat_template(..., tokenize=True)` for one question, a system message,
several turns, GLM's thinking switch and a tool-call turn, decoding stops where the checkpoints say a turn ends, and
`moebench generate FOLDER --chat` runs on both.

The templates reproduce the structure of the published ones (on the messages here they render the same text):
- chat_templates/glm4_5.jinja, zai-org/GLM-4.5's (and GLM-4.5-Air's; GLM-4.6's renders the same): `[gMASK]<sop>`,
  then <|system|>, <|user|>, <|assistant|> and <|observation|> turns that no token closes; the tools listed in a
  system turn; an assistant turn opening with its reasoning in <think></think> (empty before the last user turn);
  tool calls as <tool_call>name<arg_key>..</arg_key><arg_value>..</arg_value></tool_call>; enable_thinking=false
  writes /nothink after each user turn and an empty <think></think> after the generation prompt; tool results as
  text.
- chat_templates/deepseek_v3.jinja, deepseek-ai/DeepSeek-V3's in the form published with V3-0324: the bos token,
  the system messages joined, <｜User｜> and <｜Assistant｜> turns closed by <｜end▁of▁sentence｜>, a turn's tool
  calls after its text (the arguments as JSON text), tool outputs after which the assistant's turn is not reopened.

The folders: GLM keeps its template in chat_template.jinja beside a tokenizer_config.json whose added_tokens_decoder
makes every control token special, and its config.json and generation_config.json end a turn on <|endoftext|>,
<|user|> and <|observation|> (151329, 151336 and 151338 in the published vocabulary; here the same tokens after the
256 bytes). DeepSeek-V3 lists its tokens in tokenizer.json only and keeps the template inline in
tokenizer_config.json, with bos and eos as AddedToken objects; it ends a turn on <｜end▁of▁sentence｜> (id 1 there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from byte_tokenizer import write_byte_tokenizer
from test_chat import generate_json
from test_chat_hybrids import transformers_ids
from tokenizers import AddedToken, Tokenizer

import moebench
from moebench.checkpoint.chat import ChatError, prompt_ids
from moebench.checkpoint.tokenizer import stop_ids

torch = pytest.importorskip("torch", reason="the folders are written by transformers (dev dependency torch)")

TEMPLATES = Path(__file__).parent / "chat_templates"
BYTES = 256
# GLM-4.5's added tokens in the published order (151329 <|endoftext|> ... 151364 <|video|>), all special
GLM_TOKENS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
              "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
              "<|end_of_video|>", "<|begin_of_audio|>", "<|end_of_audio|>", "<|begin_of_transcription|>",
              "<|end_of_transcription|>", "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>", "<think>",
              "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>",
              "</arg_key>", "<arg_value>", "</arg_value>", "/nothink", "<|begin_of_box|>", "<|end_of_box|>",
              "<|image|>", "<|video|>"]
# DeepSeek-V3's: bos, eos and pad (ids 0-2 there) special, then its fill-in-the-middle, turn and tool tokens
DEEPSEEK_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
DEEPSEEK_TOKENS = [*DEEPSEEK_SPECIAL, "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>", "<｜User｜>",
                   "<｜Assistant｜>", "<|EOT|>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                   "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                   "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"]
FLAGS = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def added_token(content: str) -> dict:
    """A token as DeepSeek's tokenizer_config.json names bos and eos: an AddedToken object."""
    return {"__type": "AddedToken", "content": content, **FLAGS}


@dataclass(frozen=True)
class ChatFolder:
    """What a family's published folder holds: its added tokens (after the bytes here), which are special, whether
    tokenizer_config.json lists them too (added_tokens_decoder), its other fields, the template and where the folder
    keeps it, the tokens ending a turn (config.json's and generation_config.json's eos_token_id), and a tiny model of
    the family."""

    tokens: list[str]
    special: frozenset[str]
    listed: bool
    tokenizer_config: dict
    template: str
    inline: bool
    ends: tuple[str, ...]
    vocab_size: int  # padded past the tokenizer's ids, as the published vocabularies are
    model: dict

    def token_id(self, token: str) -> int:
        return BYTES + self.tokens.index(token)


FAMILIES = {
    "glm4_moe": ChatFolder(
        GLM_TOKENS, frozenset(GLM_TOKENS), True, {
            "clean_up_tokenization_spaces": False, "do_lower_case": False, "eos_token": "<|endoftext|>",
            "model_max_length": 128000, "pad_token": "<|endoftext|>", "padding_side": "left", "remove_space": False,
            "tokenizer_class": "PreTrainedTokenizerFast"},
        "glm4_5.jinja", inline=False, ends=("<|endoftext|>", "<|user|>", "<|observation|>"), vocab_size=296,
        model=dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16, n_shared_experts=1,
                   num_experts_per_tok=4, first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
                   routed_scaling_factor=1.5, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
                   max_position_embeddings=256, tie_word_embeddings=False, num_nextn_predict_layers=0)),
    "deepseek_v3": ChatFolder(
        DEEPSEEK_TOKENS, frozenset(DEEPSEEK_SPECIAL), False, {
            "add_bos_token": False, "add_eos_token": False, "bos_token": added_token(DEEPSEEK_TOKENS[0]),
            "clean_up_tokenization_spaces": False, "eos_token": added_token(DEEPSEEK_TOKENS[1]), "legacy": True,
            "model_max_length": 131072, "pad_token": added_token(DEEPSEEK_TOKENS[1]), "sp_model_kwargs": {},
            "unk_token": None, "tokenizer_class": "LlamaTokenizerFast"},
        "deepseek_v3.jinja", inline=True, ends=("<｜end▁of▁sentence｜>",), vocab_size=280,
        model=dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                   intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16, n_shared_experts=1,
                   num_experts_per_tok=4, first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
                   routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=64, qk_nope_head_dim=32,
                   qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=256, tie_word_embeddings=False,
                   attention_bias=False)),
}


def write_tokenizer_folder(folder: Path, family: ChatFolder) -> None:
    """The byte tokenizer with the family's tokens added after the bytes, and tokenizer_config.json as the family
    publishes it: listing them where it does (added_tokens_decoder), naming the special tokens, and holding the
    template where the folder keeps it there (else chat_template.jinja)."""
    path = write_byte_tokenizer(folder)
    tok = Tokenizer.from_file(str(path))
    tok.add_tokens([AddedToken(t, special=t in family.special, normalized=False) for t in family.tokens])
    tok.save(str(path))
    listed = {str(family.token_id(t)): {"content": t, **FLAGS, "special": t in family.special} for t in family.tokens}
    config = {**({"added_tokens_decoder": listed} if family.listed else {}), **family.tokenizer_config}
    template = (TEMPLATES / family.template).read_text()
    if family.inline:
        config["chat_template"] = template
    else:
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def save_chat_folder(folder: Path, name: str) -> Path:
    """transformers' tiny model of the family with the published folder's end-of-turn ids in config.json and
    generation_config.json, and its tokenizer folder."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM

    family = FAMILIES[name]
    ends = [family.token_id(t) for t in family.ends]
    eos = ends if len(ends) > 1 else ends[0]  # GLM lists three, DeepSeek names one
    config_cls, model_cls = {"glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM),
                             "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM)}[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**family.model, vocab_size=family.vocab_size, eos_token_id=eos,
                                 pad_token_id=family.token_id(family.tokens[0]), bos_token_id=None))
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"_from_model_config": True, "eos_token_id": eos, "pad_token_id": family.token_id(family.tokens[0])}))
    write_tokenizer_folder(folder, family)
    return folder


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> dict[str, tuple]:
    """Each family's folder with its model and tokenizer, opened by moebench.load as a user opens it."""
    root = tmp_path_factory.mktemp("glm-deepseek-chat")
    folders = {name: save_chat_folder(root / name, name) for name in FAMILIES}
    return {name: (folder, *moebench.load(folder)) for name, folder in folders.items()}


QUESTION = [{"role": "user", "content": "What is 2+2?"}]
SYSTEM = [{"role": "system", "content": "  You are terse (ünïcode).\n"}, *QUESTION]
GLM_TURNS = [*SYSTEM, {"role": "assistant", "content": "<think>\n2 and 2\n</think>\n\n4"},
             {"role": "user", "content": "And 3+3? /nothink"}, {"role": "assistant", "content": "6", "thinking": "3+3"},
             {"role": "user", "content": [{"type": "text", "text": "Thanks"}, {"type": "text", "text": "!"}]}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
# GLM writes each argument (a mapping) as a key and a value
GLM_CALL = [*SYSTEM, {"role": "assistant", "content": "Adding.", "reasoning_content": "Use the tool.", "tool_calls": [
    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": [2, "ü"], "unit": "m"}}},
    {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 1}}}]},
    {"role": "tool", "content": "4"}, {"role": "tool", "content": "2"}]
GLM_ANSWERED = [*GLM_CALL, {"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "ok"}]
# DeepSeek writes the arguments as they are given (JSON text) and joins the system messages
DEEPSEEK_TURNS = [*SYSTEM, {"role": "system", "content": "Answer in digits."}, {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "And 3+3?"}]
DEEPSEEK_CALL = [*SYSTEM, {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": "ü"}'}},
    {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]},
    {"role": "tool", "content": "4"}, {"role": "tool", "content": "2"}]
DEEPSEEK_ANSWERED = [*DEEPSEEK_CALL, {"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "ok"}]
MESSAGES = {
    "glm4_moe": {"question": QUESTION, "system": SYSTEM, "turns": GLM_TURNS, "tool-call": GLM_CALL,
                 "tool-answered": GLM_ANSWERED},
    "deepseek_v3": {"question": QUESTION, "system": SYSTEM, "turns": DEEPSEEK_TURNS, "tool-call": DEEPSEEK_CALL,
                    "tool-answered": DEEPSEEK_ANSWERED},
}
THINKING = {"default": {}, "on": {"enable_thinking": True}, "off": {"enable_thinking": False}}
CASES = [("glm4_moe", name, thinking) for name in MESSAGES["glm4_moe"] for thinking in THINKING]
CASES += [("deepseek_v3", name, "default") for name in MESSAGES["deepseek_v3"]]  # its template has no switch


@pytest.mark.parametrize("family,name,thinking", CASES, ids=["-".join(c) for c in CASES])
def test_chat_prompt_ids_equal_transformers(chats, family, name, thinking):
    messages = MESSAGES[family][name]
    variables = {**THINKING[thinking], **({"tools": TOOLS} if name.startswith("tool") else {})}
    folder, model, tok = chats[family]
    assert model.args.model_type == family and not tok.chat_template.builtin
    assert prompt_ids(messages, tok, **variables) == transformers_ids(folder, messages, variables)


def text_of(tok, messages, **variables) -> str:
    return tok.decode(prompt_ids(messages, tok, **variables), skip_special_tokens=False)


def test_what_the_glm_template_renders(chats):
    """Control tokens as single ids, the thinking switch as GLM writes it, tool calls as keys and values."""
    _, _, tok = chats["glm4_moe"]
    ids = prompt_ids(QUESTION, tok)
    assert ids[:2] == [tok.token_to_id("[gMASK]"), tok.token_to_id("<sop>")]
    assert text_of(tok, QUESTION) == "[gMASK]<sop><|user|>\nWhat is 2+2?<|assistant|>"
    off = prompt_ids(QUESTION, tok, enable_thinking=False)
    assert tok.decode(off, skip_special_tokens=False).endswith("2+2?/nothink<|assistant|>\n<think></think>")
    assert tok.token_to_id("/nothink") in off
    turns = text_of(tok, GLM_TURNS, enable_thinking=False)
    assert "And 3+3? /nothink<|assistant|>" in turns and "/nothink/nothink" not in turns  # written once
    assert "<|assistant|>\n<think></think>\n4<|user|>" in turns and "2 and 2" not in turns  # past reasoning dropped
    called = text_of(tok, GLM_CALL, tools=TOOLS)
    assert called.startswith("[gMASK]<sop><|system|>\n# Tools\n") and '"name": "add"' in called
    assert ("<|assistant|>\n<think>Use the tool.</think>\nAdding.\n<tool_call>add\n<arg_key>a</arg_key>\n"
            '<arg_value>2</arg_value>\n<arg_key>b</arg_key>\n<arg_value>[2, "ü"]</arg_value>\n<arg_key>unit</arg_key>\n'
            "<arg_value>m</arg_value>\n</tool_call>\n<tool_call>add\n") in called
    assert called.endswith("<|observation|>\n<tool_response>\n4\n</tool_response>\n<tool_response>\n2\n"
                           "</tool_response><|assistant|>")


def test_enable_thinking_none_leaves_glm_its_default(chats):
    """enable_thinking=None is no choice in moebench (Qwen3's template takes a None so too); GLM's asks only whether
    the switch is defined and falsy, so a None passed on would switch thinking off: moebench does not pass it."""
    folder, _, tok = chats["glm4_moe"]
    assert prompt_ids(QUESTION, tok, enable_thinking=None) == transformers_ids(folder, QUESTION, {})
    assert prompt_ids(QUESTION, tok, enable_thinking=None) != prompt_ids(QUESTION, tok, enable_thinking=False)


def test_what_the_deepseek_template_renders(chats):
    """bos, the system prompt, closed turns; after tool outputs the model goes on without a new turn."""
    _, _, tok = chats["deepseek_v3"]
    ids = prompt_ids(SYSTEM, tok)
    assert ids[0] == tok.token_to_id("<｜begin▁of▁sentence｜>")
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<｜begin▁of▁sentence｜>  You are terse (ünïcode).\n<｜User｜>What is 2+2?<｜Assistant｜>")
    assert text_of(tok, DEEPSEEK_TURNS).endswith(
        "(ünïcode).\n\n\nAnswer in digits.<｜User｜>What is 2+2?<｜Assistant｜>4<｜end▁of▁sentence｜><｜User｜>And 3+3?"
        "<｜Assistant｜>")
    called = text_of(tok, DEEPSEEK_CALL, tools=TOOLS)
    assert ('<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n'
            '{"a": 2, "b": "ü"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>') in called
    assert called.endswith("<｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>4"
                           "<｜tool▁output▁end｜><｜tool▁output▁begin｜>2<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")
    # bos, eos and pad are the control tokens left out of displayed text; the turn tokens show, as they are not special
    assert tok.decode(prompt_ids(QUESTION, tok)) == "<｜User｜>What is 2+2?<｜Assistant｜>"


def test_a_deepseek_tool_call_without_text_is_refused_as_transformers_refuses_it(chats):
    """transformers drops a message's None values before the template sees them, so DeepSeek-V3's `content is none`
    never holds and a tool-call turn without text fails to render there; moebench refuses it the same way (and says
    which template), rather than writing a prompt transformers would not. A turn of calls alone takes content ''."""
    import jinja2

    folder, _, tok = chats["deepseek_v3"]
    messages = [*QUESTION, {**DEEPSEEK_CALL[2], "content": None}]
    with pytest.raises(ChatError, match=r"tokenizer_config.json: field 'chat_template'.*no attribute 'content'"):
        prompt_ids(messages, tok)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="no attribute 'content'"):
        transformers_ids(folder, messages, {})


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_stops_where_the_checkpoint_ends_a_turn(chats, family):
    """config.json's and generation_config.json's eos ids with the tokenizer's eos token, as mlx-lm stops: GLM's three
    tokens, DeepSeek's end of sentence."""
    from mlx_lm.tokenizer_utils import load as load_mlx_lm_tokenizer
    from mlx_lm.utils import load_config

    folder, model, tok = chats[family]
    stops = stop_ids(model.args.eos_token_id, tok)
    assert stops == tuple(FAMILIES[family].token_id(t) for t in FAMILIES[family].ends)
    assert [tok.decode([i], skip_special_tokens=False) for i in stops] == list(FAMILIES[family].ends)
    eos = load_config(folder)["eos_token_id"]
    assert set(stops) == load_mlx_lm_tokenizer(folder, eos_token_ids=eos).eos_token_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_chat_runs_on_each_folder(chats, family, capsys):
    folder, _, tok = chats[family]
    out = generate_json(capsys, str(folder), "--chat", "--prompt", "What is 2+2?", "--max-tokens", "3")
    assert out["prompt_ids"] == transformers_ids(folder, QUESTION, {})
    assert out["stop_ids"] == [FAMILIES[family].token_id(t) for t in FAMILIES[family].ends]
    where = "tokenizer_config.json: field 'chat_template'" if FAMILIES[family].inline else "chat_template.jinja"
    assert out["chat_template"].endswith(where)
    assert 0 < len(out["token_ids"]) <= 3
    assert out["text"] == tok.decode(out["token_ids"])
    out = generate_json(capsys, str(folder), "--system", "Be brief.", "--thinking", "off", "--prompt", "2+2?",
                        "--max-tokens", "1")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert out["prompt_ids"] == transformers_ids(folder, messages, {"enable_thinking": False})
