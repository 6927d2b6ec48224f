"""A few training steps of a small random Qwen2-MoE in one process or as a rank of a group (test_train.py):
writes the losses and a digest of the final weights to OUT/rank{r}.json."""

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from moebench.tools.train import TrainSettings, init_model, make_loss, rows_per_domain, sample_batch, train
from moebench.tools.writer import qwen2_moe_config

out = Path(sys.argv[1])
group = mx.distributed.init()
config = qwen2_moe_config(vocab_size=64, num_experts=8, num_experts_per_tok=2)
model = init_model(config, seed=0)
rng = np.random.default_rng(1)
streams = [rng.integers(1, 64, 4000).astype(np.int32), np.tile(np.arange(1, 40, dtype=np.int32), 100)]
# Pinned, not the defaults: a top-k near-tie that float order tips one way in one process and the other way
# in two changes the steps after it; these 6 steps (with an uneven 3 code / 5 prose batch) have none.
settings = TrainSettings(steps=6, batch=8, seq_len=32, peak_lr=1e-2, warmup=2, eval_every=100, balance_coef=0.02,
                         domain_coef=0.5, prose_share=0.625)
records = []
losses = train(model, streams, settings, log=records.append, group=group)
weights = {k: float(mx.sum(v * v).item()) for k, v in tree_flatten(model.parameters())}

# The domain term's share of the untrained model's averaged gradient on one more batch (the gradient with it,
# weighted up, less the gradient without it): the same weights in one process and in two, so no step before can
# set them apart.
model = init_model(config, seed=0)
per_stream = rows_per_domain(settings, 2)
x, y = sample_batch(streams, per_stream, settings.seq_len, np.random.default_rng(2))
rows = slice(group.rank() * settings.batch // group.size(), (group.rank() + 1) * settings.batch // group.size())
code = mx.array(np.repeat([1.0, 0.0], per_stream)[rows], dtype=mx.float32)
with_term, without = (nn.value_and_grad(model, make_loss(model, 0.0, coef, group))(model, x[rows], y[rows], code)[1]
                      for coef in (1000.0, 0.0))
grads = tree_map(lambda a, b: a - b, with_term, without)
grads = nn.average_gradients(grads, group=group) if group.size() > 1 else grads
domain_grads = {k: float(mx.sum(v * v).item()) for k, v in tree_flatten(grads)}
(out / f"rank{group.rank()}.json").write_text(json.dumps({"losses": losses, "records": records, "weights": weights,
                                                          "domain_grads": domain_grads}))
