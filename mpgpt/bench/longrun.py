"""A long training run that records its loss curve, step time and peak memory (chapters 9 and 10).

The ladder (`mpgpt.bench.training`) times 30 steps on random tokens: enough for speed, useless for
accuracy. The fp8 and 16-bit-optimizer chapters also need to know whether a cheaper format trains
*as well*, which takes thousands of steps on text with something to learn. This module runs one
such training, the same way for every variant it compares:

* data: the course's Markov source (`mpgpt.data.generate_corpus`), which can be generated at any
  length, so a GPU run of a few thousand steps never repeats a window (and its entropy rate,
  `corpus_entropy_rate()`, is the floor no model can beat);
* batches from one seeded generator, the model from one seed: variants see identical data and
  start from identical weights;
* AdamW-style optimizer built by the caller, linear warm-up then cosine decay, clipping at 1.0;
* the losses stay on the GPU until the end (no sync per step); a validation loss every
  ``eval_every`` steps, which is also where a non-finite loss stops the run loudly;
* each step timed with CUDA events (the median of all but the first WARMUP_STEPS, evaluation
  excluded) and the peak memory from `torch.cuda.max_memory_allocated`;
* the validation windows are the same for every run (VAL_SEED), so two runs are always scored on
  the same text.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch

from mpgpt.data import TextDataset, generate_corpus

__all__ = ["RunConfig", "corpus_dataset", "lr_at", "long_run"]

VAL_SEED = 10_000     # validation windows: shared by all runs, so runs of different seeds are compared on the same text
WARMUP_STEPS = 10     # left out of the step-time median: the first steps compile, autotune and allocate


@dataclass(frozen=True)
class RunConfig:
    steps: int = 2000
    batch_size: int = 16
    block_size: int = 256
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup: int = 100
    clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    seed: int = 0

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.block_size < 2 or self.eval_every < 1:
            raise ValueError("RunConfig needs steps >= 1, batch_size >= 1, block_size >= 2 and eval_every >= 1")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup ({self.warmup}) must be in [0, steps={self.steps})")


def corpus_dataset(n_chars: int, seed: int = 1) -> TextDataset:
    """n_chars of the Markov source, split 90/10 by position."""
    return TextDataset(generate_corpus(n_chars, seed=seed))


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warm-up over cfg.warmup steps, then cosine decay from cfg.lr to cfg.min_lr."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - 1 - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def _val_loss(model, dataset, cfg, device, autocast_dtype) -> float:
    gen = torch.Generator().manual_seed(VAL_SEED)   # the same windows at every evaluation and for every seed
    total = torch.zeros((), device=device)
    for _ in range(cfg.eval_batches):
        x, y = dataset.get_batch("val", cfg.batch_size, cfg.block_size, generator=gen, device=device)
        with _autocast(device, autocast_dtype):
            _, loss = model(x, y)
        total += loss.float()
    return (total / cfg.eval_batches).item()


def _autocast(device, dtype):
    return torch.autocast(torch.device(device).type, dtype=dtype) if dtype is not None else nullcontext()


def long_run(model, optimizer, dataset: TextDataset, cfg: RunConfig, device: str = "cuda",
             autocast_dtype: torch.dtype | None = None) -> dict:
    """Train ``model`` with ``optimizer`` for cfg.steps steps; return the curves and the costs.

    ``autocast_dtype``: run forward and backward under autocast to this dtype (None: the model's
    own dtype). Raises FloatingPointError at the first evaluation after a non-finite loss, naming
    the first step whose loss was not finite."""
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(cfg.seed)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    losses, step_ms, val = [], [], []
    events = []
    wall = time.perf_counter()
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = dataset.get_batch("train", cfg.batch_size, cfg.block_size, generator=gen, device=device)
        start = torch.cuda.Event(enable_timing=True) if on_cuda else None
        if on_cuda:
            start.record()
        t0 = time.perf_counter()
        with _autocast(device, autocast_dtype):
            _, loss = model(x, y)
        loss.backward()
        if cfg.clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
        if on_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            events.append((start, end))
        else:
            step_ms.append((time.perf_counter() - t0) * 1e3)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            if on_cuda:
                torch.cuda.synchronize()
                step_ms += [s.elapsed_time(e) for s, e in events]
                events = []
            v = _val_loss(model, dataset, cfg, device, autocast_dtype)
            recent = torch.stack(losses[-cfg.eval_every:])        # every training loss since the last check
            finite = torch.isfinite(recent)
            if not (math.isfinite(v) and bool(finite.all())):
                # recent[j] is the loss of step (step + 2 - len(recent) + j), counting steps from 1
                bad = step + 1 if finite.all() else step + 2 - len(recent) + int((~finite).nonzero()[0])
                raise FloatingPointError(f"the run diverged at step {bad}: train loss {losses[bad - 1].item()}, "
                                         f"val loss {v}; lower the learning rate or use a safer format")
            val.append((step + 1, v))
    wall = time.perf_counter() - wall
    timed = sorted(step_ms[WARMUP_STEPS:])
    if not timed:
        raise ValueError(f"a timed run needs more than {WARMUP_STEPS} steps (the first {WARMUP_STEPS} warm up)")
    median = timed[len(timed) // 2]   # the upper middle one for an even count
    tokens = cfg.batch_size * cfg.block_size
    return {
        "run": asdict(cfg),
        "train_loss": [round(v, 5) for v in torch.stack(losses).tolist()],
        "val_loss": [[s, round(v, 5)] for s, v in val],
        "ms_per_step": median,
        "timed_steps": len(timed),
        "tokens_per_s": tokens / median * 1e3,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None,
        "wall_s": wall,
    }
