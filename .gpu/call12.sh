export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /tmp/pip.log 2>&1 && export PYTHONPATH=/tmp/site:$PWD || exit
timeout 290 python3 -m benchmarks.long_context_1gpu --parts longest --longest llama-8b:0 --steps 3 --out $OUT > $OUT/driver.log 2>&1; echo "rc=$?" >> $OUT/driver.log
cd /tmp/long_context_1gpu && tar czf $OUT/logs.tgz *.log *.yaml */metrics.jsonl 2>/dev/null; ls -la $OUT
