#!/usr/bin/env bash
# One call on the 2-GPU H200 machine (kind nvidia-h200-x2), run from the repository root with .whl carried:
#   1. DDP/FSDP2 scaling on 1 vs 2 GPUs (eager bf16, then bf16 + compile, DDP only), alone on the machine;
#   2. then, side by side: the distributed tests (gloo and NCCL) and chapters 2-8 executed on the GPUs.
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
timeout 130 python3 -m mpgpt.distributed bench --config bf16 --out-dir "$OUT" --tag ddp 2>&1 | tee "$LOG/ddp.log" | tail -7
timeout 170 python3 -m mpgpt.distributed bench --config bf16+compile --no-fsdp --out-dir "$OUT" --tag ddp-compile 2>&1 \
  | tee "$LOG/ddp_compile.log" | tail -5
echo "scaling bench: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
mkdir -p $PWD/nbgpu && cp notebooks/*.ipynb $PWD/nbgpu/
# Chapters 2-8 at once, split over the two GPUs (one kernel each; their timings are not benchmarks).
i=0
for nb in $PWD/nbgpu/0[2-8]*.ipynb; do
  ( CUDA_VISIBLE_DEVICES=$((i % 2)) timeout 230 python3 scripts/run_notebook.py "$nb" > "$nb.log" 2>&1; echo "exit $?" >> "$nb.log" ) &
  i=$((i + 1))
done
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py 2>&1 | tee "$LOG/dist_tests.log" | tail -4
wait
echo "tests + notebooks: $(( $(date +%s) - t0 )) s"
for f in $PWD/nbgpu/*.log; do echo "== $f"; grep -v "^\s*$" "$f" | tail -2; done | tee "$LOG/notebooks_gpu.log"
cp -r nbgpu $LOG/ && tar czf "$OUT/logs_and_gpu_notebooks.tgz" -C /tmp logs
