"""ch5-scaler: the dynamic loss scaler of chapter 5, behind GradScaler's four calls.

The learner writes a class ``DynamicLossScaler`` with the protocol of ``mpgpt.scaling`` (and of
``torch.amp.GradScaler``): ``scale(loss)``, ``unscale_(optimizer)``, ``step(optimizer)``,
``update()``, plus ``get_scale()``, ``state_dict()`` and ``load_state_dict()``. The expected
behaviour is ``torch.amp.GradScaler``'s on the CPU: the same scale after every update and the same
skipped steps, which chapter 5 shows for the package's own scaler.
"""
from __future__ import annotations

import random

import torch

from .core import Check, Failed, expect

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


def _model():
    """One parameter vector with fresh, nonzero target gradients."""
    p = torch.nn.Parameter(torch.rand(4) + 0.5)
    g = torch.rand(4) + 0.5
    return p, g


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


def _trajectory(scaler, flags: str):
    p, g = _model()
    optimizer = torch.optim.SGD([p], lr=0.0)
    scales, stepped = [], []
    for flag in flags:
        stepped.append(_iteration(scaler, p, g, optimizer, flag))
        scales.append(float(scaler.get_scale()))
    return scales, stepped


def _reference(flags: str, **kw):
    return _trajectory(torch.amp.GradScaler("cpu", **kw), flags)


def _compare(module, flags: str, what: str, **kw) -> None:
    want_scales, want_steps = _reference(flags, **kw)
    got_scales, got_steps = _trajectory(module.DynamicLossScaler(**kw), flags)
    for i, (a, b, s, t) in enumerate(zip(got_scales, want_scales, got_steps, want_steps)):
        if s != t:
            raise Failed(f"{what}: iteration {i} ({flags[:i + 1]!r}) was {'taken' if s else 'skipped'}, "
                         f"should be {'taken' if t else 'skipped'}")
        if a != b:
            raise Failed(f"{what}: after iteration {i} (flags {flags[:i + 1]!r}, {kw}) the scale is {a:g}, "
                         f"expected {b:g}")


def _check_scale(module) -> None:
    s = module.DynamicLossScaler(init_scale=1024.0)
    loss = torch.rand(()) + 0.5
    out = s.scale(loss)
    expect(isinstance(out, torch.Tensor), f"scale(loss) returned {type(out).__name__}, not a tensor")
    expect(torch.equal(out, loss * 1024.0), f"scale(loss) gave {out.item():g} for loss {loss.item():g} at S = 1024")
    expect(out.requires_grad == loss.requires_grad, "scale(loss) must stay differentiable")
    expect(float(s.get_scale()) == 1024.0, f"get_scale() is {s.get_scale()!r} before any update; expected 1024.0")


def _true_update(module, unscale_first) -> None:
    """Clean iterations (one per entry of `unscale_first`, each with or without an explicit
    unscale_()); each must apply the true gradient, so state left over from an earlier iteration
    (an "already unscaled" flag never reset) is caught too."""
    pattern = [unscale_first] if isinstance(unscale_first, bool) else list(unscale_first)
    p, g = _model()
    scaler = module.DynamicLossScaler(init_scale=2.0**10, growth_interval=1000)
    optimizer = torch.optim.SGD([p], lr=0.5)
    for i, first in enumerate(pattern):
        before = p.detach().clone()
        stepped = _iteration(scaler, p, g, optimizer, ".", unscale_first=first)
        expect(stepped, f"clean iteration {i} was skipped")
        delta = (before - p.detach()) / 0.5  # the gradient SGD applied
        ratio = (delta / g).mean().item()
        expect(torch.allclose(delta, g, rtol=1e-5, atol=0),
               f"iteration {i} ({'with' if first else 'without'} unscale_() first) applied gradients "
               f"{ratio:.3g} times the true ones (S = 1024)")


def _check_step_unscales(module) -> None:
    _true_update(module, unscale_first=False)


def _check_unscale_once(module) -> None:
    _true_update(module, unscale_first=[True, False, True, False])


def _check_unscale_twice_raises(module) -> None:
    p, g = _model()
    scaler = module.DynamicLossScaler()
    optimizer = torch.optim.SGD([p], lr=0.1)
    scaler.scale((p * g).sum()).backward()
    scaler.unscale_(optimizer)
    try:
        scaler.unscale_(optimizer)
    except RuntimeError:
        return
    raise Failed("a second unscale_() in the same iteration did not raise RuntimeError")


def _check_skips(module) -> None:
    for flag, what in (("x", "an inf"), ("n", "a NaN")):
        p, g = _model()
        before = p.detach().clone()
        scaler = module.DynamicLossScaler()
        optimizer = torch.optim.SGD([p], lr=0.5)
        stepped = _iteration(scaler, p, g, optimizer, flag)
        expect(not stepped and torch.equal(p.detach(), before), f"an iteration with {what} gradient was not skipped")


def _check_backoff(module) -> None:
    _compare(module, "xxn", "backoff", growth_interval=5)
    _compare(module, "x.", "backoff", init_scale=64.0, backoff_factor=0.25)


def _check_growth(module) -> None:
    _compare(module, "." * 10, "growth", growth_interval=3)
    _compare(module, "." * 6, "growth", growth_interval=1, growth_factor=4.0)


def _check_reset(module) -> None:
    _compare(module, "..x...x....", "growth after an overflow", growth_interval=3)


def _check_gradscaler(module) -> None:
    rng = random.Random()
    for _ in range(3):
        flags = "".join(rng.choice("......xn") for _ in range(40))
        kw = dict(init_scale=2.0 ** rng.randint(4, 20), growth_interval=rng.randint(1, 5),
                  growth_factor=rng.choice((2.0, 4.0)), backoff_factor=rng.choice((0.5, 0.25)))
        _compare(module, flags, "random run", **kw)


def _check_resume(module) -> None:
    rng = random.Random()
    # Clean steps first, so that a cut at 2 or 3 falls mid-window (a lost tracker delays the growth),
    # then a random tail.
    flags = "." * 10 + "".join(rng.choice(".....x") for _ in range(20))
    kw = dict(init_scale=2.0**12, growth_interval=4)
    whole = _trajectory(module.DynamicLossScaler(**kw), flags)
    for cut in (2, 3, 9, 10, 11, 12, 13, 14):
        first = module.DynamicLossScaler(**kw)
        head = _trajectory(first, flags[:cut])
        state = first.state_dict()
        expect(isinstance(state, dict), f"state_dict() returned {type(state).__name__}, not a dict")
        second = module.DynamicLossScaler()  # built with the defaults: the state must carry everything
        second.load_state_dict(state)
        tail = _trajectory(second, flags[cut:])
        if head[0] + tail[0] != whole[0] or head[1] + tail[1] != whole[1]:
            raise Failed(f"a run resumed from state_dict() after iteration {cut} departs from the "
                         f"uninterrupted one (flags {flags!r}, {kw})")


def checks() -> list[Check]:
    return [
        Check("scale(loss) multiplies by the scale", "return loss * S as a tensor; the first scale is init_scale",
              _check_scale),
        Check("step() applies the true gradients", "step() must divide the gradients by S (unscale) "
              "before optimizer.step() when unscale_() was not called", _check_step_unscales),
        Check("unscale_() then step() divides by S only once", "remember that this iteration is already "
              "unscaled, and let step() skip its own unscale; reset that in update()", _check_unscale_once),
        Check("a second unscale_() in one iteration raises", "track the stage of the iteration; a second "
              "call before update() must raise RuntimeError", _check_unscale_twice_raises),
        Check("steps with inf or NaN gradients are skipped", "check every gradient with torch.isfinite "
              "(NaN too, not only inf) and do not call optimizer.step() when any is not finite", _check_skips),
        Check("an overflow backs the scale off", "after an overflow: S *= backoff_factor and the tracker "
              "restarts at 0", _check_backoff),
        Check("the scale grows after growth_interval clean steps", "count clean steps; grow when the count "
              "reaches growth_interval (not one later), then restart the count at 0", _check_growth),
        Check("an overflow restarts the growth count", "any overflow resets the tracker, so the next growth "
              "needs a full window of clean steps", _check_reset),
        Check("same scales and skipped steps as torch.amp.GradScaler", "compare your trajectory with "
              "GradScaler's on the same flags, iteration by iteration (chapter 5's replay_scaler)",
              _check_gradscaler),
        Check("state_dict() resumes the run exactly", "save the growth tracker and the factors and interval "
              "as well as the scale; load_state_dict() must restore all of them", _check_resume),
    ]
