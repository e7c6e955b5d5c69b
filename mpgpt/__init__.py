"""mpgpt: mixed-precision GPT training from scratch — the package every chapter of the course imports.

Map of the package, in layers: each module imports only from the layers above it in this list,
runtime from no other mpgpt module, the layer-1 modules (formats to results, optim16 and ddp_by_hand) from runtime at most.
The reference model imports nothing of the fast path: fast applies it from outside, and recipe and
fp8 reach it only inside a function, since Triton is optional (tests/test_layering.py checks all of
it). Each module's docstring names the chapter that teaches it.

    runtime      what the device can do: capability, memory, Triton; about()      all
    formats      bit-level views of fp32 / fp16 / bf16 / fp8                      chapter 1
    data         character tokenizer, the embedded corpus, loaders                chapter 2
    precision    precision policies, device defaults, fp32 master weights         chapter 3
    scaling      loss scalers written from scratch, and make_scaler               chapters 4, 5
    checkpoint   atomic save and verified load                                    chapter 5
    fused_loss   output layer + cross-entropy in chunks, never the full logits    chapter 7
    optim16      AdamW with weights and moments in 16 bits, stochastic rounding   chapter 10
    ddp_by_hand  data parallelism by hand: per-parameter, buckets, overlap        chapter 8
    results      the benchmark result format; curated records shipped inside      chapters 6-8
    model        GPTConfig and GPT, the fp32 reference model; peak FLOP/s, MFU    chapters 2, 7
    fp8          saturating fp8 casts, scaling recipes, scaled matmul, Fp8Linear  chapter 9
    kernels      Triton matmul kernels, plan(), TritonLinear                      chapter 6
    fast         convert() and the GPT-2 fused kernels, applied from outside       chapters 6, 7
    recipe       recipe names (bf16+compile+...) -> settings; the one table        chapters 3-10
    trainer      TrainConfig, History, Trainer: the step, the loop, checkpoints   chapters 2-5
    distributed  DDP / FSDP2 on top of the trainer, rank-agreed overflow          chapter 8
    train        train() and the `python -m mpgpt.train` command line             chapters 2-5
    bench        `python -m mpgpt.bench train|kernels|ddp`                        chapters 6-8
    plots        figures and widgets the chapters share                           all
    notebook     chapters without Triton: skip the cells that need it             chapter 6
    labs         the NaN lab: hooks that name the first inf/NaN, broken scripts   lab after 5
    grade        `python -m mpgpt.grade`: the student edition's grader            chapters 1, 5, 6, lab

Names are imported lazily so that `import mpgpt` stays fast and works where Triton is missing.
"""
import importlib
import os

import torch

# Triton reads TRITON_INTERPRET when it decorates a kernel, including its own library helpers
# (tl.cdiv and friends) at `import triton`. Set it as early as possible — on `import mpgpt` — so a
# CPU-only session runs the kernels in the interpreter even if something imports triton later on.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

__version__ = "0.2.0"

_EXPORTS = {
    "GPT": "model", "GPTConfig": "model",
    "CharTokenizer": "data", "TextDataset": "data", "default_corpus": "data", "load_text": "data",
    "StaticLossScaler": "scaling", "DynamicLossScaler": "scaling",
    "PrecisionPolicy": "precision", "resolve_precision": "precision",
    "about": "runtime",
    "TrainConfig": "trainer", "History": "trainer", "Trainer": "trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        module = importlib.import_module(f"mpgpt.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'mpgpt' has no attribute {name!r}")
