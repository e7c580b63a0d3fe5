#!/bin/bash
# Issue #66 (config.py imports no engine: the engine enters the run's arguments in sft.plan.arguments): the package
# before (7309d18, `git archive 7309d18 sft` carried as .gpu_old/) and after, side by side, on one cell of
# benchmarks/throughput (CELL: the 1B ZeRO-2 cell on one GPU by default; `CELL='8b-2gpu-zero3-sft$'` on two), 8 steps:
# old, new, then new again (the same code's run-to-run noise). Writes $OUT/split.txt and $OUT/split.tar.gz.
set -u
work=/tmp/split; mkdir -p "$work"
cell=${CELL:-'1b-1gpu-zero2-sft$'}
per_run=${PER_RUN:-200}
for arm in old new new2; do
    (( SECONDS + per_run > ${DEADLINE:-560} )) && { echo "[$arm] not started: past the deadline"; continue; }
    if [[ $arm == old ]]; then
        PYTHONPATH=/tmp/site:$PWD/.gpu_old:$PWD SFT_CODE=$PWD/.gpu_old timeout "$per_run" python3 -m benchmarks.throughput \
            --only "$cell" --steps 8 --warmup 3 --out "$work/$arm" > "$work/$arm.log" 2>&1
    else
        timeout "$per_run" python3 -m benchmarks.throughput --only "$cell" --steps 8 --warmup 3 --out "$work/$arm" \
            > "$work/$arm.log" 2>&1
    fi
    echo "[$arm] rc=$? $SECONDS s $(grep -E "exit [0-9]+, .*tokens/s/GPU" "$work/$arm.log" | tail -1)"
done > "$OUT/split.txt" 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$work/gpu.txt"
tar -czf "$OUT/split.tar.gz" -C "$work" .
cat "$OUT/split.txt"
