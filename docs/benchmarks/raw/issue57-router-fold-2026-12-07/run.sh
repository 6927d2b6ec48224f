#!/usr/bin/env bash
# Issue 57's device runs of 2026-12-07, round 6 (stages as arguments; each fits one device call after the wheel parts).
# Snapshots carried (git archive REV moebench kernels | tar x -C .snap/REV): .snap/main (main before the router fold,
# a6d3c99) and, for the fold's stages, this revision in the working tree.
#   patches: each of $PATCHES (default: ../issue57-compact-2026-12-07/attn-unroll.patch) applied to .snap/main's code and benched against it at $P_PROMPTS (default 64 2048) with
#            $P_LIMIT seconds (default 270), then taken off; the working tree's moebench and kernels are set to
#            .snap/main's first, so edits in progress there do not travel into the arms
#   gpu:     install, the CUDA tests of the two folds (kernel A selecting, the attention kernel joining its partials)
#            and of decoding through the kernels
#   (llama.cpp's build and GGUFs: round 3's `llama` stage, ../issue57-normed-router-2026-12-07/run.sh llama, first)
#   qwen3:   Qwen3-30B-A3B random 4-bit g64: llama.cpp tg128, then moebench (this revision and .snap/main, fused and
#            compiled) against mlx-lm at $Q_PROMPTS (default 64 2048 4096), then llama.cpp again
#   retime:  this revision against .snap/main at $R_PROMPTS (default 64 2048), Qwen3-30B-A3B, no llama.cpp
#   a27b:    the same as qwen3 for Qwen1.5-MoE-A2.7B
#   kernels: the GPU time by kernel of this revision and of .snap/main, Qwen3-30B-A3B, 64 compiled steps
set -uo pipefail
R=$OUT; export OUT=/root/r; mkdir -p $OUT
bash scripts/install-on-device.sh 2>&1 | tail -2
common="GEN=128 REPEATS=5 FUSED=on COMPILED=on DEADLINE=575"
for stage in "$@"; do
  case $stage in
    patches)
      rm -rf moebench kernels && cp -r .snap/main/moebench .snap/main/kernels .
      for p in ${PATCHES:-docs/benchmarks/raw/issue57-compact-2026-12-07/attn-unroll.patch}; do
        echo "== $p"
        (git apply $p 2>/dev/null || patch -p1 < $p) && \
          env $common PRESET=qwen3-30b-a3b PROMPTS="${P_PROMPTS:-64 2048}" SNAPSHOT=.snap/main BENCH_LIMIT=${P_LIMIT:-270} \
          bash scripts/device_bench.sh make bench 2>&1 | tail -30
        n=$(basename $p .patch); for f in $OUT/bench-*; do mv $f ${f%/*}/$n-${f##*/}; done
        git apply -R $p 2>/dev/null || patch -R -p1 < $p
      done ;;
    gpu)  # the folds' CUDA tests first (kernel A selecting, the attention kernel joining), then decoding through them
      t=tests/gpu/test_cuda_kernel.py
      env DEADLINE=575 GPUTESTS_LIMIT=${GPU_LIMIT:-240} GPUTESTS="$t::test_cuda_kernel_a_selecting_matches_the_router_kernel_then_the_pair \
        $t::test_cuda_attention_kernel_joining_its_partials_equals_the_joining_launch \
        $t::test_compiled_step_writes_the_cache_in_place_and_decodes_as_the_eager_step \
        $t::test_decode_on_cuda_runs_the_kernels_every_step ${GPU_MORE:-}" \
        bash scripts/device_bench.sh gputests 2>&1 | tail -25 ;;
    qwen3)
      env $common PRESET=qwen3-30b-a3b PROMPTS="${Q_PROMPTS:-64 2048 4096}" LLAMA_DEPTHS="${Q_DEPTHS:-0 2048 4096}" \
        SNAPSHOT=.snap/main BENCH_LIMIT=${Q_LIMIT:-330} bash scripts/device_bench.sh llamacpp make bench 2>&1 | tail -40 ;;
    retime)  # this revision (both folds) against .snap/main, Qwen3-30B-A3B
      env $common PRESET=qwen3-30b-a3b PROMPTS="${R_PROMPTS:-64 2048}" SNAPSHOT=.snap/main BENCH_LIMIT=${R_LIMIT:-330} \
        bash scripts/device_bench.sh make bench 2>&1 | tail -40 ;;
    a27b)
      env $common PRESET=qwen1.5-moe-a2.7b PROMPTS="64 2048 4096" LLAMA_DEPTHS="0 2048 4096" SNAPSHOT=.snap/main \
        BENCH_LIMIT=300 bash scripts/device_bench.sh llamacpp make bench 2>&1 | tail -40 ;;
    kernels)
      env $common PRESET=qwen3-30b-a3b bash scripts/device_bench.sh make kernels 2>&1 | tail -20
      (cd .snap/main && PYTHONPATH=$PWD MLX_PTX_CACHE_DIR=$OLDPWD/.ptx-cache timeout 150 python3 ../../scripts/device_diag.py \
        /root/moebench-qwen3-30b-a3b-4bit-g64-bfloat16 kernels 2>&1 | tee $OUT/kernels-qwen3-30b-a3b-main.txt \
        | grep -E "us/token" | head -16) ;;
  esac
done
cp $OUT/ptx-cache.tgz $R/ 2>/dev/null
tar czf $R/r.tgz -C /root r
