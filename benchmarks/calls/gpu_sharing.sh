#!/bin/bash
# Issue #65, session 36 (2 GPUs of one machine, wheels installed): do the two GPUs of a lent machine slow each other
# down? (Two one-process trainings at once ran at half their speed alone, whatever OMP_NUM_THREADS.) A bf16 matmul
# loop on GPU 0 alone, then on both at once; the GPUs' identity, power limit and topology; then sft's soft-capped
# attention at Gemma-2-9B's widths padded to 2,048 tokens (GPU 0) and unpadded (GPU 1), with time to compile.
set -u
work=/tmp/call; mkdir -p "$work"
mm() {  # mm GPU: bf16 8192^3 matmuls for 8 s, TFLOP/s
    CUDA_VISIBLE_DEVICES=$1 python3 -c "
import time, torch
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16); b = a.clone()
for _ in range(20): a @ b
torch.cuda.synchronize(); start, n = time.time(), 0
while time.time() - start < 8:
    for _ in range(50): a @ b
    torch.cuda.synchronize(); n += 50
print('GPU $1', round(2 * 8192**3 * n / (time.time() - start) / 1e12), 'TFLOP/s')"
}
{
    nvidia-smi --query-gpu=index,name,pci.bus_id,power.limit,clocks.max.sm,uuid --format=csv
    nvidia-smi topo -m | head -4
    echo "alone:"; mm 0
    echo "both at once:"; mm 0 & mm 1 & wait
    for spec in "0 2048" "1 0"; do
        # shellcheck disable=SC2086  # the spec is split into its words on purpose
        set -- $spec
        CUDA_VISIBLE_DEVICES=$1 timeout 400 python3 -m benchmarks.scored_attention --out "$work/scored$2" \
            --timeout 380 --multiples "$2" > "$work/scored$2.log" 2>&1 &
    done
    wait
    tail -3 "$work"/scored*.log
} > "$OUT/summary.txt" 2>&1
tar -czf "$OUT/results.tar.gz" -C "$work" .
cat "$OUT/summary.txt"
