"""Chat prompts on the hybrids (issue 41): a tiny Qwen3-Next and a tiny Qwen3.5-MoE folder saved by transformers,
with tokenizer folders laid out like the published ones; moebench's prompt ids equal transformers'
`apply_chat_template(..., tokenize=True)` with thinking on and off, a system message, several turns, tools, and
(Qwen3.5) messages whose content is a list of text parts.

Qwen3-Next ships Qwen3's template (chat_templates/qwen3.jinja); Qwen3.5 its own (chat_templates/qwen3_5.jinja):
thinking on by default, tool calls as <function=...> blocks, content parts. An image or video part is refused by
moebench with a ChatError naming it: transformers' tokenizer would write the template's vision placeholder tokens,
but moebench runs the text model only (the vision tower is left out when the folder is loaded), so no image would
reach the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

import moebench
from moebench.checkpoint.chat import ChatError, prompt_ids
from moebench.inspect.record import Stepper

torch = pytest.importorskip("torch", reason="the folders are written by transformers (dev dependency torch)")

TEMPLATES = Path(__file__).parent / "chat_templates"
TEMPLATE = {"qwen3_next": "qwen3.jinja", "qwen3_5_moe": "qwen3_5.jinja"}
BYTES = 256
# the published tokenizers' added tokens, in their order (Qwen3.5's vision tokens too); the first ones are special
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
PLAIN = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]
VOCAB = 272  # the 256 bytes and 13 added tokens, padded as the published vocabularies are
# three Gated DeltaNet layers and a full-attention one, 4 experts top-2 and a shared expert: tiny
TEXT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, linear_num_key_heads=1, linear_num_value_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, eos_token_id=258)


def write_tokenizer(folder: Path, family: str) -> None:
    """A byte-level tokenizer.json with the control tokens after the bytes, tokenizer_config.json naming them
    (added_tokens_decoder, eos <|im_end|>) and the family's chat_template.jinja, as the hub folders have them."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=t in SPECIAL, normalized=False) for t in SPECIAL + PLAIN])
    tok.save(str(folder / "tokenizer.json"))
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    config = {"added_tokens_decoder": {str(BYTES + i): {"content": t, **flags, "special": t in SPECIAL}
                                       for i, t in enumerate(SPECIAL + PLAIN)},
              "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
              "clean_up_tokenization_spaces": False, "errors": "replace", "model_max_length": 262144,
              "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "chat_template.jinja").write_text((TEMPLATES / TEMPLATE[family]).read_text())


def save_hybrid(folder: Path, family: str) -> Path:
    """transformers' tiny model of the family, saved as the hub folders are (Qwen3.5: the multimodal folder with
    its vision tower), with the tokenizer folder beside it."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(0)
    if family == "qwen3_next":
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**TEXT, intermediate_size=32, tie_word_embeddings=False))
    else:
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT["hidden_size"])
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=TEXT, vision_config=vision,
                                                                     tie_word_embeddings=False))
    model.save_pretrained(folder, save_original_format=False)
    write_tokenizer(folder, family)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid-chat")
    return {family: save_hybrid(root / family, family) for family in TEMPLATE}


@pytest.fixture(scope="module")
def loaded(folders) -> dict[str, tuple]:
    """(model, tokenizer) of each folder, opened by moebench.load as a user opens it."""
    return {family: moebench.load(folder) for family, folder in folders.items()}


def transformers_ids(folder: Path, messages, variables) -> list[int]:
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=True, **variables)
    return list(out)


QUESTION = [{"role": "user", "content": "What is 2+2?"}]
SYSTEM = [{"role": "system", "content": "  You are terse (ünïcode).\n"}, *QUESTION]
TURNS = [*SYSTEM, {"role": "assistant", "content": "<think>\n2 and 2\n</think>\n\n4"},
         {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6", "reasoning_content": "3+3"},
         {"role": "user", "content": "Thanks"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
CALLING = [*SYSTEM, {"role": "assistant", "content": "Adding.", "reasoning_content": "Use the tool.", "tool_calls": [
    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": [2, "ü"]}}},
    {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 1}}}]},
    {"role": "tool", "content": "4"}, {"role": "tool", "content": "2"}]
PARTS = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
         {"role": "user", "content": [{"type": "text", "text": "Add "}, {"type": "text", "text": "2 and 2."}]},
         {"role": "assistant", "content": [{"type": "text", "text": "4"}]},
         {"role": "user", "content": [{"text": "And 3+3?"}]}]
THINKING = {"default": {}, "on": {"enable_thinking": True}, "off": {"enable_thinking": False}}
MESSAGES = {"question": QUESTION, "system": SYSTEM, "turns": TURNS, "tool-call": CALLING}
CASES = [(family, name, thinking) for family in TEMPLATE for name in MESSAGES for thinking in THINKING]
CASES += [("qwen3_5_moe", "parts", thinking) for thinking in THINKING]


@pytest.mark.parametrize("family,name,thinking", CASES, ids=["-".join(c) for c in CASES])
def test_chat_prompt_ids_equal_transformers(folders, loaded, family, name, thinking):
    messages = PARTS if name == "parts" else MESSAGES[name]
    variables = {**THINKING[thinking], **({"tools": TOOLS} if name == "tool-call" else {})}
    model, tok = loaded[family]
    assert model.args.model_type.startswith(family) and not tok.chat_template.builtin
    assert prompt_ids(messages, tok, **variables) == transformers_ids(folders[family], messages, variables)


def test_what_the_qwen3_5_template_renders(loaded):
    """Thinking on unless switched off, past reasoning only after the last query, tool calls as <function=...>."""
    _, tok = loaded["qwen3_5_moe"]

    def text(messages, **variables) -> str:
        return tok.decode(prompt_ids(messages, tok, **variables), skip_special_tokens=False)

    assert text(QUESTION).endswith("<|im_start|>assistant\n<think>\n")
    assert text(QUESTION, enable_thinking="off").endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert text(SYSTEM).startswith("<|im_start|>system\nYou are terse (ünïcode).<|im_end|>\n")
    turns = text(TURNS)
    assert "<|im_start|>assistant\n4<|im_end|>" in turns and "2 and 2" not in turns and "3+3<" not in turns
    called = text(CALLING, tools=TOOLS)
    assert ("<think>\nUse the tool.\n</think>\n\nAdding.\n\n<tool_call>\n<function=add>\n<parameter=a>\n2\n"
            '</parameter>\n<parameter=b>\n[2, "ü"]\n</parameter>\n</function>\n</tool_call>') in called
    assert "<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n2\n</tool_response>" in called
    assert text(PARTS).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAdd 2 and 2.<|im_end|>")


@pytest.mark.parametrize("part, named", [
    ({"type": "image", "image": "https://example.com/cat.png"}, "'image'"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "'image_url'"),
    ({"image": "cat.png"}, "'image'"),
    ({"type": "video", "video": "clip.mp4"}, "'video'"),
    ({"type": "image", "image": object()}, "'image'"),  # a decoded picture, as a processor would take it
])
def test_an_image_or_video_part_is_refused_by_name(loaded, part, named):
    _, tok = loaded["qwen3_5_moe"]
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    with pytest.raises(ChatError, match=r"message 0 content part 1 is not text but .*text model only") as error:
        prompt_ids(messages, tok)
    assert named in str(error.value)


def test_a_chat_prompt_decodes_on_each_hybrid(folders, loaded):
    """The prompt ids reach the hybrid's decode: thinking off, a system message, two greedy tokens."""
    for family, folder in folders.items():
        model, tok = loaded[family]
        stepper = Stepper(model, tok, SYSTEM, enable_thinking=False, max_tokens=2)
        trace = stepper.run(2)
        assert trace.prompt_ids == transformers_ids(folder, SYSTEM, {"enable_thinking": False}), family
        assert len(trace.generated) == 2
