#!/usr/bin/env bash
# Issue 57's device runs of 2026-12-07, round 3 (stages as arguments; each fits one device call after the wheel parts;
# .snap/385b789 is main before this round: git archive 385b789 moebench kernels, carried):
#   gpu:    install, the CUDA tests of the norm + logits kernel and of decoding through the kernels (carry .whl3)
#   llama:  llama.cpp's build and the two random Q4_0 GGUFs (carry .anchors: beside .whl3 a call passes 64 MiB)
#   qwen3:  Qwen3-30B-A3B random 4-bit g64: llama.cpp tg128, then moebench (the working tree and .snap/385b789, fused
#           and compiled) against mlx-lm at 64, 2048 and 4096, then llama.cpp again; the GPU time by kernel
#   a27b:   the same for Qwen1.5-MoE-A2.7B
#   retime: this revision against .snap/385b789 at 64 and 2048 (not run yet; owed for main at 27bc67c: the norm +
#           logits arithmetic and o_proj + residual in the rows kernel, the unrolled expert kernels)
#   retime2: this revision against .snap/4a37dd2 (main before the rows kernel took q/k/v and o_proj) at 64 and 2048
#   kernels: the GPU time by kernel of this revision, of .snap/4a37dd2 and of .snap/385b789, Qwen3-30B-A3B, 64
#            compiled steps
#   long:   Qwen3-30B-A3B at 16384 and 32768 (llama.cpp, moebench, mlx-lm; no snapshot arm)
#   retime3: (round 5) this revision (kernel sources compacted) against .snap/c4679bb (main before) at 64 and 2048
#   unroll: (round 5) ../issue57-compact-2026-12-07/attn-unroll.patch applied, against this revision (.snap/main:
#           git archive HEAD moebench kernels, carried) at $U_PROMPTS (default 2048 16384), then the patch taken off
#   probe:  (round 5) the decode-attention kernel's GPU time with parts of it cut out or changed
#           (../issue57-attention-probe-2026-12-07/probe.py), at 100 and 2048 positions; needs no checkpoint
set -uo pipefail
R=$OUT; export OUT=/root/r; mkdir -p $OUT
bash scripts/install-on-device.sh 2>&1 | tail -2
common="GEN=128 REPEATS=5 FUSED=on COMPILED=on DEADLINE=575"
for stage in "$@"; do
  case $stage in
    gpu)
      t=tests/gpu/test_cuda_kernel.py
      # (12:52 UTC ran the first design's test_cuda_normed_router_matches_the_unfused_ops_on_the_gpu in its place)
      # (15:35 UTC added the expert kernels' tests, as their loops are unrolled since 36bbb5a, and ran the rows test;
      # 300 s cut it in the pair's variants, docs/benchmarks/issue57-rows-h100-2026-12-07.md)
      env DEADLINE=575 GPUTESTS_LIMIT=${GPU_LIMIT:-540} GPUTESTS="$t::test_cuda_rows_kernel_matches_the_unfused_ops_on_the_gpu \
        $t::test_cuda_router_kernel_matches_the_reference $t::test_decode_on_cuda_runs_the_kernels_every_step \
        $t::test_gpt_oss_decode_on_cuda_runs_the_moe_kernels_every_step \
        $t::test_compiled_step_writes_the_cache_in_place_and_decodes_as_the_eager_step \
        $t::test_cuda_kernels_are_deterministic_and_independent_of_rows \
        $t::test_cuda_kernel_with_the_shared_expert_matches_reference_and_truth \
        $t::test_cuda_expert_variants_match_reference_and_truth" \
        bash scripts/device_bench.sh gputests 2>&1 | tail -25 ;;
    llama)
      env DEADLINE=575 bash scripts/device_bench.sh llamabuild 2>&1 | tail -5
      for arch in qwen3moe qwen2moe; do
        PYTHONPATH=/root/lcp/llama.cpp/gguf-py timeout 120 python3 .anchors/gguf_random.py /root/$arch-q4_0.gguf Q4_0 $arch \
          2>&1 | tail -2
      done ;;
    qwen3)
      env $common PRESET=qwen3-30b-a3b PROMPTS="64 2048 4096" LLAMA_DEPTHS="0 2048 4096" SNAPSHOT=.snap/385b789 BENCH_LIMIT=330 \
        bash scripts/device_bench.sh llamacpp make bench kernels 2>&1 | tail -40 ;;
    a27b)
      env $common PRESET=qwen1.5-moe-a2.7b PROMPTS="64 2048 4096" LLAMA_DEPTHS="0 2048 4096" SNAPSHOT=.snap/385b789 BENCH_LIMIT=300 \
        bash scripts/device_bench.sh llamacpp make bench 2>&1 | tail -40 ;;
    retime)  # this revision (the norm + logits kernel, the unrolled expert kernels) against .snap/385b789
      env $common PRESET=qwen3-30b-a3b PROMPTS="64 2048" SNAPSHOT=.snap/385b789 BENCH_LIMIT=300 \
        bash scripts/device_bench.sh make kernels bench 2>&1 | tail -40 ;;
    retime2)  # this revision against .snap/4a37dd2
      env $common PRESET=qwen3-30b-a3b PROMPTS="64 2048" SNAPSHOT=.snap/4a37dd2 BENCH_LIMIT=300 \
        bash scripts/device_bench.sh make bench 2>&1 | tail -40 ;;
    retime3)  # this revision against .snap/c4679bb
      env $common PRESET=qwen3-30b-a3b PROMPTS="${R3_PROMPTS:-64 2048}" SNAPSHOT=.snap/c4679bb BENCH_LIMIT=${R3_LIMIT:-420} \
        bash scripts/device_bench.sh make bench 2>&1 | tail -40 ;;
    unroll)  # the unrolled attention kernel against this revision, where the GPU's time is the bound
      u=docs/benchmarks/raw/issue57-compact-2026-12-07/attn-unroll.patch
      (git apply $u 2>/dev/null || patch -p1 < $u) && \
        env $common PRESET=qwen3-30b-a3b PROMPTS="${U_PROMPTS:-2048 16384}" SNAPSHOT=.snap/main BENCH_LIMIT=${U_LIMIT:-480} \
        bash scripts/device_bench.sh make bench 2>&1 | tail -40
      git apply -R $u 2>/dev/null || patch -R -p1 < $u ;;
    kernels)  # the GPU time by kernel of this revision and of the snapshots carried, Qwen3-30B-A3B
      env $common PRESET=qwen3-30b-a3b bash scripts/device_bench.sh make kernels 2>&1 | tail -20
      ckpt=/root/moebench-qwen3-30b-a3b-4bit-g64-bfloat16 root=$PWD
      for snap in c4679bb 4a37dd2 385b789; do
        [ -d .snap/$snap ] || continue
        (cd .snap/$snap && PYTHONPATH=$PWD MLX_PTX_CACHE_DIR=$root/.ptx-cache timeout 150 python3 \
          ../../scripts/device_diag.py $ckpt kernels 2>&1 | tee $OUT/kernels-qwen3-30b-a3b-$snap.txt | grep -E "us/token" | head -16)
      done ;;
    probe)
      timeout 200 python3 docs/benchmarks/raw/issue57-attention-probe-2026-12-07/probe.py --positions 100 2048 \
        2>&1 | grep -v Warning | tee $OUT/probe.txt | tail -40 ;;
    long)
      env $common PRESET=qwen3-30b-a3b PROMPTS="16384 32768" BENCH_LIMIT=420 \
        bash scripts/device_bench.sh llamacpp make bench 2>&1 | tail -40 ;;
  esac
done
cp $OUT/ptx-cache.tgz $R/ 2>/dev/null
tar czf $R/r.tgz -C /root r
