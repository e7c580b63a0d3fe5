export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /tmp/pip.log 2>&1 && export PYTHONPATH=/tmp/site:$PWD || exit
mkdir -p $OUT/q $OUT/l
timeout 330 python3 -m benchmarks.long_context_1gpu --parts rows --longest qwen3-4b:12 --factors 1.0,1.1 --steps 3 --out $OUT/q > $OUT/q/driver.log 2>&1; echo "rc=$?" >> $OUT/q/driver.log
timeout 190 python3 -m benchmarks.long_context_1gpu --parts rows --longest llama-3b:12 --factors 1.1 --steps 2 --out $OUT/l > $OUT/l/driver.log 2>&1; echo "rc=$?" >> $OUT/l/driver.log
cd /tmp/long_context_1gpu && tar czf $OUT/logs.tgz *.log *.yaml */metrics.jsonl 2>/dev/null; ls -laR $OUT
