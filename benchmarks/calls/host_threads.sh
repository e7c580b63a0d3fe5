#!/bin/bash
# Issue #65, session 36 (2 GPUs of one machine, wheels installed): do two one-process trainings on one host slow each
# other down? Phi-3-mini's default (micro 2 x 16, no engine; planned for 79.18 GiB) on both GPUs at once, as it is and
# with OMP_NUM_THREADS=4; then sft's soft-capped attention alone (benchmarks/scored_attention.py) with the host's
# memory sampled every 5 s. Results under $OUT: summary.txt and results.tar.gz.
set -u
work=/tmp/call; mkdir -p "$work"
cat /sys/fs/cgroup/memory.max /proc/meminfo 2>/dev/null | head -3 > "$work/host.txt"; nproc >> "$work/host.txt"
pair() {  # pair NAME [ENV...]: the same sweep on GPU 0 and GPU 1 at once
    local name=$1; shift
    for gpu in 0 1; do
        env CUDA_VISIBLE_DEVICES=$gpu "$@" timeout 200 python3 -m benchmarks.speed_sweep --shape phi3-mini \
            --gpu-memory 79.18 --only z2-default+nods --steps 5 --warmup 2 --run-timeout 180 \
            --out "$work/$name-gpu$gpu" > "$work/$name-gpu$gpu.log" 2>&1 &
    done
    wait
    grep -h "tokens/s" "$work/$name"-gpu*.log | sed "s/^/[$name] /"
}
{
    pair together
    pair together-omp4 OMP_NUM_THREADS=4
    (while sleep 5; do echo "$(date +%T) $(free -m | awk '/Mem:/{print $3}') MiB used; top: $(ps -eo rss,comm --sort=-rss | sed -n 2,4p | tr '\n' ' ')"; done) > "$work/memory.txt" &
    monitor=$!
    CUDA_VISIBLE_DEVICES=0 timeout 250 python3 -m benchmarks.scored_attention --out "$work/scored" --timeout 120 \
        --multiples 0 2048 > "$work/scored.log" 2>&1
    kill $monitor
    tail -4 "$work/scored.log"; tail -3 "$work/memory.txt"
} > "$OUT/summary.txt" 2>&1
tar -czf "$OUT/results.tar.gz" -C "$work" .
cat "$OUT/summary.txt"
