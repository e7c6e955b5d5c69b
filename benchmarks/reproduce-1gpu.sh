#!/usr/bin/env bash
# Re-measure the single-GPU records on one CUDA GPU of compute capability 8.0 or newer:
#   kernels-h200          python -m mpgpt.bench kernels
#   train-h200            python -m mpgpt.bench train (the full ladder, largest batch, profile, real run)
#   scaler-overhead-h200  python benchmarks/scaler_overhead.py --device cuda --preset gpt2
#   train-h200-fused-ce   python -m mpgpt.bench train --configs bf16+compile,bf16+compile+fused-ce
#   (train-peers-h200 needs llm.c and nanoGPT beside the package; its record keeps the command)
#   the compiled ladder   python -m mpgpt.bench train --configs ladder (chapter 7's rungs in one run)
#   lab-gpu-h200          python benchmarks/lab_gpu_check.py
#   optim16-h200, optim16-training-h200   python -m mpgpt.bench optim16 (--parts training)
#   fp8-h200, fp8-training-h200           python -m mpgpt.bench fp8 (needs sm_89+: skipped below that)
#   fp8-cast-h200                         benchmarks/fp8_cast_probe.py (sm_89+)
#
# Needs only the package installed from the repository (`pip install .`) and a GPU.
#   bash benchmarks/reproduce-1gpu.sh [OUT_DIR]      # OUT_DIR defaults to ./results
# Writes into OUT_DIR: one JSON result per benchmark (<kind>_<machine>_<date>[_<tag>].json),
# a log per benchmark, the commands run (commands.txt), nvidia-smi and nvidia-smi topo -m.
# The kernel autotuning and the largest-batch sweep take most of the time.
# PYTHON picks the interpreter (default: python).
set -euo pipefail

out="${1:-./results}"
py="${PYTHON:-python}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$out"

# The code commit each result records: the checkout this script sits in, unless MPGPT_COMMIT is set.
# (It describes the installed package only if that was installed from this checkout as it is now.)
if [ -z "${MPGPT_COMMIT:-}" ] && commit="$(git -C "$here" rev-parse HEAD 2>/dev/null)"; then
    export MPGPT_COMMIT="$commit"
fi

run() {  # run NAME CMD...: print the command, keep it in commands.txt, log its output to NAME.log
    local name="$1"
    shift
    printf '\n+ %s\n' "$*" | tee -a "$out/commands.txt"
    "$@" 2>&1 | tee "$out/$name.log"
}

printf '# %s %s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$0" "$*" >> "$out/commands.txt"
echo "results go to $out (code commit recorded: ${MPGPT_COMMIT:-none; the mpgpt version is recorded instead})"
nvidia-smi | tee "$out/nvidia-smi.txt"
nvidia-smi topo -m > "$out/nvidia-smi-topo.txt"
"$py" - <<'EOF'
import sys

import torch

import mpgpt

if not torch.cuda.is_available():
    sys.exit("reproduce-1gpu.sh: torch sees no CUDA GPU")
major, minor = torch.cuda.get_device_capability(0)
if (major, minor) < (8, 0):
    sys.exit(f"reproduce-1gpu.sh: {torch.cuda.get_device_name(0)} is sm_{major}{minor}; the bf16 Triton kernels need sm_80+")
print(f"mpgpt {mpgpt.__version__} from {mpgpt.__file__}; torch {torch.__version__}; {torch.cuda.get_device_name(0)} (sm_{major}{minor})")
EOF

# Chapter 6: Triton matmul kernels against cuBLAS, fused bias+GELU, TritonLinear (record kernels-h200).
run kernels "$py" -m mpgpt.bench kernels --out-dir "$out"

# Chapters 3, 5 and 7: the training ladder, GPT-2 small at batch 12 x 1024 (record train-h200).
run train "$py" -m mpgpt.bench train \
    --configs fp32,tf32,bf16,fp16,fp16-gradscaler,bf16+checkpointing,bf16+triton,bf16+compile,fp16+compile,fp16-gradscaler+compile,bf16+compile+cudnn-attn,bf16+compile+cudagraphs,bf16+compile+chunked-loss,bf16+compile-nobias,bf16+compile+triton \
    --warmup 10 --steps 30 --max-batch-config bf16 --profile bf16+compile \
    --real-run-config bf16+compile --real-steps 150 --out-dir "$out"

# Chapter 5: DynamicLossScaler against torch.amp.GradScaler, GPT-2 small, fp16 (record scaler-overhead-h200).
run scaler-overhead "$py" "$here/scaler_overhead.py" --device cuda --preset gpt2 --out-dir "$out"

# Chapter 7: the fused classifier against the compiled step, in one run (record train-h200-fused-ce).
run train-fused-ce "$py" -m mpgpt.bench train --configs bf16+compile,bf16+compile+fused-ce \
    --warmup 10 --steps 30 --tag fused-ce --out-dir "$out"

# Chapter 7: the compiled ladder rung by rung, the bias-free last rung, fp16 beside bf16 where it can
# go (mpgpt.bench.training.LADDER: thirteen rows; rows like these took 18-30 s each on an H200,
# compile included, in the peer records). The peer records add
# llm.c and nanoGPT to such a run (their harness stays outside the repository; each record keeps it).
run train-ladder "$py" -m mpgpt.bench train --configs ladder --warmup 15 --steps 40 --tag ladder --out-dir "$out"

# The NaN lab on a GPU: hidden syncs, the grader compiled, the scripts' times (record lab-gpu-h200).
run lab-gpu "$py" "$here/lab_gpu_check.py" --out-dir "$out"

# Chapter 10: one optimizer step per variant, then GPT-2 small trained with the record's variants
# (records optim16-h200 and optim16-training-h200; the training takes about 4 minutes on an H200).
run optim16 "$py" -m mpgpt.bench optim16 --out-dir "$out"
run optim16-training "$py" -m mpgpt.bench optim16 --parts training --train-steps 1000 \
    --variants fp32-master,bf16,bf16-sr,bf16-kahan,all-bf16-sr --out-dir "$out"
# Every variant for 3000 steps (record optim16-long-h200, recorded three runs at a time; one after
# another, as here, it takes about 15 minutes on an H200).
run optim16-long "$py" -m mpgpt.bench optim16 --parts training --train-steps 3000 --tag long --out-dir "$out"

# Chapter 9: fp8 GEMMs, the layer map, accumulation, and the 2000-step runs (records fp8-h200 and
# fp8-training-h200). Only on a GPU with fp8 tensor cores (sm_89+); the bench says so otherwise.
if "$py" -c "import sys, mpgpt.runtime as r; sys.exit(0 if r.current().fp8 else 1)"; then
  run fp8 "$py" -m mpgpt.bench fp8 --parts gemm,crossover,accumulation --out-dir "$out"
  run fp8-training "$py" -m mpgpt.bench fp8 --parts training --train-runs bf16,bf16_seed1,fp8_lm_head,fp8_all_linear --out-dir "$out"
  run fp8-cast "$py" "$here/fp8_cast_probe.py" --out-dir "$out"
fi

echo
echo "done; results in $out:"
ls -1 "$out"
