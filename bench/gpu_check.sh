#!/usr/bin/env bash
# The prepared GPU check: `OUT=/some/dir bash bench/gpu_check.sh` (every stage; STAGES=e2e,small for some), each
# stage under its own limit within an 8-minute budget. Stages, outputs, the CPU dry run and what to carry to the
# machine: bench/README.md, "The GPU check".
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
  log "stage $name: $status after ${took}s"
  { echo "----- tail of $name.log -----"; tail -n 40 "$OUT/$name.log"; echo "-----------------------------"; } \
    >> "$SUMMARY"
  if [ -f "$OUT/bench_$name.json" ]; then
    "$PY" -m bench report "$OUT/bench_$name.json" --no-image 2>&1 | head -n 1 | tee -a "$SUMMARY"
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
  "$PY" -m bench run --full --device "$DEVICE" --json "$OUT/bench_$name.json" --record "$WORK/RESULTS.md" "$@" $EXTRA
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

feature() {  # feature SECTION "WORDS" BENCH-ARGS...: the gpu tests named after WORDS, then the bench SECTION
  local section=$1 words=$2 rc
  shift 2
  gpu_tests -k "$(echo "$words" | sed 's/ / or /g')"
  rc=$?
  [ $rc -eq 0 ] || [ $rc -eq 5 ] || return $rc
  bench "$section" "$@"
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
# Each bench stage names the sections it runs (`--full`: every part of them; e2e's ksweep, kcompile and perrow
# parts are CPU-only), and the packaged and quant sections have stages of their own.
stage full 90 bash -c "bench full --config '$FULL_CONFIG' --weights random --only latency --skip stock \
  --context 128 --time-budget 10"
E2E_SOURCE="--e2e-target synthetic --distill-steps 100"
[ -d "$E2E_CHECKPOINT" ] && E2E_SOURCE="--e2e-checkpoint $E2E_CHECKPOINT"
stage e2e 80 bash -c "bench e2e --only e2e $E2E_SOURCE --e2e-prompts 2 --e2e-tokens 48"
AOTI="packaged aoti" QUANT="quantiz int8 float8 torchao"  # the feature stages' test words
stage tests 75 bash -c "gpu_tests -k 'not cuda_graph and not ($(echo $AOTI $QUANT | sed 's/ / or /g'))'"
# the packaged round on tiny (AOTInductor compiles are what the stage costs): its gpu test, then the section alone
stage aoti 70 bash -c "feature packaged '$AOTI' --only packaged --time-budget 8"
stage quant 40 bash -c "feature quant '$QUANT' --config '$FULL_CONFIG' --weights random --only quant --with quant \
  --time-budget 8"
stage small rest bash -c "bench small --config '$SMALL_CONFIG' --only compile,latency --skip stock --context 128 \
  --recompile-steps 10 --time-budget 8 --probe-timeout 60"

closing_table
log "done in $(elapsed)s; $OUT holds: $(cd "$OUT" && ls | tr '\n' ' ')(tar: $(tar -tf "$TAR" 2>/dev/null | sort -u \
  | tr '\n' ' '))"
