#!/bin/bash
# Issue #79 on one GPU: flash-linear-attention's Gated DeltaNet kernels trained under Triton 3.7.1 (fla issue #640:
# wrong gradients below it on Hopper), brought beside the image's torch 2.11 / Triton 3.6, and Gemma 4's attention
# kernels. Carry `.tri` (benchmarks/calls/pack_triton.sh) and run with the NCCL variables of ../shared/gpu/README.md
# set: `triton371.sh PART...`. Three Python paths: $site (the image's missing packages), $fla (fla-core) and $tri
# (Triton 3.7.1, first on the path where used). Parts:
#   check      benchmarks/triton_check.py under 3.7.1 and under 3.6: torch.compile, flex_attention, Liger vs eager
#   linear     benchmarks/linear_attention.py (Qwen3.5 text widths, 4 layers, rows of 8,192, --grads): fla varlen
#              under 3.7.1, the per-sample and batched torch paths under 3.6 without fla; the table
#   varlen     its fla run alone
#   cli        sft's defaults through sft/train.py (benchmarks/architectures.py --cli, $LAYERS layers, rows of 4,096,
#              planned for and capped at 79.18 GiB): Qwen3.5 and Qwen3.5-MoE with fla under 3.7.1, then Qwen3.5,
#              Llama and Qwen3.5-MoE on the torch path under 3.6 ($FAMILIES, $TORCH_FAMILIES: others; ENGINE_AUTO=1:
#              the engine sft's plan picks instead of ds_configs/zero2.json; $CLI_S: each half's timeout, 240 s)
#   gputest    tests/test_gpu.py under 3.6 (its output in test_gpu.txt; $GPUTEST_K: pytest's -k)
#   compiled   $COMPILE_FAMILIES (gemma4 gemma4_moe) eager against compiled layers in-process (2 layers)
#   compiledcli  Gemma 4 and Llama --cli with `compile_decoder_layers: true`
#   moecompile $MOE_COMPILE (gemma4_moe glm4_moe) --cli --engine-auto, each with sft's defaults then with
#              `compile_decoder_layers: true`, one after the other ($CLI_S each; $MOE_VARIANTS: only some; fla
#              under 3.7.1 for qwen3_5*)
#   wide       benchmarks/wide_heads.py: Gemma 4's full (512) and sliding (256) layers' kernels over packed rows
#   gemma      Gemma 4 and Gemma 4 MoE through sft's `auto` attention against eager one sample at a time (2 layers),
#              then Gemma 4's defaults (--cli, $LAYERS layers) with `auto` (per layer) and with sdpa ($GEMMA_ATTN),
#              and Llama
#   profile    benchmarks/profile_step.py --shape $SHAPE (gemma4) at $LAYERS layers, capped at 79.18 GiB: variants
#              $VARIANTS (sft sft_compile), one step under torch.profiler each; fla under 3.7.1 for qwen3_5*
#   dense      --cli: $DENSE (olmo3 smollm3 gemma3 llama) under 3.6
#   moe        --cli --engine-auto: $MOE (gemma4_moe qwen3_moe gpt_oss glm4_moe llama) under 3.6, then
#              qwen3_5_moe with fla under 3.7.1
#   moefla     that qwen3_5_moe run alone
#   liger      Liger's Gemma 4 and Qwen3.5 patches against plain bf16, eager and compiled, in-process (2 layers)
#   ligercli   Gemma 4's defaults (--cli) with and without `use_liger_kernel: true`, and Llama
# Each part's result files go straight under $OUT (a call cut by its time limit still returns them); logs and the rest
# are tarred at the end.
set -u
site=/tmp/site tri=/tmp/tri37 fla=/tmp/fla-site work=/tmp/t37
mkdir -p "$site" "$tri" "$fla" "$work"
tar -xJf .tri/site312.tar.xz -C "$site" && tar -xJf .tri/triton371.tar.xz -C "$tri" || exit
python3 -m pip install -q --no-index --no-deps --no-compile --target "$fla" .tri/fla/*.whl || exit
old=$(python3 -c "import triton, os; print(os.path.dirname(triton.__file__))")
cp -r "$old/backends/nvidia/bin" "$tri/triton/backends/nvidia/"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
t36() { PYTHONPATH="$site:$PWD" "$@"; }
t37() { PYTHONPATH="$tri:$fla:$site:$PWD" "$@"; }
# `for_family FAMILY CMD...`: Qwen3.5's families with fla under 3.7.1, the rest under the image's 3.6
for_family() { if [[ $1 == qwen3_5* ]]; then t37 "${@:2}"; else t36 "${@:2}"; fi; }
late() { (( SECONDS > ${DEADLINE:-540} )) && { echo "[$1] not started: past the deadline"; return 0; }; return 1; }
linear=(python3 -m benchmarks.linear_attention --grads --out "$work/linear")
cli=(python3 -m benchmarks.architectures --cli --layers "${LAYERS:-8}" --steps 8 --gpu-memory 79.18 ${ENGINE_AUTO:+--engine-auto})
read -ra with_fla <<< "${FAMILIES:-qwen3_5 qwen3_5_moe}"
read -ra without <<< "${TORCH_FAMILIES:-qwen3_5 llama qwen3_5_moe}"
for part in "$@"; do
    late "$part" && continue
    case $part in
    check)
        t37 timeout 150 python3 -m benchmarks.triton_check --out "$OUT/triton_check_371.json" > "$work/check37.log" 2>&1
        t36 timeout 150 python3 -m benchmarks.triton_check --out "$OUT/triton_check_360.json" > "$work/check36.log" 2>&1
        grep -h "^[a-z_]* {" "$work"/check3*.log | cut -c1-400 ;;
    linear | varlen)
        t37 timeout "${VARLEN_S:-300}" "${linear[@]}" --path varlen >> "$work/linear.log" 2>&1 || echo "varlen rc $?"
        if [ "$part" = linear ]; then
            late per-sample || t36 timeout 120 "${linear[@]}" --path per-sample >> "$work/linear.log" 2>&1
            late batched || t36 timeout 120 "${linear[@]}" --path batched >> "$work/linear.log" 2>&1
        fi
        t36 python3 -m benchmarks.linear_attention --compare --out "$work/linear" > "$OUT/linear_attention.md" 2>&1
        grep -E "^gradients|^linear_attention_|Error" "$work/linear.log" | cut -c1-500 ;;
    cli)
        t37 timeout "${CLI_S:-240}" "${cli[@]}" --families "${with_fla[@]}" --out "$OUT/cli_fla" --work "$work/fla" \
            > "$work/cli_fla.log" 2>&1
        late cli-torch || t36 timeout "${CLI_S:-240}" "${cli[@]}" --families "${without[@]}" \
            --out "$OUT/cli_torch" > "$work/cli_torch.log" 2>&1
        grep -hE "^[a-z0-9_]+ \{" "$work"/cli_*.log | cut -c1-700 ;;
    gemma)
        t36 timeout 150 python3 -m benchmarks.architectures --families gemma4 gemma4_moe --variants plain --layers 2 \
            --steps 3 --out "$OUT/gemma_exact" > "$work/gemma_exact.log" 2>&1
        grep -hE "exactness" "$work/gemma_exact.log" | cut -c1-400
        read -ra attns <<< "${GEMMA_ATTN:-auto sdpa}"
        for attn in "${attns[@]}"; do
            late "gemma-$attn" || t36 timeout 150 "${cli[@]}" --families gemma4 --attn "$attn" \
                --out "$OUT/cli_gemma_$attn" > "$work/cli_gemma_$attn.log" 2>&1
        done
        late llama || t36 timeout 100 "${cli[@]}" --families llama --out "$OUT/cli_llama" > "$work/cli_llama.log" 2>&1
        grep -hE "^[a-z0-9_]+ \{" "$work"/cli_gemma_*.log "$work"/cli_llama.log | cut -c1-500 ;;
    profile)
        shape=${SHAPE:-gemma4}
        read -ra variants <<< "${VARIANTS:-sft sft_compile}"
        for_family "$shape" timeout 400 python3 -m benchmarks.profile_step --shape "$shape" --layers "${LAYERS:-8}" \
            --gpu-memory 79.18 --only "${variants[@]}" --out "$work/profile_$shape" > "$work/profile.log" 2>&1
        cp "$work/profile_$shape/profile.md" "$OUT/profile_$shape.md"
        sed -n 1,12p "$OUT/profile_$shape.md"; grep -E "exit [1-9]" "$work/profile.log" ;;
    dense)
        read -ra dense <<< "${DENSE:-olmo3 smollm3 gemma3 llama}"
        t36 timeout 420 "${cli[@]}" --families "${dense[@]}" --out "$OUT/cli_dense" > "$work/cli_dense.log" 2>&1
        grep -hE "^[a-z0-9_]+ \{" "$work/cli_dense.log" | cut -c1-600 ;;
    moefla)
        t37 timeout 200 "${cli[@]}" --engine-auto --families qwen3_5_moe --out "$OUT/cli_moe_fla" \
            > "$work/cli_moe_fla.log" 2>&1
        grep -hE "^[a-z0-9_]+ \{" "$work"/cli_moe_fla.log | cut -c1-600 ;;
    liger)
        t36 timeout 240 python3 -m benchmarks.architectures --families gemma4 qwen3_5 --variants plain liger \
            plain_compiled liger_compiled --layers 2 --steps 6 --skip-exactness --out "$OUT/liger" \
            > "$work/liger.log" 2>&1
        grep -hE "^(gemma4|qwen3_5)[a-z0-9_]* (plain|liger)" "$work/liger.log" | cut -c1-400 ;;
    ligercli)
        t36 timeout 100 "${cli[@]}" --families gemma4 llama --out "$OUT/cli_gemma_default" \
            > "$work/cli_gemma_default.log" 2>&1
        late gemma-liger || t36 timeout 100 "${cli[@]}" --families gemma4 --set "use_liger_kernel: true" \
            --out "$OUT/cli_gemma_liger" > "$work/cli_gemma_liger.log" 2>&1
        grep -hE "^[a-z0-9_]+ \{" "$work"/cli_gemma_default.log "$work"/cli_gemma_liger.log | cut -c1-500 ;;
    moe)
        read -ra moe <<< "${MOE:-gemma4_moe qwen3_moe gpt_oss glm4_moe llama}"
        t36 timeout 420 "${cli[@]}" --engine-auto --families "${moe[@]}" --out "$OUT/cli_moe" > "$work/cli_moe.log" 2>&1
        late moe-fla || t37 timeout 200 "${cli[@]}" --engine-auto --families qwen3_5_moe --out "$OUT/cli_moe_fla" \
            > "$work/cli_moe_fla.log" 2>&1
        grep -hE "^[a-z0-9_]+ \{" "$work"/cli_moe*.log | cut -c1-600 ;;
    gputest)
        t36 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py ${GPUTEST_K:+-k "$GPUTEST_K"} \
            > "$OUT/test_gpu.txt" 2>&1
        tail -5 "$OUT/test_gpu.txt" ;;
    compiled)
        read -ra compiled <<< "${COMPILE_FAMILIES:-gemma4 gemma4_moe}"
        t36 timeout 200 python3 -m benchmarks.architectures --families "${compiled[@]}" --variants plain plain_compiled \
            --layers 2 --steps 6 --skip-exactness --out "$OUT/compile_exact" > "$work/compile_exact.log" 2>&1
        grep -hE "^gemma[a-z0-9_]* plain" "$work/compile_exact.log" | cut -c1-400 ;;
    compiledcli)
        t36 timeout 200 "${cli[@]}" --families gemma4 llama --set "compile_decoder_layers: true" \
            --out "$OUT/cli_gemma_compiled" > "$work/cli_gemma_compiled.log" 2>&1
        grep -hE "^[a-z0-9_]+ \{" "$work/cli_gemma_compiled.log" | cut -c1-500 ;;
    moecompile)
        read -ra mc <<< "${MOE_COMPILE:-gemma4_moe glm4_moe}"
        for fam in "${mc[@]}"; do
            for variant in ${MOE_VARIANTS:-default compiled}; do
                extra=(); [[ $variant == compiled ]] && extra=(--set "compile_decoder_layers: true")
                late "$fam-$variant" || for_family "$fam" timeout "${CLI_S:-240}" "${cli[@]}" --engine-auto \
                    --families "$fam" "${extra[@]}" --out "$OUT/cli_${fam}_$variant" --work "$work/$fam-$variant" \
                    > "$work/cli_${fam}_$variant.log" 2>&1
            done
        done
        grep -hE "^[a-z0-9_]+ \{" "$work"/cli_*_default.log "$work"/cli_*_compiled.log | cut -c1-600 ;;
    wide)
        t36 timeout 200 python3 -m benchmarks.wide_heads --out "$OUT/wide_heads.json" > "$work/wide.log" 2>&1
        grep -E "^(256|512) " "$work/wide.log" | cut -c1-300 ;;
    esac
done
tar -czf "$OUT/triton371.tar.gz" -C "$work" --exclude='model-*' --exclude='*.safetensors' .
