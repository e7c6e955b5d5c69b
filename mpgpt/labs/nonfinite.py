"""Find where a NaN or an inf first appears: hooks that name the module (the NaN lab, after chapter 5).

A NaN loss says nothing about where it came from: one overflowing activation poisons everything
after it. These two functions run a forward (or forward and backward) pass with a hook on every
module and report the first module, in the order the pass runs them, whose output (or whose input
gradient) holds an inf or a NaN. They are cheap enough for a debugging session, not for every
step: each hook reads a flag back from the device.

    name = first_nonfinite_module(model, lambda: model(x, y))          # forward
    name = first_nonfinite_grad(model, lambda: model(x, y)[1].backward())  # backward

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
    """Call ``run()`` (a forward and a backward pass) with a backward hook on every module; return the
    name of the first module, in backward order, whose gradient with respect to its inputs holds an
    inf or a NaN while the gradient it received was finite: the module where the gradient went bad.
    None if there is none (all finite, or the bad values arrived with the loss itself)."""
    found: list[str] = []
    names = {id(m): name for name, m in model.named_modules()}

    def hook(module, grad_input, grad_output):
        if not found and all_finite(grad_output) and not all_finite(grad_input):
            found.append(names[id(module)])

    handles = [m.register_full_backward_hook(hook) for m in model.modules()]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None

