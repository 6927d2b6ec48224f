#!/usr/bin/env bash
# one-off device driver for issue 55's owed runs and issue 57's attention kernel (not committed)
set -uo pipefail
phase=$1; R=$OUT; ROOT=$PWD; mkdir -p /root/r
export MLX_PTX_CACHE_DIR=$ROOT/.ptx-cache PYTHONUNBUFFERED=1; mkdir -p $MLX_PTX_CACHE_DIR
[ -z "$(ls -A $MLX_PTX_CACHE_DIR)" ] && [ -f .ptx-cache.tgz ] && tar xzf .ptx-cache.tgz -C $MLX_PTX_CACHE_DIR
df -BG /root | tail -1; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
left() { echo $((${LIMIT:-585} - SECONDS)); }
gpu() {  # gpu NAME -k EXPR: CUDA tests in the background
  local name=$1; shift
  (cd $ROOT && timeout 400 python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/gpu "$@" > $R/gputests-$name.txt 2>&1; echo "exit $?" >> $R/gputests-$name.txt) &
}
case $phase in
c3)
  bash scripts/install-on-device.sh 2>&1 | tail -2
  python3 -c 'import mlx_lm; print("mlx_lm", mlx_lm.__version__)'
  timeout 150 python3 scripts/attention_bench.py --snapshot .snap/after --contexts 2048 16384 32768 > $R/attnbench.txt 2>&1; echo "attnbench exit $? at +${SECONDS}s"
  tail -25 $R/attnbench.txt
  gpu attn -k "attention or compiled_step"; wait; echo "gputests done at +${SECONDS}s"; tail -4 $R/gputests-attn.txt
  ;;
glm|ds)
  bash scripts/install-on-device.sh 2>&1 | tail -1
  if [ -n "${ATTN:-}" ]; then
    timeout 120 python3 scripts/attention_bench.py --snapshot .snap/after --rounds 5 --contexts 2048 16384 32768 > $R/attnbench.txt 2>&1; echo "attnbench exit $? at +${SECONDS}s"
    grep -v "^\s*$" $R/attnbench.txt | tail -14
  fi
  rm -rf /root/moebench-*
  if [ $phase = glm ]; then P=glm-4.5-air; L=$([ "$mem" -gt 100000 ] && echo 36 || echo 24)
  else P=deepseek-v3-12l; L=$([ "$mem" -gt 100000 ] && echo 10 || echo 7); fi
  echo "LAYERS=$L"
  [ -n "${TESTS:-}" ] && gpu $phase -k "$TESTS"
  OUT=/root/r/$phase PRESET=$P LAYERS=$L DEADLINE=250 bash scripts/device_bench.sh make > $R/make-$phase.log 2>&1
  echo "made at +${SECONDS}s"; wait; echo "gputests done at +${SECONDS}s"; tail -4 $R/gputests-$phase.txt 2>/dev/null
  OUT=/root/r/$phase PRESET=$P LAYERS=$L PROMPTS="64 2048" REPEATS=5 COMPILED=on DEADLINE=$(left) BENCH_LIMIT=560 \
    bash scripts/device_bench.sh bench 2>&1 | tee $R/bench-$phase.txt | tail -30
  ;;
esac
echo "phase $phase done at +${SECONDS}s"
tar czf $R/r-$phase.tgz --exclude='*.json.gz' --exclude=ptx-cache.tgz -C /root r
tar czf $R/ptx-cache.tgz -C $MLX_PTX_CACHE_DIR .
