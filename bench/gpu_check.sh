#!/usr/bin/env bash
# One prepared GPU check (written for an H200 with torch + triton preinstalled and this repo copied in).
#
#   OUT=/some/dir bash bench/gpu_check.sh
#
# Stages, each under its own time limit so the whole script stays within ~8 minutes:
#   env    editable install of this package (no deps) and the versions of everything it needs
#   tests  pytest -m gpu
#   full   the benchmark at the real per-depth dims (1 MTP depth, 2-layer trunk), bf16, random weights built on the
#          device (no checkpoint on disk): latency of eager / compiled / CUDA graph / transformers / GEMM floor,
#          kernel counts, bytes read vs measured copy bandwidth
#   small  the benchmark at `small` (H 1024, V 32000), bf16, a synthetic checkpoint shared with transformers:
#          cold / warm compile + CUDA-graph capture in subprocesses, kernels, latency
# STAGES=tests,full (comma-separated) runs only those stages: a rerun after a fix need not repeat the rest.
# Everything lands in $OUT: gpu_check.log (summary), <stage>.log, bench_full.json, bench_small.json (written after
# each section, so a stage cut short keeps what it measured), RESULTS.md (entries to append to bench/RESULTS.md).
#
# Dry run on a CPU machine: BENCH_DEVICE=cpu FULL_CONFIG=tiny SMALL_CONFIG=tiny BENCH_EXTRA=--quick bash ...
#
# Packages the GPU image lacks travel as wheels in .whl/ (git-ignored), installed into a private folder first. The
# image read on 2026-11-17 had transformers 5.17 (no Inkling classes; we need >= 5.23) and every other dependency,
# so before calling the device tool, here:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl transformers==5.24.0
# and name .whl in the call's carry.
set -u

cd "$(dirname "$0")/.."
OUT="${OUT:-$(pwd)/bench/out/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
DEVICE="${BENCH_DEVICE:-cuda}"
FULL_CONFIG="${FULL_CONFIG:-full}"
SMALL_CONFIG="${SMALL_CONFIG:-small}"
EXTRA="${BENCH_EXTRA:-}"
T_ENV="${T_ENV:-60}" T_TESTS="${T_TESTS:-110}" T_FULL="${T_FULL:-140}" T_SMALL="${T_SMALL:-150}"
START=$(date +%s)
export PYTHONUNBUFFERED=1
export INKLING_COMPILED_CACHE="${INKLING_COMPILED_CACHE:-/tmp/inkling_compiled_checkpoints}"  # not under $OUT: it is copied back

log() { echo "[gpu_check $(( $(date +%s) - START ))s] $*" | tee -a "$OUT/gpu_check.log"; }

STAGES="${STAGES:-env,tests,full,small}"  # a rerun after a fix can name only the stages it needs, e.g. STAGES=tests

stage() {  # stage NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2 rc
  shift 2
  case ",$STAGES," in *",$name,"*) ;; *) log "stage $name: not in STAGES=$STAGES, skipped"; return 0 ;; esac
  log "stage $name (limit ${limit}s): $*"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    log "stage $name: TIMED OUT after ${limit}s (exit $rc)"
  else
    log "stage $name: exit $rc"
  fi
  echo "----- tail of $name.log -----"
  tail -n 70 "$OUT/$name.log"
  echo "-----------------------------"
  return 0
}

env_report() {
  "$PY" -m pip install --no-deps -e . -q || echo "pip install -e . failed (continuing with PYTHONPATH)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
  "$PY" - <<'EOF'
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("torch", "triton", "transformers", "safetensors", "huggingface_hub", "tqdm", "pytest", "inkling_compiled"):
    try:
        m = importlib.import_module(name)
        print(f"{name:16s} {getattr(m, '__version__', 'ok')}")
    except Exception as e:  # noqa: BLE001
        print(f"{name:16s} MISSING ({type(e).__name__}: {e})")
import torch
print("cuda available", torch.cuda.is_available(), "| device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
      "| torch.version.cuda", torch.version.cuda)
EOF
}

export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
log "OUT=$OUT device=$DEVICE full=$FULL_CONFIG small=$SMALL_CONFIG extra=[$EXTRA]"
if compgen -G ".whl/*.whl" > /dev/null; then
  SITE="${WHEEL_SITE:-/tmp/inkling_compiled_site}"
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl; then
    export PYTHONPATH="$(pwd):$SITE${PYTHONPATH#"$(pwd)"}"
    log "installed carried wheels into $SITE: $(cd .whl && ls *.whl | tr '\n' ' ')"
  else
    log "installing the carried wheels failed (continuing with the machine's packages)"
  fi
fi
export -f env_report
export PY
stage env "$T_ENV" bash -c env_report  # timeout runs programs, not shell functions
if [ "$DEVICE" = "cuda" ]; then
  stage tests "$T_TESTS" "$PY" -m pytest -m gpu -v -rfE --durations=20 -p no:cacheprovider -o addopts=""
fi
# full: the GPU goal (CUDA-graph step vs HBM floor); no compile subprocesses (small covers compile times)
stage full "$T_FULL" "$PY" -m bench.run --config "$FULL_CONFIG" --device "$DEVICE" --weights random \
  --skip compile,stock,e2e --context 128 --time-budget 10 \
  --json "$OUT/bench_full.json" --results-md "$OUT/RESULTS.md" $EXTRA
stage small "$T_SMALL" "$PY" -m bench.run --config "$SMALL_CONFIG" --device "$DEVICE" \
  --skip e2e --context 128 --recompile-steps 10 --time-budget 10 --probe-timeout 120 \
  --json "$OUT/bench_small.json" --results-md "$OUT/RESULTS.md" $EXTRA
log "done in $(( $(date +%s) - START ))s; results in $OUT"
