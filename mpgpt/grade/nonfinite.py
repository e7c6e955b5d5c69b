"""lab-nans-hooks: name the first module whose output holds an inf or a NaN (the NaN lab).

The learner writes ``first_nonfinite_module(model, run)``, the forward-hook detective of the lab;
the package's own is ``mpgpt.labs.nonfinite.first_nonfinite_module``. The checks build small
models with a planted overflow and know which module must be named.
"""
from __future__ import annotations

import random
from typing import Callable

import torch
from torch import nn

from mpgpt.model import GPT, GPTConfig

from .core import Case, Check, Failed, exact, expect

NAME = "lab-nans-hooks"
OWN = ("mpgpt.labs.nonfinite",)
LEGEND = ""

STUB = '''"""The NaN lab, graded: name the first module whose output holds an inf or a NaN.

Grade it with:  python -m mpgpt.grade lab-nans-hooks this_file.py
"""
from typing import Any, Callable

import torch
from torch import nn


def first_nonfinite_module(model: nn.Module, run: Callable[[], Any]) -> "str | None":
    """Call run() (which runs model's forward pass) with a forward hook on every module of model
    (register_forward_hook); return the name of the first module whose output contains an inf
    or a NaN, or None if every output was finite.

    - "First" is the order in which the pass *finishes* modules: a forward hook fires when the
      module's forward returns, so a child reports before its parent. That is not the order of
      model.named_modules(), which follows the attributes' definition.
    - Names are those of model.named_modules(): "blocks.0.mlp" for a nested module, "" for model.
    - Outputs may be a tensor or a tuple/list/dict of them (and of other things): check every
      floating-point tensor in it, for inf and for NaN.
    - Leave the model as you found it: remove every hook afterwards, also when run() raises.
    - Do not change any output (a forward hook that returns a value replaces the output).
    """
    raise NotImplementedError
'''


class _Scale(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class _Chain(nn.Module):
    """x -> lin -> scale (x factor) -> act -> out; the scale overflows fp16 when factor is huge."""

    def __init__(self, factor: float):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), _Scale(factor), nn.Tanh())
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.inner(x))


class _Reordered(nn.Module):
    """Defined b then a, run a then b: named_modules() order is not the order of the pass."""

    def __init__(self):
        super().__init__()
        self.b = _Scale(float("nan"))
        self.a = _Scale(float("inf"))

    def forward(self, x):
        return self.b(self.a(x))


class _TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.pair = _Pair()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        y, aux = self.pair(x)
        return self.head(y), aux


class _Pair(nn.Module):
    """Returns (finite tensor, tensor with an inf in it, a string): only the second is bad."""

    def forward(self, x):
        aux = x.clone()
        aux[0, 0] = float("inf")
        return x + 1.0, {"aux": aux, "note": "not a tensor"}


def _x():
    return torch.rand(3, 8) + 0.5


def _hooks_left(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _name(module, model, run) -> str | None:
    return exact(module.first_nonfinite_module(model, run), str, type(None), what="first_nonfinite_module")


def _expecting(name: str | None, what: str) -> Callable[[random.Random], Case]:
    """prepare(): the name the planted model must give (known without running anything)."""
    return lambda rng: Case({"what": what}, name)


HINTS = {
    "none": "return None when no hook saw an inf or a NaN (and the name of the first module that did)",
    "missed": "a hook must test every floating-point tensor of the output with torch.isfinite "
              "(inf and NaN alike: torch.isnan misses inf, torch.isinf misses NaN)",
    "order": "record the name inside the hook as the pass runs and keep the first; do not scan "
             "named_modules() afterwards (its order is the definition's, not the pass's)",
    "parent": "a forward hook on every module fires child first: keep the first report, not the last",
    "names": "use the names of model.named_modules() (\"inner.1\", \"\" for the model itself)",
}


def _judge_name(case: Case, got) -> None:
    want, what = case.expected, case.inputs["what"]
    if got == want:
        return
    if want is None:
        hint = HINTS["none"]
    elif got is None:
        hint = HINTS["missed"]
    elif isinstance(got, str) and want.startswith(got):  # a parent of the right module
        hint = HINTS["parent"]
    else:
        hint = None
    raise Failed(f"{what}: returned {got!r}, expected {want!r}", hint)


def _observe_finite(module, inputs):
    model = _Chain(2.0)
    return _name(module, model, lambda: model(_x()))


def _observe_inf(module, inputs):
    model = _Chain(1e38)  # lin's output times 1e38: some |value| passes fp32's 3.4e38 -> inf
    with torch.no_grad():
        model.inner[0].weight.fill_(1.0)
    return _name(module, model, lambda: model(_x() * 10))


def _observe_nan(module, inputs):
    model = _Chain(float("nan"))
    return _name(module, model, lambda: model(_x()))


def _observe_order(module, inputs):
    model = _Reordered()
    return _name(module, model, lambda: model(_x()))


def _observe_nested_outputs(module, inputs):
    model = _TupleOut()
    return _name(module, model, lambda: model(_x()))


def _observe_hooks_removed(module, inputs) -> list[int]:
    model = _Chain(float("nan"))
    module.first_nonfinite_module(model, lambda: model(_x()))
    after_normal = _hooks_left(model)

    def failing():
        model(_x())
        raise ValueError("the pass failed")
    try:
        module.first_nonfinite_module(model, failing)
    except ValueError:
        pass
    return [after_normal, _hooks_left(model) - after_normal]


def _judge_hooks_removed(case: Case, left) -> None:
    normal, raised = left
    expect(normal == 0, f"{normal} hooks left on the model after a normal run")
    expect(raised == 0, f"{raised} hooks left on the model after run() raised",
           "remove the hooks in a finally: block, so they go also when run() raises")


def _observe_outputs_unchanged(module, inputs) -> list:
    model = _Chain(3.0)
    x = _x()
    want = model(x)
    seen = []
    module.first_nonfinite_module(model, lambda: seen.append(model(x)))
    return [len(seen), len(seen) == 1 and type(seen[0]) is torch.Tensor and torch.equal(seen[0], want)]


def _judge_outputs_unchanged(case: Case, observed) -> None:
    calls, same = observed
    expect(calls == 1, f"run() was called {calls} times; call it once", "call run() exactly once")
    expect(same is True, "the model's output changed while the hooks were on",
           "a forward hook must return None: a hook that returns a value replaces the module's output")


def _observe_gpt(module, inputs):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=32, n_embd=32, n_layer=2, block_size=16))
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(2.0**20)  # c_fc's outputs reach ~1e6: past fp16's 65504
    x = torch.randint(0, 32, (2, 16))

    def run():
        with torch.autocast("cpu", dtype=torch.float16):
            return model(x, x)
    return _name(module, model, run)


def warm_up() -> None:
    """Run once in the child before the learner's file is imported (torch loads code lazily on a
    first forward pass under autocast): it must not count against the first behaviour's time."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=32, n_embd=32, n_layer=2, block_size=16))
    handles = [m.register_forward_hook(lambda *args: None) for m in model.modules()]
    x = torch.randint(0, 32, (2, 16))
    with torch.autocast("cpu", dtype=torch.float16):
        model(x, x)
    for h in handles:
        h.remove()


def checks() -> list[Check]:
    return [
        Check("None when every output is finite", HINTS["none"], _observe_finite, _judge_name,
              _expecting(None, "an all-finite model")),
        Check("names the module whose output overflows to inf", "check outputs with torch.isfinite "
              "(inf and NaN), and keep only the first report", _observe_inf, _judge_name,
              _expecting("inner.1", "Linear -> x1e38 (overflows to inf) -> Tanh -> Linear")),
        Check("NaN counts too", "torch.isnan alone misses inf and torch.isinf misses NaN: use torch.isfinite",
              _observe_nan, _judge_name, _expecting("inner.1", "a module that outputs NaN")),
        Check("the first module in the order of the pass", HINTS["order"], _observe_order, _judge_name,
              _expecting("a", "modules defined b, a but run a, b")),
        Check("tuple and dict outputs", "walk tuples, lists and dicts; skip what is not a floating tensor",
              _observe_nested_outputs, _judge_name,
              _expecting("pair", "a module returning (tensor, {'aux': tensor with an inf, 'note': str})")),
        Check("hooks are removed, also when run() raises", "keep the handles of register_forward_hook and "
              "call handle.remove() in a finally: block", _observe_hooks_removed, _judge_hooks_removed),
        Check("outputs are left unchanged", "a forward hook must return None; call run() exactly once",
              _observe_outputs_unchanged, _judge_outputs_unchanged),
        Check("finds the overflowing layer of the course GPT in fp16", "hook every module "
              "(model.modules(), not only model.children()) and use named_modules() names", _observe_gpt,
              _judge_name, _expecting("transformer.h.1.mlp.c_fc",
                                      "the course GPT in fp16 with an oversized c_fc weight in block 1")),
    ]
