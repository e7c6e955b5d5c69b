#!/usr/bin/env bash
# DDP/FSDP2 settings on the 2-GPU H200 machine (kind nvidia-h200-x2), after the first scaling run
# (ddp_*.json) showed eager DDP at 1.865x, FSDP2 at 0.82x and compiled DDP at 1.24x:
#   a. eager bf16 with gradient_as_bucket_view (now the default) and FSDP2 with fused AdamW;
#   b. eager bf16, 100 MB buckets;  c. compile, one whole graph;  d. compile, split at 100 MB buckets.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=/tmp/logs; mkdir -p $LOG
export PYTHONPATH=$PWD
t0=$(date +%s)
D="python3 -m mpgpt.distributed bench --out-dir $OUT"
timeout 120 $D --config bf16 --tag ddp-sweep-a-eager-b25 2>&1 | tee $LOG/a.log | grep -E "GPU|x,"
timeout 70 $D --config bf16 --no-fsdp --bucket-mb 100 --tag ddp-sweep-b-eager-b100 2>&1 | tee $LOG/b.log | grep -E "GPU|x,"
timeout 130 $D --config bf16+compile --no-fsdp --whole-graph --tag ddp-sweep-c-compile-whole 2>&1 | tee $LOG/c.log | grep -E "GPU|x,"
timeout 130 $D --config bf16+compile --no-fsdp --bucket-mb 100 --tag ddp-sweep-d-compile-b100 2>&1 | tee $LOG/d.log | grep -E "GPU|x,"
echo "sweep: $(( $(date +%s) - t0 )) s"
tar czf "$OUT/sweep_logs.tgz" -C /tmp logs
