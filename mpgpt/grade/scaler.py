"""ch5-scaler: the dynamic loss scaler of chapter 5, behind GradScaler's four calls.

The learner writes a class ``DynamicLossScaler`` with the protocol of ``mpgpt.scaling`` (and of
``torch.amp.GradScaler``): ``scale(loss)``, ``unscale_(optimizer)``, ``step(optimizer)``,
``update()``, plus ``get_scale()``, ``state_dict()`` and ``load_state_dict()``. The expected
behaviour is ``torch.amp.GradScaler``'s on the CPU: the same scale after every update and the same
skipped steps, which chapter 5 shows for the package's own scaler.
"""
from __future__ import annotations

import random
from typing import Any, Callable

import torch

from .core import Case, Check, Failed, expect

NAME = "ch5-scaler"

STUB = '''"""Chapter 5, graded: a dynamic loss scaler with GradScaler's protocol.

Grade it with:  python -m mpgpt.grade ch5-scaler this_file.py

A training step uses it as it uses torch.amp.GradScaler:

    scaler.scale(loss).backward()   # gradients are S times too large
    scaler.unscale_(optimizer)      # optional: divide by S now (e.g. to clip true gradients)
    scaler.step(optimizer)          # unscale if not done yet; skip optimizer.step() on inf/nan
    scaler.update()                 # adapt S to what this iteration saw
"""
import torch


class DynamicLossScaler:
    """Dynamic loss scaling: halve the scale after an overflow, double it after
    ``growth_interval`` clean steps in a row.

    The state is two numbers: the scale S and a growth tracker, the count of clean steps since
    the scale last changed. After an iteration whose gradients held an inf or a NaN: skip the
    optimizer step, S *= backoff_factor, tracker = 0. After a clean one: tracker += 1, and when
    it reaches growth_interval, S *= growth_factor and tracker = 0.
    """

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        raise NotImplementedError

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Return loss * S."""
        raise NotImplementedError

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide every gradient of ``optimizer`` by S, in place, and remember whether any of
        them holds an inf or a NaN. At most once per iteration: a second call before update()
        raises RuntimeError (dividing twice would make every gradient S times too small)."""
        raise NotImplementedError

    def step(self, optimizer: torch.optim.Optimizer):
        """Unscale (unless unscale_ was called this iteration), then call optimizer.step() only
        if every gradient is finite. Return what optimizer.step() returns, or None if skipped."""
        raise NotImplementedError

    def update(self) -> None:
        """End the iteration: back off after an overflow, grow after growth_interval clean steps."""
        raise NotImplementedError

    def get_scale(self) -> float:
        """The current scale S as a Python float."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Everything needed to continue the run after a restart, as plain Python numbers."""
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() saved, so that the resumed run continues exactly."""
        raise NotImplementedError
'''


OWN = ("mpgpt.scaling",)
# torch's scaler is what the checks compare with: a file that uses it is not graded either.
# So are the two kernels it is built on (the scale update is the behaviour graded here).
REFERENCE_NAMES = ("GradScaler", "_amp_update_scale_", "_amp_foreach_non_finite_check_and_unscale_")
REFERENCES = ("torch.amp.GradScaler", "torch.amp.grad_scaler.GradScaler", "torch.cuda.amp.GradScaler",
              "torch.cuda.amp.grad_scaler.GradScaler", "torch.cpu.amp.GradScaler", "torch.GradScaler",
              "torch._amp_update_scale_", "torch._amp_foreach_non_finite_check_and_unscale_",
              "torch.ops.aten._amp_update_scale_", "torch.ops.aten._amp_foreach_non_finite_check_and_unscale_")
REFERENCE_FILES = ("torch.amp.grad_scaler", "torch.cuda.amp.grad_scaler", "torch.cpu.amp.grad_scaler")
LEGEND = ("Flags in a failure line: one letter per iteration, '.' clean, 'x' an inf in a gradient, "
          "'n' a NaN in a gradient; the last letter is the iteration where your scaler went wrong.")

HINTS = {
    "nan": "a NaN gradient was not caught: check every gradient with torch.isfinite (NaN != NaN, so a "
           "test for inf or a comparison with a threshold misses it)",
    "inf": "an inf gradient was not caught: check every gradient with torch.isfinite and skip "
           "optimizer.step() when any element is not finite",
    "clean_skipped": "a clean iteration was skipped: recompute the inf/NaN flag in every iteration "
                     "(and clear it in update()), so an old overflow does not skip later steps",
    "no_backoff": "after an overflow: S *= backoff_factor (in update(), once per iteration)",
    "backoff_factor": "back off by backoff_factor exactly (the constructor's argument), once per overflow",
    "late_growth": "count clean steps; grow when the count reaches growth_interval (not one later), "
                   "then restart the count at 0",
    "early_growth": "grow only after growth_interval clean steps in a row; restart the count at 0 "
                    "after each growth",
    "reset": "any overflow resets the growth count to 0, so the next growth needs a full window of "
             "clean steps",
    "growth_factor": "grow by growth_factor exactly (the constructor's argument)",
    "clean_backoff": "the scale went down after a clean iteration: clear the overflow flag in update()",
    "get_scale": "get_scale() returns S as a Python float (float(S)), not a tensor",
}


def _model(p0: list[float], g0: list[float]):
    """One parameter vector and the gradient its loss (p * g).sum() gives it."""
    return torch.nn.Parameter(torch.tensor(p0)), torch.tensor(g0)


def _draw_model(rng: random.Random) -> dict:
    """Fresh, nonzero values: the parameter and its target gradient."""
    return {"p": [rng.uniform(0.5, 1.5) for _ in range(4)], "g": [rng.uniform(0.5, 1.5) for _ in range(4)]}


def _iteration(scaler, p, g, optimizer, flag: str, unscale_first: bool = False) -> bool:
    """One training iteration; flag '.' clean, 'x' an inf gradient, 'n' a NaN. Returns: stepped?"""
    taken = []
    handle = optimizer.register_step_post_hook(lambda *args: taken.append(True))
    try:
        optimizer.zero_grad(set_to_none=True)
        scaler.scale((p * g).sum()).backward()
        if flag != ".":
            with torch.no_grad():
                p.grad[1] = float("inf") if flag == "x" else float("nan")
        if unscale_first:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    finally:
        handle.remove()
    return bool(taken)


def _scale_of(scaler) -> float:
    s = scaler.get_scale()
    if type(s) not in (float, int):
        raise Failed(f"get_scale() returned {type(s).__name__}, not a float", HINTS["get_scale"])
    return float(s)


def _trajectory(scaler, flags: str, model: dict) -> list:
    """[scales after each update(), whether each iteration stepped]"""
    p, g = _model(model["p"], model["g"])
    optimizer = torch.optim.SGD([p], lr=0.0)
    scales, stepped = [], []
    for flag in flags:
        stepped.append(_iteration(scaler, p, g, optimizer, flag))
        scales.append(_scale_of(scaler))
    return [scales, stepped]


# --- trajectories: the learner's scaler and torch.amp.GradScaler on the same flags


def _runs(*runs: tuple[str, dict]) -> Callable[[random.Random], Case]:
    """prepare(): fixed runs (flags, constructor arguments), GradScaler's trajectory for each."""
    def prepare(rng: random.Random) -> Case:
        return _reference_case([(flags, kw) for flags, kw in runs], rng)
    return prepare


def _reference_case(runs: list[tuple[str, dict]], rng: random.Random) -> Case:
    inputs = [{"flags": flags, "kw": kw, "model": _draw_model(rng)} for flags, kw in runs]
    expected = [_trajectory(torch.amp.GradScaler("cpu", **run["kw"]), run["flags"], run["model"]) for run in inputs]
    return Case(inputs, expected)


def _observe_runs(module, inputs) -> list:
    return [_trajectory(module.DynamicLossScaler(**run["kw"]), run["flags"], run["model"]) for run in inputs]


def _divergence(flags: str, kw: dict, got: list, want: list) -> Failed | None:
    """The first iteration where the learner's trajectory leaves GradScaler's, as a Failed whose
    hint names the behaviour that went wrong there."""
    interval = kw.get("growth_interval", 2000)
    growth = kw.get("growth_factor", 2.0)
    for i, flag in enumerate(flags):
        a, b = float(got[0][i]), float(want[0][i])
        s, t = bool(got[1][i]), bool(want[1][i])
        where = f"iteration {i} (flags {flags[:i + 1]!r}, {kw})"
        if s != t:
            hint = HINTS["clean_skipped"] if flag == "." else HINTS["nan" if flag == "n" else "inf"]
            return Failed(f"{where} was {'taken' if s else 'skipped'}, should be {'taken' if t else 'skipped'}", hint)
        if a == b:
            continue
        prev = float(want[0][i - 1]) if i else float(kw.get("init_scale", 2.0**16))
        if flag != ".":
            hint = HINTS["no_backoff"] if a == prev else HINTS["backoff_factor"]
        elif a < prev:
            hint = HINTS["clean_backoff"]
        elif b > prev:  # GradScaler grew here
            hint = HINTS["late_growth"] if a == prev else HINTS["growth_factor"]
        else:  # the learner grew where GradScaler did not
            recent = flags[max(0, i + 1 - interval): i + 1]
            hint = HINTS["reset"] if any(f != "." for f in recent) else (
                HINTS["early_growth"] if a == prev * growth else HINTS["growth_factor"])
        return Failed(f"after {where} the scale is {a:g}, expected {b:g}", hint)
    return None


def _judge_runs(what: str) -> Callable[[Case, Any], None]:
    def judge(case: Case, observed) -> None:
        for run, got, want in zip(case.inputs, observed, case.expected, strict=True):
            failure = _divergence(run["flags"], run["kw"], got, want)
            if failure:
                failure.seen = f"{what}: {failure.seen}"
                raise failure
    return judge


def _random_runs(rng: random.Random) -> Case:
    runs = []
    for _ in range(3):
        flags = "".join(rng.choice("......xn") for _ in range(40))
        kw = dict(init_scale=2.0 ** rng.randint(4, 20), growth_interval=rng.randint(1, 5),
                  growth_factor=rng.choice((2.0, 4.0)), backoff_factor=rng.choice((0.5, 0.25)))
        runs.append((flags, kw))
    return _reference_case(runs, rng)


# --- scale(loss)


def _prepare_scale(rng: random.Random) -> Case:
    loss = torch.tensor(rng.uniform(0.5, 1.5), dtype=torch.float32)
    return Case({"loss": loss.item()}, {"scaled": (loss * 1024.0).item()})


def _observe_scale(module, inputs) -> dict:
    s = module.DynamicLossScaler(init_scale=1024.0)
    first = _scale_of(s)
    loss = torch.tensor(inputs["loss"], dtype=torch.float32, requires_grad=True)
    out = s.scale(loss)
    if type(out) is not torch.Tensor:
        raise Failed(f"scale(loss) returned {type(out).__name__}, not a torch.Tensor")
    return {"first_scale": first, "dtype": str(out.dtype), "shape": list(out.shape),
            "value": out.detach().float().item() if out.numel() == 1 else None, "requires_grad": out.requires_grad}


def _judge_scale(case: Case, seen) -> None:
    loss = case.inputs["loss"]
    expect(seen["first_scale"] == 1024.0, f"get_scale() is {seen['first_scale']!r} before any update; expected 1024.0",
           "store init_scale as the first scale")
    expect(seen["dtype"] == "torch.float32" and seen["shape"] == [],
           f"scale(loss) returned a {seen['dtype']} tensor of shape {seen['shape']} for a float32 scalar loss",
           "return loss * S: same dtype and shape as the loss")
    expect(seen["value"] == case.expected["scaled"],
           f"scale(loss) gave {seen['value']!r} for loss {loss!r} at S = 1024", "return loss * S")
    expect(seen["requires_grad"] is True, "scale(loss) is not differentiable (requires_grad is False)",
           "multiply the loss tensor itself; do not call .item() or detach()")


# --- the gradient an optimizer step applies


def _prepare_true_update(pattern: list[bool]) -> Callable[[random.Random], Case]:
    def prepare(rng: random.Random) -> Case:
        return Case({"pattern": pattern, "model": _draw_model(rng)})
    return prepare


def _observe_true_update(module, inputs) -> list:
    """Clean iterations (one per entry of the pattern, each with or without an explicit unscale_()):
    [stepped, the gradient SGD applied] for each."""
    p, g = _model(inputs["model"]["p"], inputs["model"]["g"])
    scaler = module.DynamicLossScaler(init_scale=2.0**10, growth_interval=1000)
    optimizer = torch.optim.SGD([p], lr=0.5)
    out = []
    for first in inputs["pattern"]:
        before = p.detach().clone()
        stepped = _iteration(scaler, p, g, optimizer, ".", unscale_first=first)
        out.append([stepped, ((before - p.detach()) / 0.5).tolist()])
    return out


def _judge_true_update(case: Case, observed) -> None:
    g = torch.tensor(case.inputs["model"]["g"])
    for i, (first, (stepped, applied)) in enumerate(zip(case.inputs["pattern"], observed, strict=True)):
        expect(stepped is True, f"clean iteration {i} was skipped", HINTS["clean_skipped"])
        delta = torch.tensor(applied, dtype=torch.float32)
        ratio = (delta / g).mean().item()
        if not torch.allclose(delta, g, rtol=1e-5, atol=0):
            if abs(ratio - 1024.0) < 1:
                hint = ("divide every gradient by S before optimizer.step() (step() unscales when unscale_() "
                        "was not called)")
            elif abs(ratio * 1024.0 - 1) < 1e-3:
                hint = ("the gradients were divided by S twice: remember that this iteration is already unscaled, "
                        "let step() skip its own unscale, and clear that in update()")
            else:
                hint = None
            raise Failed(f"iteration {i} ({'with' if first else 'without'} unscale_() first) applied gradients "
                         f"{ratio:.3g} times the true ones (S = 1024)", hint)


# --- unscale_() twice, and skipping


def _observe_unscale_twice(module, inputs) -> bool:
    p, g = _model([1.0] * 4, [1.0] * 4)
    scaler = module.DynamicLossScaler()
    optimizer = torch.optim.SGD([p], lr=0.1)
    scaler.scale((p * g).sum()).backward()
    scaler.unscale_(optimizer)
    try:
        scaler.unscale_(optimizer)
    except RuntimeError:
        return True
    return False


def _judge_unscale_twice(case: Case, raised) -> None:
    expect(raised is True, "a second unscale_() in the same iteration did not raise RuntimeError")


def _observe_skips(module, inputs) -> dict:
    out = {}
    for flag in "xn":
        p, g = _model(inputs["p"], inputs["g"])
        before = p.detach().clone()
        scaler = module.DynamicLossScaler()
        optimizer = torch.optim.SGD([p], lr=0.5)
        stepped = _iteration(scaler, p, g, optimizer, flag)
        out[flag] = [stepped, torch.equal(p.detach(), before)]
    return out


def _judge_skips(case: Case, observed) -> None:
    for flag, what in (("n", "a NaN"), ("x", "an inf")):
        stepped, unchanged = observed[flag]
        expect(stepped is False and unchanged is True, f"an iteration with {what} gradient was not skipped",
               HINTS["nan" if flag == "n" else "inf"])


# --- state_dict() and load_state_dict()


def _prepare_resume(rng: random.Random) -> Case:
    # Clean steps first, so that a cut at 2 or 3 falls mid-window (a lost tracker delays the growth),
    # then a random tail.
    flags = "." * 10 + "".join(rng.choice(".....x") for _ in range(20))
    return Case({"flags": flags, "kw": dict(init_scale=2.0**12, growth_interval=4), "model": _draw_model(rng),
                 "cuts": [2, 3, 9, 10, 11, 12, 13, 14]})


def _observe_resume(module, inputs) -> dict:
    flags, kw, model = inputs["flags"], inputs["kw"], inputs["model"]
    whole = _trajectory(module.DynamicLossScaler(**kw), flags, model)
    resumed = []
    for cut in inputs["cuts"]:
        first = module.DynamicLossScaler(**kw)
        head = _trajectory(first, flags[:cut], model)
        state = first.state_dict()
        if not isinstance(state, dict):
            raise Failed(f"state_dict() returned {type(state).__name__}, not a dict")
        second = module.DynamicLossScaler()  # built with the defaults: the state must carry everything
        second.load_state_dict(state)
        tail = _trajectory(second, flags[cut:], model)
        resumed.append([head[0] + tail[0], head[1] + tail[1]])
    return {"whole": whole, "resumed": resumed}


def _judge_resume(case: Case, observed) -> None:
    flags, kw = case.inputs["flags"], case.inputs["kw"]
    for cut, run in zip(case.inputs["cuts"], observed["resumed"], strict=True):
        if run != observed["whole"]:
            i = next((i for i in range(len(flags)) if run[0][i] != observed["whole"][0][i]
                      or run[1][i] != observed["whole"][1][i]), len(flags))
            hint = ("save the scale itself: the resumed run started from another scale" if i == cut else None)
            raise Failed(f"a run resumed from state_dict() after iteration {cut} departs from the "
                         f"uninterrupted one at iteration {i} (flags {flags!r}, {kw})", hint)


def warm_up() -> None:
    """Run once in the child before the learner's file is imported: torch's first optimizer step
    loads code lazily, which must not count against the time limit of the first behaviour."""
    p, g = _model([1.0] * 4, [1.0] * 4)
    optimizer = torch.optim.SGD([p], lr=0.5)
    handle = optimizer.register_step_post_hook(lambda *args: None)
    (p * g).sum().backward()
    bool(torch.isfinite(p.grad).all())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    handle.remove()


def checks() -> list[Check]:
    return [
        Check("scale(loss) multiplies by the scale", "return loss * S as a tensor; the first scale is init_scale",
              _observe_scale, _judge_scale, _prepare_scale),
        Check("step() applies the true gradients", "step() must divide the gradients by S (unscale) "
              "before optimizer.step() when unscale_() was not called",
              _observe_true_update, _judge_true_update, _prepare_true_update([False])),
        Check("unscale_() then step() divides by S only once", "remember that this iteration is already "
              "unscaled, and let step() skip its own unscale; reset that in update()",
              _observe_true_update, _judge_true_update, _prepare_true_update([True, False, True, False])),
        Check("a second unscale_() in one iteration raises", "track the stage of the iteration; a second "
              "call before update() must raise RuntimeError", _observe_unscale_twice, _judge_unscale_twice),
        Check("steps with inf or NaN gradients are skipped", "check every gradient with torch.isfinite "
              "(NaN too, not only inf) and do not call optimizer.step() when any is not finite",
              _observe_skips, _judge_skips, lambda rng: Case(_draw_model(rng))),
        Check("an overflow backs the scale off", HINTS["no_backoff"], _observe_runs, _judge_runs("backoff"),
              _runs(("xxn", dict(growth_interval=5)), ("x.", dict(init_scale=64.0, backoff_factor=0.25)))),
        Check("the scale grows after growth_interval clean steps", HINTS["late_growth"], _observe_runs,
              _judge_runs("growth"), _runs(("." * 10, dict(growth_interval=3)),
                                           ("." * 6, dict(growth_interval=1, growth_factor=4.0)))),
        Check("an overflow restarts the growth count", HINTS["reset"], _observe_runs,
              _judge_runs("growth after an overflow"), _runs(("..x...x....", dict(growth_interval=3)))),
        Check("same scales and skipped steps as torch.amp.GradScaler", "compare your trajectory with "
              "GradScaler's on the same flags, iteration by iteration (chapter 5's replay_scaler)",
              _observe_runs, _judge_runs("random run"), _random_runs),
        Check("state_dict() resumes the run exactly", "save the growth tracker and the factors and interval "
              "as well as the scale; load_state_dict() must restore all of them",
              _observe_resume, _judge_resume, _prepare_resume),
    ]
