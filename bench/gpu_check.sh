#!/usr/bin/env bash
# The prepared GPU check: one run on a lent GPU (written for an H200 with torch 2.11 + triton 3.6 preinstalled and
# this repo copied in) that produces every CUDA figure the open issues ask for, in <= 8 minutes.
#
#   OUT=/some/dir bash bench/gpu_check.sh                 # every stage, most valuable first
#   STAGES=e2e,small OUT=/some/dir bash bench/gpu_check.sh  # only these: a rerun after a fix, or the rest of a run
#                                                         # that was cut (the summary lists what did not finish)
#
# Stages, in order of value; each runs under its own limit (seconds, override with T_<NAME>=...), and no stage
# starts or runs past BUDGET (470 s) from the script's start, so the whole run stays within 8 minutes:
#   env     30  the machine and GPU first, then the carried wheels from .whl/ (no registry is needed or
#               reached), then the versions of what the stages import
#   graphs  60  pytest -m gpu -k cuda_graph: the drafter's CUDA-graph capture / replay tests, K = 1 and the whole
#               K = 8 round (issue 11) as one graph per bucket
#   full    90  the benchmark at the real per-depth dims (1 MTP depth, 2-layer trunk), bf16, random weights built on
#               the device: eager / compiled / transformers / GEMM floor, kernel counts, bytes read vs copy
#               bandwidth; the CUDA-graph variant is built last (a capture failure loses nothing else)
#   e2e     80  speculative generation end to end on CUDA (compiled drafter, CUDA graphs) vs the target alone and
#               transformers' generate(use_mtp=True), on the carried self-distilled tiny target (else one distilled
#               there, briefly): tokens/s, acceptance, same tokens as the target
#   tests   75  the other gpu tests: Triton launch counts of our passes, ulp-compared outputs, the CUDA-graph GEMM
#               floor, copy bandwidth
#   aoti    70  the packaged AOTInductor rounds (issue 15): their gpu test (CUDA graphs of a K = 3 packaged round),
#               then the benchmark's packaged section on tiny: start-up and per-call rows
#   quant   40  weight-only quantized drafting (issue 14): its gpu tests (ours and torchao's schemes under CUDA
#               graphs), and the benchmark's quant section at the real per-depth dims (fp32 / bf16 / int8 depths /
#               int8 depths + head / torchao int8 and float8 depths + our int8 head, against the fp32 GEMM floor)
#   small  rest the benchmark at `small` (H 1024, V 32000), bf16, a synthetic checkpoint shared with transformers:
#               cold / warm compile + CUDA-graph capture in subprocesses, kernels, latency (>= 25 s even when every
#               stage before it runs to its limit)
# aoti / quant each run their gpu tests (pytest -m gpu -k <words>) and their benchmark section (a name in
# bench/run.py's SECTIONS) where the build has them, and otherwise say "not available in this build".
#
# $OUT gets at most 5 files at any moment (the device tool returns 8): gpu_check.log (the summary: each stage's
# command, exit, time and log tail, and a closing table), gpu_check.tar (each finished stage's full log and JSON,
# its report image where the machine has matplotlib (else draw it here: `python -m bench.report bench_<stage>.json`),
# and RESULTS.md with the entries to append to bench/RESULTS.md), and while a stage runs its own <stage>.log and
# bench_<stage>.json (written after every section: a stage cut at its limit, or the whole command cut, keeps what
# it measured; a TERM or INT to the script stops the running stage and closes the summary). Read the tar with
# `tar -xf gpu_check.tar` (a later copy of a name replaces an earlier one).
#
# Dry run on a CPU machine (the GPU-only parts skip; the chosen presets run on CPU):
#   BENCH_DEVICE=cpu FULL_CONFIG=tiny SMALL_CONFIG=tiny BENCH_EXTRA=--quick OUT=/tmp/gpu_check bash bench/gpu_check.sh
# (with PYTHON=path/to/python where python3 is not the one that has the project's packages)
#
# Before calling the device tool, here, in the repo root (git ignores .whl/): the GPU image had transformers 5.17
# (no Inkling classes; we need >= 5.23) and no torchao (the quant stage's torchao rows and tests need it; its wheel
# is cp310-abi3, so it installs on the image's Python 3.12), so
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl transformers==5.24.0 torchao==0.18.0
# and the
# self-distilled tiny checkpoint for the e2e stage (distilling it there takes most of that stage; .cache/ is ignored),
# with the project's Python:
#   python -c "import shutil; from bench.e2e import distilled_checkpoint as d; shutil.copytree(d(), '.cache/e2e-tiny')"
# then name .whl and .cache/e2e-tiny in the call's carry. The command: `OUT=$OUT bash bench/gpu_check.sh`, with
# timeout_s 540 (8 minutes and a margin).
set -u

cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT="${OUT:-$REPO/bench/out/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
DEVICE="${BENCH_DEVICE:-cuda}"
FULL_CONFIG="${FULL_CONFIG:-full}"
SMALL_CONFIG="${SMALL_CONFIG:-small}"
EXTRA="${BENCH_EXTRA:-}"
STAGES="${STAGES:-env,graphs,full,e2e,tests,aoti,quant,small}"
BUDGET="${BUDGET:-470}"
WORK="${WORK:-/tmp/inkling_gpu_check}"  # the RESULTS.md entries accumulate here, outside $OUT
SITE="${WHEEL_SITE:-/tmp/inkling_compiled_site}"
E2E_CHECKPOINT="${E2E_CHECKPOINT:-.cache/e2e-tiny}"  # a distilled tiny checkpoint built here and carried (header)
START=$(date +%s)
SUMMARY="$OUT/gpu_check.log"
TAR="$OUT/gpu_check.tar"
export PYTHONUNBUFFERED=1 PY
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # the repo is imported from here: nothing to install
export INKLING_COMPILED_CACHE="${INKLING_COMPILED_CACHE:-/tmp/inkling_compiled_checkpoints}"  # not under $OUT
rm -rf "$WORK" && mkdir -p "$WORK"
ROWS=()

elapsed() { echo $(( $(date +%s) - START )); }
log() { echo "[gpu_check $(elapsed)s] $*" | tee -a "$SUMMARY"; }

bundle() {  # bundle FILE...: append to the tar (from $OUT or $WORK) and drop the $OUT copies
  local f
  for f in "$@"; do
    [ -f "$f" ] || continue
    tar -rf "$TAR" -C "$(dirname "$f")" "$(basename "$f")" && case "$f" in "$OUT"/*) rm -f "$f" ;; esac
  done
}

wanted() { case ",$STAGES," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

stage() {  # stage NAME LIMIT COMMAND...   (LIMIT "rest": whatever is left of the budget)
  local name=$1 limit=$2 rc t0 took left var status
  shift 2
  if ! wanted "$name"; then
    log "stage $name: not in STAGES=$STAGES, skipped"; ROWS+=("$name|-|-|not selected"); return 0
  fi
  var="T_${name^^}"; limit="${!var:-$limit}"
  left=$(( BUDGET - $(elapsed) ))
  if [ "$limit" = rest ] || [ "$limit" -gt "$left" ]; then limit=$left; fi
  if [ "$limit" -lt 5 ]; then
    log "stage $name: SKIPPED, ${left}s left of the ${BUDGET}s budget"; ROWS+=("$name|-|-|no time left"); return 0
  fi
  log "stage $name (limit ${limit}s): $*"
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1 &  # waited for in the background, so a signal reaches the trap
  CURRENT=$name CURRENT_PID=$! CURRENT_LIMIT=$limit CURRENT_T0=$t0
  wait "$CURRENT_PID"
  rc=$?
  CURRENT_PID=""
  took=$(( $(date +%s) - t0 ))
  case $rc in
    124|137) status="TIMED OUT at ${limit}s" ;;
    0) status="ok" ;;
    5) status="no gpu tests selected" ;;
    *) status="exit $rc" ;;
  esac
  grep -q "not available in this build" "$OUT/$name.log" && status="not available in this build"
  log "stage $name: $status after ${took}s"
  { echo "----- tail of $name.log -----"; tail -n 40 "$OUT/$name.log"; echo "-----------------------------"; } \
    >> "$SUMMARY"
  if [ -f "$OUT/bench_$name.json" ]; then
    "$PY" -m bench.records "$OUT/bench_$name.json" 2>&1 | tee -a "$SUMMARY"
  fi
  # writes cut short by the kill (the JSON and image before them are whole)
  rm -f "$OUT/bench_$name.json.tmp" "$OUT/bench_$name.png.tmp"
  ROWS+=("$name|$limit|$took|$status")
  bundle "$OUT/$name.log" "$OUT/bench_$name.json" "$OUT/bench_$name.png" "$WORK/RESULTS.md"
  return 0
}

bench() {  # bench NAME ARGS...: the benchmark on $DEVICE, JSON after every section, entries recorded in $WORK
  local name=$1
  shift
  "$PY" -m bench.run --device "$DEVICE" --json "$OUT/bench_$name.json" --record "$WORK/RESULTS.md" "$@" $EXTRA
}

gpu_tests() {  # gpu_tests PYTEST-ARGS...: exit 5 means no gpu test was selected
  "$PY" -m pytest -m gpu -v -rfE --durations=15 -p no:cacheprovider -o addopts="" "$@"
  local rc=$?
  [ $rc -eq 5 ] && echo "no gpu tests selected by: $*"
  return $rc
}

env_report() {  # the machine first (no imports), then the carried wheels (no registry), then what the stages import
  echo "== machine"; date -u; uname -a; nproc; "$PY" -V
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | head -5
  if compgen -G ".whl/*.whl" > /dev/null; then
    echo "== carried wheels: $(cd .whl && ls ./*.whl | tr '\n' ' ')"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      && touch "$SITE/.complete" || echo "installing the carried wheels failed (the machine's packages stay)"
    [ -f "$SITE/.complete" ] && export PYTHONPATH="$REPO:$SITE${PYTHONPATH#"$REPO"}"
  fi
  echo "== packages as the stages see them (PYTHONPATH=$PYTHONPATH)"
  "$PY" - <<'EOF'
import importlib
import torch
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| available", torch.cuda.is_available(), "|",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
for name in ("triton", "transformers", "safetensors", "huggingface_hub", "pytest", "torchao", "matplotlib",
             "inkling_compiled"):
    try:
        m = importlib.import_module(name)
        print(f"{name:16s} {getattr(m, '__version__', 'ok'):12s} {getattr(m, '__file__', '')}")
    except Exception as e:  # noqa: BLE001
        print(f"{name:16s} MISSING ({type(e).__name__}: {e})")
EOF
}

feature() {  # feature SECTION "WORDS" BENCH-ARGS...: gpu tests named after WORDS and the bench SECTION, if present
  local section=$1 words=$2 files rc found=0
  shift 2
  files=$(grep -rlE "def test_[a-z0-9_]*($(echo "$words" | tr ' ' '|'))" tests --include='*.py')
  if [ -n "$files" ]; then
    # shellcheck disable=SC2086
    gpu_tests -k "$(echo "$words" | sed 's/ / or /g')" $files
    rc=$?
    case $rc in 0) found=1 ;; 5) ;; *) return $rc ;; esac
  fi
  if grep -qE "^    \"$section\": \"" bench/run.py; then
    found=1
    bench "$section" "$@" || return $?
  fi
  [ $found -eq 1 ] || echo "$section (gpu tests named after: $words): not available in this build"
}

closing_table() {
  {
    echo "== stages (limit and time in seconds)"
    printf '%-8s %6s %6s  %s\n' stage limit time status
    for row in "${ROWS[@]}"; do
      IFS='|' read -r n l t s <<< "$row"; printf '%-8s %6s %6s  %s\n' "$n" "$l" "$t" "$s"
    done
  } | tee -a "$SUMMARY"
}

on_signal() {  # the caller cut the whole run: stop the stage, say so; its log and JSON so far stay in $OUT
  if [ -n "$CURRENT_PID" ]; then
    kill -TERM "$CURRENT_PID" 2>/dev/null  # timeout passes it on to the stage's processes
    ROWS+=("$CURRENT|$CURRENT_LIMIT|$(( $(date +%s) - CURRENT_T0 ))|cut by a signal (its log and JSON are in \$OUT)")
  fi
  log "cut by a signal after $(elapsed)s, during stage ${CURRENT:-none}; what it wrote so far stays in $OUT"
  closing_table
  exit 143
}
CURRENT="" CURRENT_PID=""
trap on_signal TERM INT

export -f env_report gpu_tests bench feature
export REPO SITE WORK OUT DEVICE EXTRA

log "OUT=$OUT device=$DEVICE full=$FULL_CONFIG small=$SMALL_CONFIG extra=[$EXTRA] stages=$STAGES budget=${BUDGET}s"
stage env 30 bash -c env_report
[ -f "$SITE/.complete" ] && export PYTHONPATH="$REPO:$SITE${PYTHONPATH#"$REPO"}"
stage graphs 60 bash -c 'gpu_tests -k cuda_graph'  # K = 1 and the whole K = 8 round as one graph per bucket
# Each bench stage names the sections it leaves out: the depths / kcompile sweep is CPU-only, and the packaged and
# quant sections have stages of their own.
NOT_HERE="depths,kcompile,packaged"
stage full 90 bash -c "bench full --config '$FULL_CONFIG' --weights random --skip compile,stock,quant,e2e,$NOT_HERE \
  --context 128 --time-budget 10"
E2E_SOURCE="--distill-steps 100"
[ -d "$E2E_CHECKPOINT" ] && E2E_SOURCE="--e2e-checkpoint $E2E_CHECKPOINT"
stage e2e 80 bash -c "bench e2e --skip compile,latency,$NOT_HERE $E2E_SOURCE --e2e-prompts 2 --e2e-tokens 48"
AOTI="packaged aoti" QUANT="quantiz int8 float8 torchao"  # the feature stages' test words
stage tests 75 bash -c "gpu_tests -k 'not cuda_graph and not ($(echo $AOTI $QUANT | sed 's/ / or /g'))'"
# the packaged round on tiny (AOTInductor compiles are what the stage costs): its gpu test, then the section alone
stage aoti 70 bash -c "feature packaged '$AOTI' --skip compile,latency,kernels,quant,e2e,depths,kcompile \
  --time-budget 8"
stage quant 40 bash -c "feature quant '$QUANT' --config '$FULL_CONFIG' --weights random \
  --skip compile,latency,e2e,$NOT_HERE --with quant --time-budget 8"
stage small rest bash -c "bench small --config '$SMALL_CONFIG' --skip e2e,stock,quant,$NOT_HERE --context 128 \
  --recompile-steps 10 --time-budget 8 --probe-timeout 60"

closing_table
log "done in $(elapsed)s; $OUT holds: $(cd "$OUT" && ls | tr '\n' ' ')(tar: $(tar -tf "$TAR" 2>/dev/null | sort -u \
  | tr '\n' ' '))"
