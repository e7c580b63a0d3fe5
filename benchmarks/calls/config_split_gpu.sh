#!/bin/bash
# Issue #66 (config.py imports no engine: the engine enters the run's arguments in sft.plan.arguments): the package
# before (7309d18, `git archive 7309d18 sft` carried as .gpu_old/) and after, side by side on one GPU, on
# benchmarks/throughput's 1B ZeRO-2 cell (Llama-3.2-1B widths, rows of 4,096 tokens, sft's defaults), 8 steps:
# old, new, then new again (the same code's run-to-run noise). Writes $OUT/split.txt and $OUT/split.tar.gz.
set -u
work=/tmp/split; mkdir -p "$work"
cell='1b-1gpu-zero2-sft$'
for arm in old new new2; do
    (( SECONDS > ${DEADLINE:-480} )) && { echo "[$arm] not started: past the deadline"; continue; }
    if [[ $arm == old ]]; then
        PYTHONPATH=/tmp/site:$PWD/.gpu_old:$PWD SFT_CODE=$PWD/.gpu_old timeout 200 python3 -m benchmarks.throughput \
            --only "$cell" --steps 8 --warmup 3 --out "$work/$arm" > "$work/$arm.log" 2>&1
    else
        timeout 200 python3 -m benchmarks.throughput --only "$cell" --steps 8 --warmup 3 --out "$work/$arm" \
            > "$work/$arm.log" 2>&1
    fi
    echo "[$arm] rc=$? $(grep -E "tokens/s" "$work/$arm.log" | tail -1)"
done > "$OUT/split.txt" 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$work/gpu.txt"
tar -czf "$OUT/split.tar.gz" -C "$work" .
cat "$OUT/split.txt"
