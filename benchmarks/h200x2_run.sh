#!/usr/bin/env bash
# One call on the 2-GPU H200 machine (kind nvidia-h200-x2), run from the repository root with .whl carried:
#   1. distributed tests (gloo and NCCL), 2. DDP/FSDP scaling on 1 vs 2 GPUs,
#   3. in parallel: the training ladder on GPU 0 and every chapter notebook executed on GPU 1.
# NCCL's environment (NVLink multicast off) is left exactly as the machine sets it.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG=/tmp/logs; mkdir -p $LOG  # logs and executed notebooks come back as one tarball (8 files at most)
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site nbclient ipykernel nbval ipywidgets tqdm \
  > "$LOG/pip.log" 2>&1 || tail -3 "$LOG/pip.log"
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=index,name,driver_version --format=csv | tee "$LOG/nvidia-smi.txt"
env | grep -E "^(NCCL|TORCH_SYMM|NVSHMEM)" | tee -a "$LOG/nvidia-smi.txt"
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py 2>&1 | tee "$LOG/dist_tests.log" | tail -4
echo "distributed tests: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 120 python3 -m mpgpt.distributed bench --config bf16 --out-dir "$OUT" --tag ddp 2>&1 | tee "$LOG/ddp.log" | tail -7
timeout 120 python3 -m mpgpt.distributed bench --config bf16+compile --no-fsdp --out-dir "$OUT" --tag ddp-compile 2>&1 \
  | tee "$LOG/ddp_compile.log" | tail -5
echo "scaling bench: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
mkdir -p $PWD/nbgpu && cp notebooks/*.ipynb $PWD/nbgpu/
# All chapter notebooks at once on GPU 1 (one kernel each; their timings are not benchmarks).
for nb in $PWD/nbgpu/0[2-8]*.ipynb; do
  ( CUDA_VISIBLE_DEVICES=1 timeout 280 python3 scripts/run_notebook.py "$nb" > "$nb.log" 2>&1; echo "exit $?" >> "$nb.log" ) &
done
CUDA_VISIBLE_DEVICES=0 timeout 260 python3 -m mpgpt.bench train \
  --configs fp16,fp16-gradscaler,bf16,bf16-nobias,bf16+checkpointing,fp16+compile,bf16+compile,bf16+compile-nobias,bf16+compile+cudagraphs \
  --warmup 10 --steps 30 --out-dir "$OUT" --tag train 2>&1 | tee "$LOG/bench_train.log" | grep "|" | tail -12
wait
echo "ladder + notebooks: $(( $(date +%s) - t0 )) s"
for f in $PWD/nbgpu/*.log; do echo "== $f"; tail -3 "$f"; done | tee "$LOG/notebooks_gpu.log"
cp -r nbgpu $LOG/ && tar czf "$OUT/logs_and_gpu_notebooks.tgz" -C /tmp logs
