"""Host cost of the eager fused decode on the GPU code path, on a CPU: tok/s of moebench.generate(compiled=False)
when the 'cuda' backend's kernels are stubbed to return zeros at once, so what is timed is the host's work
(building each step's graph, the loop). Runs any revision of moebench: only its top-level API, and the names
built_kernel / available_backend wherever they live. On the shipped model, where the rest of the compute is
small:

    python3 scripts/host_cost_stubbed.py data/tiny-qwen2-moe                       # this checkout
    git archive REV moebench kernels | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old python3 scripts/host_cost_stubbed.py data/tiny-qwen2-moe      # revision REV
"""
import json
import statistics
import sys

import mlx.core as mx

import moebench


class Stub:
    calls = 0

    def __call__(self, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **kw):
        Stub.calls += 1
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

stub = Stub()
model, _ = moebench.load(sys.argv[1])
ids = [(i * 7919 + 11) % model.args.vocab_size for i in range(16)]
moebench.generate(model, ids, 4, compiled=False)  # imports whatever the decode path imports
for name, mod in list(sys.modules.items()):
    if name.startswith("moebench"):
        if hasattr(mod, "built_kernel"):
            mod.built_kernel = lambda backend, stage: stub
        if hasattr(mod, "available_backend"):
            mod.available_backend = lambda: "cuda"
out = {}
for on in (True, False):
    with moebench.fused_moe(on):
        moebench.generate(model, ids, 8, compiled=False)
        before = Stub.calls
        out["fused" if on else "fallback"] = statistics.median(
            moebench.generate(model, ids, 64, compiled=False).decode_tps for _ in range(3))
        out[("fused" if on else "fallback") + "_kernel_calls_per_token"] = (Stub.calls - before) / (3 * 63)
print(json.dumps(out))
