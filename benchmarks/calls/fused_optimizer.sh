#!/bin/bash
# Issue #79, item 5 on one GPU (wheels installed into /tmp/site as ../shared/gpu/README.md says). Parts, any of:
# `variants`: benchmarks/adamw8bit_variants.py (the kernel over 2^30 weights, before/now and each part left out);
# `step`: benchmarks/optimizer_step.py over the 1B/4B/8B parameter sets ($SETS, $STEP_S its seconds; torchao's 8-bit
# AdamW, sft's fused step, torch's fused fp32 AdamW; the flat prototype of 2026-12-01 left out); a speed_sweep shape
# (`qwen3-4b`, `8b`): sft's one-GPU default (no DeepSpeed, planned for an H100's 79.18 GiB) with the fused step and
# with torchao's own (`+tao`: SFT_FUSED_ADAMW=0), one after the other in this call. Results under $OUT.
set -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt"
work=/tmp/fused; mkdir -p "$work"
for part in "$@"; do
    (( SECONDS > ${DEADLINE:-540} )) && { echo "[$part] not started: past the deadline"; continue; }
    if [ "$part" = step ]; then
        # shellcheck disable=SC2086  # the sets are words
        timeout "${STEP_S:-300}" python3 -m benchmarks.optimizer_step --no-prototype \
            --sets ${SETS:-llama-3.2-1b qwen3-4b llama-3.1-8b} --out "$OUT/optimizer_step.json" \
            > "$work/step.log" 2>&1
        tail -5 "$work/step.log" | cut -c1-600
        continue
    fi
    if [ "$part" = variants ]; then
        timeout 240 python3 -m benchmarks.adamw8bit_variants --out "$OUT/variants.json" > "$work/variants.log" 2>&1
        grep '^{' "$work/variants.log" | cut -c1-200
        continue
    fi
    CUDA_VISIBLE_DEVICES=0 timeout 330 python3 -m benchmarks.speed_sweep --shape "$part" --gpu-memory 79.18 \
        --only z2-default+nods z2-default+nods+tao --steps 5 --warmup 2 --run-timeout 160 --out "$work/$part" \
        > "$work/$part.log" 2>&1
    grep -E "tokens/s|done in|Error|error" "$work/$part.log" | tail -4 | cut -c1-300 | sed "s/^/[$part] /"
    cp "$work/$part/runs.jsonl" "$OUT/runs_$part.jsonl" 2>/dev/null
done
tar -czf "$OUT/logs.tar.gz" -C "$work" .
