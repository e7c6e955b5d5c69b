"""Find where a NaN or an inf first appears: hooks that name the module (the NaN lab, after chapter 5).

A NaN loss says nothing about where it came from: one overflowing activation poisons everything
after it. These two functions run a forward (or forward and backward) pass with a hook on every
module and report the first module, in the order the pass runs them, whose output (or whose input
gradient) holds an inf or a NaN. They are cheap enough for a debugging session, not for every
step: each hook reads a flag back from the device.

    name = first_nonfinite_module(model, lambda: model(x, y))          # forward
    name = first_nonfinite_grad(model, lambda: scaler.scale(model(x, y)[1]).backward())  # backward

Names are those of ``model.named_modules()`` ("" is the model itself). The hooks are removed
afterwards, also when the pass raises.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = ["first_nonfinite_module", "first_nonfinite_grad", "tensors_in", "all_finite"]


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every floating-point tensor inside a module's output: a tensor, or tuples/lists/dicts of them."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def all_finite(value: Any) -> bool:
    """True if no floating-point tensor in ``value`` holds an inf or a NaN (one sync per tensor)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors_in(value))


def first_nonfinite_module(model: nn.Module, run: Callable[[], Any]) -> str | None:
    """Call ``run()`` with a forward hook on every module of ``model``; return the name of the first
    module to finish its forward with an inf or NaN in its output, or None if none did.

    A module's forward hook fires when its forward returns, so children report before their parent
    and the first report is the innermost module where the values went bad.
    """
    found: list[str] = []
    names = {id(m): name for name, m in model.named_modules()}

    def hook(module, inputs, output):
        if not found and not all_finite(output):
            found.append(names[id(module)])

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def first_nonfinite_grad(model: nn.Module, run: Callable[[], Any]) -> str | None:
    """Call ``run()`` (a forward and a backward pass) with gradient hooks on every module's outputs
    and every parameter; return the name of the first of them, in the order backward computes
    the gradients, whose gradient holds an inf or a NaN, or None if none did.

    A module output is named after its module ("transformer.h.1.mlp.c_fc"), a parameter as in
    ``named_parameters()`` ("transformer.h.1.mlp.c_fc.weight"). Backward runs from the loss
    towards the inputs, so the first name is the latest point of the network where the gradient
    was already bad: with a loss scale too large for fp16, the output nearest the loss.
    """
    found: list[str] = []
    names = {id(m): name for name, m in model.named_modules()}

    def watch(name):
        def hook(grad):
            if not found and grad is not None and not bool(torch.isfinite(grad).all()):
                found.append(name)
        return hook

    def forward_hook(module, inputs, output):
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(watch(names[id(module)]))  # lives as long as the tensor: no handle to keep

    handles = [m.register_forward_hook(forward_hook) for m in model.modules()]
    handles += [p.register_hook(watch(name)) for name, p in model.named_parameters() if p.requires_grad]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None
