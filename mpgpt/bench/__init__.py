"""Benchmarks that print a table and write a JSON result with its environment (mpgpt.results).

    python -m mpgpt.bench train     # GPT-2 small training throughput across precisions (training.py)
    python -m mpgpt.bench kernels   # Triton matmul against cuBLAS, compute capability >= 8.0 (kernels.py)
    python -m mpgpt.bench ddp       # 1 vs N GPUs, DDP and FSDP2 (ddp.py)
    python -m mpgpt.bench ddp-by-hand  # mpgpt.ddp_by_hand's three variants against DDP (ddp_by_hand.py)
    python -m mpgpt.bench fp8       # fp8 GEMMs, Fp8Linear against bf16, accumulation; sm_89+ (fp8.py)
    python -m mpgpt.bench optim16   # one AdamW step at GPT-2 small: 16-bit variants vs torch fused (optim16.py)

Every result records the GPU, driver, CUDA, torch and triton versions, the date, the command and the
code commit, and goes to ``--out-dir`` (default: the current folder), never into the package. The
records the book shows ship with the package (mpgpt.results.load_record).
"""
from mpgpt.bench.training import TRAIN_CONFIGS, SyntheticTokens, bench_train, make_trainer

__all__ = ["TRAIN_CONFIGS", "SyntheticTokens", "bench_train", "make_trainer"]
