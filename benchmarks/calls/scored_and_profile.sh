#!/bin/bash
# Issue #65, session 36 (2 GPUs of one machine, wheels installed as ../shared/gpu/README.md says): on GPU 0, sft's
# soft-capped attention per micro batch unpadded and padded (benchmarks/scored_attention.py), then Gemma-2-9B's default
# (one process, planned for 79.18 GiB) with torch.compile's recompilations logged and py-spy's stacks every 60 s; on
# GPU 1, where Gemma-3-4B's default and Phi-3-mini's micro 2 and 4 (planned for the H200: micro 4 does not fit
# an H100) spend a step (benchmarks/profile_step.py's summary).
# Results under $OUT: lane0.txt, lane1.txt and results.tar.gz.
set -u
work=/tmp/call; mkdir -p "$work"
spy() {  # spy SECONDS LOG: py-spy's stacks of every sft process every 60 s for SECONDS
    for _ in $(seq 1 $(( $1 / 60 ))); do
        sleep 60
        for pid in $(pgrep -f "sft/train.py|sft.train"); do
            echo "=== $(date +%T) pid $pid"; /tmp/site/bin/py-spy dump --pid "$pid" 2>&1 | head -60
        done >> "$2"
    done
}
lane0() {
    CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m benchmarks.scored_attention --out "$work/scored" --timeout 110 \
        > "$work/scored.log" 2>&1
    tail -5 "$work/scored.log"
    spy 300 "$work/gemma2.spy" &
    CUDA_VISIBLE_DEVICES=0 TORCH_LOGS=recompiles timeout 330 python3 -m benchmarks.speed_sweep --shape gemma2-9b \
        --gpu-memory 79.18 --only z2-default+nods --steps 4 --warmup 1 --run-timeout 300 --out "$work/gemma2-9b" \
        > "$work/gemma2.log" 2>&1
    grep -E "tokens/s|done in" "$work/gemma2.log" | tail -3
}
lane1() {
    CUDA_VISIBLE_DEVICES=1 timeout 250 python3 -m benchmarks.speed_sweep --shape gemma3-4b --gpu-memory 79.18 \
        --steps 5 --warmup 2 --run-timeout 220 --only z2-default+nods+prof --out "$work/gemma3-4b" \
        > "$work/gemma3-4b.log" 2>&1
    CUDA_VISIBLE_DEVICES=1 timeout 320 python3 -m benchmarks.speed_sweep --shape phi3-mini \
        --steps 5 --warmup 2 --run-timeout 150 --only z2-m2-none-bf16+nods+prof z2-m4-none-bf16+nods+prof \
        --out "$work/phi3-mini" > "$work/phi3-mini.log" 2>&1
    grep -h "tokens/s" "$work"/gemma3-4b.log "$work"/phi3-mini.log
}
lane0 > "$OUT/lane0.txt" 2>&1 &
lane1 > "$OUT/lane1.txt" 2>&1 &
wait
nvidia-smi --query-gpu=name,memory.total --format=csv > "$work/gpu.txt"
tar -czf "$OUT/results.tar.gz" -C "$work" .
cat "$OUT"/lane*.txt
