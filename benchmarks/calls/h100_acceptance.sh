#!/bin/bash
# Issue #65's H100 acceptance matrix, one part per device call (each under 10 minutes on 1 x H100 80GB; wheels
# installed as ../shared/gpu/README.md says): `qwen3` sft's default for Qwen3-4B widths beside the hand-tuned TRL run
# (DeepSpeed ZeRO-3, the largest micro batch that fits with fp32 AdamW, checkpointing, Liger), `vlm` the Qwen2.5-VL-7B
# widths benchmark beside TRL tuned (length-grouped, micro 4 x 18, no checkpointing, sdpa), `families-a`/`families-b`
# each family's default (one process, planned for 79.18 GiB). Results under $OUT (a tarball where there are more files
# than a call brings back). `profile`: where Gemma-3-4B's default and Phi-3-mini's micro 2 and 4 spend their steps (a
# profiled step each: session 35 measured them at 0.45-0.49 of their estimates, Phi-3's micro 2 at half its micro 4).
# `gemma2`: Gemma-2-9B's default, which made no step in 4 minutes in session 35, with torch.compile's recompilations
# logged (its soft-capped attention is flex_attention, compiled, over rows whose packed length varies).
set -u
part=${1:?qwen3 | vlm | families-a | families-b | profile | gemma2}
mkdir -p /tmp/acc/vlm
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
case $part in
qwen3)
    python3 -m benchmarks.speed_sweep --shape qwen3-4b --gpu-memory 79.18 --steps 6 --warmup 2 --run-timeout 280 \
        --only z2-default z3-m4-ckpt-bf16+adamw+ds --out /tmp/acc/qwen3 > "$OUT/qwen3.log" 2>&1
    tar -czf "$OUT/qwen3.tar.gz" -C /tmp/acc qwen3 ;;
vlm)
    python3 -m benchmarks.vlm --out /tmp/acc/vlm --work /tmp/vlmwork --gpu-memory 79.18 --steps 10 --warmup 3 \
        --records 1200 --trl-batch 4 --trl-accumulation 18 --run-timeout 270 --only sft trl > "$OUT/vlm.log" 2>&1
    tar -czf "$OUT/vlm.tar.gz" -C /tmp/acc vlm ;;
families-a | families-b)
    [ "$part" = families-a ] && shapes="gemma3-4b phi3-mini olmo2-7b" || shapes="qwen2.5-7b qwen3-8b mistral-7b"
    for shape in $shapes; do
        timeout 190 python3 -m benchmarks.speed_sweep --shape "$shape" --gpu-memory 79.18 --only z2-default+nods \
            --steps 5 --warmup 2 --run-timeout 180 --out "/tmp/acc/$shape" > "/tmp/acc/$shape.log" 2>&1
        grep -E "tokens/s" "/tmp/acc/$shape.log" | sed "s/^/[$shape] /"
    done > "$OUT/$part.txt"
    tar -czf "$OUT/$part.tar.gz" -C /tmp/acc . ;;
profile)
    python3 -m benchmarks.speed_sweep --shape gemma3-4b --gpu-memory 79.18 --steps 5 --warmup 2 --run-timeout 200 \
        --only z2-default+nods+prof --out /tmp/acc/gemma3-4b > /tmp/acc/gemma3-4b.log 2>&1
    python3 -m benchmarks.speed_sweep --shape phi3-mini --gpu-memory 79.18 --steps 5 --warmup 2 --run-timeout 200 \
        --only z2-m2-none-bf16+nods+prof z2-m4-none-bf16+nods+prof --out /tmp/acc/phi3-mini > /tmp/acc/phi3-mini.log 2>&1
    grep -h "tokens/s" /tmp/acc/*.log > "$OUT/profile.txt"
    tar -czf "$OUT/profile.tar.gz" -C /tmp/acc . ;;
gemma2)
    TORCH_LOGS=recompiles python3 -m benchmarks.speed_sweep --shape gemma2-9b --gpu-memory 79.18 --steps 4 \
        --warmup 1 --run-timeout 420 --only z2-default+nods --out /tmp/acc/gemma2-9b > "$OUT/gemma2.log" 2>&1
    tar -czf "$OUT/gemma2.tar.gz" -C /tmp/acc gemma2-9b ;;
esac
