#!/usr/bin/env bash
# Issue #39 on one GPU: both one-process commands (no launcher) train the demo under the demo's ZeRO-2 config in bf16
# with sft's GPU defaults (Liger on for Llama); their logs are searched for warnings, MPI discovery and tracebacks.
# Run from anywhere with $OUT set: bash benchmarks/one_process.sh  (results: benchmarks/results/one_process)
cd "$(dirname "$0")/.." || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt"
common=(--config recipes/demo.yaml --max_steps 40 --logging_steps 10 --eval_strategy no --save_steps 20 --bf16 true
        --dtype bfloat16)
python sft/train.py "${common[@]}" --output_dir /tmp/python > "$OUT/python_sft_train.log" 2>&1
echo "python sft/train.py rc=$?" >> "$OUT/summary.txt"
python -m sft train "${common[@]}" --output_dir /tmp/sft_train > "$OUT/sft_train.log" 2>&1
echo "sft train rc=$?" >> "$OUT/summary.txt"
python sft/train.py "${common[@]}" --output_dir /tmp/python >> "$OUT/python_sft_train.log" 2>&1
echo "python sft/train.py again (a finished run: exit 2 expected) rc=$?" >> "$OUT/summary.txt"
for f in python_sft_train sft_train; do
  {
    echo "== $f"
    echo "warning lines: $(grep -ciE 'warning:' "$OUT/$f.log")"
    grep -iE 'warning:' "$OUT/$f.log" | cut -c1-200
    echo "mpi4py lines: $(grep -c mpi4py "$OUT/$f.log")"
    echo "Traceback lines: $(grep -c Traceback "$OUT/$f.log")"
    grep -E "Liger|Parallel sizes|Starting the DeepSpeed|train_runtime|Saved the model|sft: error" "$OUT/$f.log" | cut -c1-240
    grep "'loss'" "$OUT/$f.log" | sed -n '1p;$p' | cut -c1-120
  } >> "$OUT/summary.txt"
done
cat "$OUT/summary.txt"
