"""A tiny random quantized Qwen2-MoE with a byte-level BPE tokenizer, for widget tests (seconds to build)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moebench.writer import qwen2_moe_config, write_random_checkpoint

VOCAB = 320
TEXT = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on.",
]


def write_tiny_model(folder: Path, shared_expert: bool = True) -> Path:
    """Random 4-bit weights (4 layers, 8 experts, top-2) plus tokenizer.json, in `folder`."""
    config = qwen2_moe_config(vocab_size=VOCAB, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2)
    if not shared_expert:
        config["shared_expert_intermediate_size"] = 0
    write_random_checkpoint(folder, config, seed=1, bits=4, group_size=64)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TEXT, trainer)
    tok.save(str(folder / "tokenizer.json"))
    return folder
