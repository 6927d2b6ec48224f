#!/usr/bin/env bash
# The H200 runs of issues 7 and 9, unattended. Runs ON the device machine, from the project root, after
# scripts/install-on-device.sh has installed MLX with CUDA (and mlx-lm, when its wheel was carried:
# `../shared/device/prepare-mlx-cuda.sh mlx-lm==0.32.2` here first). See docs/benchmarks/README.md.
#
#   bash scripts/device_bench.sh [gputests] [make] [profile] [kernels] [timeline] [llamabuild] [llamacpp] [bench] [selfcheck]
#   (no argument: make bench selfcheck)
#
# In the same call as the install: bash scripts/install-on-device.sh && DEADLINE=$((580 - SECONDS)) bash scripts/device_bench.sh
# The device tool brings back at most 8 files from its $OUT: write to another folder and pack it, e.g.
#   R=$OUT; export OUT=/root/r; bash scripts/device_bench.sh ...; tar czf $R/r.tgz -C /root r
# Qwen3-30B-A3B as mlx-community ships it (experts stacked), at three prompt lengths:
#   PRESET=qwen3-30b-a3b PROMPTS="64 2048 4096" REPEATS=3 bash scripts/device_bench.sh make bench
# The same model with every quantized weight in mxfp4 (mlx_lm.convert --q-mode mxfp4's layout):
#   PRESET=qwen3-30b-a3b MODE=mxfp4 PROMPTS="64 2048" bash scripts/device_bench.sh make bench
#
# make       random $PRESET weights (default Qwen1.5-MoE-A2.7B; 4-bit, group 64, bf16 scales, 5 GB shards) with
#            the experts laid out as the family's MLX checkpoints lay them out (per expert for Qwen1.5-MoE,
#            stacked mlp.switch_mlp.* for Qwen3-MoE; LAYOUT=stacked|per-expert to choose) on local disk; reused
#            when an earlier call on this machine wrote them (always made when missing)
# bench      moebench bench: $PROMPTS-token prompt (default 64; several, e.g. PROMPTS="64 2048 4096": one model
#            load, each length a full bench, a table per length), $GEN generated tokens (default 128), $REPEATS repeats;
#            moebench fused on and off ($FUSED=on: fused only), each eager and through the compiled decode step; mlx-lm generate_step
#            and mlx-lm's model under moebench's loop; with SNAPSHOT=DIR (e.g. .snap/before: git archive REV
#            moebench kernels, carried) an earlier revision's fused and fallback arms too, and HEAD/snapshot per
#            round; all on the same weights, interleaved; at most $BENCH_LIMIT seconds (default 360)
# selfcheck  moebench selfcheck on that checkpoint, and on the shipped model when data/ has it
# gputests   the CUDA-only tests (tests/gpu: kernel parity against the reference and a float64 truth); $GPUTESTS
#            names other pytest targets, $GPUTESTS_LIMIT the stage's seconds (default 240)
# profile    moebench profile (one decode token after a $PROFILE_PROMPT-token prompt, default 64: build / eval ms,
#            graph nodes by primitive), fused on and off and mlx-lm's model; also with the package in .snap/before
#            (an earlier commit, when carried) for a before/after pair
# kernels    GPU time per decode token by kernel, compiled fused step (scripts/device_diag.py kernels: CUPTI through
#            torch.profiler, which the device image has), the union of kernel intervals, host build/encode time
# timeline   generate's host work and GPU kernels on one clock: GPU idle time per token and what the host does
#            meanwhile (scripts/device_diag.py timeline), with a Chrome trace (timeline-*-trace.json.gz) and its
#            kernels and CUDA calls per token (timeline-*-per-token.txt, device_diag.py TRACE trace)
# attnbench  decode attention alone (scripts/attention_bench.py): this revision's kernel, .snap/before's when carried,
#            and MLX's scaled_dot_product_attention at Qwen3-30B-A3B's and A2.7B's shapes, $ATTN_CONTEXTS positions
#            (default 2048 4096 16384 32768); needs no checkpoint
# llamabuild llama.cpp's llama-bench with CUDA (sm_90), built once a machine (about 5 minutes: a call of its own) from
#            .anchors/llama.cpp-src.tgz (copy ../shared/anchors to the git-ignored .anchors/ and carry it, 8 MB, in a
#            call after the install: beside a wheel part it passes the 64 MiB a call carries)
# llamacpp   llama.cpp's tg128 (llama-bench -p 0 -n $GEN -fa 1 -ngl 99, $REPEATS repetitions, Q4_0) at the depths
#            $LLAMA_DEPTHS (default $PROMPTS) on a random GGUF of $PRESET's shapes (.anchors/gguf_random.py: Qwen3-30B-A3B
#            or Qwen1.5-MoE-A2.7B); with bench in the same call it runs before and after moebench's arms
#            (llamacpp-$PRESET-1.txt, -2.txt), so the engines alternate
# GLM-4.5-Air at 4-bit is ~60 GB and bench holds two copies (moebench's, mlx-lm's): LAYERS=36 writes its first 36
# layers (~47 GB), two of which fit an H200 (docs/benchmarks/issue55-glm-deepseek-h200-2026-12-07.md).
# MOEBENCH_DEVICE_CKPT defaults to /root/moebench-$PRESET-4bit-g64-$DTYPE (4bit-g64 is $MODE when MODE is not
# affine; -$LAYOUT, -${LAYERS}l when given); outputs are named
# by $PRESET.
#
# Everything lands in $OUT (logs, tables, JSON records, timing.txt); each stage has a time limit so a
# hung stage cannot eat the call, and the script exits non-zero when any stage failed.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
REPEATS=${REPEATS:-5}
DEADLINE=${DEADLINE:-570}  # seconds this script may use in all (one device call allows 600)
PRESET=${PRESET:-qwen1.5-moe-a2.7b}  # a smaller preset (and DTYPE=float32) for a dry run on a CPU
DTYPE=${DTYPE:-bfloat16}
LAYOUT=${LAYOUT:-}  # empty: the family's (moebench make-random's default)
MODE=${MODE:-affine}  # make-random --mode: affine 4-bit g64, or every quantized weight mxfp4 / nvfp4 / mxfp8
PROMPTS=${PROMPTS:-64}
GEN=${GEN:-128}  # tokens generated per bench round
BENCH_LIMIT=${BENCH_LIMIT:-360}
QUANT=$([ "$MODE" = affine ] && echo 4bit-g64 || echo "$MODE")
LAYERS=${LAYERS:-}  # empty: every layer of the preset; N: its first N (make-random --layers: a model cut to fit the disk)
CKPT=${MOEBENCH_DEVICE_CKPT:-/root/moebench-$PRESET-$QUANT-$DTYPE${LAYOUT:+-$LAYOUT}${LAYERS:+-${LAYERS}l}}
stages=${*:-make bench selfcheck}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# MLX compiles each CUDA kernel variant with NVRTC on first use and keeps the result in MLX_PTX_CACHE_DIR (default
# /tmp/mlx/<version>/ptx): on a fresh machine the first warm-up of a real-size model spent 124-134 s compiling
# (docs/benchmarks/issues-36-41-h200-cpu-2026-12-03.md; 216 s at an 8192-token prompt, issues-36-41-h200-2026-12-04.md).
# Every call's $OUT gets the cache as ptx-cache.tgz (~5 MB; the folder is ~40 MB, too much to ride with a wheel part):
# keep the newest as the git-ignored .ptx-cache.tgz here and carry it (carry [".whl3", ".ptx-cache.tgz"]); an empty
# cache folder is filled from it.
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$PWD/.ptx-cache}
mkdir -p "$MLX_PTX_CACHE_DIR"
if [ -f .ptx-cache.tgz ] && [ -z "$(ls -A "$MLX_PTX_CACHE_DIR")" ]; then
  tar xzf .ptx-cache.tgz -C "$MLX_PTX_CACHE_DIR" && echo "kernel cache: $(ls "$MLX_PTX_CACHE_DIR" | wc -l) files from .ptx-cache.tgz"
fi
log() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$OUT/timing.txt"; }
failed=()

run_stage() {  # run_stage NAME LIMIT_S LOGFILE COMMAND...: at most LIMIT_S, and never past DEADLINE
  local name=$1 limit=$2 logfile=$3 left=$((DEADLINE - SECONDS))
  shift 3
  if [ "$left" -lt 30 ]; then
    log "skip $name: only ${left}s left before DEADLINE=${DEADLINE}s"
    failed+=("$name (no time left)")
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  log "start $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$logfile"
  local rc=${PIPESTATUS[0]}
  log "end $name: exit $rc"
  [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}

# install-on-device.sh skips every wheel when MLX is already there: add a carried mlx-lm wheel if it is missing
if ! python3 -c 'import mlx_lm' 2>/dev/null && ls .whl*/mlx_lm-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile .whl*/mlx_lm-*.whl || echo "mlx-lm wheel did not install"
fi

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "stages: $stages; preset: $PRESET $DTYPE ${LAYOUT:-family layout}; checkpoint: $CKPT; repeats: $REPEATS;"\
    "prompts: $PROMPTS"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 - <<'EOF'
import platform
from importlib.metadata import PackageNotFoundError, version
import mlx.core as mx
print("python", platform.python_version(), platform.platform())
print("mlx", mx.__version__, "cuda", mx.cuda.is_available(), "default device", mx.default_device())
print("device_info", mx.device_info())
for pkg in ("mlx-cuda-13", "mlx-lm", "transformers", "numpy", "moebench"):
    try:
        print(pkg, version(pkg))
    except PackageNotFoundError:
        print(pkg, "not installed")
EOF
} 2>&1 | tee "$OUT/platform.txt"
python3 -c 'import moebench.cli' || { echo "moebench does not import here; see above" >&2; exit 1; }

if [[ " $stages " == *" gputests "* ]]; then
  run_stage gputests "${GPUTESTS_LIMIT:-240}" gputests.txt python3 -m pytest -q -s -o addopts="" -p no:cacheprovider ${GPUTESTS:-tests/gpu}
fi

if [[ " $stages " == *" attnbench "* ]]; then
  run_stage attnbench "${ATTN_LIMIT:-240}" attnbench.txt python3 scripts/attention_bench.py \
    $([ -d .snap/before/moebench ] && echo --snapshot .snap/before) --contexts ${ATTN_CONTEXTS:-2048 4096 16384 32768}
fi
needs_checkpoint=$(for s in $stages; do case $s in gputests|attnbench|llamabuild|llamacpp) ;; *) echo yes ;; esac; done)
if [ -z "$needs_checkpoint" ]; then
  log "no moebench checkpoint needed (stages: $stages)"
elif [ -f "$CKPT.done" ]; then
  log "reusing $CKPT (written by an earlier call on this machine)"
else  # every later stage needs the checkpoint: make it whether or not 'make' was asked for
  rm -rf "$CKPT"
  failed_before=${#failed[@]}
  run_stage make-random 300 make-random.log \
    python3 -m moebench.cli make-random "$CKPT" --preset "$PRESET" --bits 4 --group-size 64 --mode "$MODE" \
    --dtype "$DTYPE" ${LAYOUT:+--layout "$LAYOUT"} ${LAYERS:+--layers "$LAYERS"}
  # only make-random's own failure leaves it unmarked (a gputests failure before it did, and cost a re-make)
  [ -f "$CKPT/config.json" ] && [ ${#failed[@]} -eq "$failed_before" ] && touch "$CKPT.done"
  du -sh "$CKPT" 2>&1 | tee -a "$OUT/make-random.log"
fi

if [[ " $stages " == *" profile "* ]]; then
  for snap in . .snap/before; do  # python -m puts the working directory first: run each from its own root
    [ -d "$snap/moebench" ] || continue
    tag=$PRESET$([ "$snap" = . ] || echo -before)
    run_stage "profile-$tag" 180 "profile-$tag.txt" env -C "$snap" PYTHONPATH= \
      python3 -m moebench.cli profile "$CKPT" --prompt-tokens "${PROFILE_PROMPT:-64}" --steps 32 --gen-tokens 128 --fused both \
      --compare mlx-lm --json "$OUT/profile-$tag.json"
  done
fi

if [[ " $stages " == *" kernels "* ]]; then
  run_stage "kernels-$PRESET" 180 "kernels-$PRESET.txt" python3 scripts/device_diag.py "$CKPT" kernels
fi

if [[ " $stages " == *" timeline "* ]]; then
  run_stage "timeline-$PRESET" 180 "timeline-$PRESET.txt" \
    python3 scripts/device_diag.py "$CKPT" timeline "$OUT/timeline-$PRESET-trace.json"
  gzip -f "$OUT/timeline-$PRESET-trace.json" 2>/dev/null \
    && python3 scripts/device_diag.py "$OUT/timeline-$PRESET-trace.json.gz" trace > "$OUT/timeline-$PRESET-per-token.txt"
fi

LLAMA=/root/lcp/llama.cpp
if [[ " $stages " == *" llamabuild "* ]]; then
  if [ -x "$LLAMA/build/bin/llama-bench" ]; then
    log "llama-bench already built"
  else
    mkdir -p /root/lcp && tar xzf .anchors/llama.cpp-src.tgz -C /root/lcp
    run_stage llamabuild 540 llamabuild.txt bash -c "cmake -S $LLAMA -B $LLAMA/build -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DCMAKE_BUILD_TYPE=Release \
      && cmake --build $LLAMA/build --target llama-bench -j 16"
  fi
fi

llamacpp() {  # llamacpp N: llama-bench tg$GEN at $LLAMA_DEPTHS on the GGUF of $PRESET's shapes, into llamacpp-$PRESET-N.txt
  local arch
  case $PRESET in
    qwen3-30b-a3b) arch=qwen3moe ;;
    qwen1.5-moe-a2.7b) arch=qwen2moe ;;
    *) log "skip llamacpp: no GGUF writer for $PRESET (.anchors/gguf_random.py writes qwen3-30b-a3b and qwen1.5-moe-a2.7b)"
       failed+=("llamacpp (no GGUF for $PRESET)"); return ;;
  esac
  if [ ! -f "/root/$arch-q4_0.gguf" ]; then
    run_stage "gguf-$arch" 240 "gguf-$arch.txt" env PYTHONPATH="$LLAMA/gguf-py" \
      python3 .anchors/gguf_random.py "/root/$arch-q4_0.gguf" Q4_0 "$arch"
  fi
  local depths
  depths=$(echo ${LLAMA_DEPTHS:-$PROMPTS} | tr ' ' ',')
  run_stage "llamacpp-$1" 300 "llamacpp-$PRESET-$1.txt" "$LLAMA/build/bin/llama-bench" -m "/root/$arch-q4_0.gguf" \
    -ngl 99 -fa 1 -p 0 -n "$GEN" -r "$REPEATS" -d "$depths"
}

if [[ " $stages " == *" llamacpp "* ]]; then
  llamacpp 1
fi

if [[ " $stages " == *" bench "* ]]; then
  # $PROMPTS unquoted: one --prompt-tokens argument per length
  run_stage bench "$BENCH_LIMIT" "bench-$PRESET.txt" \
    python3 -m moebench.cli bench "$CKPT" --prompt-tokens $PROMPTS --gen-tokens "$GEN" --repeats "$REPEATS" --fused "${FUSED:-both}" \
    --compiled "${COMPILED:-both}" --compare mlx-lm ${SNAPSHOT:+--snapshot "$SNAPSHOT"} --json "$OUT/bench-$PRESET.json"
fi

if [[ " $stages " == *" llamacpp "* && " $stages " == *" bench "* ]]; then
  llamacpp 2
fi

if [[ " $stages " == *" selfcheck "* ]]; then
  run_stage "selfcheck-$PRESET" 240 "selfcheck-$PRESET.txt" \
    python3 -m moebench.cli selfcheck "$CKPT" --json "$OUT/selfcheck-$PRESET.json"
  if [ -f data/tiny-qwen2-moe/config.json ]; then
    run_stage selfcheck-shipped 240 selfcheck-shipped.txt \
      python3 -m moebench.cli selfcheck data/tiny-qwen2-moe --json "$OUT/selfcheck-shipped.json"
  fi
fi

tar czf "$OUT/ptx-cache.tgz" -C "$MLX_PTX_CACHE_DIR" . 2>/dev/null && log "ptx cache: $(du -sh "$MLX_PTX_CACHE_DIR" | cut -f1)"

echo; echo "== results (full logs, tables and JSON in $OUT) =="
[ -f "$OUT/bench-$PRESET.txt" ] && grep -E "^(model |prompt |\||skipped|moebench .* / snapshot)" "$OUT/bench-$PRESET.txt"
for f in "$OUT"/llamacpp-*.txt; do [ -f "$f" ] && { echo "-- $(basename "$f")"; grep -E "^\| (model|qwen|---)" "$f"; }; done
for f in "$OUT"/kernels-*.txt; do [ -f "$f" ] && { echo "-- $(basename "$f")"; grep -E "^kernels:|us/token" "$f" | head -14; }; done
for f in "$OUT"/timeline-*.txt; do [ -f "$f" ] && { echo "-- $(basename "$f")"; grep -E "^timeline:|us/token" "$f" | head -12; }; done
for f in "$OUT"/profile-*.txt; do [ -f "$f" ] && { echo "-- $(basename "$f")"; grep -E "^\| (per token|MoE|attention|build|eval|sync|pipelined|graph|nodes)" "$f"; }; done
for f in "$OUT"/selfcheck-*.txt; do
  [ -f "$f" ] && { echo "-- $(basename "$f")"; grep -E "^(platform|dispatch|greedy|PASS|FAIL|\| [^c|-])" "$f" | grep -v "| pass |$"; }
done
cat "$OUT/timing.txt"

if [ ${#failed[@]} -gt 0 ]; then
  log "FAILED: ${failed[*]}"
  exit 1
fi
log "all stages done"
