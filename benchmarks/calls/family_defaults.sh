#!/bin/bash
# Issue #65: sft's default (one process, planned for an H100's 79.18 GiB) for each family at its public widths, one
# after another on GPU 0. Usage (on the GPU machine, wheels installed): family_defaults.sh SHAPES, a comma-separated
# list of speed_sweep shapes. Writes $OUT/families.tar.gz and the log's lines.
# One at a time: two one-process trainings on the two GPUs of one lent machine ran at half their speed alone, each
# (call 12 of benchmarks/results/family_speed_h100), while the GPUs' matmuls did not slow each other (call 13).
set -u
work=/tmp/families; mkdir -p "$work"
for shape in ${1//,/ }; do
    (( SECONDS > ${DEADLINE:-400} )) && { echo "[$shape] not started: past the deadline"; continue; }
    CUDA_VISIBLE_DEVICES=0 timeout 290 python3 -m benchmarks.speed_sweep --shape "$shape" --gpu-memory 79.18 \
        --only z2-default+nods --steps 5 --warmup 2 --run-timeout 270 --out "$work/$shape" > "$work/$shape.log" 2>&1
    grep -E "tokens/s|done in|Error|error" "$work/$shape.log" | tail -3 | sed "s/^/[$shape] /"
done > "$OUT/families.txt" 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$work/gpu.txt"
tar -czf "$OUT/families.tar.gz" -C "$work" .
cat "$OUT/families.txt"
