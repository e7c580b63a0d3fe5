#!/bin/bash
# Issue #79, Gemma 4's 512-wide heads on one GPU: `efficient_varlen` (torch's memory-efficient kernel) against
# `wide_varlen` (sft.model.wide_heads: batched matrix products over the samples). Carry `.whl` and run
# `wide_heads.sh PART...` with the NCCL variables of ../shared/gpu/README.md set. transformers 5.25 needs a newer
# huggingface-hub than the image's, and it needs httpx2: the wheels that imported there on 2026-12-07 (call 24),
#   ../shared/gpu/make_wheels.sh --extra torchao==0.18.0 --extra huggingface-hub==2.4.0 --extra tokenizers==0.23.3 \
#     --extra safetensors==0.8.0 --extra regex==2026.12.2 --extra hf-xet==1.8.0 --extra httpx2==2.17.0 \
#     --extra httpcore2==2.17.0 --extra click==8.5.1 --extra truststore --extra anyio==4.16.0 --extra h11==0.16.0 \
#     --extra idna==3.21 --extra sniffio==1.3.1
# Parts:
#   wide     benchmarks/wide_heads.py, the full layers' kernels on 2 and on 8 rows of 4,096 tokens
#   cli      Gemma 4's defaults through sft/train.py (benchmarks/architectures.py --cli --engine-auto, $LAYERS layers,
#            rows of 4,096, planned for and capped at 79.18 GiB) with SFT_WIDE_HEADS=matmul, then Llama, then
#            Gemma 4 with =efficient
#   runs     each of $RUNS through sft/train.py as `cli` runs them: `label=family[,field=value...]` (recipe fields
#            over the defaults), e.g. RUNS="gemma4_fp8=gemma4,fp8=true llama_bf16=llama,fp8=false"; each within
#            $RUN_TIMEOUT s (220: Gemma 4 with fp8: true needed more, its first step 149 s of compiling, call 26) or
#            what is left before $LIMIT s (570), whichever is less
#   trl      the TRL baseline (benchmarks/architectures.py --cli --trl) of each of $TRL_FAMILIES (gemma4 llama), the
#            families' runs otherwise as `cli` runs them
#   stepprof benchmarks/profile_step.py: where $SHAPE's (gemma4) step goes under sft's one-GPU plan ($LAYERS layers)
#   compnan  benchmarks/calls/compile_nan.py: where Gemma 4 MoE's compiled layers turn non-finite ($LAYERS layers,
#            per experts implementation in $EXPERTS)
#   gputest  tests/test_gpu.py -k "$TESTS" (default `wide`: both kernels against fp32 one sample at a time)
#   profile  benchmarks/wide_heads_profile.py: wide_varlen's kernels under torch.profiler (2 rows)
# With `.fla` carried as well (fla_hopper.sh's header), fla-core is on the path of every part.
# Result files go straight under $OUT; logs are tarred at the end.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit
export PYTHONPATH=/tmp/site:$PWD
if compgen -G ".fla/*.whl" > /dev/null; then  # fla carried (fla_hopper.sh's header): on the path of every part
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla .fla/*.whl || exit
    export PYTHONPATH=/tmp/fla:$PYTHONPATH
fi
python3 -c "import transformers, trl, deepspeed, datasets" || echo "the carried packages do not import"
work=/tmp/wide/$(date +%s); mkdir -p "$work"  # a new one per call: a warm machine keeps /tmp
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
late() { (( SECONDS > ${DEADLINE:-500} )) && { echo "[$1] not started: past the deadline"; return 0; }; return 1; }
# a run's limit: $RUN_TIMEOUT, or what is left before $LIMIT s (the call's own limit less the tar), whichever is less
left() { local rest=$(( ${LIMIT:-570} - SECONDS )); (( rest < $1 )) && echo "$rest" || echo "$1"; }
cli=(python3 -m benchmarks.architectures --cli --layers "${LAYERS:-8}" --steps 8 --gpu-memory 79.18 --engine-auto)
for part in "$@"; do
    late "$part" && continue
    case $part in
    wide)
        for rows in 2 8; do
            timeout 120 python3 -m benchmarks.wide_heads --rows "$rows" --kernels ${KERNELS:-efficient_varlen wide_varlen \
                wide_varlen_eager per_sample_sdpa varlen} --out "$OUT/wide_heads_rows$rows.json" > "$work/wide$rows.log" 2>&1
            grep -E "^(256|512) " "$work/wide$rows.log" | cut -c1-300
        done ;;
    cli)
        for run in gemma4-matmul llama-efficient gemma4-efficient; do  # the kernel sft has taken so far last
            late "$run" || SFT_WIDE_HEADS=${run#*-} timeout 200 "${cli[@]}" --families "${run%-*}" \
                --out "$OUT/cli_$run" --work "$work/$run" > "$work/cli_$run.log" 2>&1
        done
        grep -hE "^[a-z0-9_]+ \{" "$work"/cli_*.log | cut -c1-500 ;;
    runs)
        for run in ${RUNS:-}; do
            label=${run%%=*} spec=${run#*=}; family=${spec%%,*} sets=()
            [[ $spec == *,* ]] && for kv in $(tr , ' ' <<< "${spec#*,}"); do sets+=("${kv%%=*}: ${kv#*=}"); done
            late "$label" || timeout "$(left "${RUN_TIMEOUT:-220}")" "${cli[@]}" --families "$family" --set "${sets[@]}" --out "$OUT/cli_$label" \
                --work "$work/$label" > "$work/cli_$label.log" 2>&1
            grep -hE "^[a-z0-9_]+ \{" "$work/cli_$label.log" | cut -c1-300
        done ;;
    trl)
        # without fla: on Hopper under this image's Triton fla refuses its backward (issue #640), so a TRL user
        # runs transformers' torch path (padded rows: `trl_setting`)
        late trl || PYTHONPATH=/tmp/site:$PWD timeout "${RUN_TIMEOUT:-400}" "${cli[@]}" --trl --families ${TRL_FAMILIES:-gemma4 llama} \
            --out "$OUT/cli_trl" --work "$work/trl" > "$work/cli_trl.log" 2>&1
        grep -hE "^[a-z0-9_]+ \{" "$work/cli_trl.log" | cut -c1-400 ;;
    stepprof)
        timeout 240 python3 -m benchmarks.profile_step --shape "${SHAPE:-gemma4}" --layers "${LAYERS:-8}" --only sft_nods \
            --gpu-memory 79.18 --out "$OUT/stepprof" > "$work/stepprof.log" 2>&1
        cat "$OUT/stepprof/profile.md" 2>/dev/null | head -40 ;;
    profile)
        timeout 100 python3 -m benchmarks.wide_heads_profile --out "$OUT/wide_heads_profile.txt" > "$work/profile.log" 2>&1
        grep -E "out_dtype|Self CPU time|Self CUDA time|^bmm" "$OUT/wide_heads_profile.txt" ;;
    compnan)
        timeout "${RUN_TIMEOUT:-300}" python3 benchmarks/calls/compile_nan.py gemma4_moe "${LAYERS:-8}" ${EXPERTS:-} \
            > "$work/compnan.log" 2>&1
        grep -E "^[a-z_]+ \{" "$work/compnan.log" | cut -c1-1200; tail -3 "$work/compnan.log" ;;
    gputest)
        timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "${TESTS:-wide}" > "$OUT/test_gpu.txt" 2>&1
        tail -3 "$OUT/test_gpu.txt" ;;
    esac
done
tar -czf "$OUT/wide_heads_logs.tar.gz" -C "$work" --exclude='model-*' --exclude='*.safetensors' .
