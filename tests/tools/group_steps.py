"""A few training steps of a small random Qwen2-MoE in one process or as a rank of a group (test_train.py):
writes the losses and a digest of the final weights to OUT/rank{r}.json."""

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from moebench.tools.train import TrainSettings, init_model, train
from moebench.tools.writer import qwen2_moe_config

out = Path(sys.argv[1])
group = mx.distributed.init()
model = init_model(qwen2_moe_config(vocab_size=64, num_experts=8, num_experts_per_tok=2), seed=0)
rng = np.random.default_rng(1)
streams = [rng.integers(1, 64, 4000).astype(np.int32), np.tile(np.arange(1, 40, dtype=np.int32), 100)]
settings = TrainSettings(steps=6, batch=8, seq_len=32, peak_lr=1e-2, warmup=2, eval_every=100,
                         domain_coef=0.5)
records = []
losses = train(model, streams, settings, log=records.append, group=group)
weights = {k: float(mx.sum(v * v).item()) for k, v in tree_flatten(model.parameters())}
(out / f"rank{group.rank()}.json").write_text(json.dumps({"losses": losses, "records": records, "weights": weights}))
