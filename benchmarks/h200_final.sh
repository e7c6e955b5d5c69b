#!/usr/bin/env bash
# Short final call on one H200 (with .whl carried): the fp16/bf16 rows again after the scaler's
# no-sync change, then every chapter notebook executed on the GPU, all at once.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=/tmp/logs; mkdir -p $LOG
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site nbclient ipykernel nbval ipywidgets tqdm > $LOG/pip.log 2>&1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
timeout 95 python3 -m mpgpt.bench train --configs fp16,fp16-gradscaler,bf16,fp16+compile,bf16+compile \
  --warmup 10 --steps 30 --out-dir "$OUT" --tag train 2>&1 | tee $LOG/bench_train.log | grep "|"
echo "ladder: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
mkdir -p nbgpu && cp notebooks/*.ipynb nbgpu/
for nb in nbgpu/0[2-8]*.ipynb; do
  ( timeout 115 python3 scripts/run_notebook.py "$nb" > "$nb.log" 2>&1; echo "exit $?" >> "$nb.log" ) &
done
wait
echo "notebooks: $(( $(date +%s) - t0 )) s"
for f in nbgpu/*.log; do echo "== $f"; grep -v "^\s*$" "$f" | tail -2; done | tee $LOG/notebooks_gpu.log
cp -r nbgpu $LOG/ && tar czf "$OUT/logs_and_gpu_notebooks.tgz" -C /tmp logs
