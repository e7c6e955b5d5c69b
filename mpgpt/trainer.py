"""The trainer: one training step, the loop around it, checkpoints (chapters 2-5).

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

With torch's fused AdamW and clipping inside it (``fused_clip``), fp16 skips ``unscale_``'s pass: the
gradients' norm, computed for the clip anyway, is the inf/nan check (``scaler.defer_unscale_``), and
the optimizer divides by the scale and the clipping factor together as it reads each gradient.

:class:`TrainConfig` holds everything a run needs, :class:`Trainer` the pieces of a run (model,
optimizer, scaler, data) so they can be stepped, saved and resumed, and :class:`History` what a run
measured. The optimizer is built in one place, :meth:`Trainer.build_optimizer`, which
mpgpt.distributed calls again on FSDP2's sharded parameters. ``python -m mpgpt.train`` (mpgpt.train)
is the command line on top of this module.
"""
from __future__ import annotations

import contextlib
import math
import os
import random
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from mpgpt.checkpoint import (CheckpointError, check_compatible, check_global_batch, check_structure, load_checkpoint,
                              save_checkpoint)
from mpgpt.data import TextDataset, default_corpus, download_tiny_shakespeare, load_text
from mpgpt.graph_step import GraphedStep
from mpgpt.optim16 import VARIANTS, AdamW16
from mpgpt.model import GPT, GPTConfig, peak_flops
from mpgpt.precision import MasterWeights, resolve_precision
from mpgpt.recipe import parse as parse_recipe
from mpgpt.scaling import SCALERS, BaseLossScaler, NullScaler, make_scaler

__all__ = ["TrainConfig", "History", "Trainer", "DivergenceError", "lr_at", "load_dataset", "param_groups"]


class DivergenceError(RuntimeError):
    """The run diverged (a non-finite loss or weight, or a loss scale pushed below its floor). The last
    checkpoint written before it (if any) is kept; no checkpoint of the diverged state is written."""


def total_norm(grads) -> torch.Tensor:
    """The 2-norm of all gradients together, as clip_grad_norm_ computes it (a few multi-tensor kernels)."""
    if any(g.dtype != torch.float32 for g in grads):  # 16-bit gradients: sum their squares in fp32
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))


@dataclass
class TrainConfig:
    """Everything a run needs. Fields left at None take the preset's or the device's default."""

    preset: str = "tiny"
    data: str = "embedded"            # "embedded", "shakespeare", or a path to a UTF-8 text file
    precision: str | None = None      # None: the device's default (mpgpt.precision.default_precision)
    scaler: str = "auto"              # auto | dynamic | static | gradscaler | none (auto: dynamic for fp16)
    static_scale: float = 2.0 ** 10
    init_scale: float = 2.0 ** 16
    # The dynamic scaler's floor. 1.0, DeepSpeed's default min_loss_scale: a scale below 1 shrinks the
    # gradients, which only helps when the true (unscaled) gradients themselves overflow fp16 (> 65504),
    # and that is a diverging run, not an underflow problem. Without a floor the fp32 scale halves on
    # every overflow down to 0 and the run then skips every step in silence; with it, an overflow at
    # the floor stops the run with a DivergenceError.
    min_scale: float = 1.0
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
    # Clip inside the fused AdamW kernel (CUDA): it divides each gradient by max(1, norm / grad_clip)
    # as it reads it, which saves clip_grad_norm_'s separate pass over every gradient. Same update up
    # to rounding (a division instead of a multiplication); see Trainer.clips_in_optimizer.
    fused_clip: bool = False
    # Record the whole step (forward, backward, clip, AdamW) once as a CUDA graph and replay it
    # (mpgpt.graph_step): the host launches one graph per step instead of hundreds of kernels.
    # CUDA only, one process, a fixed batch shape, the package's own loss scalers (not GradScaler).
    cuda_graph: bool = False
    # Keep the model itself in bf16 and train it with the package's fused 16-bit AdamW
    # (mpgpt.optim16 / mpgpt.kernels.adamw16), whose state holds what the variant says: "fp32-master"
    # is llm.c's recipe (bf16 weights and gradients, fp32 master copy and moments, one pass per
    # step), "bf16-mantissa" the same numbers in 2 bytes less per parameter. None: fp32 weights
    # under autocast and torch's AdamW. Needs precision "bf16" and no loss scaler; clipping then
    # always happens inside the optimizer's kernel.
    optim16: str | None = None
    dropout: float = 0.0
    eval_interval: int = 100
    eval_batches: int = 10
    sample_tokens: int = 200
    compile: bool = False
    compile_mode: str = "default"     # torch.compile mode when compile is set ("reduce-overhead": CUDA graphs)
    device: str | None = None         # None: cuda if available, else cpu
    seed: int = 1337
    out_dir: str | None = None        # where checkpoints go; None: no checkpoints
    checkpoint_interval: int = 0      # 0: only at the end (when out_dir is set)
    resume: str | None = None         # path to a checkpoint to continue from
    progress: bool = True
    log_interval: int = 10            # per-step values are brought to the host every this many steps
    model_overrides: dict = field(default_factory=dict)  # e.g. {"n_layer": 2}: passed to GPTConfig
    fsdp: bool = False                # under torchrun: FSDP2 sharding instead of DDP (mpgpt.distributed)
    # A recipe name (mpgpt.recipe): the fast-path switches applied to the model the trainer builds.
    # Recipe.train_config() also fills the fields above that the recipe sets (precision, compile...).
    recipe: str | None = None
    ddp_bucket_mb: float | None = None  # DDP's all-reduce bucket; None: 25 MB eager, 100 MB compiled

    def validate(self) -> None:
        """Raise ValueError with a one-line message for values no run can use."""
        positive = ["steps", "batch_size", "grad_accum", "eval_interval", "eval_batches", "log_interval"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.ddp_bucket_mb is not None and not (0 < self.ddp_bucket_mb <= 1e6):
            raise ValueError(f"ddp_bucket_mb must be > 0 and at most 1e6 MB (or None for the default), "
                             f"got {self.ddp_bucket_mb}; use e.g. 25")
        if self.out_dir == "":
            raise ValueError("out_dir is empty; pass a folder for the checkpoints, or leave it out to save none")
        if self.checkpoint_interval and self.out_dir is None:
            raise ValueError("checkpoint_interval needs out_dir; pass --out-dir too")
        if not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"seed must lie in [0, 2**63), got {self.seed}")
        for name in ["lr", "static_scale", "init_scale", "min_scale"]:
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        if self.init_scale < self.min_scale:
            raise ValueError(f"init_scale ({self.init_scale}) is below min_scale ({self.min_scale}); "
                             "raise init_scale or lower min_scale")
        for name in ["warmup_steps", "weight_decay", "grad_clip", "sample_tokens", "checkpoint_interval"]:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.recipe is not None:
            parse_recipe(self.recipe)  # a ValueError that names the unknown token
        if self.scaler not in SCALERS:
            raise ValueError(f"unknown scaler {self.scaler!r}; choose one of {', '.join(SCALERS)}")
        if self.compile_mode not in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
            raise ValueError(f"unknown compile_mode {self.compile_mode!r}; use 'default' or 'reduce-overhead'")
        if self.cuda_graph and self.compile_mode != "default":
            raise ValueError(f"cuda_graph records the whole step itself; use compile_mode 'default' with it, "
                             f"not {self.compile_mode!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.optim16 is not None:
            if self.optim16 not in VARIANTS:
                raise ValueError(f"unknown optim16 variant {self.optim16!r}; choose one of {', '.join(VARIANTS)}")
            if self.precision != "bf16" or self.scaler not in ("auto", "none"):
                raise ValueError(f"optim16 trains a bf16 model without loss scaling; use precision 'bf16' and "
                                 f"scaler 'none' with it, not {self.precision!r} and {self.scaler!r}")
            if self.fsdp:
                raise ValueError("optim16 keeps its state in flat buffers that FSDP2 cannot shard; leave fsdp off")
            if self.cuda_graph and "stochastic" in (VARIANTS[self.optim16].weights, VARIANTS[self.optim16].moments):
                raise ValueError(f"a recorded step would replay one step's random bits forever; use cuda_graph "
                                 f"with a variant that rounds to nearest (e.g. fp32-master), not {self.optim16!r}")


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
    resumed_at: int | None = None  # the step this run continued from a checkpoint at (None: from scratch)

    def to_dict(self) -> dict:
        return asdict(self)

    def extend(self, other: "History") -> None:
        for f in fields(self):
            if isinstance(getattr(self, f.name), list):
                getattr(self, f.name).extend(getattr(other, f.name))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at ``steps``."""
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - min_lr)


def load_dataset(spec: str):
    """The text a run trains on: the embedded corpus, Tiny Shakespeare, or a local file."""
    if spec == "embedded":
        text = default_corpus()
    elif spec == "shakespeare":
        text = load_text(download_tiny_shakespeare())
    else:
        text = load_text(spec)
    return TextDataset(text)


def param_groups(named_params, weight_decay):
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
        cfg.validate()
        self.cfg = cfg
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.policy = resolve_precision(cfg.precision, self.device)
        self.policy.configure_backends()
        if cfg.out_dir is not None:
            _check_out_dir(Path(cfg.out_dir))  # before training: a run must not learn at the end it cannot save
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
            if cfg.recipe is not None:
                parse_recipe(cfg.recipe).apply(model)  # its fast-path switches, from outside (mpgpt.fast)
        self.model = model.to(self.device)
        fp32_weights = None
        if cfg.optim16:
            # The model becomes the bf16 copy; the optimizer starts from the fp32 values (below).
            fp32_weights = {p: p.detach().clone() for p in self.model.parameters()}
            self.model.to(torch.bfloat16)
        self.block_size = self.model.config.block_size
        if self.model.config.vocab_size < self.data.tokenizer.vocab_size:
            raise ValueError(f"the model's vocabulary ({self.model.config.vocab_size}) is smaller than the "
                             f"data's ({self.data.tokenizer.vocab_size}); raise vocab_size")

        # O2 policies cast the model and keep fp32 masters; the optimizer always sees fp32 tensors.
        self.master = MasterWeights(self.model, self.policy.param_dtype) if self.policy.master_weights else None
        named = self.master.named_params() if self.master else list(self.model.named_parameters())
        self.params = [p for _, p in named]
        self.optimizer = self.build_optimizer(named)
        if fp32_weights is not None:
            self.optimizer.load_fp32_weights(fp32_weights)
            del fp32_weights
        self.scaler = make_scaler(cfg.scaler, self.policy, self.device, static_scale=cfg.static_scale,
                                  init_scale=cfg.init_scale, growth_interval=cfg.growth_interval,
                                  hysteresis=cfg.hysteresis, min_scale=cfg.min_scale)
        self.forward = self.compiled(self.model)
        self.graphed = self._graphed_step() if cfg.cuda_graph else None
        self.clips_in_optimizer = ((cfg.fused_clip or cfg.optim16 is not None) and cfg.grad_clip > 0
                                   and self._can_fuse_clip())
        self.data_gen = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        self._pending, self._t_last = [], time.perf_counter()  # steps run() has not logged yet (_flush)
        self.history = History(precision=self.policy.name, device=str(self.device))
        self.flops_per_token = self.model.flops_per_token() if hasattr(self.model, "flops_per_token") else None
        self.peak = peak_flops(self.device)

    def build_optimizer(self, named_params) -> torch.optim.Optimizer:
        """AdamW over ``named_params`` (fp32 tensors: the model's, or its fp32 masters), with weight
        decay on matrices only (param_groups). On CUDA the fused kernel: one launch for every
        parameter, and the loss scalers hand it the inf/nan flag so a skipped step needs no sync."""
        cfg = self.cfg
        if cfg.optim16:
            return self._build_optim16(named_params)
        if cfg.cuda_graph and self.device.type == "cuda":
            # A recorded step reads the learning rate from a device tensor, set in place every step.
            return torch.optim.AdamW(param_groups(named_params, cfg.weight_decay),
                                     lr=torch.tensor(cfg.lr, device=self.device), betas=(cfg.beta1, cfg.beta2),
                                     fused=True, capturable=True)
        return torch.optim.AdamW(param_groups(named_params, cfg.weight_decay), lr=cfg.lr,
                                 betas=(cfg.beta1, cfg.beta2), fused=self.device.type == "cuda")

    def _build_optim16(self, named_params) -> AdamW16:
        """The 16-bit AdamW over the bf16 model: the fused Triton kernel on a GPU, else the reference."""
        cfg = self.cfg
        groups = param_groups(named_params, cfg.weight_decay)
        hyper = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, variant=cfg.optim16, seed=cfg.seed)
        if self.device.type == "cuda":
            from mpgpt.kernels import env as kenv
            if kenv.kernels_available()[0]:
                from mpgpt.kernels.adamw16 import FusedAdamW16
                return FusedAdamW16(groups, **hyper)
            if cfg.cuda_graph:
                raise ValueError("cuda_graph with optim16 needs the fused Triton kernel, and Triton is not usable "
                                 f"here ({kenv.kernels_available()[1]}); leave cuda_graph off")
        return AdamW16(groups, **hyper)

    def _graphed_step(self):
        """The step recorder (mpgpt.graph_step), after checking this run can be recorded."""
        if self.device.type != "cuda":
            raise ValueError(f"cuda_graph needs a CUDA device, and this run is on {self.device.type}; "
                             "leave cuda_graph off there")
        if not isinstance(self.scaler, (NullScaler, BaseLossScaler)):
            # only the package's scalers are tested recorded: their whole state is device tensors
            raise ValueError(f"cuda_graph cannot record a step with {type(self.scaler).__name__}; use the "
                             "package's loss scalers (--scaler dynamic or static), or cuda_graph off")
        return GraphedStep(self._step_body)

    def _grad_norm(self) -> torch.Tensor:
        """The 2-norm of all gradients for the clip inside the optimizer: the optimizer's own one-launch
        norm where it has one over exactly these parameters (FusedAdamW16.grad_norm), else total_norm."""
        own = getattr(self.optimizer, "grad_norm", None)
        if own is not None:
            held = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
            if held == {id(p) for p in self.params}:
                return own()
        return total_norm([p.grad for p in self.params if p.grad is not None])

    def _can_fuse_clip(self) -> bool:
        """Whether the optimizer can apply the clipping factor itself: torch's fused AdamW reads
        ``optimizer.grad_scale`` and divides every gradient by it. Only with our own scalers (or none),
        which leave a grad_scale set by the caller in place; torch's GradScaler overwrites it. Not under
        FSDP2, whose sharded gradients make the norm a distributed tensor; clip_grad_norm_ handles that."""
        if isinstance(self.optimizer, AdamW16):
            return True  # it divides by optimizer.grad_scale too, in the same pass (and on bf16 gradients
            # that is the better place: clip_grad_norm_ would round the clipped gradients to bf16)
        fused = isinstance(self.optimizer, torch.optim.AdamW) and bool(self.optimizer.defaults.get("fused"))
        return fused and not self.cfg.fsdp and isinstance(self.scaler, (NullScaler, BaseLossScaler))

    def compiled(self, module):
        """``module`` under torch.compile if the config asks for it, else ``module`` itself."""
        return torch.compile(module, mode=self.cfg.compile_mode) if self.cfg.compile else module

    # ----------------------------------------------------------------------------------------
    def batch(self, split: str):
        x, y = self.data.get_batch(split, self.cfg.batch_size, self.block_size, generator=self.data_gen)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def train_step(self, after_backward=None):
        """One optimizer step (with gradient accumulation). Returns device tensors (loss, grad_norm)."""
        cfg = self.cfg
        if self.graphed is not None and after_backward is not None:  # refused before anything changes
            raise ValueError("after_backward cannot run inside a step recorded as a CUDA graph; "
                             "set cuda_graph=False to use the hook")
        lr = lr_at(self.step, cfg)
        self._set_lr(lr)
        batches = [self.batch("train") for _ in range(cfg.grad_accum)]
        if self.graphed is not None:
            loss_sum, grad_norm = self.graphed(batches)
        else:
            loss_sum, grad_norm = self._step_body(batches, after_backward)
        self.step += 1
        return loss_sum, grad_norm, lr

    def _set_lr(self, lr: float) -> None:
        """This step's learning rate: written into the device tensor a recorded step reads, else set."""
        if isinstance(self.optimizer, AdamW16):
            self.optimizer.prepare(self.step + 1, lr)  # bias corrections from the trainer's own count
            return
        for group in self.optimizer.param_groups:
            if self.graphed is not None:
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr

    def _step_body(self, batches, after_backward=None):
        """Forward, backward, clip and optimizer for one step's micro-batches; returns (loss, grad_norm)
        as device tensors. Everything here runs on the device without a sync, so it can be recorded."""
        cfg, model = self.cfg, self.model
        loss_sum = torch.zeros((), device=self.device)
        for micro, (x, y) in enumerate(batches):
            with self.micro_step_context(last=micro == len(batches) - 1):
                with self.policy.autocast(self.device.type):
                    _, loss = self.forward(x, y)
                loss = loss / cfg.grad_accum
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach().float()
        if after_backward is not None:
            after_backward(self.step, model)  # test hook: e.g. inject inf into a gradient
        if self.master is not None:
            self.master.grads_to_master()
        if self.clips_in_optimizer and isinstance(self.scaler, BaseLossScaler):
            # fp16 with the fused optimizer: the gradients stay scaled. Their norm, needed for the clip
            # anyway, is the inf/nan check; the optimizer divides by the scale and the clip together,
            # which saves the scaler's pass over every fp32 gradient (read and written once).
            scaled_norm = self._grad_norm()
            scale = self.scaler.defer_unscale_(self.optimizer, found_inf=~torch.isfinite(scaled_norm))
            grad_norm = scaled_norm / scale
            self.optimizer.grad_scale = ((grad_norm + 1e-6) / cfg.grad_clip).clamp(min=1.0)
        elif self.clips_in_optimizer:
            self.scaler.unscale_(self.optimizer)  # a no-op without a scaler
            # clip_grad_norm_ multiplies by min(1, clip / (norm + 1e-6)); the kernel divides by the inverse
            grad_norm = self._grad_norm()
            self.optimizer.grad_scale = ((grad_norm + 1e-6) / cfg.grad_clip).clamp(min=1.0)
        elif cfg.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)  # true gradients from here on: clip them, not scaled ones
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        else:  # the norm only, for the log: a few multi-tensor kernels, as inside clip_grad_norm_
            self.scaler.unscale_(self.optimizer)
            grad_norm = total_norm([p.grad for p in self.params if p.grad is not None])
        self.scaler.step(self.optimizer)
        if self.clips_in_optimizer:
            self.optimizer.__dict__.pop("grad_scale", None)   # this step's factor only (our scalers remove it too)
        self.scaler.update()
        if self.master is not None:
            # Unconditional, so no sync is needed to ask whether the step was skipped: after a skip
            # the masters are unchanged and rounding them again rewrites the same 16-bit values.
            self.master.master_to_model()
        self.optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        return loss_sum, grad_norm

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
            "tokenizer": getattr(self.data.tokenizer, "chars", None),
            "cpu_threads": torch.get_num_threads(),  # CPU results are bit-exact only at the same count
        }

    def save(self, path) -> Path:
        return save_checkpoint(path, self.state_dict())  # OSError/RuntimeError become CheckpointError there

    def load(self, path) -> None:
        """Continue from a checkpoint: validated in full before anything is modified."""
        self.load_state_dict(load_checkpoint(path))

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's contents (as read by mpgpt.checkpoint.load_checkpoint).

        Every check runs before anything is modified: structure and types, model, global batch,
        precision and scaler, tokenizer, and that the checkpoint leaves steps to take."""
        check_structure(state)
        check_compatible(state, asdict(self.model.config), self.model.state_dict())
        check_global_batch(state, self.cfg.batch_size, self.world_size)
        if state.get("scaler_type") != type(self.scaler).__name__ or state.get("precision") != self.policy.name:
            raise CheckpointError(f"checkpoint was written with precision {state.get('precision')} and "
                                  f"{state.get('scaler_type')}, this run uses {self.policy.name} and "
                                  f"{type(self.scaler).__name__}; resume with the same --precision and --scaler")
        self._check_resumable(state)
        self.model.load_state_dict(state["model"])
        if self.master is not None:
            self.master.load_state_dict(state["master"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.graphed is not None and not isinstance(self.optimizer, AdamW16):  # that one loads in place
            # The loaded optimizer state is new tensors, which a recorded step would not see: record
            # again, with the learning rate back in a device tensor.
            for group in self.optimizer.param_groups:
                group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32).to(self.device).clone()
            self.graphed.reset()
        self.scaler.load_state_dict(state["scaler"])
        rng = dict(state["rng"])
        rng["python"] = _python_rng_tuple(rng["python"])
        _set_rng_state(rng, self.data_gen)
        self.step = int(state["step"])
        self.history = History(**{**state["history"], "resumed_at": self.step})

    def _check_resumable(self, state: dict) -> None:
        """The checks that need this trainer's live pieces; raise CheckpointError, modify nothing."""
        if self.master is not None:
            live = self.master.state_dict()
            saved = state["master"] or {}
            if set(saved) != set(live) or any(tuple(saved[k].shape) != tuple(v.shape) for k, v in live.items()):
                raise CheckpointError("checkpoint's fp32 master weights do not match the model; resume with "
                                      "the same preset, overrides and --precision")
        if state["optimizer"].get("variant") != (self.cfg.optim16 or None):
            raise CheckpointError(f"checkpoint's optimizer is optim16 {state['optimizer'].get('variant')}, this run's "
                                  f"is {self.cfg.optim16}; resume with the same --optim16")
        groups = state["optimizer"]["param_groups"]
        live_groups = self.optimizer.state_dict()["param_groups"]
        if [len(g.get("params", ())) for g in groups] != [len(g["params"]) for g in live_groups]:
            raise CheckpointError("checkpoint's optimizer state does not match the model's parameters; "
                                  "resume with the same preset and overrides")
        unknown = set(state["history"]) - {f.name for f in fields(History)}
        if unknown:
            raise CheckpointError(f"checkpoint's history has unknown fields {sorted(unknown)}; "
                                  "use the mpgpt release that wrote it")
        chars = state.get("tokenizer")
        if chars is not None and chars != getattr(self.data.tokenizer, "chars", None):
            raise CheckpointError("checkpoint was trained on text with a different alphabet (tokenizer); "
                                  "resume with the same --data")
        if int(state["step"]) >= self.cfg.steps:
            raise CheckpointError(f"checkpoint is already at step {state['step']} and this run stops at "
                                  f"--steps {self.cfg.steps}; pass a larger --steps to train further")
        threads = state.get("cpu_threads")
        if self.device.type == "cpu" and threads is not None and threads != torch.get_num_threads():
            # LayerNorm's backward (its weight/bias gradients) sums per-thread partial results on the
            # CPU, so the last bits of the gradients depend on the thread count: the run continues
            # correctly, but not bit for bit as it would have.
            warnings.warn(f"checkpoint was written with {threads} CPU threads and this run uses "
                          f"{torch.get_num_threads()}; the resumed run will not be bit-identical to an "
                          f"uninterrupted one (set OMP_NUM_THREADS={threads} for that)", stacklevel=3)

    # ----------------------------------------------------------------------------------------
    def run(self, after_backward=None, until: int | None = None) -> History:
        """Train until ``cfg.steps`` optimizer steps have been taken in total; return the History.

        ``until`` stops early after that many steps (saving a checkpoint if ``out_dir`` is set), as an
        interrupted run would; the schedule still follows ``cfg.steps``, so a resumed run continues it.
        Raises :class:`DivergenceError` on a non-finite loss or a loss scale pushed below its floor,
        and never writes a checkpoint of a diverged state: the last good one stays.
        The final checkpoint is written before the sample is drawn, so a failing sample loses nothing.
        """
        from tqdm import tqdm

        cfg = self.cfg
        self._pending = []  # device tensors not yet brought to the host: one sync per log_interval
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not cfg.progress, desc=f"train {self.policy.name}",
                   dynamic_ncols=True, file=sys.stderr)
        self._t_last = time.perf_counter()
        stop = cfg.steps if until is None else min(until, cfg.steps)
        try:
            while self.step < stop:
                step = self.step
                loss, grad_norm, lr = self.train_step(after_backward)
                self._pending.append((step, loss, grad_norm, lr, self.scaler.scale_tensor(),
                                      self.scaler.last_found_inf, getattr(self.scaler, "floor_hit", False)))
                last = self.step == stop
                if len(self._pending) >= cfg.log_interval or last:
                    self._flush()
                    bar.set_postfix(loss=f"{self.history.loss[-1]:.3f}", scale=f"{self.history.scale[-1]:g}",
                                    refresh=False)
                bar.update(1)
                if self.step % cfg.eval_interval == 0 or last:
                    self.history.val_step.append(self.step)
                    self.history.val_loss.append(self.evaluate())
                    self._t_last = time.perf_counter()  # keep evaluation out of tokens/s
                if cfg.out_dir and cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0 and not last:
                    self._flush()  # the checkpoint's History must hold every step, and none may have diverged
                    self.save(Path(cfg.out_dir) / "ckpt.pt")
                    self._t_last = time.perf_counter()
        finally:
            bar.close()
        self._flush()
        if cfg.out_dir:
            self.save(Path(cfg.out_dir) / "ckpt.pt")  # before sampling: a failing sample loses no training
        if cfg.sample_tokens and self.step == cfg.steps:
            self.history.sample = self.sample()
        return self.history

    def _flush(self) -> None:
        """Bring the pending steps' values to the host (one copy), append them to the History and stop
        the run if any step diverged."""
        pending, hist = self._pending, self.history
        if not pending:
            return
        # One device->host copy for the whole interval: loss, grad norm, scale, overflow flag and
        # scale-floor flag of each step (some may be Python numbers: no scaler, or no step yet).
        dev = pending[0][1].device
        as_f32 = lambda v: torch.as_tensor(v, dtype=torch.float32, device=dev)  # noqa: E731
        values = torch.stack([torch.stack([loss_t, gn.float(), as_f32(sc), as_f32(fi), as_f32(fl)])
                              for _, loss_t, gn, _, sc, fi, fl in pending]).tolist()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        tokens_per_step = self.cfg.batch_size * self.block_size * self.cfg.grad_accum
        tps = tokens_per_step * len(pending) / (now - self._t_last)
        self._t_last = now
        self._pending = []
        for (s, _, _, lr_s, _, _, _), (loss_v, gn_v, scale, found_inf, floor) in zip(pending, values):
            if not math.isfinite(loss_v):
                raise DivergenceError(f"training diverged at step {s}: the loss is {loss_v}; {self._kept()}; "
                                      "lower --lr (or use bf16/fp32) and resume from it")
            if not math.isfinite(gn_v) and not found_inf > 0 and isinstance(self.scaler, NullScaler):
                # Nothing checked this gradient, so the optimizer applied it: the weights are now inf/nan.
                raise DivergenceError(f"training diverged at step {s}: the gradient norm is {gn_v} and no loss "
                                      f"scaler skipped the step; {self._kept()}; lower --lr and resume from it")
            if floor > 0:
                raise DivergenceError(f"training diverged at step {s}: gradients still overflow at the loss "
                                      f"scale's floor (min_scale {self.cfg.min_scale:g}); {self._kept()}; "
                                      "lower --lr or use bf16, and resume from it")
            hist.step.append(s)
            hist.loss.append(loss_v)
            hist.grad_norm.append(gn_v)
            hist.lr.append(lr_s)
            hist.scale.append(scale)
            hist.skipped.append(found_inf > 0)
            hist.tokens_per_s.append(tps)
            flops = self.flops_per_token
            hist.mfu.append(flops * tps / self.peak if (self.peak and flops) else None)

    def _kept(self) -> str:
        path = Path(self.cfg.out_dir) / "ckpt.pt" if self.cfg.out_dir else None
        if path is not None and path.is_file():
            return f"the last good checkpoint is kept at {path}"
        return "no checkpoint was written (set --out-dir and --checkpoint-interval to keep one)"


def _check_out_dir(out_dir: Path) -> None:
    """Refuse an out_dir that cannot hold checkpoints, with a one-line reason, before any training."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out_dir {out_dir} is a file, not a folder; pass a folder for the checkpoints")
    probe = out_dir
    while not probe.exists():  # the nearest existing ancestor must let us create the folder
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"out_dir {out_dir} is not writable; pass a folder you can write to")
