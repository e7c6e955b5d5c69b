#!/usr/bin/env bash
# The training-ladder rows not yet measured, split over the two GPUs of the nvidia-h200-x2 machine
# (each GPU measures its rows alone; the two processes share only the host), and the kernel probe.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=/tmp/logs; mkdir -p $LOG
export PYTHONPATH=$PWD
t0=$(date +%s)
B="python3 -m mpgpt.bench train --warmup 10 --steps 30 --out-dir $OUT"
( CUDA_VISIBLE_DEVICES=0 timeout 290 $B --configs bf16-nobias,bf16+checkpointing,bf16+cudnn-attn,bf16+compile,bf16+compile+cudnn-attn,bf16+compile+cudagraphs \
    --tag train-gpu0 > $LOG/ladder0.log 2>&1 ) &
( CUDA_VISIBLE_DEVICES=1 timeout 60 python3 benchmarks/kernel_probe.py $OUT/kernel_probe.json > $LOG/probe.log 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 230 $B --configs bf16+compile-nobias,bf16+compile+chunked-loss,fp16-gradscaler+compile,bf16+compile+all-nobias \
    --tag train-gpu1 > $LOG/ladder1.log 2>&1 ) &
wait
echo "ladder: $(( $(date +%s) - t0 )) s"
grep -h "tok/s\|rror\|memory" $LOG/ladder0.log $LOG/ladder1.log
cat $LOG/probe.log | tail -12
tar czf "$OUT/ladder_logs.tgz" -C /tmp logs
