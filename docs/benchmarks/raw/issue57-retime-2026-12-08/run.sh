#!/usr/bin/env bash
# Issue 57's device runs of 2026-12-08, round 7 (stages as arguments; each fits one device call after the wheel parts,
# carrying .ptx-cache.tgz and .snap/main = git archive a6d3c99 moebench kernels, main before round 6's folds).
#   probe:  probe_mxfp8.py on this revision with CUDA_LAUNCH_BLOCKING=1 ($MODES, default "mxfp8 mxfp4 mxfp8": mxfp8
#           in a fresh process, then round 6's order); only when that faults, the same on .snap/main
#   retime: this revision against .snap/main at $R_PROMPTS (default 64 2048), Qwen3-30B-A3B: the folds' speed
#   qkv:    qkv-norm.patch (branch issue57-qkv-norm of 2026-12-08: the layer's input norm + q/k/v through the rows
#           kernel, a Qwen3-MoE layer 6 launches) applied to this revision, against this revision (copied to
#           .snap/head first) at $K_PROMPTS (default 64 2048)
#   kernels: a decode token's GPU time by kernel (device_diag.py kernels, 64 compiled steps), this revision and then
#           with qkv-norm.patch applied: the fused input norm + q/k/v kernel's time against rms_norm + MLX's matvec
#   unroll: round 5's unrolled attention kernel (../issue57-compact-2026-12-07/attn-unroll.patch) applied to this
#           revision, against this revision (copied to .snap/head first) at $U_PROMPTS (default 2048 16384)
set -uo pipefail
R=$OUT; export OUT=/root/r; mkdir -p $OUT
bash scripts/install-on-device.sh 2>&1 | tail -2
common="GEN=128 REPEATS=5 FUSED=on COMPILED=on DEADLINE=575 PRESET=qwen3-30b-a3b"
for stage in "$@"; do
  case $stage in
    probe)
      export MLX_PTX_CACHE_DIR=$PWD/.ptx-cache PYTHONUNBUFFERED=1
      mkdir -p $MLX_PTX_CACHE_DIR && tar xzf .ptx-cache.tgz -C $MLX_PTX_CACHE_DIR
      p=$PWD/docs/benchmarks/raw/issue57-retime-2026-12-08/probe_mxfp8.py
      for arm in head main; do
        dir=$([ $arm = head ] && echo $PWD || echo $PWD/.snap/main)
        (cd $dir && PYTHONPATH=$dir CUDA_LAUNCH_BLOCKING=1 timeout ${PROBE_LIMIT:-150} python3 $p ${MODES:-mxfp8 mxfp4 mxfp8}) \
          > $OUT/probe-$arm.txt 2>&1
        rc=$?; echo "== $arm exit $rc"; tail -12 $OUT/probe-$arm.txt
        [ $rc -eq 0 ] && break
      done
      tar czf $OUT/ptx-cache.tgz -C $MLX_PTX_CACHE_DIR . ;;
    retime)
      env $common PROMPTS="${R_PROMPTS:-64 2048}" SNAPSHOT=.snap/main BENCH_LIMIT=${R_LIMIT:-330} \
        bash scripts/device_bench.sh make bench 2>&1 | tail -40
      for f in $OUT/bench-*; do mv $f ${f%/*}/retime-${f##*/}; done ;;
    kernels)
      p=docs/benchmarks/raw/issue57-retime-2026-12-08/qkv-norm.patch
      env $common bash scripts/device_bench.sh make kernels 2>&1 | tail -16
      mv $OUT/kernels-qwen3-30b-a3b.txt $OUT/kernels-head.txt
      git apply $p 2>/dev/null || patch -p1 < $p
      env $common bash scripts/device_bench.sh kernels 2>&1 | tail -16
      mv $OUT/kernels-qwen3-30b-a3b.txt $OUT/kernels-qkv.txt
      git apply -R $p 2>/dev/null || patch -R -p1 < $p ;;
    qkv|unroll)  # a patch applied to this revision, against this revision
      if [ $stage = qkv ]; then p=docs/benchmarks/raw/issue57-retime-2026-12-08/qkv-norm.patch; prompts=${K_PROMPTS:-64 2048}
      else p=docs/benchmarks/raw/issue57-compact-2026-12-07/attn-unroll.patch; prompts=${U_PROMPTS:-2048 16384}; fi
      rm -rf .snap/head && mkdir -p .snap/head && cp -r moebench kernels .snap/head/
      git apply $p 2>/dev/null || patch -p1 < $p
      env $common PROMPTS="$prompts" SNAPSHOT=.snap/head BENCH_LIMIT=${P_LIMIT:-400} \
        bash scripts/device_bench.sh make bench 2>&1 | tail -40
      for f in $OUT/bench-*; do mv $f ${f%/*}/$stage-${f##*/}; done
      git apply -R $p 2>/dev/null || patch -R -p1 < $p ;;
  esac
done
cp $OUT/ptx-cache.tgz $R/ 2>/dev/null
tar czf $R/r.tgz -C /root r
