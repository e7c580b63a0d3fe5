#!/bin/bash
# Issue #65: sft's default (one process, planned for an H100's 79.18 GiB) for each family at its public widths, two
# lanes of sweeps on two GPUs at once. Usage (on the GPU machine, wheels installed): family_defaults.sh LANE_A LANE_B
# where each lane is a comma-separated list of speed_sweep shapes. Writes $OUT/families.tar.gz and each lane's log.
set -u
work=/tmp/families; mkdir -p "$work"
lane() {  # lane GPU SHAPES
    local gpu=$1; shift
    for shape in ${1//,/ }; do
        (( SECONDS > ${DEADLINE:-400} )) && { echo "[$shape] not started: past the deadline"; continue; }
        CUDA_VISIBLE_DEVICES=$gpu timeout 290 python3 -m benchmarks.speed_sweep --shape "$shape" --gpu-memory 79.18 \
            --only z2-default+nods --steps 5 --warmup 2 --run-timeout 270 --out "$work/$shape" > "$work/$shape.log" 2>&1
        grep -E "tokens/s|done in|Error|error" "$work/$shape.log" | tail -3 | sed "s/^/[$shape] /"
    done
}
lane 0 "$1" > "$OUT/lane0.txt" 2>&1 &
lane 1 "$2" > "$OUT/lane1.txt" 2>&1 &
wait
nvidia-smi --query-gpu=name,memory.total --format=csv > "$work/gpu.txt"
tar -czf "$OUT/families.tar.gz" -C "$work" .
cat "$OUT"/lane*.txt
