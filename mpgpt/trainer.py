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

from mpgpt.checkpoint import (CheckpointError, check_compatible, check_global_batch, check_optimizer, check_out_dir,
                              check_rng, check_structure, first_nonfinite, folder_lock, load_checkpoint, save_checkpoint)
from mpgpt.data import TextDataset, default_corpus, download_tiny_shakespeare, load_text
from mpgpt.graph_step import GraphedStep
from mpgpt.optim16 import VARIANTS, AdamW16
from mpgpt.model import GPT, GPTConfig, peak_flops
from mpgpt.precision import MasterWeights, resolve_precision
from mpgpt.recipe import parse as parse_recipe
from mpgpt.scaling import SCALERS, BaseLossScaler, NullScaler, StaticLossScaler, make_scaler

__all__ = ["TrainConfig", "History", "Trainer", "DivergenceError", "lr_at", "load_dataset", "param_groups",
           "RESUME_MUST_MATCH", "RESUME_MAY_CHANGE", "resume_policy", "usable_static_scales"]


class DivergenceError(RuntimeError):
    """The run diverged (a non-finite loss or weight, or a loss scale pushed below its floor) or stalled
    (every step skipped, or every gradient zero). The last checkpoint written before it (if any) is
    kept; no checkpoint of a diverged state is written: before every save the weights, optimizer
    state and loss scale must be finite, and so must the loss of those weights (Trainer.check_state)."""


# The resume policy. A resumed run continues the saved one bit for bit only if everything that shapes
# its numbers stays the same. The model, precision, scaler and global batch are checked with the
# weights; these settings are compared too, and a resume that changes one is refused:
RESUME_MUST_MATCH = ("data", "seed", "grad_accum", "static_scale", "min_scale", "init_scale", "growth_interval",
                     "hysteresis", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip", "dropout", "optim16",
                     "recipe")
# These may change on purpose (a lower learning rate after a divergence, more steps, another device):
# the run goes on with a printed note that it is no longer bit-identical to an uninterrupted one, and
# every such change is recorded in the checkpoints it writes ("resume_changes"). Everything else
# (where and how often to save, evaluate, print) does not touch the numbers.
RESUME_MAY_CHANGE = ("lr", "min_lr", "steps", "compile", "fused_clip")
_FLAGS = {"data": "--data", "seed": "--seed", "grad_accum": "--grad-accum", "static_scale": "--static-scale",
          "min_scale": "--min-scale", "lr": "--lr", "steps": "--steps", "compile": "--compile",
          "fused_clip": "--fused-clip", "optim16": "--optim16", "sample_tokens": "--sample-tokens",
          "recipe": "--recipe"}
MAX_STEPS = 10 ** 9  # about 30 years at one step a second
MAX_SAMPLE_TOKENS = 10_000  # a sample is for reading; more is a typo (and minutes of generation)


def resume_policy() -> str:
    """The resume policy in one paragraph (``python -m mpgpt.train --help`` prints it)."""
    def names(keys):
        flags = [_FLAGS[k] for k in keys if k in _FLAGS]
        others = [k for k in keys if k not in _FLAGS]
        return ", ".join(flags) + (f" (or TrainConfig's {', '.join(others)})" if others else "")

    return ("Resuming (--resume) continues a run bit for bit on the same device, precision and CPU thread "
            "count. Refused: a different --preset or --block-size, --precision, --scaler, global batch "
            f"(--batch-size x ranks), {names(RESUME_MUST_MATCH)}. Accepted with a note that the run is no longer "
            f"bit-identical, recorded in the checkpoints it writes: a different {names(RESUME_MAY_CHANGE)} or "
            "device.")


def usable_static_scales(policy, tokens_per_step: int, vocab_size: int) -> tuple[float, float]:
    """The static loss scales that can train the package's GPT (a mean cross-entropy loss).

    The loss's gradient reaching the logits is up to scale / tokens_per_step per logit, and it is
    cast to the dtype the backward pass runs in: below that dtype's smallest number it is zero, and
    so is every gradient behind it; above its largest, every step overflows and is skipped. The
    scaled loss itself (about ln(vocab_size) at the start) must be finite in fp32."""
    info = torch.finfo(policy.autocast_dtype or policy.param_dtype)
    smallest = info.tiny * info.eps  # the smallest subnormal: 2**-24 in fp16, 2**-149 in fp32
    return (smallest / 2 * tokens_per_step,  # below half the smallest, a value rounds to 0
            min(info.max * tokens_per_step, torch.finfo(torch.float32).max / math.log(max(vocab_size, 2))))


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
        if self.steps > MAX_STEPS:
            raise ValueError(f"steps must be at most {MAX_STEPS:.0e} (a run that would never end), got {self.steps}; "
                             "pass a smaller --steps")
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
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value) and value <= torch.finfo(torch.float32).max):
                flag = _FLAGS.get(name, f"TrainConfig.{name}")
                raise ValueError(f"{name} must be a finite number > 0 representable in fp32 (at most 3.4e38), "
                                 f"got {value}; pass another {flag}")
        if self.init_scale < self.min_scale:
            raise ValueError(f"min_scale ({self.min_scale:g}) is above the initial loss scale ({self.init_scale:g}); "
                             f"lower --min-scale to at most {self.init_scale:g}")
        for name in ["warmup_steps", "weight_decay", "grad_clip", "sample_tokens", "checkpoint_interval"]:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.recipe is not None:
            parse_recipe(self.recipe)  # a ValueError that names the unknown token
        if self.sample_tokens > MAX_SAMPLE_TOKENS:
            raise ValueError(f"sample_tokens must be at most {MAX_SAMPLE_TOKENS}, got {self.sample_tokens}; pass a "
                             "smaller --sample-tokens (200 reads well)")
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
            check_out_dir(cfg.out_dir)  # before training: a run must not learn at the end it cannot save
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

        self.data = dataset if dataset is not None else load_dataset(cfg.data)
        builtin_model = model is None
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
        if isinstance(self.scaler, StaticLossScaler) and builtin_model:  # refused now, not after a run of skips
            self._check_static_scale()
        self.forward = self.compiled(self.model)
        self.graphed = self._graphed_step() if cfg.cuda_graph else None
        self.clips_in_optimizer = ((cfg.fused_clip or cfg.optim16 is not None) and cfg.grad_clip > 0
                                   and self._can_fuse_clip())
        self.data_gen = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        self._pending, self._t_last = [], time.perf_counter()  # steps run() has not logged yet (_flush)
        self.history = History(precision=self.policy.name, device=str(self.device))
        self.resume_changes: list[str] = []  # what resumes changed on purpose (RESUME_MAY_CHANGE), saved along
        self._kept_checkpoint: tuple[Path, int] | None = None  # the good checkpoint written or resumed from
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

    def _check_static_scale(self) -> None:
        """Refuse a static loss scale that cannot train this model (usable_static_scales says why)."""
        cfg = self.cfg
        tokens = cfg.batch_size * self.block_size * cfg.grad_accum
        low, high = usable_static_scales(self.policy, tokens, self.model.config.vocab_size)
        dtype = str(self.policy.autocast_dtype or self.policy.param_dtype).replace("torch.", "")
        if not low <= cfg.static_scale <= high:
            why = ("every gradient would be zero: the loss's gradient at the logits, at most scale / "
                   f"{tokens} tokens, is below the smallest number {dtype}" if cfg.static_scale < low else
                   "every step would overflow and be skipped: the scaled loss or its gradient at the logits "
                   f"is above the largest number {dtype}")
            raise ValueError(f"--static-scale {cfg.static_scale:g} cannot train in {self.policy.name}: {why} "
                             f"can hold; use a scale in [{low:.3g}, {high:.3g}], e.g. {min(max(1024.0, low), high):g}")

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
    def evaluate(self, batches: int | None = None) -> float:
        """Mean validation loss over ``batches`` (default ``eval_batches``) batches from a fixed generator.

        A separate generator keeps evaluation from shifting the training batches, so a run with
        evaluation takes exactly the same optimizer steps as one without.
        """
        self.model.eval()
        gen = torch.Generator().manual_seed(self.cfg.seed + 1)
        losses = []
        for _ in range(self.cfg.eval_batches if batches is None else batches):
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
            "resume_changes": list(self.resume_changes),
        }

    def save(self, path) -> Path:
        return save_checkpoint(path, self.state_dict())  # OSError/RuntimeError become CheckpointError there

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this process writes the checkpoints: yes, unless it is a rank other than 0 under torchrun."""
        return int(os.environ.get("RANK", "0")) == 0

    def check_state(self) -> None:
        """Raise DivergenceError unless the state now is one to keep: every weight, master weight and
        optimizer tensor finite, the loss scale finite and > 0, and the loss these weights give (one
        validation batch, after the update that made them) finite. run() calls it before every save
        and at the end, so "the last good checkpoint" is good: the loss of a step is computed before
        its update, and an update can wreck weights that are still finite (try --lr 1e30)."""
        state = self.state_dict()
        tensors = [(f"model weight {k}", v) for k, v in state["model"].items()]
        tensors += [(f"master weight {k}", v) for k, v in (state["master"] or {}).items()]
        tensors += [("optimizer state", v) for v in _tensors(state["optimizer"])]
        what = first_nonfinite(tensors)
        what = what and f"{what} is not finite after the update"
        scale = self.scaler.get_scale()
        if what is None and not (math.isfinite(scale) and scale > 0):
            what = f"the loss scale is {scale}"
        if what is None:
            hist = self.history
            loss = hist.val_loss[-1] if hist.val_step and hist.val_step[-1] == self.step else self.evaluate(1)
            if not math.isfinite(loss):
                what = f"the loss after the update is {loss}"
        if what is not None:
            raise DivergenceError(f"training diverged at step {self.step}: {what}; {self._kept()}; lower --lr "
                                  "(or use bf16/fp32) and resume from it")

    def _save_checked(self) -> None:
        """The checkpoint in out_dir, written only from a state check_state found good."""
        self._flush()  # the checkpoint's History must hold every step, and none may have diverged
        self.check_state()
        path = Path(self.cfg.out_dir) / "ckpt.pt"
        self.save(path)
        self._kept_checkpoint = (path, self.step)

    def load(self, path) -> None:
        """Continue from a checkpoint: validated in full before anything is modified."""
        self.load_state_dict(load_checkpoint(path))
        self._kept_checkpoint = (Path(path), self.step)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's contents (as read by mpgpt.checkpoint.load_checkpoint).

        Every check runs before anything is modified: structure and types, model (names, shapes,
        dtypes, finite), global batch, precision and scaler, the scaler's and the optimizer's state,
        the RNG states, the settings the resume policy compares, tokenizer, and that the checkpoint
        leaves steps to take. A setting changed on purpose (RESUME_MAY_CHANGE) is noted (a warning)
        and recorded in ``resume_changes``."""
        check_structure(state)
        check_compatible(state, asdict(self.model.config), self.model.state_dict())
        check_global_batch(state, self.cfg.batch_size, self.world_size)
        if state.get("scaler_type") != type(self.scaler).__name__ or state.get("precision") != self.policy.name:
            raise CheckpointError(f"checkpoint was written with precision {state.get('precision')} and "
                                  f"{state.get('scaler_type')}, this run uses {self.policy.name} and "
                                  f"{type(self.scaler).__name__}; resume with the same --precision and --scaler")
        changes = self._check_resumable(state)
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
        self.resume_changes = list(state.get("resume_changes") or []) + changes
        for change in changes:
            warnings.warn(f"resuming with {change}: the run is no longer bit-identical to an uninterrupted one "
                          "(recorded in the checkpoint)", stacklevel=3)
        threads = state.get("cpu_threads")
        if self.device.type == "cpu" and threads is not None and threads != torch.get_num_threads():
            # LayerNorm's backward (its weight/bias gradients) sums per-thread partial results on the
            # CPU, so the last bits of the gradients depend on the thread count: the run continues
            # correctly, but not bit for bit as it would have.
            warnings.warn(f"checkpoint was written with {threads} CPU threads and this run uses "
                          f"{torch.get_num_threads()}; the resumed run will not be bit-identical to an "
                          f"uninterrupted one (set OMP_NUM_THREADS={threads} for that)", stacklevel=3)

    def _check_resumable(self, state: dict) -> list[str]:
        """The checks that need this trainer's live pieces; raise CheckpointError, modify nothing.
        Returns the settings changed on purpose (RESUME_MAY_CHANGE), to note once the load is done."""
        if self.master is not None:
            live = self.master.state_dict()
            saved = state["master"] or {}
            if set(saved) != set(live) or any(not isinstance(saved[k], torch.Tensor) or saved[k].shape != v.shape
                                              or saved[k].dtype != v.dtype for k, v in live.items()):
                raise CheckpointError("checkpoint's fp32 master weights do not match the model; resume with "
                                      "the same preset, overrides and --precision")
            bad = first_nonfinite(saved.items())
            if bad:
                raise CheckpointError(f"checkpoint's master weight {bad} holds inf or nan; resume from an earlier "
                                      "checkpoint")
        if state["optimizer"].get("variant") != (self.cfg.optim16 or None):
            raise CheckpointError(f"checkpoint's optimizer is optim16 {state['optimizer'].get('variant')}, this run's "
                                  f"is {self.cfg.optim16}; resume with the same --optim16")
        check_optimizer(state["optimizer"], self.optimizer)
        try:
            self.scaler.check_state_dict(state["scaler"])
        except ValueError as e:
            raise CheckpointError(f"checkpoint's loss-scaler state is damaged ({e}); resume from an earlier "
                                  "checkpoint or start a new run") from None
        check_rng(state["rng"])
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
        return self._compare_settings(state)

    def _compare_settings(self, state: dict) -> list[str]:
        """The resume policy (RESUME_MUST_MATCH, RESUME_MAY_CHANGE): refuse a changed setting that must
        match, in one line naming the flags; return notes for the ones that may change."""
        saved, live, defaults = state["train_config"], asdict(self.cfg), asdict(TrainConfig())
        for name in RESUME_MUST_MATCH + RESUME_MAY_CHANGE:
            if name not in saved and name != "recipe":  # a checkpoint of a run without --recipe may lack it
                raise CheckpointError(f"checkpoint is incomplete or damaged (its train_config has no {name}); "
                                      "resume from an earlier checkpoint or start a new run")
        for name, value in saved.items():
            if name in defaults and not _same_kind(value, defaults[name]):
                raise CheckpointError(f"checkpoint is incomplete or damaged (its train_config {name} is {value!r}); "
                                      "resume from an earlier checkpoint or start a new run")
        try:  # the saved settings must be ones a run could use (older checkpoints may lack newer fields)
            TrainConfig(**{k: v for k, v in saved.items() if k in defaults}).validate()
        except ValueError as e:
            raise CheckpointError(f"checkpoint is incomplete or damaged (its train_config: {str(e).split(';')[0]}); "
                                  "resume from an earlier checkpoint or start a new run") from None
        flag = lambda k, v: f"{_FLAGS.get(k, k)} {v}"  # noqa: E731
        changed = [k for k in RESUME_MUST_MATCH if saved.get(k) != live[k]]
        if changed:
            raise CheckpointError(f"a resume must keep the settings that shape the run; the checkpoint has "
                                  f"{', '.join(flag(k, saved[k]) for k in changed)}, this run asks for "
                                  f"{', '.join(flag(k, live[k]) for k in changed)}: pass the checkpoint's values, "
                                  "or start a new run without --resume")
        notes = [f"{flag(k, live[k])} (was {saved[k]}) from step {state['step']}"
                 for k in RESUME_MAY_CHANGE if saved[k] != live[k]]
        saved_device = state["history"].get("device")
        if isinstance(saved_device, str) and saved_device and saved_device.split(":")[0] != self.device.type:
            notes.append(f"device {self.device.type} (was {saved_device}) from step {state['step']}")
        return notes

    # ----------------------------------------------------------------------------------------
    def run(self, after_backward=None, until: int | None = None) -> History:
        """Train until ``cfg.steps`` optimizer steps have been taken in total; return the History.

        ``until`` stops early after that many steps (saving a checkpoint if ``out_dir`` is set), as an
        interrupted run would; the schedule still follows ``cfg.steps``, so a resumed run continues it.
        Raises :class:`DivergenceError` on a non-finite loss or a loss scale pushed below its floor,
        or when the run stalls, and never writes a checkpoint of a diverged state (check_state runs
        before every save): the last good one stays. With ``out_dir`` the run holds the folder's lock
        (a second run there is refused) and refuses to overwrite a checkpoint it neither wrote nor
        resumed from.
        The final checkpoint is written before the sample is drawn, so a failing sample loses nothing.
        """
        cfg = self.cfg
        if not (cfg.out_dir and self.writes_checkpoints):
            return self._run(after_backward, until)
        check_out_dir(cfg.out_dir)  # again: the folder may have changed since this trainer was built
        self._refuse_a_foreign_checkpoint(Path(cfg.out_dir) / "ckpt.pt")
        with folder_lock(cfg.out_dir):  # one run per folder: a second one is refused, not interleaved
            return self._run(after_backward, until)

    def _run(self, after_backward, until) -> History:
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
                    self._save_checked()
                    self._t_last = time.perf_counter()
        finally:
            bar.close()
        if cfg.out_dir:
            self._save_checked()  # before sampling: a failing sample loses no training
        else:
            self._flush()
            self.check_state()  # without a checkpoint too: a run must not end in a diverged state
        if cfg.sample_tokens and self.step == cfg.steps:
            self.history.sample = self.sample()
        return self.history

    def _refuse_a_foreign_checkpoint(self, path: Path) -> None:
        """A new run must not overwrite a checkpoint it neither wrote nor resumed from: that is another
        run's work. (Resuming from it, or a trainer running on after run(until=...), is fine.)"""
        if not path.exists():
            return
        kept = self._kept_checkpoint
        if kept is not None and kept[0].exists() and os.path.samefile(kept[0], path):
            return
        raise CheckpointError(f"{path} holds another run's checkpoint; continue it with --resume {path}, or pass "
                              "another --out-dir (or move the file away)")

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
            self._check_progress(s, gn_v, found_inf > 0, scale)
            hist.step.append(s)
            hist.loss.append(loss_v)
            hist.grad_norm.append(gn_v)
            hist.lr.append(lr_s)
            hist.scale.append(scale)
            hist.skipped.append(found_inf > 0)
            hist.tokens_per_s.append(tps)
            flops = self.flops_per_token
            hist.mfu.append(flops * tps / self.peak if (self.peak and flops) else None)

    def _check_progress(self, step: int, grad_norm: float, skipped: bool, scale: float) -> None:
        """Stop a run that cannot learn: the last STALL_STEPS steps (or all, in a shorter run) were
        skipped for inf/nan gradients, or had gradients that are exactly zero (a loss scale so small
        that fp16 flushes them). Called for each step before it is appended to the History."""
        hist = self.history
        n = min(STALL_STEPS, self.cfg.steps)
        recent = list(zip(hist.skipped[-(n - 1):], hist.grad_norm[-(n - 1):])) if n > 1 else []
        recent.append((skipped, grad_norm))
        if len(recent) < n or not all(k or g == 0 for k, g in recent):
            return
        static = isinstance(self.scaler, StaticLossScaler)
        if all(k for k, _ in recent):
            what = f"were all skipped: their gradients overflow at loss scale {scale:g}"
            fix = "lower --static-scale" if static else "lower --lr or use bf16"
        else:
            what = ("were all skipped or had gradients that are exactly zero" if any(k for k, _ in recent)
                    else "all had gradients that are exactly zero") + f" (loss scale {scale:g})"
            fix = ("raise --static-scale" if static else "use --scaler dynamic (or bf16)"
                   if isinstance(self.scaler, NullScaler) and self.policy.loss_scaling
                   else "check the model and --data: these gradients are zero before any loss scaling")
        raise DivergenceError(f"training stalled at step {step}: the last {n} steps {what}; {self._kept()}; "
                              f"{fix}")

    def _kept(self) -> str:
        kept = self._kept_checkpoint
        if kept is not None and kept[0].is_file():
            return f"the last good checkpoint (step {kept[1]}) is kept at {kept[0]}"
        if self.cfg.out_dir:
            return "no checkpoint of this run was written before it"
        return "no checkpoint was written (set --out-dir and --checkpoint-interval to keep one)"


STALL_STEPS = 25  # steps in a row that learn nothing (all skipped, or zero gradients) before a run stops


def _tensors(obj):
    """Every tensor inside nested dicts and lists (an optimizer's state_dict)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _same_kind(saved, default) -> bool:
    """Whether a saved setting has the kind of value its default has: a number for a number, a flag for
    a flag, text for text, a dict for a dict; where the default is None, None or a number or text."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    if default is None:
        return saved is None or number(saved) or isinstance(saved, str)
    return type(saved) is type(default) or (number(saved) and number(default) and not isinstance(default, int))
