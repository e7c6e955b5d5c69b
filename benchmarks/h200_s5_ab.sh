#!/usr/bin/env bash
# Session 5, call 9 (kind nvidia-h200): why bf16+triton trained slower in call 8 (262k against
# 315k tok/s in session 3): the eager rows with the warp-specialised kernel off (MPGPT_WS=0) and
# with session 3's policy (MPGPT_WS=0 MPGPT_TRITON_TMA=fwd); then chapter 6 under nbval.
source benchmarks/device_env.sh
t0=$(date +%s)
for env in "" "MPGPT_WS=0" "MPGPT_WS=0 MPGPT_TRITON_TMA=fwd"; do
  echo "== ${env:-defaults}"
  env $env timeout 60 python3 -m mpgpt.bench train --configs bf16+triton --warmup 10 --steps 30 --out-dir "$OUT" \
    --tag "train-triton-ab$(echo $env | tr -cd 'A-Z0-9' | head -c 20)" 2>&1 | grep "tok/s\|rror"
done
echo "train a/b: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider --nbval-lax notebooks/06_triton_kernel.ipynb 2>&1 | tee $LOG/nb06.log | tail -3
echo "notebook 06: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s5-call9.tgz -C /tmp logs
