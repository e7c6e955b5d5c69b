#!/usr/bin/env bash
# Session 4, calls 2 and 3 (kind nvidia-h200, .whl carried), at commits eb33c5b and 7ffc3cd (the STREAM_K option,
# removed afterwards): where stream-K time goes (benchmarks/sk_probe.py; call 3 with --wide).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=/tmp/logs; mkdir -p $LOG
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site nbclient ipykernel nbval ipywidgets tqdm > $LOG/pip.log 2>&1
export PYTHONPATH=/tmp/site:$PWD
t0=$(date +%s)
timeout 200 python3 benchmarks/sk_probe.py --wide "$OUT/sk-probe-wide.json" 2>&1 | tee $LOG/probe.log | grep -v Warn
echo "probe: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
[ -n "${TESTS:-}" ] && MPGPT_AUTOTUNE=0 timeout 300 python3 -m pytest -q -p no:cacheprovider -m "sm80" -k "stream_k or every_tma or lean or large_shapes" tests/test_kernels.py 2>&1 | tee $LOG/gpu_tests.log | tail -6
echo "gpu tests: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s4-call3.tgz -C /tmp logs
