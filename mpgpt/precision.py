"""Precision policies: the one place that decides how a training step runs (chapter 3).

A policy answers four questions for the trainer:

1. In which dtype do the model's weights live during forward and backward?  (``param_dtype``)
2. Does the forward pass run under ``torch.autocast``, and to which dtype?   (``autocast_dtype``)
3. May fp32 matrix products use TF32 tensor cores?                          (``allow_tf32``)
4. Must the loss be scaled, and are there separate fp32 master weights?     (``loss_scaling``, ``master_weights``)

| policy        | weights  | autocast | TF32 | loss scaling | master weights |
| ------------- | -------- | -------- | ---- | ------------ | -------------- |
| `fp32`        | fp32     | off      | off  | no           | no (weights are fp32 already) |
| `tf32`        | fp32     | off      | on   | no           | no             |
| `bf16`        | fp32     | bf16     | on   | no           | no             |
| `fp16`        | fp32     | fp16     | on   | yes          | no             |
| `bf16-master` | bf16     | bf16     | on   | no           | yes (O2)       |
| `fp16-master` | fp16     | fp16     | on   | yes          | yes (O2)       |

`bf16`/`fp16` are autocast ("O1"-style): the weights stay fp32 and autocast casts them for each matmul.
The `-master` policies are O2-style: the model itself is cast to the low precision (half the weight
memory, no per-op casts of weights), and the optimizer updates a separate fp32 copy — the master
weights — because small updates round away in a 16-bit weight (chapter 3 shows the stall).

Device rules (DESIGN.md, section 3): bf16 needs compute capability >= 8.0. We read the capability
instead of ``torch.cuda.is_bf16_supported()``, which answers True on a T4 because bf16 is *emulated*
there (slowly). TF32 exists only on NVIDIA tensor cores from Ampere (sm_80) on. On a CPU every
policy but `tf32` runs — autocast supports bf16 and fp16 on CPU — which is enough for the course
to demonstrate the numerics on a laptop; it is not faster there.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from mpgpt import runtime

__all__ = [
    "PrecisionPolicy", "POLICIES", "resolve_precision", "default_precision", "device_capability",
    "supported_precisions",
    "MasterWeights",
]


@dataclass(frozen=True)
class PrecisionPolicy:
    """How one training step runs. Build it with :func:`resolve_precision`, not by hand."""

    name: str
    param_dtype: torch.dtype            # dtype of the weights the forward pass reads
    autocast_dtype: torch.dtype | None  # None: no autocast
    allow_tf32: bool                    # fp32 matmuls may use TF32 tensor cores (CUDA only)
    loss_scaling: bool                  # fp16 gradients underflow without it
    master_weights: bool                # optimizer updates a separate fp32 copy (O2)
    summary: str

    def autocast(self, device_type: str):
        """The autocast context for the forward pass (a no-op context for fp32/tf32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)

    def configure_backends(self) -> None:
        """Set the process-wide fp32 matmul precision: 'highest' = true fp32, 'high' = TF32 allowed."""
        torch.set_float32_matmul_precision("high" if self.allow_tf32 else "highest")


POLICIES: dict[str, PrecisionPolicy] = {
    "fp32": PrecisionPolicy("fp32", torch.float32, None, False, False, False,
                            "fp32 everywhere, TF32 off: the reference"),
    "tf32": PrecisionPolicy("tf32", torch.float32, None, True, False, False,
                            "fp32 weights, matmuls on TF32 tensor cores (10-bit mantissa inputs)"),
    "bf16": PrecisionPolicy("bf16", torch.float32, torch.bfloat16, True, False, False,
                            "fp32 weights, autocast to bf16"),
    "fp16": PrecisionPolicy("fp16", torch.float32, torch.float16, True, True, False,
                            "fp32 weights, autocast to fp16, dynamic loss scaling"),
    "bf16-master": PrecisionPolicy("bf16-master", torch.bfloat16, torch.bfloat16, True, False, True,
                                   "bf16 model, fp32 master weights in the optimizer (O2)"),
    "fp16-master": PrecisionPolicy("fp16-master", torch.float16, torch.float16, True, True, True,
                                   "fp16 model, fp32 master weights, dynamic loss scaling (O2)"),
}

_NEEDS_SM80 = {"bf16", "bf16-master", "tf32"}


def device_capability(device) -> tuple[int, int] | None:
    """Compute capability of a CUDA device as (major, minor); None for anything else."""
    return runtime.capability(torch.device(device))


def default_precision(device) -> str:
    """The policy a user gets without asking: bf16 on sm_80+, fp16 on older GPUs, fp32 on CPU."""
    cap = device_capability(device)
    if cap is None:
        return "fp32"
    return "bf16" if cap >= (8, 0) else "fp16"


def supported_precisions(device) -> tuple[str, ...]:
    """The policies ``device`` runs natively, in the order the course compares them: on sm_80+
    GPUs and on a CPU the bf16 family, below sm_80 (a T4) the fp16 family with loss scaling."""
    cap = device_capability(device)
    if cap is None:
        return ("fp32", "bf16", "bf16-master", "fp16", "fp16-master")
    if cap < (8, 0):
        return ("fp32", "fp16", "fp16-master")
    return ("fp32", "tf32", "bf16", "bf16-master", "fp16", "fp16-master")


def resolve_precision(name: str | None, device) -> PrecisionPolicy:
    """Return the policy called ``name`` (or the device's default) after checking the device can run it.

    Raises ValueError with a one-line message that names what to use instead.
    """
    device = torch.device(device)
    if name is None or name == "auto":
        name = default_precision(device)
    if name not in POLICIES:
        raise ValueError(f"unknown precision {name!r}; choose one of {', '.join(POLICIES)}")
    if device.type not in ("cpu", "cuda"):
        if name != "fp32":
            raise ValueError(f"precision {name!r} is only wired up for cpu and cuda, not {device.type}; use fp32")
        return POLICIES[name]
    cap = device_capability(device)
    if device.type == "cpu" and name == "tf32":
        raise ValueError("tf32 is a mode of NVIDIA tensor cores (sm_80+) and does not exist on a CPU; "
                         "use fp32 (or bf16 to see autocast on a CPU)")
    if cap is not None and cap < (8, 0) and name in _NEEDS_SM80:
        gpu = runtime.device_name(device)
        instead = "fp16-master" if name == "bf16-master" else "fp16"
        raise ValueError(f"{name} needs compute capability >= 8.0 but {gpu} is sm_{cap[0]}{cap[1]} "
                         f"(bf16 is only emulated there); use {instead} with dynamic loss scaling")
    return POLICIES[name]


class MasterWeights:
    """O2-style fp32 master weights for a model whose own parameters are bf16 or fp16.

    The model is cast to ``dtype`` in place, so its forward and backward read and write 16-bit
    tensors. ``params`` are fp32 copies, one per model parameter, in the same order; build the
    optimizer on them. Each step:

        loss.backward()            # 16-bit grads on the model's parameters
        mw.grads_to_master()       # master.grad = fp32 copy (then unscale, clip, step on masters)
        optimizer.step()
        mw.master_to_model()       # round the updated fp32 masters back into the 16-bit model

    An update too small to change a 16-bit weight still accumulates in its fp32 master, and shows up
    in the model once enough of them add up — the reason master weights exist.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.model = model
        self.names = [n for n, _ in model.named_parameters()]
        # Copy in fp32 *before* casting the model, so no precision is lost at the start.
        self.params = [nn.Parameter(p.detach().clone().float()) for p in model.parameters()]
        model.to(dtype)

    def named_params(self):
        return list(zip(self.names, self.params))

    @torch.no_grad()
    def grads_to_master(self) -> None:
        """fp32 copies of the model's 16-bit gradients (None stays None)."""
        for master, p in zip(self.params, self.model.parameters()):
            master.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Round the fp32 masters into the model's 16-bit parameters (round-to-nearest-even)."""
        model_params = list(self.model.parameters())
        torch._foreach_copy_(model_params, self.params)

    def state_dict(self) -> dict:
        """The fp32 masters, keyed like the model's state_dict: the canonical weights to checkpoint."""
        return {name: p.detach().clone() for name, p in zip(self.names, self.params)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for name, p in zip(self.names, self.params):
            p.copy_(state[name])
        self.master_to_model()
