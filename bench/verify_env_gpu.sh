#!/usr/bin/env bash
# Usage (device tool, kind nvidia-h200-x2, carry .whl): bash bench/verify_env_gpu.sh
# .whl/ holds the wheels the image lacks (LLaMA-Factory 0.9.5, DeepSpeed, transformers and what they
# need, fetched with pip download --python-version 3.12) plus jsonschema (see bench/results/verify_env_h200x2.md).
# verify_env on the device machine (nvidia-h200-x2): the stage for real on 2 GPUs, twice (the first
# run also compiles the carried packages' bytecode), then with NCCL_P2P_DISABLE=1, which must fail.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/workflow
O='{"hardware":{"gpus_per_node":2,"processes_per_node":0}}'
run() {  # run JSON LOG NCCLLOG [VAR=value...]: one verify-env, its log, wall time, raw NCCL log
  local json=$1 log=$OUT/$2 nccl=$3; shift 3
  echo "$ $* python -m llmft verify-env --config config/config.yaml --overrides '$O' --out $json" >> $log
  local s=$(date +%s.%N)
  rm -rf /tmp/keep; env "$@" LLMFT_VERIFY_SCRATCH=/tmp/keep python3 -m llmft verify-env --config config/config.yaml --overrides "$O" --out $OUT/$json >> $log 2>&1
  echo "exit $? wall $(python3 -c "print(round($(date +%s.%N)-$s,1))") s" >> $log
  [ -n "$nccl" ] && cat /tmp/keep/verify-*/nccl.*.log > $OUT/$nccl
}
L=verify_env_h200x2.log
{ nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; nvidia-smi topo -m; } > $OUT/$L 2>&1
run verify_env_h200x2_cold.json $L "" NCCL_NVLS_ENABLE=0
echo "--- second run (bytecode already compiled) ---" >> $OUT/$L
run verify_env_h200x2.json $L nccl_h200x2.log NCCL_NVLS_ENABLE=0
run verify_env_h200x2_p2p_off.json verify_env_h200x2_p2p_off.log nccl_h200x2_p2p_off.log NCCL_P2P_DISABLE=1
rm -f $OUT/verify.failed.json
grep -E "FAIL|passed|FAILED|exit|node facts" $OUT/*.log
