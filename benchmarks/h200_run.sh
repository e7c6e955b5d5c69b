#!/usr/bin/env bash
# One call on the H200: GPU tests, then the training-throughput ladder (issue 6).
# Usage on the device machine (repository root): bash benchmarks/h200_run.sh   (writes under $OUT)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
start=$(date +%s)
MPGPT_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or sm80" \
  tests/test_kernels.py tests/test_scaling.py tests/test_train.py tests/test_model.py tests/test_precision.py \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -25
echo "gpu tests: $(( $(date +%s) - start )) s"
start=$(date +%s)
timeout ${BENCH_TIMEOUT:-330} python3 -m mpgpt.bench train \
  --configs fp32,tf32,fp16,fp16-gradscaler,bf16,bf16+compile,fp16+compile,bf16+compile+triton \
  --warmup 10 --steps 30 --max-batch-config bf16 --profile bf16+compile \
  --real-run-config bf16+compile --real-steps 150 --out-dir "$OUT" 2>&1 | tee "$OUT/bench_train.log" | grep -v "^ \{2,\}\|^-\{5,\}" | tail -40
echo "bench: $(( $(date +%s) - start )) s"
