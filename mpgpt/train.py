"""``train()`` and the ``python -m mpgpt.train`` command line (chapters 2-5): the entry point.

The training step and loop live in mpgpt.trainer (its docstring shows one step). This module adds
``train()``, which picks the single-process trainer or, under torchrun, mpgpt.distributed's, and
the command line.
``train(TrainConfig(...))`` returns a :class:`History` with per-step loss, learning rate, loss scale,
skipped-step flag, gradient norm, tokens/s and (on a GPU) MFU, plus validation losses and a sample.

Every refusal is one line on stderr naming what to do instead (exit 2); a run that diverges (a
non-finite loss, or a loss scale pushed below ``--min-scale``) or stalls (every step skipped, or every
gradient zero) stops with one line and exit 1, keeping its last good checkpoint; Ctrl-C (exit 130) and
SIGTERM (exit 143) finish a checkpoint being written, say what is kept and never leave a half-written
one. Bit-identical resume holds on the same device and precision and, on a CPU, the same thread
count; the resume policy (mpgpt.trainer.resume_policy, printed by ``--help``) says what a resume may
change.

Run ``python -m mpgpt.train --help`` for the flags. With no flags it trains the tiny preset on the
embedded corpus with the device's default precision and prints a sample.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from mpgpt.checkpoint import CheckpointError
from mpgpt.optim16 import VARIANTS
from mpgpt.scaling import SCALERS
from mpgpt.distributed import DistributedTrainer, launched_by_torchrun
from mpgpt.recipe import parse as parse_recipe
from mpgpt.trainer import MAX_SAMPLE_TOKENS, DivergenceError, History, Trainer, TrainConfig, lr_at, resume_policy

__all__ = ["train", "main", "TrainConfig", "History", "Trainer", "lr_at"]


def train(config: TrainConfig | None = None, *, model=None, dataset=None, after_backward=None, **overrides) -> History:
    """Train and return the History. ``train(steps=50)`` is short for ``train(TrainConfig(steps=50))``.

    ``model``/``dataset`` replace the preset model and the configured text; ``after_backward(step, model)``
    is called after every backward pass, before unscaling (the fault-injection tests use it).
    """
    cfg = config if config is not None else TrainConfig()
    for key, value in overrides.items():
        if not hasattr(cfg, key):
            raise TypeError(f"TrainConfig has no field {key!r}")
        setattr(cfg, key, value)
    # A recipe's Inductor settings are in force while the step compiles and runs.
    with parse_recipe(cfg.recipe).inductor_settings() if cfg.recipe else contextlib.nullcontext():
        if cfg.fsdp or launched_by_torchrun():
            trainer = DistributedTrainer(cfg, model=model, dataset=dataset)
        else:
            trainer = Trainer(cfg, model=model, dataset=dataset)
        if cfg.resume:
            trainer.load(cfg.resume)
        return trainer.run(after_backward=after_backward)


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block, non-zero exit
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = _Parser(prog="python -m mpgpt.train",
                description="Train a small GPT with the mpgpt mixed-precision trainer. With no flags: the tiny "
                            "preset on the embedded corpus, in the device's default precision, then a sample.",
                epilog=resume_policy(), formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default=d.preset, choices=["tiny", "small", "gpt2"], help="model size")
    p.add_argument("--recipe", default=None,
                   help="how the step runs, as +-joined tokens (mpgpt.recipe), e.g. bf16+compile or 'fastest'; "
                        "it sets the precision, scaler, compile and fast-path options itself")
    p.add_argument("--data", default=d.data, help="'embedded', 'shakespeare' (downloads once) or a text file path")
    p.add_argument("--precision", default="auto",
                   help="auto | fp32 | tf32 | bf16 | fp16 | bf16-master | fp16-master (auto: bf16 on sm_80+, "
                        "fp16 on older GPUs, fp32 on CPU)")
    p.add_argument("--scaler", default=d.scaler, choices=list(SCALERS),
                   help="loss scaler (auto: dynamic for fp16 policies, none otherwise)")
    p.add_argument("--static-scale", type=float, default=d.static_scale, help="scale for --scaler static")
    p.add_argument("--min-scale", type=float, default=d.min_scale,
                   help="floor of the dynamic loss scale: an overflow there stops the run as diverged")
    p.add_argument("--steps", type=int, default=d.steps, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per micro-batch")
    p.add_argument("--block-size", type=int, default=None, help="context length (default: the preset's)")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out-dir", default=None, help="folder for ckpt.pt (written atomically)")
    p.add_argument("--checkpoint-interval", type=int, default=0, help="also save every N steps")
    p.add_argument("--resume", default=None, help="checkpoint to continue from (see below for what may change)")
    p.add_argument("--eval-interval", type=int, default=d.eval_interval)
    p.add_argument("--sample-tokens", type=int, default=d.sample_tokens,
                   help=f"characters to sample at the end (at most {MAX_SAMPLE_TOKENS})")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--fused-clip", action="store_true",
                   help="clip the gradients inside the fused AdamW kernel (CUDA), saving a pass over them")
    p.add_argument("--cuda-graph", action="store_true",
                   help="record the whole step once as a CUDA graph and replay it (CUDA, one process, fixed batch)")
    p.add_argument("--optim16", default=None, metavar="VARIANT", choices=list(VARIANTS),
                   help="keep the model in bf16 and train it with the fused 16-bit AdamW, its state stored as "
                        "VARIANT says (fp32-master: fp32 masters and moments, llm.c's recipe); needs --precision bf16")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard with FSDP2 (bf16 params, fp32 reduce) instead of DDP")
    p.add_argument("--ddp-bucket-mb", type=float, default=d.ddp_bucket_mb,
                   help="under torchrun: DDP's all-reduce bucket size in MB (default 25, or 100 with --compile)")
    return p


# Flags a recipe sets itself: flag -> (argparse attribute, its value when not given).
_RECIPE_FLAGS = {"--precision": ("precision", "auto"), "--scaler": ("scaler", "auto"), "--compile": ("compile", False),
                 "--fused-clip": ("fused_clip", False), "--cuda-graph": ("cuda_graph", False),
                 "--optim16": ("optim16", None)}


def config_from_args(args) -> TrainConfig:
    cfg = _config_from_flags(args)
    if args.recipe is None:
        return cfg
    given = [flag for flag, (attr, unset) in _RECIPE_FLAGS.items() if getattr(args, attr) != unset]
    if given:
        raise ValueError(f"--recipe sets {given[0]} itself; drop {given[0]} or the recipe")
    for key, value in parse_recipe(args.recipe).train_config().items():
        setattr(cfg, key, value)
    return cfg


def _config_from_flags(args) -> TrainConfig:
    return TrainConfig(
        preset=args.preset, data=args.data, precision=None if args.precision == "auto" else args.precision,
        scaler=args.scaler, static_scale=args.static_scale, min_scale=args.min_scale, steps=args.steps, batch_size=args.batch_size,
        block_size=args.block_size, grad_accum=args.grad_accum, lr=args.lr, compile=args.compile,
        device=args.device, seed=args.seed, out_dir=args.out_dir, checkpoint_interval=args.checkpoint_interval,
        resume=args.resume, eval_interval=args.eval_interval, sample_tokens=args.sample_tokens,
        progress=not args.no_progress, fsdp=args.fsdp, ddp_bucket_mb=args.ddp_bucket_mb,
        fused_clip=args.fused_clip, cuda_graph=args.cuda_graph, optim16=args.optim16)


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, ``kill``, a closing terminal), handled like Ctrl-C."""


def _terminate(signum, frame):
    raise _Terminated


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    in_main_thread = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None  # like Ctrl-C
    try:
        with warnings.catch_warnings():  # notes (a changed --lr on resume, a thread count) as one line each
            warnings.simplefilter("always")
            show = warnings.showwarning
            warnings.showwarning = lambda message, *a, **k: print(f"{parser.prog}: note: {message}", file=sys.stderr)
            try:
                return _main(parser, args)
            finally:
                warnings.showwarning = show
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _main(parser, args) -> int:
    cfg = None
    try:
        cfg = config_from_args(args)
        if cfg.device is not None:
            device = torch.device(cfg.device)  # raises RuntimeError on nonsense like "gpu"
            if device.type not in ("cpu", "cuda"):
                raise ValueError(f"device {cfg.device} is not supported by mpgpt.train; use --device cpu or cuda")
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {cfg.device} requested but no CUDA GPU is available; use --device cpu")
        if cfg.recipe is not None:  # a token the device cannot run is refused before anything is built
            parse_recipe(cfg.recipe).check_device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if cfg.data not in ("embedded", "shakespeare") and not Path(cfg.data).exists():
            raise FileNotFoundError(f"data file {cfg.data} does not exist; pass a UTF-8 text file or 'embedded'")
        if cfg.resume is not None and Path(cfg.resume).is_dir():
            raise ValueError(f"--resume {cfg.resume} is a folder; pass the checkpoint file in it, e.g. "
                             f"{Path(cfg.resume) / 'ckpt.pt'}")
        if args.static_scale != build_parser().get_default("static_scale") and cfg.scaler != "static":
            raise ValueError("--static-scale only applies with --scaler static; add --scaler static or drop it")
        start = time.perf_counter()
        hist = train(cfg)
    except DivergenceError as e:  # the run itself failed, not its arguments: exit 1, the message says why
        print(f"{parser.prog}: error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"{parser.prog}: error: out of memory; use a smaller --batch-size, --block-size or --preset",
              file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, CheckpointError, RuntimeError, OSError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "can't allocate memory" in msg or "out of memory" in msg.lower():  # torch's allocators' words
            msg = "out of memory; use a smaller --batch-size, --block-size or --preset"
        print(f"{parser.prog}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        how, code = ("terminated (SIGTERM)", 143) if isinstance(e, _Terminated) else ("interrupted", 130)
        ckpt = Path(cfg.out_dir) / "ckpt.pt" if cfg is not None and cfg.out_dir else None
        kept = (f"the checkpoint at {ckpt} is whole; resume with --resume {ckpt}" if ckpt and ckpt.is_file()
                else "no checkpoint was written")
        print(f"{parser.prog}: {how}; {kept}", file=sys.stderr)
        return code
    elapsed = time.perf_counter() - start
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun only rank 0 reports (every rank holds the same all-reduced numbers)
    skipped = sum(hist.skipped)
    start = hist.resumed_at or 0
    resumed = f" (resumed at step {start}; {len(hist.loss)} in all)" if hist.resumed_at is not None else ""
    print(f"trained {len(hist.loss) - start} steps{resumed} in {elapsed:.1f} s on {hist.device} with "
          f"{hist.precision}: loss {hist.loss[0]:.3f} -> {hist.loss[-1]:.3f}, val {hist.val_loss[-1]:.3f}, "
          f"{skipped} skipped steps")
    if hist.sample:
        print("--- sample ---")
        print(hist.sample)
    return 0


if __name__ == "__main__":
    sys.exit(main())
