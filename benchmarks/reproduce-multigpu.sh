#!/usr/bin/env bash
# Re-measure the multi-GPU record on one host with two or more CUDA GPUs:
#   ddp-h200x2   python -m mpgpt.bench ddp: GPT-2 small, bf16, batch 12 x 1024 per GPU, on 1 GPU and
#                on N GPUs with DDP and with FSDP2 (tokens/s, speedup, scaling efficiency)
#   ddp-by-hand  python -m mpgpt.bench ddp-by-hand: GPT-2 small, bf16, the three hand-built variants of
#                chapter 8 against DDP and against no averaging (ms per step, exposed communication)
#
# Needs only the package installed from the repository (`pip install .`) and the GPUs.
#   bash benchmarks/reproduce-multigpu.sh [OUT_DIR] [NPROC]   # OUT_DIR: ./results; NPROC: every visible GPU
# The record used 2 GPUs (NPROC=2). Writes into OUT_DIR: the JSON result (ddp_<machine>_<date>.json),
# its log, the commands run (commands.txt), nvidia-smi, nvidia-smi topo -m and the NCCL settings of
# the environment. PYTHON picks the interpreter (default: python).
set -euo pipefail

out="${1:-./results}"
py="${PYTHON:-python}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
gpus="$("$py" -c 'import torch; print(torch.cuda.device_count())')"  # what torch sees (CUDA_VISIBLE_DEVICES)
nproc="${2:-$gpus}"

if ! [ "$nproc" -ge 2 ] 2>/dev/null || [ "$nproc" -gt "$gpus" ]; then
    echo "reproduce-multigpu.sh: asked for ${nproc:-?} GPUs, torch sees $gpus; this needs 2 or more" >&2
    exit 1
fi
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
echo "results go to $out; $nproc of $gpus GPUs (code commit recorded: ${MPGPT_COMMIT:-none; the mpgpt version is recorded instead})"
nvidia-smi | tee "$out/nvidia-smi.txt"
nvidia-smi topo -m | tee "$out/nvidia-smi-topo.txt"
# NCCL's choices (NVLink SHARP, multicast) change the all-reduce; keep what this environment sets.
env | grep -E '^(NCCL_|NVSHMEM_|TORCH_SYMM_MEM_|TORCH_NCCL_|CUDA_VISIBLE_DEVICES=)' | sort > "$out/nccl-env.txt" || true
"$py" -c "import mpgpt, torch; print(f'mpgpt {mpgpt.__version__} from {mpgpt.__file__}; torch {torch.__version__}; {torch.cuda.device_count()} GPUs')"

# Chapter 8: 1 GPU against NPROC GPUs, DDP and FSDP2 (record ddp-h200x2).
run ddp "$py" -m mpgpt.bench ddp --config bf16 --nproc "$nproc" --out-dir "$out"
# Chapter 8: the hand-built data parallelism (mpgpt.ddp_by_hand) against DDP, per-step time, NPROC GPUs.
run ddp-by-hand "$py" -m mpgpt.bench ddp-by-hand --device cuda --nproc "$nproc" --out-dir "$out"

echo
echo "done; results in $out:"
ls -1 "$out"
