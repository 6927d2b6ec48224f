#!/usr/bin/env bash
# Issue 57's device runs of 2026-12-07 (stages as arguments; each fits one device call after the wheel parts):
#   attn:   install, the CUDA parity tests (attention; issue 55's owed ones), attention_bench with a tiling sweep
#   decode: Qwen3-30B-A3B random 4-bit g64 at a 16384-token prompt, fused compiled, this revision vs .snap/after
#   mxfp4:  Qwen3-30B-A3B with every quantized weight mxfp4, 64 and 2048 prompts, against mlx-lm and .snap/after
set -uo pipefail
R=$OUT; export OUT=/root/r; mkdir -p $OUT
bash scripts/install-on-device.sh 2>&1 | tail -3
for stage in "$@"; do
  case $stage in
    attn)
      timeout 200 python3 -m pytest -q -s -o addopts="" -p no:cacheprovider tests/gpu/test_cuda_kernel.py \
        -k "attention or expert_variants or grouped_router or decode_on_cuda_runs" 2>&1 | tee $OUT/gputests.txt | tail -15
      timeout 330 python3 scripts/attention_bench.py --snapshot .snap/after --rounds 5 --contexts 256 2048 32768 \
        --tilings 32,32,8,256,128 64,16,8,256,128 32,16,8,256,128 64,32,4,256,128 32,32,4,512,128 64,32,8,512,128 \
        64,32,8,256,512 2>&1 | tee $OUT/attnbench.txt ;;
    decode)
      PRESET=qwen3-30b-a3b PROMPTS=16384 GEN=64 REPEATS=5 FUSED=on COMPILED=on SNAPSHOT=.snap/after DEADLINE=560 \
        BENCH_LIMIT=330 bash scripts/device_bench.sh make bench 2>&1 | tail -30 ;;
    mxfp4)
      PRESET=qwen3-30b-a3b MODE=mxfp4 PROMPTS="64 2048" GEN=128 REPEATS=5 FUSED=on COMPILED=on SNAPSHOT=.snap/after DEADLINE=560 \
        BENCH_LIMIT=330 bash scripts/device_bench.sh make bench 2>&1 | tail -30 ;;
  esac
done
cp $OUT/ptx-cache.tgz $R/ 2>/dev/null
tar czf $R/r.tgz -C /root r
