#!/usr/bin/env bash
# Session 4, call 1 (kind nvidia-h200, .whl carried), at commit ddad518 (its STREAM_K option was removed
# afterwards): the stream-K variant sweep at the N = 768 shapes (benchmarks/tma_variants.py --stream-k),
# then the TMA-kernel GPU tests.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=/tmp/logs; mkdir -p $LOG
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site nbclient ipykernel nbval ipywidgets tqdm > $LOG/pip.log 2>&1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
t0=$(date +%s)
timeout 300 python3 benchmarks/tma_variants.py --stream-k "$OUT/tma-variants-sk.json" > $LOG/sweep.log 2>&1
grep -v '^{' $LOG/sweep.log | head -40
echo "sweep: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
MPGPT_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -m "sm80" -k "stream_k or every_tma or lean or large_shapes" tests/test_kernels.py 2>&1 | tee $LOG/gpu_tests.log | tail -6
echo "gpu tests: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s4-call1.tgz -C /tmp logs
