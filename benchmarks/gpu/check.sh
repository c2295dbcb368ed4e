#!/usr/bin/env bash
# One GPU window, one command (issue 27). On the device machine, from the repo root:
#     device run, carry [".whl"], timeout_s 480, command: bash benchmarks/gpu/check.sh
# after `bash benchmarks/gpu/wheels.sh` here has made .whl/ (pydantic and the rest the GPU image lacks).
#
# The pieces, in order, each under `timeout` and all under DEADLINE_S (default 420 s, the ~7 minutes a
# window can count on): environment; the GPU-only tests; correctness on CUDA (125M GPT,
# benchmarks/gpu/correctness.py); throughput at 350M and 1.3B (plain, zerodp 2, zerodp 3, FSDP2) as
# TFLOP/s and ratios to plain; the 2.7B checkpointed peak against zerodp estimate's prediction
# (benchmarks/results/gpu-check-2.7B-ckpt-world1.json); the 6.7B row as rank 0 of 64 fake ranks, the
# worker alone; DeepSpeed ZeRO-2 at 350M if time is left. Each result is a JSON line appended to
# $OUT/summary.jsonl as it ends, so a run killed halfway still reports what finished; the table is
# printed last. Without a CUDA device (a CPU machine) the CPU-possible pieces run (environment, and
# correctness at tiny size) and the others are marked "no CUDA device". It exits 0 when zerodp
# imported and no piece that ran failed. $OUT comes back from the device machine: it holds at most 7 files.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}  # where the carried wheels are installed
OUT=${OUT:-$PWD/gpu-check-out}
DEADLINE_S=${DEADLINE_S:-420}
mkdir -p "$OUT"
summary=$OUT/summary.jsonl log=$OUT/check.log
: >"$summary"; : >"$log"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
export PYTHONUNBUFFERED=1
t0=$SECONDS failed=0 cuda=0 zerodp=0 zerodp_error="environment piece did not finish"
pieces=(benchmarks/gpu/pieces.py)

# The GPU-only tests (skipped on a CPU host), by id: tests/test_gpu_check.py keeps this list whole.
GPU_TESTS=(
    tests/test_device.py::test_accelerator_side_stream_copy_and_timing_events
    tests/test_offload_param.py::test_stage3_offload_param_on_cuda_holds_only_gathered_windows_on_the_device
    tests/test_host_sync.py::test_monitor_reads_a_gpu_steps_values_only_once_their_copy_has_landed
    tests/test_offload.py::test_offloaded_bf16_step_on_cuda_allocates_no_device_temporary_of_a_shard
)

# Carried wheels (benchmarks/gpu/wheels.sh) go to a folder of their own, on the path before the image's
# packages; only where zerodp's config library is missing, so a machine that has it keeps its own.
if ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import pydantic" 2>/dev/null; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .whl/*.whl >>"$log" 2>&1; then
        export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
        echo "installed the carried wheels: $(cd .whl && echo *.whl)" | tee -a "$log"
    else
        echo "installing the carried wheels failed (see $log)" | tee -a "$log"
    fi
else
    echo "wheels: $(ls .whl/*.whl 2>/dev/null | wc -l) carried; not installed (pydantic imports, or none carried)" \
        | tee -a "$log"
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}  # zerodp from this tree, not an installed one

# piece NAME CAP_S NEEDS CMD...: run CMD under `timeout` (its cap, or what is left of the deadline),
# its output to the log, then one line for it in the summary. NEEDS: env (always runs), cpu (needs
# zerodp), gpu (needs zerodp and a CUDA device). CMD may read $PIECE_BUDGET (its limit in seconds).
piece() {
    local name=$1 cap=$2 needs=$3; shift 3
    local left=$((DEADLINE_S - (SECONDS - t0) - 10))
    local why=""
    [[ $needs != env && $zerodp != 1 ]] && why="not run: import zerodp fails ($zerodp_error)"
    [[ -z $why && $needs == gpu && $cuda != 1 ]] && why="no CUDA device"
    [[ -z $why ]] && ((left < 20)) && why="not run: $((left + 10)) s left of the ${DEADLINE_S} s deadline"
    if [[ -n $why ]]; then
        "$PY" "${pieces[@]}" record --summary "$summary" --piece "$name" --status skipped --result "$why" --rc 0
        return
    fi
    local budget=$((cap < left ? cap : left)) start=$SECONDS rc
    echo "=== $name (limit ${budget} s)" >>"$log"
    PIECE_BUDGET=$budget timeout -k 10 "$budget" "$@" >"$work/piece.log" 2>&1 </dev/null
    rc=$?
    cat "$work/piece.log" >>"$log"
    if [[ $needs == env ]]; then cat "$work/piece.log"; else grep -E '^(ok|FAIL|skipped) ' "$work/piece.log"; fi
    if ((rc != 0)); then
        failed=$((failed + 1))
        echo "--- $name: exit $rc; its last lines:"; tail -n 15 "$work/piece.log"
    fi
    "$PY" "${pieces[@]}" record --summary "$summary" --piece "$name" --rc "$rc" --seconds $((SECONDS - start)) \
        --limit "$budget" --result "$(tail -n 1 "$work/piece.log" | cut -c1-200)" --detail "$work/detail.json"
    rm -f "$work/detail.json"
}

piece environment 120 env "$PY" "${pieces[@]}" env --state "$work/state" --detail "$work/detail.json"
[[ -f $work/state ]] && source "$work/state"
piece "GPU-only tests" 120 gpu "$PY" -m pytest -q -p no:cacheprovider "${GPU_TESTS[@]}"
# (CORRECTNESS_CAP_S: the suite's CPU run of this script, on a loaded 2-core machine, gives it more)
piece correctness "${CORRECTNESS_CAP_S:-150}" cpu "$PY" benchmarks/gpu/correctness.py --summary "$summary"
bench() {  # bench NAME CAP COMMAND [pieces options] -- [zerodp bench options]
    local name=$1 cap=$2 cmd=$3; shift 3
    piece "$name" "$cap" gpu "$PY" "${pieces[@]}" "$cmd" --summary "$summary" "$@"
}
bench "throughput 350M" 100 throughput --json "$OUT/bench-350M.json" -- --model 350M --micro-batch 8 --seq 1024
bench "throughput 1.3B" 120 throughput --json "$OUT/bench-1.3B.json" -- --model 1.3B --micro-batch 8 --seq 1024
bench "peak 2.7B checkpointed" 90 peak --modes zerodp2 --json "$OUT/peak-2.7B.json" -- \
    --model 2.7B --micro-batch 8 --seq 1024 --checkpointing --steps 3 --warmup 2
bench "6.7B fake 64" 60 fake --modes zerodp2 --fake-world 64 --json "$OUT/fake64-6.7B.json" -- \
    --model 6.7B --micro-batch 4 --seq 1024 --checkpointing --steps 3 --warmup 2
bench "deepspeed 350M" 90 throughput --modes deepspeed2 --plain-from "$OUT/bench-350M.json" \
    --json "$OUT/bench-deepspeed.json" -- --model 350M --micro-batch 8 --seq 1024

echo
"$PY" "${pieces[@]}" table --summary "$summary" | tee -a "$log"
echo "$((SECONDS - t0)) s of a ${DEADLINE_S} s deadline; $failed piece(s) failed; log: $log"
((zerodp == 1)) || echo "nothing was checked: zerodp did not import here ($zerodp_error)"
((failed == 0 && zerodp == 1))
