"""qwen3.5-moe-tiny with its full-attention layer inside (layer 2 of 4) rather than last: python3 THIS OUT."""

import sys

from moebench.tools.presets import PRESETS, Preset, get_preset, write_random

config = {**get_preset("qwen3.5-moe-tiny").config, "full_attention_interval": 3, "max_position_embeddings": 16384}
config.pop("layer_types", None)
PRESETS["attention-inside"] = Preset("attention-inside", "tiny hybrid, full attention at layer 2 of 4", config)
print(write_random(sys.argv[1], "attention-inside", dtype="float32", progress=False))
