#!/bin/bash
# Issue #79, Qwen3.5's Gated DeltaNet on fla's kernels under the GPU image's own Triton 3.6: fla-core 0.6 refuses its
# gated `chunk_bwd_dqkwg` on Hopper there (fla issue #640), and `sft.model.fla_hopper` registers a torch form of it.
# Carry `.whl` (wide_heads.sh's header: the wheels that import there) and `.fla` (fla_core-0.6.0-py3-none-any.whl,
# `pip download --no-deps fla-core==0.6.0 -d .fla`); run `fla_hopper.sh PART...` with the NCCL variables of
# ../shared/gpu/README.md set. fla is on the path only where a part says so.
# Parts:
#   linear   benchmarks/linear_attention.py --grads (Qwen3.5 text widths, 4 layers, rows of 8,192): fla's varlen
#            kernels with sft's backward piece against each sample alone, then the batched torch path without fla
#   varlen   its fla run alone
#   cli      Qwen3.5 (fla) and Llama through sft/train.py (benchmarks/architectures.py --cli --engine-auto, $LAYERS
#            layers, rows of 4,096, planned for and capped at 79.18 GiB); $FLA_FAMILIES for more (qwen3_5_moe)
#   activations  benchmarks/linear_activations.py: what a Gated DeltaNet layer keeps per token on each path (fla
#            with the piece, batched, per sample) against the memory plan's term
# Result files go straight under $OUT; logs are tarred at the end.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla .fla/*.whl || exit
work=/tmp/flah/$(date +%s); mkdir -p "$work"  # a new one per call: a warm machine keeps /tmp
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import triton; print('triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
plain() { PYTHONPATH="/tmp/site:$PWD" "$@"; }
fla() { PYTHONPATH="/tmp/fla:/tmp/site:$PWD" "$@"; }
late() { (( SECONDS > ${DEADLINE:-500} )) && { echo "[$1] not started: past the deadline"; return 0; }; return 1; }
linear=(python3 -m benchmarks.linear_attention --grads --out "$OUT/linear")
cli=(python3 -m benchmarks.architectures --cli --layers "${LAYERS:-8}" --steps 8 --gpu-memory 79.18 --engine-auto)
for part in "$@"; do
    late "$part" && continue
    case $part in
    linear | varlen)
        fla timeout "${VARLEN_S:-300}" "${linear[@]}" --path varlen > "$work/linear.log" 2>&1 || echo "varlen rc $?"
        [ "$part" = varlen ] || late batched || plain timeout 150 "${linear[@]}" --path batched >> "$work/linear.log" 2>&1
        plain python3 -m benchmarks.linear_attention --compare --out "$OUT/linear" > "$OUT/linear_attention.md" 2>&1
        grep -E "^gradients|^linear_attention_|Error|FLA Backend" "$work/linear.log" | cut -c1-600 ;;
    cli)
        # Llama beside them in the same process tree (fla on the path changes nothing for it)
        fla timeout "${CLI_S:-300}" "${cli[@]}" --families qwen3_5 ${FLA_FAMILIES:-} llama --out "$OUT/cli" \
            --work "$work/cli" > "$work/cli.log" 2>&1
        grep -hE "^[a-z0-9_]+ \{" "$work/cli.log" | cut -c1-600
        grep -rh "Linear attention" "$work/cli" | head -1 | cut -c1-500 ;;
    activations)
        fla timeout 200 python3 -m benchmarks.linear_activations --out "$OUT" > "$work/activations.log" 2>&1
        grep -E "measured|Error" "$work/activations.log" | cut -c1-300 ;;
    esac
done
tar -czf "$OUT/fla_hopper_logs.tar.gz" -C "$work" --exclude='model-*' --exclude='*.safetensors' .
