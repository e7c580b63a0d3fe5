#!/bin/bash
# Issue #67's GPU points, one part per device call (wheels installed into /tmp/site as ../shared/gpu/README.md says;
# fla-core's wheel, kept apart, into /tmp/fla-site: a process sees flash-linear-attention only where this script puts
# that folder on its PYTHONPATH). `exact`: each new family's packed row through sft's `auto` backend against eager one
# sample at a time in bf16, and a few plain training steps (benchmarks/architectures.py, 2 layers: one of each kind),
# then Qwen3.5's linear attention: the per-sample torch path (no fla) and fla's varlen kernels over the whole row
# (benchmarks/linear_attention.py). `cli`: each new family's defaults through sft/train.py
# (ZeRO-2, one process, packed rows of 4096 tokens, 10 steps), fla installed. `linear`: both of them for the
# linear-attention families only (after their layers' forward became one per row, not one per sample). Results under
# $OUT.
set -u
part=${1:?exact | cli | linear}
families=(olmo3 smollm3 gemma4 gemma4_moe qwen3_5 qwen3_5_moe)
[ "$part" = linear ] && families=(qwen3_5 qwen3_5_moe)
fla=/tmp/fla-site
mkdir -p /tmp/new "$fla"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$fla" .whl/fla/*.whl || exit
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
with_fla() { PYTHONPATH="$fla:$PYTHONPATH" "$@"; }
case $part in
exact | linear)
    with_fla timeout 280 python3 -m benchmarks.architectures --families "${families[@]}" --variants plain --layers 2 \
        --out /tmp/new/architectures > "$OUT/architectures.log" 2>&1
    linear=(python3 -m benchmarks.linear_attention --out /tmp/new/linear)
    timeout 150 "${linear[@]}" --path per-sample >> "$OUT/linear_attention.log" 2>&1
    with_fla timeout 200 "${linear[@]}" --path varlen >> "$OUT/linear_attention.log" 2>&1
    python3 -m benchmarks.linear_attention --compare --out /tmp/new/linear >> "$OUT/linear_attention.log" 2>&1
    [ "$part" = linear ] && with_fla timeout 200 python3 -m benchmarks.architectures --cli --families \
        "${families[@]}" --layers 2 --steps 10 --out /tmp/new/cli > "$OUT/cli.log" 2>&1
    tar -czf "$OUT/$part.tar.gz" -C /tmp/new . ;;
cli)
    with_fla timeout 560 python3 -m benchmarks.architectures --cli --families "${families[@]}" --layers 2 --steps 10 \
        --out /tmp/new/cli > "$OUT/cli.log" 2>&1
    tar -czf "$OUT/cli.tar.gz" -C /tmp/new . ;;
esac
grep -hE "exactness|plain|linear_attention_|^\| |^[a-z0-9_]+ \{" "$OUT"/*.log | cut -c1-600
