"""Registering the kernels as PyTorch operators in the namespace `mpgpt`, at little host cost.

torch.compile treats an operator as a box: its graph records one call, and a "fake"
implementation tells the compiler the outputs' shapes and dtypes (ops.py says why the kernels
need this). PyTorch offers two ways to make one:

* `torch.library.custom_op` wraps the function in Python layers that run at *every* call: an
  autograd step (which, with no backward registered, only checks that no gradient is wanted) and
  a wrapper that checks the outputs do not alias the inputs;
* `torch.library.Library`: define the schema, register the function for the backends, register
  the fake. The dispatcher calls the function directly.

The compiled training step calls these operators 100-200 times, and each call must leave the
host's time to the GPU. `custom_op` wraps every call in Python checks of its own; `Library` lets
the dispatcher call the function directly, which on an H100 machine's host cost a few
microseconds a call over the plain function against about fifteen for `custom_op`. So the
operators here are registered the second way. Neither way gives the operator a backward formula: our autograd Functions (linear.py, mlp.py,
qkv.py, layernorm.py) call the operators in their forward and backward and supply the gradients
themselves.

Operators that write into an argument (embedding.py's) keep `custom_op`, which handles the
mutation's bookkeeping for torch.compile; they run once a step.
"""
from __future__ import annotations

from typing import Callable

import torch

NAMESPACE = "mpgpt"
# One fragment of the namespace for every operator defined here (kept alive for the process:
# dropping a Library object unregisters its operators).
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
DEFINED: list[str] = []  # the names registered here, in order


def operator(name: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Register `impl` as the operator mpgpt::name and return it (`torch.ops.mpgpt.<name>.default`).

    The schema is inferred from impl's type annotations, as custom_op infers it; impl must return
    new tensors (no output may alias an input), and `fake` must return tensors of the outputs'
    shapes, dtypes and strides without computing anything. impl runs for every device
    (CompositeExplicitAutograd: one kernel for CPU and CUDA alike, and not decomposed by compile)."""
    schema = torch.library.infer_schema(impl, mutates_args=())
    _LIB.define(name + schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    DEFINED.append(name)
    return getattr(getattr(torch.ops, NAMESPACE), name).default
