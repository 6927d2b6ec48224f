import shutil

from moebench.tools.presets import get_preset
from moebench.tools.writer import write_random_checkpoint

cfg = {**get_preset("qwen3-tiny").config, "vocab_size": 4096, "num_hidden_layers": 4, "num_experts": 32,
       "num_experts_per_tok": 8, "eos_token_id": 0}
f = write_random_checkpoint("/tmp/bench/tiny-qwen3-moe", cfg, seed=0)
shutil.copy("/work/main/data/tiny-qwen2-moe/tokenizer.json", f / "tokenizer.json")
print(f)
