"""The training loop and the ``python -m mpgpt.train`` command line (chapters 2-5).

One step, whatever the precision policy (mpgpt.precision) and loss scaler (mpgpt.scaling):

    for each micro-batch:                       # gradient accumulation
        with policy.autocast(device):           # fp32 / bf16 / fp16 forward
            loss = model(x, y) / accum
        scaler.scale(loss).backward()           # scaled so fp16 gradients don't underflow
    master.grads_to_master()                    # O2 policies only: fp32 copies of 16-bit grads
    scaler.unscale_(optimizer)                  # divide by the scale *before* clipping
    clip_grad_norm_(params, grad_clip)          # clip the true gradient, not the scaled one
    scaler.step(optimizer)                      # skipped if any gradient is inf/nan
    scaler.update()                             # grow or back off the scale
    master.master_to_model()                    # O2 only: round fp32 masters into the model

``train(TrainConfig(...))`` returns a :class:`History` with per-step loss, learning rate, loss scale,
skipped-step flag, gradient norm, tokens/s and (on a GPU) MFU, plus validation losses and a sample.

Run ``python -m mpgpt.train --help`` for the flags. With no flags it trains the tiny preset on the
embedded corpus with the device's default precision and prints a sample.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from mpgpt.checkpoint import CheckpointError, check_compatible, check_global_batch, load_checkpoint, save_checkpoint
from mpgpt.precision import MasterWeights, resolve_precision

__all__ = ["TrainConfig", "History", "train", "main", "NullScaler", "make_scaler", "peak_flops"]

# Dense bf16/fp16 tensor-core peaks from the vendors' datasheets (FLOP/s), for MFU. MFU is always
# reported against the bf16 peak, whatever the policy, so the precisions can be compared.
_PEAK_BF16 = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
    "T4": 65e12, "V100": 125e12, "RTX 4090": 165e12, "RTX 3090": 71e12,
}


def peak_flops(device) -> float | None:
    """Datasheet dense bf16 (fp16 before sm_80) tensor-core FLOP/s of a CUDA device, or None if unknown."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in _PEAK_BF16.items():
        if key in name:
            return value
    return None


@dataclass
class TrainConfig:
    """Everything a run needs. Fields left at None take the preset's or the device's default."""

    preset: str = "tiny"
    data: str = "embedded"            # "embedded", "shakespeare", or a path to a UTF-8 text file
    precision: str | None = None      # None: the device's default (mpgpt.precision.default_precision)
    scaler: str = "auto"              # auto | dynamic | static | none ("auto": dynamic for fp16 policies)
    static_scale: float = 2.0 ** 10
    init_scale: float = 2.0 ** 16
    growth_interval: int = 2000
    hysteresis: int = 1
    steps: int = 400
    batch_size: int = 16
    block_size: int | None = None     # None: the preset's; may not exceed it
    grad_accum: int = 1
    lr: float = 2e-3
    min_lr: float | None = None       # None: lr / 10
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0            # 0 disables clipping
    dropout: float = 0.0
    eval_interval: int = 100
    eval_batches: int = 10
    sample_tokens: int = 200
    compile: bool = False
    device: str | None = None         # None: cuda if available, else cpu
    seed: int = 1337
    out_dir: str | None = None        # where checkpoints go; None: no checkpoints
    checkpoint_interval: int = 0      # 0: only at the end (when out_dir is set)
    resume: str | None = None         # path to a checkpoint to continue from
    progress: bool = True
    log_interval: int = 10            # per-step values are brought to the host every this many steps
    model_overrides: dict = field(default_factory=dict)  # e.g. {"n_layer": 2}: passed to GPTConfig
    fsdp: bool = False                # under torchrun: FSDP2 sharding instead of DDP (mpgpt.distributed)
    ddp_bucket_mb: float | None = None  # DDP's all-reduce bucket; None: 25 MB eager, 100 MB compiled

    def validate(self) -> None:
        """Raise ValueError with a one-line message for values no run can use."""
        positive = ["steps", "batch_size", "grad_accum", "eval_interval", "eval_batches", "log_interval"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.ddp_bucket_mb is not None and not self.ddp_bucket_mb > 0:
            raise ValueError(f"ddp_bucket_mb must be > 0 (or None for the default), got {self.ddp_bucket_mb}")
        for name in ["lr", "static_scale", "init_scale"]:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ["warmup_steps", "weight_decay", "grad_clip", "sample_tokens", "checkpoint_interval"]:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.scaler not in ("auto", "dynamic", "static", "none"):
            raise ValueError(f"unknown scaler {self.scaler!r}; choose auto, dynamic, static or none")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


@dataclass
class History:
    """What a run measured, one entry per optimizer step (and per evaluation for ``val_*``)."""

    step: list = field(default_factory=list)
    loss: list = field(default_factory=list)
    lr: list = field(default_factory=list)
    scale: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    grad_norm: list = field(default_factory=list)
    tokens_per_s: list = field(default_factory=list)
    mfu: list = field(default_factory=list)
    val_step: list = field(default_factory=list)
    val_loss: list = field(default_factory=list)
    sample: str = ""
    precision: str = ""
    device: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def extend(self, other: "History") -> None:
        for f in fields(self):
            if isinstance(getattr(self, f.name), list):
                getattr(self, f.name).extend(getattr(other, f.name))


class NullScaler:
    """The scaler interface with no scaling and no overflow check: every step is taken (fp32/bf16)."""

    last_step_skipped = False
    last_found_inf = 0.0

    def scale(self, loss):
        return loss

    def unscale_(self, optimizer):
        pass

    def step(self, optimizer, *args, **kwargs):
        return optimizer.step(*args, **kwargs)

    def update(self):
        pass

    def get_scale(self) -> float:
        return 1.0

    def scale_tensor(self) -> float:
        return 1.0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state):
        pass


def make_scaler(cfg: TrainConfig, policy, device):
    """The loss scaler a run uses: dynamic for fp16 policies unless the config says otherwise."""
    from mpgpt.scaling import DynamicLossScaler, StaticLossScaler

    kind = cfg.scaler
    if kind == "auto":
        kind = "dynamic" if policy.loss_scaling else "none"
    if kind == "none":
        return NullScaler()
    if kind == "static":
        return StaticLossScaler(cfg.static_scale)
    return DynamicLossScaler(init_scale=cfg.init_scale, growth_interval=cfg.growth_interval,
                             hysteresis=cfg.hysteresis)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at ``steps``."""
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - min_lr)


def load_dataset(spec: str):
    """The text a run trains on: the embedded corpus, Tiny Shakespeare, or a local file."""
    from mpgpt import data

    if spec == "embedded":
        text = data.default_corpus()
    elif spec == "shakespeare":
        text = data.load_text(data.download_tiny_shakespeare())
    else:
        text = data.load_text(spec)
    return data.TextDataset(text)


def _param_groups(named_params, weight_decay):
    """AdamW groups: decay matrices (dim >= 2), not biases or LayerNorm gains (nanoGPT's rule)."""
    decay = [p for _, p in named_params if p.dim() >= 2]
    no_decay = [p for _, p in named_params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _rng_state(data_gen: torch.Generator) -> dict:
    state = {"torch": torch.get_rng_state(), "data": data_gen.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict, data_gen: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    data_gen.set_state(state["data"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _python_rng_tuple(state):
    # weights_only loading turns the tuple inside random.getstate() into lists; make it a tuple again.
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


class Trainer:
    """Holds the pieces of a run (model, optimizer, scaler, data) so they can be stepped and saved."""

    def __init__(self, cfg: TrainConfig, model=None, dataset=None):
        from mpgpt.model import GPT, GPTConfig

        cfg.validate()
        self.cfg = cfg
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.policy = resolve_precision(cfg.precision, self.device)
        self.policy.configure_backends()
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

        self.data = dataset if dataset is not None else load_dataset(cfg.data)
        if model is None:
            base = GPTConfig.preset(cfg.preset)
            overrides = {"vocab_size": self.data.tokenizer.vocab_size, "dropout": cfg.dropout,
                         **cfg.model_overrides}
            if cfg.block_size is not None:
                if cfg.block_size > base.block_size:
                    raise ValueError(f"block_size {cfg.block_size} exceeds the {cfg.preset} preset's "
                                     f"{base.block_size}; use --block-size <= {base.block_size}")
                overrides["block_size"] = cfg.block_size
            if cfg.preset == "gpt2" and "vocab_size" not in cfg.model_overrides:
                overrides.pop("vocab_size")  # keep the padded 50304 of GPT-2's vocabulary
            model = GPT(GPTConfig.preset(cfg.preset, **overrides))
        self.model = model.to(self.device)
        self.block_size = self.model.config.block_size
        if self.model.config.vocab_size < self.data.tokenizer.vocab_size:
            raise ValueError(f"the model's vocabulary ({self.model.config.vocab_size}) is smaller than the "
                             f"data's ({self.data.tokenizer.vocab_size}); raise vocab_size")

        # O2 policies cast the model and keep fp32 masters; the optimizer always sees fp32 tensors.
        self.master = MasterWeights(self.model, self.policy.param_dtype) if self.policy.master_weights else None
        named = self.master.named_params() if self.master else list(self.model.named_parameters())
        self.params = [p for _, p in named]
        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(_param_groups(named, cfg.weight_decay), lr=cfg.lr,
                                           betas=(cfg.beta1, cfg.beta2), fused=fused)
        self.scaler = make_scaler(cfg, self.policy, self.device)
        self.forward = torch.compile(self.model) if cfg.compile else self.model
        self.data_gen = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        self.history = History(precision=self.policy.name, device=str(self.device))
        self.flops_per_token = self.model.flops_per_token() if hasattr(self.model, "flops_per_token") else None
        self.peak = peak_flops(self.device)

    # ----------------------------------------------------------------------------------------
    def batch(self, split: str):
        x, y = self.data.get_batch(split, self.cfg.batch_size, self.block_size, generator=self.data_gen)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def train_step(self, after_backward=None):
        """One optimizer step (with gradient accumulation). Returns device tensors (loss, grad_norm)."""
        cfg, model = self.cfg, self.model
        lr = lr_at(self.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            x, y = self.batch("train")
            with self.micro_step_context(last=micro == cfg.grad_accum - 1):
                with self.policy.autocast(self.device.type):
                    _, loss = self.forward(x, y)
                loss = loss / cfg.grad_accum
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach().float()
        if after_backward is not None:
            after_backward(self.step, model)  # test hook: e.g. inject inf into a gradient
        if self.master is not None:
            self.master.grads_to_master()
        self.scaler.unscale_(self.optimizer)  # true gradients from here on: clip them, not scaled ones
        if cfg.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        else:  # the norm only, for the log: a few multi-tensor kernels, as inside clip_grad_norm_
            grads = [p.grad for p in self.params if p.grad is not None]
            if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
                grad_norm = torch.nn.utils.get_total_norm(grads)
            else:
                grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.master is not None:
            # Unconditional, so no sync is needed to ask whether the step was skipped: after a skip
            # the masters are unchanged and rounding them again rewrites the same 16-bit values.
            self.master.master_to_model()
        self.optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        self.step += 1
        return loss_sum, grad_norm, lr

    @property
    def world_size(self) -> int:
        """Processes sharing each global batch: 1 here; mpgpt.distributed overrides it."""
        return 1

    def micro_step_context(self, last: bool):
        """Wraps one micro-batch's forward and backward. A no-op here; mpgpt.distributed skips the
        gradient all-reduce (DDP ``no_sync``) on every micro-batch but the last."""
        return contextlib.nullcontext()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``eval_batches`` batches, drawn from a fixed generator.

        A separate generator keeps evaluation from shifting the training batches, so a run with
        evaluation takes exactly the same optimizer steps as one without.
        """
        self.model.eval()
        gen = torch.Generator().manual_seed(self.cfg.seed + 1)
        losses = []
        for _ in range(self.cfg.eval_batches):
            x, y = self.data.get_batch("val", self.cfg.batch_size, self.block_size, generator=gen)
            with self.policy.autocast(self.device.type):
                _, loss = self.forward(x.to(self.device), y.to(self.device))
            losses.append(loss.float())
        self.model.train()
        return torch.stack(losses).mean().item()

    @torch.no_grad()
    def sample(self, prompt: str = "\n", max_new_tokens: int | None = None) -> str:
        tok = self.data.tokenizer
        n = self.cfg.sample_tokens if max_new_tokens is None else max_new_tokens
        idx = torch.tensor([tok.encode(prompt)], dtype=torch.long, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.seed)
        self.model.eval()
        with self.policy.autocast(self.device.type):
            out = self.model.generate(idx, n, temperature=0.8, top_k=None, generator=gen)
        self.model.train()
        return tok.decode(out[0].tolist())

    # ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        model_config = asdict(self.model.config)
        return {
            "model_config": model_config,
            "train_config": asdict(self.cfg),
            "model": self.model.state_dict(),
            "master": self.master.state_dict() if self.master else None,
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "scaler_type": type(self.scaler).__name__,
            "precision": self.policy.name,
            "rng": _rng_state(self.data_gen),
            "step": self.step,
            "history": self.history.to_dict(),
        }

    def save(self, path) -> Path:
        return save_checkpoint(path, self.state_dict())

    def load(self, path) -> None:
        """Continue from a checkpoint: validated in full before anything is modified."""
        self.load_state_dict(load_checkpoint(path))

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's contents (as read by mpgpt.checkpoint.load_checkpoint)."""
        check_compatible(state, asdict(self.model.config), self.model.state_dict())
        check_global_batch(state, self.cfg.batch_size, self.world_size)
        if state.get("scaler_type") != type(self.scaler).__name__ or state.get("precision") != self.policy.name:
            raise CheckpointError(f"checkpoint was written with precision {state.get('precision')} and "
                                  f"{state.get('scaler_type')}, this run uses {self.policy.name} and "
                                  f"{type(self.scaler).__name__}; resume with the same --precision and --scaler")
        self.model.load_state_dict(state["model"])
        if self.master is not None:
            self.master.load_state_dict(state["master"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        rng = dict(state["rng"])
        rng["python"] = _python_rng_tuple(rng["python"])
        _set_rng_state(rng, self.data_gen)
        self.step = int(state["step"])
        self.history = History(**state["history"])

    # ----------------------------------------------------------------------------------------
    def run(self, after_backward=None, until: int | None = None) -> History:
        """Train until ``cfg.steps`` optimizer steps have been taken in total; return the History.

        ``until`` stops early after that many steps (saving a checkpoint if ``out_dir`` is set), as an
        interrupted run would; the schedule still follows ``cfg.steps``, so a resumed run continues it.
        """
        from tqdm import tqdm

        cfg, hist = self.cfg, self.history
        tokens_per_step = cfg.batch_size * self.block_size * cfg.grad_accum
        pending = []  # device tensors not yet brought to the host: one sync per log_interval
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not cfg.progress, desc=f"train {self.policy.name}",
                   dynamic_ncols=True, file=sys.stderr)
        t_last = time.perf_counter()
        stop = cfg.steps if until is None else min(until, cfg.steps)
        while self.step < stop:
            step = self.step
            loss, grad_norm, lr = self.train_step(after_backward)
            pending.append((step, loss, grad_norm, lr, self.scaler.scale_tensor(), self.scaler.last_found_inf))
            last = self.step == stop
            if len(pending) >= cfg.log_interval or last:
                # One device->host copy for the whole interval: loss, grad norm, scale and overflow
                # flag of each step (the scale and flag may be Python floats: no scaler, or no step yet).
                dev = pending[0][1].device
                values = torch.stack([torch.stack([loss_t, gn.float(), torch.as_tensor(sc, dtype=torch.float32, device=dev),
                                                   torch.as_tensor(fi, dtype=torch.float32, device=dev)])
                                      for _, loss_t, gn, _, sc, fi in pending]).tolist()
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                now = time.perf_counter()
                tps = tokens_per_step * len(pending) / (now - t_last)
                t_last = now
                for (s, _, _, lr_s, _, _), (loss_v, gn_v, scale, found_inf) in zip(pending, values):
                    hist.step.append(s)
                    hist.loss.append(loss_v)
                    hist.grad_norm.append(gn_v)
                    hist.lr.append(lr_s)
                    hist.scale.append(scale)
                    hist.skipped.append(found_inf > 0)
                    hist.tokens_per_s.append(tps)
                    flops = self.flops_per_token
                    hist.mfu.append(flops * tps / self.peak if (self.peak and flops) else None)
                pending = []
                bar.set_postfix(loss=f"{hist.loss[-1]:.3f}", scale=f"{hist.scale[-1]:g}", refresh=False)
            bar.update(1)
            if self.step % cfg.eval_interval == 0 or last:
                hist.val_step.append(self.step)
                hist.val_loss.append(self.evaluate())
                t_last = time.perf_counter()  # keep evaluation out of tokens/s
            if cfg.out_dir and cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0 and not last:
                self.save(Path(cfg.out_dir) / "ckpt.pt")
                t_last = time.perf_counter()
        bar.close()
        if cfg.sample_tokens and self.step == cfg.steps:
            hist.sample = self.sample()
        if cfg.out_dir:
            self.save(Path(cfg.out_dir) / "ckpt.pt")
        return hist


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
    if cfg.fsdp or launched_by_torchrun():
        from mpgpt.distributed import DistributedTrainer  # DDP or FSDP2, one process per device (chapter 8)

        trainer = DistributedTrainer(cfg, model=model, dataset=dataset)
    else:
        trainer = Trainer(cfg, model=model, dataset=dataset)
    if cfg.resume:
        trainer.load(cfg.resume)
    return trainer.run(after_backward=after_backward)


def launched_by_torchrun() -> bool:
    """True in a process started by torchrun (or mpgpt.distributed.launch) with more than one rank."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


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
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default=d.preset, choices=["tiny", "small", "gpt2"], help="model size")
    p.add_argument("--data", default=d.data, help="'embedded', 'shakespeare' (downloads once) or a text file path")
    p.add_argument("--precision", default="auto",
                   help="auto | fp32 | tf32 | bf16 | fp16 | bf16-master | fp16-master (auto: bf16 on sm_80+, "
                        "fp16 on older GPUs, fp32 on CPU)")
    p.add_argument("--scaler", default=d.scaler, choices=["auto", "dynamic", "static", "none"],
                   help="loss scaler (auto: dynamic for fp16 policies, none otherwise)")
    p.add_argument("--static-scale", type=float, default=d.static_scale, help="scale for --scaler static")
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
    p.add_argument("--resume", default=None, help="checkpoint to continue from")
    p.add_argument("--eval-interval", type=int, default=d.eval_interval)
    p.add_argument("--sample-tokens", type=int, default=d.sample_tokens, help="characters to sample at the end")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard with FSDP2 (bf16 params, fp32 reduce) instead of DDP")
    p.add_argument("--ddp-bucket-mb", type=float, default=d.ddp_bucket_mb,
                   help="under torchrun: DDP's all-reduce bucket size in MB (default 25, or 100 with --compile)")
    return p


def config_from_args(args) -> TrainConfig:
    return TrainConfig(
        preset=args.preset, data=args.data, precision=None if args.precision == "auto" else args.precision,
        scaler=args.scaler, static_scale=args.static_scale, steps=args.steps, batch_size=args.batch_size,
        block_size=args.block_size, grad_accum=args.grad_accum, lr=args.lr, compile=args.compile,
        device=args.device, seed=args.seed, out_dir=args.out_dir, checkpoint_interval=args.checkpoint_interval,
        resume=args.resume, eval_interval=args.eval_interval, sample_tokens=args.sample_tokens,
        progress=not args.no_progress, fsdp=args.fsdp, ddp_bucket_mb=args.ddp_bucket_mb)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        if cfg.device is not None:
            device = torch.device(cfg.device)  # raises RuntimeError on nonsense like "gpu"
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {cfg.device} requested but no CUDA GPU is available; use --device cpu")
        if cfg.data not in ("embedded", "shakespeare") and not Path(cfg.data).exists():
            raise FileNotFoundError(f"data file {cfg.data} does not exist; pass a UTF-8 text file or 'embedded'")
        start = time.perf_counter()
        hist = train(cfg)
    except (ValueError, FileNotFoundError, CheckpointError, RuntimeError, OSError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"{parser.prog}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    elapsed = time.perf_counter() - start
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun only rank 0 reports (every rank holds the same all-reduced numbers)
    skipped = sum(hist.skipped)
    print(f"trained {len(hist.loss)} steps in {elapsed:.1f} s on {hist.device} with {hist.precision}: "
          f"loss {hist.loss[0]:.3f} -> {hist.loss[-1]:.3f}, val {hist.val_loss[-1]:.3f}, "
          f"{skipped} skipped steps")
    if hist.sample:
        print("--- sample ---")
        print(hist.sample)
    return 0


if __name__ == "__main__":
    sys.exit(main())
