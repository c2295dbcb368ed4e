#!/usr/bin/env bash
# One of issue 5's H100 rows, run on the device machine from the repo root:
#   device run, carry [".whl"], command: bash benchmarks/gpu/rows.sh 350M
# Installs the carried wheels (benchmarks/gpu/wheels.sh), runs `zerodp bench` from the source tree
# and writes the JSON and the log under $OUT. Rows: 350M, 1.3B, 2.7B-ckpt, 6.7B-fake64, phases.
set -uo pipefail
row=${1:?usage: rows.sh 350M|1.3B|2.7B-ckpt|6.7B-fake64|phases}
out=${OUT:-out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
bench() { python3 -m zerodp.cli bench --repeats "${REPEATS:-1}" "$@" --json "$out/h100-$row.json" 2>&1 | tee "$out/h100-$row.log"; }
case $row in
    350M) bench --model 350M --micro-batch 8 --seq 1024 ;;
    1.3B) bench --model 1.3B --micro-batch 8 --seq 1024 ;;
    2.7B-ckpt) bench --model 2.7B --micro-batch 8 --seq 1024 --checkpointing ;;
    6.7B-fake64) bench --model 6.7B --micro-batch 4 --seq 1024 --checkpointing --modes zerodp2 \
                       --fake-world 64 --steps 3 --warmup 2 ;;
    phases) python3 benchmarks/step_phases.py --model 1.3B --micro-batch 8 --seq 1024 --dtype bf16 \
                --modes plain zerodp2 2>&1 | tee "$out/h100-phases.log" ;;
    *) echo "unknown row $row"; exit 2 ;;
esac
