"""Loss scalers written from scratch: a static one (chapter 4) and a dynamic one (chapter 5).

fp16 has 5 exponent bits: gradients below about 6e-8 (2**-24) flush to zero. Multiplying the loss by
a scale S multiplies every gradient by S (backprop is linear), lifting small gradients out of the
underflow zone; before the optimizer uses them we divide by S again ("unscale"). If S is too large
some gradient overflows to inf (or an inf - inf turns into nan): that step must be skipped.

Both scalers speak the ``torch.amp.GradScaler`` protocol, so a training loop reads the same::

    scaler.scale(loss).backward()   # grads are S times too large
    scaler.unscale_(optimizer)      # optional: divide by S now, e.g. to clip true gradients
    scaler.step(optimizer)          # unscale (if not done), skip optimizer.step() on inf/nan
    scaler.update()                 # dynamic: adapt S; static: S stays

* :class:`StaticLossScaler` keeps one scale forever. It still checks every step for inf/nan and
  skips those steps: the check is free (it is fused into the unscale) and an overflowed update
  would write inf/nan into the weights for good. Only the scale never changes.
* :class:`DynamicLossScaler` halves S after an overflow and doubles it after ``growth_interval``
  clean steps in a row. With its default arguments it reproduces ``torch.amp.GradScaler``
  exactly: the same scale after every ``update()`` and the same skipped steps
  (``tests/test_scaling.py`` checks this on random sequences of finite, inf and nan gradients).
  ``hysteresis``, ``min_scale`` and ``max_scale`` add DeepSpeed's overflow tolerance and bounds.

Design points the chapters explain:

* The scale lives on the device, as a 0-d fp32 tensor (the growth trackers as int32), created by
  the first ``scale(loss)`` on the loss's device. Updating it is tensor arithmetic on the device,
  so ``update()`` never waits for the GPU.
* At most one host-device synchronisation per ``step()``: Python must know whether to call
  ``optimizer.step()``, so it reads the inf/nan flag once (``found_inf.item()``). Nothing else
  reads a device value: no per-parameter ``.item()`` (that would be hundreds of syncs). Fused
  optimizers (below) need not even that one.
* ``found_inf_reducer`` lets the distributed chapter all-reduce the flag (MAX) before that one
  read, so every rank skips the same steps and keeps the same scale.
* Optimizers that advertise ``_step_supports_amp_scaling`` (fused Adam/AdamW) receive the
  inf/nan flag as ``optimizer.found_inf`` and skip their own update on the device, as GradScaler
  arranges it: then ``step()`` needs no sync at all, and the GPU never idles while Python waits
  for the flag (measured: record train-h200, whose fp16 rows are within a millisecond of bf16).
  The gradients are still unscaled by us first, in one pass, so that clipping sees true gradients;
  ``defer_unscale_`` skips that pass for a caller that checks them itself (the trainer takes the
  check from the norm it computes for clipping, and the fused optimizer divides by the scale).

Two more classes speak the same protocol, so the trainer never asks which kind it holds:
:class:`NullScaler` (no scaling, no check: fp32 and bf16 runs) and :class:`GradScalerAdapter`
(``torch.amp.GradScaler`` itself, for comparisons). :func:`make_scaler` picks one by name.

Errors use GradScaler's messages (so search results for them apply), followed by what to do.
Where GradScaler raises ``AssertionError`` (step or update with nothing recorded) we raise
``RuntimeError`` with the same text: these are usage errors, not internal assertions.
"""
from __future__ import annotations

import math
from collections import abc, defaultdict
from enum import Enum
from typing import Any, Callable

import torch

__all__ = ["BaseLossScaler", "StaticLossScaler", "DynamicLossScaler", "NullScaler", "GradScalerAdapter",
           "SCALERS", "make_scaler"]

_FP32_MAX = torch.finfo(torch.float32).max


class _Stage(Enum):
    """Where one optimizer is in the current iteration (reset by ``update()``)."""

    READY = 0     # nothing done yet
    UNSCALED = 1  # grads divided by the scale and checked for inf/nan
    STEPPED = 2   # step() decided (optimizer.step() called or skipped)


def _fresh_optimizer_state() -> dict[str, Any]:
    # found_inf_per_device: {device: 0-d fp32 tensor, > 0 iff that device's grads had an inf/nan}
    # found_inf: the flags of all devices combined (and passed through found_inf_reducer), cached
    # so that the reducer runs exactly once per optimizer per iteration.
    # scaled: the gradients were left scaled (defer_unscale_), so step() has the optimizer divide.
    return {"stage": _Stage.READY, "found_inf_per_device": {}, "found_inf": None, "scaled": False}


class BaseLossScaler:
    """The machinery both scalers share: scale, check-and-unscale, skip, the per-optimizer protocol.

    Subclasses decide what ``update()`` does to the scale (:meth:`_update_scale`) and may add state.
    """

    def __init__(self, init_scale: float, *, found_inf_reducer: Callable[[torch.Tensor], None] | None = None,
                 enabled: bool = True) -> None:
        self._enabled = enabled
        self._init_scale = float(init_scale)  # used until the first scale() creates the tensor
        self._scale: torch.Tensor | None = None  # 0-d fp32, on the device of the first loss
        self.found_inf_reducer = found_inf_reducer
        self._last_found_inf: torch.Tensor | float = 0.0  # the latest step()'s flag (> 0: skipped)
        # Keyed by id(optimizer), exactly like GradScaler: one training loop may drive several optimizers.
        self._per_optimizer: dict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)

    # ---------------------------------------------------------------- the four calls of a step
    def scale(self, outputs):
        """Multiply a loss (or a list/tuple/iterable of tensors) by the current scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._init_device_state(outputs.device)
            # .to() is a no-op when the loss is on the scale's device (the usual case): no copy, no sync.
            return outputs * self._scale.to(outputs.device)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, abc.Iterable):
            return map(self.scale, outputs)
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and record whether any is inf/nan.

        Optional: ``step()`` does it when you have not. Call it yourself to see true gradients
        before the step (gradient clipping). At most once per optimizer per iteration. No sync.
        """
        if not self._enabled:
            return
        self._require_scale("unscale_")
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update(). "
                               "Call it once per iteration, after the last backward (with gradient "
                               "accumulation: after the last micro-batch).")
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step(). Call unscale_() before step(), "
                               "or update() first to start the next iteration.")
        # 1/scale in fp64, rounded once to fp32 (as GradScaler does): an fp32 reciprocal may be off by
        # an ulp under some compile options. For a power-of-two scale both are exact.
        inv_scale = self._scale.double().reciprocal().float()
        state["found_inf_per_device"] = self._check_and_unscale_grads(optimizer, inv_scale)
        state["stage"] = _Stage.UNSCALED

    def defer_unscale_(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> torch.Tensor | float:
        """Instead of ``unscale_``: leave the gradients scaled and take the caller's inf/nan check.

        ``unscale_`` reads and writes every gradient once. A caller that reads them all anyway can
        skip that pass: an inf or nan in any gradient makes the 2-norm of the scaled gradients inf
        or nan, so a finite norm means every gradient is finite (the trainer computes the norm for
        clipping), and divided by the scale it is the true norm (exact for a power-of-two scale).
        ``found_inf`` is that check: a 0-d tensor, nonzero (or True) iff a gradient is inf/nan.
        ``step()`` then hands a fused optimizer the flag and the scale to divide by as it reads each
        gradient, times any ``optimizer.grad_scale`` the caller set (a clipping factor): the same
        update, bit for bit, as ``unscale_`` followed by that factor, for a power-of-two scale.
        Only for optimizers that divide by ``grad_scale`` themselves (torch's fused Adam/AdamW);
        returns the scale, so the caller can unscale its norm. No sync.
        """
        if not self._enabled:
            return 1.0
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            raise ValueError(f"defer_unscale_ leaves the gradients scaled, and {type(optimizer).__name__} does "
                             "not divide by optimizer.grad_scale itself; call unscale_(optimizer) instead, or use "
                             "a fused optimizer (torch.optim.AdamW(..., fused=True))")
        self._require_scale("defer_unscale_")
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is not _Stage.READY:
            raise RuntimeError("defer_unscale_() after unscale_(), defer_unscale_() or step() in this iteration: "
                               "check and unscale once per iteration, before step().")
        state["found_inf_per_device"] = {found_inf.device: found_inf.detach().float().reshape(())}
        state["scaled"] = True
        state["stage"] = _Stage.UNSCALED
        return self._scale

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Unscale (unless done), then call ``optimizer.step(*args, **kwargs)`` only if all grads are finite.

        Returns what ``optimizer.step`` returns, or None when the step was skipped. Sets
        :attr:`last_step_skipped`. The iteration's one host-device sync happens here (none with a fused
        optimizer, which skips on the device). With
        several optimizers each ``step()`` decides for its own gradients (as GradScaler does), and
        ``last_step_skipped`` tells the latest decision.
        """
        if not self._enabled:
            self._last_found_inf = 0.0
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled. "
                               "Compute the loss, call scale(loss).backward(), then step(optimizer).")
        self._require_scale("step")
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update(). "
                               "Call update() once per iteration, after step().")
        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        if not state["found_inf_per_device"]:
            raise RuntimeError("No inf checks were recorded for this optimizer. None of its parameters has "
                               "a gradient: call scale(loss).backward() before step(optimizer).")
        found_inf = self._found_inf(state)
        self._last_found_inf = found_inf
        retval = None
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # Fused Adam/AdamW take the flag themselves and skip their update *on the device* when it
            # is set, so Python need not know: no sync at all (GradScaler does the same). After
            # unscale_ the gradients are unscaled, so no factor of ours is needed.
            # A grad_scale the caller set on the optimizer is kept as it is, as GradScaler keeps it
            # once the gradients are unscaled. Gradients left scaled (defer_unscale_) are divided by
            # the scale too, in the same multiply-free pass: the optimizer divides by the product.
            factor = getattr(optimizer, "grad_scale", None)
            if state["scaled"]:
                factor = self._scale if factor is None else factor * self._scale
            optimizer.grad_scale = factor
            optimizer.found_inf = found_inf
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale, optimizer.found_inf
        else:
            # THE sync: Python needs a bool to decide whether to call optimizer.step(). Keep the bool,
            # so reading last_step_skipped afterwards costs no second sync.
            skipped = found_inf.item() > 0
            self._last_found_inf = 1.0 if skipped else 0.0
            if not skipped:
                retval = optimizer.step(*args, **kwargs)
        state["stage"] = _Stage.STEPPED
        return retval

    @property
    def last_found_inf(self) -> torch.Tensor | float:
        """The latest ``step()``'s overflow flag, > 0 if it skipped: a device tensor after a fused optimizer's
        step (read it without a sync, e.g. in batches), a Python float after any other. A copy, as
        scale_tensor() and floor_hit are: a step recorded as a CUDA graph (mpgpt.graph_step) rewrites
        the same flag tensor at every replay."""
        flag = self._last_found_inf
        return flag.detach().clone() if isinstance(flag, torch.Tensor) else flag

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest ``step()`` skipped the optimizer. Reading it after a fused optimizer's step
        is a sync (the flag lives on the device): fine for logging, not for every step of a fast loop."""
        flag = self._last_found_inf
        return bool(flag.item() > 0) if isinstance(flag, torch.Tensor) else flag > 0

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: adapt the scale to this iteration's overflows (on the device, no sync).

        ``new_scale`` sets the scale by hand instead (a float, or a 1-element tensor).
        """
        if not self._enabled:
            return
        self._require_scale("update")
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise ValueError("new_scale must be a float or a 1-element tensor that does not require grad")
                self._scale.copy_(new_scale.reshape(()))
            else:
                self._scale.fill_(float(new_scale))
        else:
            flags = [self._found_inf(state) for state in self._per_optimizer.values()
                     if state["found_inf_per_device"]]
            if not flags:
                raise RuntimeError("No inf checks were recorded prior to update. "
                                   "Call step(optimizer) (or unscale_) before update().")
            # The iteration overflowed if any optimizer saw an inf/nan: a 0-d bool tensor on the device.
            found_inf = _sum_flags(flags, self._scale.device) > 0
            self._update_scale(found_inf)
        self._per_optimizer = defaultdict(_fresh_optimizer_state)

    # ---------------------------------------------------------------- inspection and checkpoints
    def get_scale(self) -> float:
        """The current scale as a Python float (a sync: for logging and checkpoints, not every step)."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else self._scale.item()

    def scale_tensor(self) -> torch.Tensor | float:
        """The current scale without a sync: a copy of the device tensor (or the float before the first
        ``scale()``). The trainer logs it every step and reads the values in batches."""
        if not self._enabled or self._scale is None:
            return self.get_scale()
        return self._scale.detach().clone()

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state as plain Python numbers. Save it after ``update()``."""
        return {"scale": self.get_scale()} if self._enabled else {}

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise ValueError, naming the entry, unless ``state_dict`` holds a usable scale (finite, > 0)."""
        if not isinstance(state_dict, dict) or "scale" not in state_dict:
            raise ValueError("the scaler state has no 'scale'; it was saved from a disabled scaler or is damaged")
        _check_scale_value("scale", state_dict["scale"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled "
                               "instance of GradScaler. Save the state of an enabled scaler.")
        self.check_state_dict(state_dict)
        self._init_scale = float(state_dict["scale"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)

    # ---------------------------------------------------------------- what subclasses provide
    def _init_device_state(self, device: torch.device) -> None:
        """Create the device tensors (first ``scale()``). Subclasses add their trackers."""
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)

    def _update_scale(self, found_inf: torch.Tensor) -> None:
        """Change the scale given this iteration's overflow flag (0-d bool tensor). No syncs allowed."""
        raise NotImplementedError

    # ---------------------------------------------------------------- helpers
    def _require_scale(self, funcname: str) -> None:
        if self._scale is None:
            raise RuntimeError(f"Attempted {funcname} but the scale is not initialised yet: "
                               "call scaler.scale(loss).backward() earlier in the iteration.")

    @torch.no_grad()
    def _check_and_unscale_grads(self, optimizer: torch.optim.Optimizer,
                                 inv_scale: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        """grads *= inv_scale for every grad of ``optimizer``; returns {device: found_inf flag}."""
        # The fused op below wants one list per (device, dtype), so group the grads first.
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:  # a frozen or unused parameter: nothing to check or unscale
                    continue
                if param.grad.dtype == torch.float16:
                    # Unscaled fp16 grads would underflow again (the very thing scaling prevents), and
                    # the optimizer would update fp16 weights directly.
                    raise ValueError("Attempting to unscale FP16 gradients. Keep fp32 parameters (autocast) "
                                     "or fp32 master weights, and unscale their fp32 gradients.")
                # A sparse grad (nn.Embedding(sparse=True)) stores its numbers in _values().
                grad = param.grad._values() if param.grad.is_sparse else param.grad
                groups[(grad.device, grad.dtype)].append(grad)

        found_inf_per_device: dict[torch.device, torch.Tensor] = {}
        inv_scale_per_device: dict[torch.device, torch.Tensor] = {}
        for (device, _dtype), grads in groups.items():
            if device not in found_inf_per_device:
                found_inf_per_device[device] = torch.zeros((), dtype=torch.float32, device=device)
                inv_scale_per_device[device] = inv_scale.to(device)
            # The fused op, for every g in grads:
            #     if not torch.isfinite(g).all(): found_inf.fill_(1.0)   # flag written on the device
            #     g.mul_(inv_scale)                                      # skipped when inv_scale == 1
            # in one pass over the memory (one multi-tensor kernel launch per list on CUDA) and without
            # bringing any value back to the host. In the open, the same thing reads:
            #     found_inf += ~torch.stack([g.isfinite().all() for g in grads]).all()
            #     torch._foreach_mul_(grads, inv_scale)
            # (check before multiplying: with a scale below 1 a finite grad could overflow in the product).
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found_inf_per_device[device], inv_scale_per_device[device])
        return found_inf_per_device

    def _found_inf(self, state: dict[str, Any]) -> torch.Tensor:
        """One 0-d fp32 flag for an optimizer: > 0 iff any of its devices saw an inf/nan. No sync."""
        if state["found_inf"] is None:
            found_inf = _sum_flags(list(state["found_inf_per_device"].values()), self._scale.device)
            if self.found_inf_reducer is not None:
                # e.g. dist.all_reduce(found_inf, op=MAX): every rank then agrees to skip (or not).
                self.found_inf_reducer(found_inf)
            state["found_inf"] = found_inf
        return state["found_inf"]


class StaticLossScaler(BaseLossScaler):
    """A fixed loss scale (chapter 4). Steps with inf/nan gradients are still skipped; the scale never moves.

    Skipping costs nothing extra (the check is fused into the unscale) and keeps one bad batch from
    writing inf/nan into the weights. A scale too large for your model then shows up as many
    skipped steps (``last_step_skipped``) rather than a diverged run.
    """

    def __init__(self, scale: float, *, found_inf_reducer: Callable[[torch.Tensor], None] | None = None,
                 enabled: bool = True) -> None:
        _check_scale_value("scale", scale)
        super().__init__(scale, found_inf_reducer=found_inf_reducer, enabled=enabled)

    def _update_scale(self, found_inf: torch.Tensor) -> None:
        pass  # static: the scale stays what it was given


class DynamicLossScaler(BaseLossScaler):
    """A loss scale that adapts to the gradients (chapter 5); defaults equal ``torch.amp.GradScaler``'s.

    The state machine, run by ``update()`` on the device, with ``tracker`` counting clean steps:

    * overflow (any inf/nan this iteration; the step was skipped): ``tracker = 0`` and, unless
      hysteresis absorbs it (below), ``scale *= backoff_factor``;
    * clean step: ``tracker += 1``; when it reaches ``growth_interval``: ``scale *= growth_factor``
      (unless that overflows fp32 to inf: then the scale stays) and ``tracker = 0``;
    * then, if given, the scale is clamped to ``[min_scale, max_scale]`` (DeepSpeed's
      ``min_loss_scale``, apex's 2**24 cap).

    Products are computed in fp64 and rounded once to fp32, as GradScaler's kernel does, so any
    factors give the same numbers as GradScaler, not only powers of two.

    Cost: ``update()`` is about fifteen tiny tensor ops where GradScaler launches one fused kernel
    (``torch._amp_update_scale_``); tens of microseconds per step, invisible beyond toy models
    (benchmarks/scaler_overhead.py measures it). We keep the ops in the open because the course
    teaches this state machine.

    **Hysteresis** (``hysteresis=h``), DeepSpeed's rule: ``DynamicLossScaler.update_scale`` in
    deepspeed/runtime/fp16/loss_scaler.py, where ``h`` is called ``delayed_shift``. A counter starts at
    ``h``. On an overflow, if the counter is above 1 it is decremented and the scale is kept;
    if it is 1 the scale backs off (and the counter stays 1, so every further overflow backs off
    too). The counter is refilled to ``h`` when the scale grows (a full ``growth_interval`` of clean
    steps), not by a single clean step: overflows need not be consecutive to use up the allowance.
    With ``consecutive_hysteresis=True`` (DeepSpeed's option of the same name) every clean step
    refills it, so only ``h`` overflows in a row back off. Overflow steps are always skipped, and
    any overflow restarts the growth window. ``hysteresis=1`` is exactly GradScaler.
    (DeepSpeed's own growth window, at the version we read, grows after ``scale_window + 1`` clean
    steps; we keep GradScaler's ``growth_interval``.)

    **Bounds.** ``min_scale`` clamps the scale from below; an overflow that would take it below
    ``min_scale`` also sets :attr:`floor_hit` (a device flag, read without a sync in batches), which
    the trainer treats as divergence: a run whose gradients overflow fp16 even at the floor will not
    recover by scaling. GradScaler has no floor: its scale decays towards 0 (and, in fp32, reaches
    it after about 150 overflows in a row, after which every step is skipped silently).

    **The fused-optimizer protocol, compared with GradScaler.** For an optimizer that advertises
    ``_step_supports_amp_scaling`` GradScaler sets two attributes around ``optimizer.step()``:
    ``found_inf`` (the flag) and ``grad_scale`` (its scale, multiplied into any ``grad_scale`` the
    caller set, when ``unscale_`` was not called; the caller's own ``grad_scale`` unchanged, when it
    was), and deletes both afterwards. We set the same two attributes, and since we always unscale
    before stepping (so that clipping sees true gradients), ``grad_scale`` is always the caller's own
    value or None, exactly GradScaler's UNSCALED case. Two differences remain: GradScaler lets the
    fused kernel do the unscaling when ``unscale_`` was not called (one pass fewer; the same numbers
    for power-of-two scales), and it still honours the deprecated ``grad_scaler=`` keyword of
    ``optimizer.step``, which we never pass. We delete the attributes even when ``optimizer.step``
    raises (GradScaler leaves them behind then).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, hysteresis: int = 1, min_scale: float | None = None,
                 max_scale: float | None = None, *, consecutive_hysteresis: bool = False,
                 found_inf_reducer: Callable[[torch.Tensor], None] | None = None, enabled: bool = True) -> None:
        _check_dynamic(init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale,
                       scale_name="init_scale")
        super().__init__(init_scale, found_inf_reducer=found_inf_reducer, enabled=enabled)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = min_scale
        self.max_scale = max_scale
        # Device tensors, created with the scale by the first scale(); until then the initial values.
        self._init_growth_tracker = 0
        self._init_hysteresis_tracker = hysteresis
        self._growth_tracker: torch.Tensor | None = None      # int32: clean steps since the last growth/overflow
        self._hysteresis_tracker: torch.Tensor | None = None  # int32: overflows still tolerated, from h down to 1
        self._floor_hit: torch.Tensor | None = None  # bool: some backoff wanted to go below min_scale

    def _init_device_state(self, device: torch.device) -> None:
        super()._init_device_state(device)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=device)
        self._floor_hit = torch.zeros((), dtype=torch.bool, device=device)

    @property
    def floor_hit(self) -> torch.Tensor | bool:
        """Whether an overflow has wanted to take the scale below ``min_scale`` (the scale stayed at the
        floor). A 0-d bool device tensor once scaling started (read it in batches: a sync), else False."""
        return False if self._floor_hit is None else self._floor_hit.detach().clone()

    def _update_scale(self, found_inf: torch.Tensor) -> None:
        # Every case is computed and torch.where picks one: no Python `if` reads a device value.
        scale, tracker = self._scale, self._growth_tracker
        successful = tracker + 1                                  # clean steps, counting this one
        grow = ~found_inf & (successful >= self.growth_interval)  # a full window of clean steps
        backoff = found_inf if self.hysteresis == 1 else self._spend_hysteresis(found_inf, grow)

        # fp32 scale times an fp64 factor, rounded once to fp32: the arithmetic of GradScaler's kernel.
        scale64 = scale.double()
        new_scale = torch.where(backoff, scale64 * self.backoff_factor,
                                torch.where(grow, scale64 * self.growth_factor, scale64)).float()
        new_scale = torch.where(torch.isfinite(new_scale), new_scale, scale)  # never grow past fp32 to inf
        if self.min_scale is not None:
            self._floor_hit |= backoff & (new_scale < self.min_scale)
        if self.min_scale is not None or self.max_scale is not None:
            new_scale = new_scale.clamp(self.min_scale, self.max_scale)
        scale.copy_(new_scale)
        tracker.copy_(torch.where(found_inf | grow, 0, successful))  # any overflow restarts the window

    def _spend_hysteresis(self, found_inf: torch.Tensor, grow: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's hysteresis: which overflow backs off, and the allowance left (0-d tensors)."""
        allowance = self._hysteresis_tracker
        backoff = found_inf & (allowance <= 1)  # no allowance left: this overflow backs off
        refill = ~found_inf if self.consecutive_hysteresis else grow
        allowance.copy_(torch.where(found_inf, (allowance - 1).clamp(min=1),  # spend one (never below 1)
                                    torch.where(refill, self.hysteresis, allowance)))
        return backoff

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's five keys (so either can load the other's), plus hysteresis and bounds."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self._tracker_value(self._growth_tracker, self._init_growth_tracker),
            "hysteresis": self.hysteresis,
            "_hysteresis_tracker": self._tracker_value(self._hysteresis_tracker, self._init_hysteresis_tracker),
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
        }

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise ValueError, naming the entry, unless ``state_dict`` is a state this scaler can run from:
        the constructor's checks, plus the trackers in range. ``load_state_dict`` runs it first."""
        if not isinstance(state_dict, dict) or not state_dict:
            raise ValueError("the scaler state is empty; it was saved from a disabled scaler or is damaged")
        missing = [k for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
                   if k not in state_dict]
        if missing:
            raise ValueError(f"the scaler state has no {missing[0]!r}")
        get = lambda key, default: state_dict.get(key, default)  # noqa: E731: GradScaler's has only five keys
        hysteresis = get("hysteresis", self.hysteresis)
        _check_dynamic(state_dict["scale"], state_dict["growth_factor"], state_dict["backoff_factor"],
                       state_dict["growth_interval"], hysteresis, get("min_scale", self.min_scale),
                       get("max_scale", self.max_scale), scale_name="scale")
        tracker = state_dict["_growth_tracker"]
        if not (_is_int(tracker) and 0 <= tracker < state_dict["growth_interval"]):
            raise ValueError(f"_growth_tracker must be an integer in [0, growth_interval) (got {tracker!r})")
        allowance = get("_hysteresis_tracker", hysteresis)
        if not (_is_int(allowance) and 1 <= allowance <= hysteresis):
            raise ValueError(f"_hysteresis_tracker must be an integer in [1, hysteresis] (got {allowance!r})")
        if not isinstance(get("consecutive_hysteresis", False), bool):
            raise ValueError(f"consecutive_hysteresis must be True or False (got {state_dict['consecutive_hysteresis']!r})")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our state dict or a ``torch.amp.GradScaler`` one (then hysteresis and bounds stay as built).
        Every entry is checked (check_state_dict) before anything changes."""
        if not self._enabled:
            return
        super().load_state_dict(state_dict)  # which runs check_state_dict (this class's) first
        self.growth_factor = float(state_dict["growth_factor"])
        self.backoff_factor = float(state_dict["backoff_factor"])
        self.growth_interval = int(state_dict["growth_interval"])
        self.hysteresis = int(state_dict.get("hysteresis", self.hysteresis))
        self.consecutive_hysteresis = bool(state_dict.get("consecutive_hysteresis", self.consecutive_hysteresis))
        self.min_scale = state_dict.get("min_scale", self.min_scale)
        self.max_scale = state_dict.get("max_scale", self.max_scale)
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        self._init_hysteresis_tracker = int(state_dict.get("_hysteresis_tracker", self.hysteresis))
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)

    @staticmethod
    def _tracker_value(tensor: torch.Tensor | None, initial: int) -> int:
        return initial if tensor is None else int(tensor.item())


def _sum_flags(flags: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Add 0-d fp32 inf/nan flags on ``device`` (> 0 iff any is set). One flag, the usual case, is used as is."""
    if len(flags) == 1:
        return flags[0].to(device)
    return torch.stack([f.to(device) for f in flags]).sum()


def _check_scale_value(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and 0 < value <= _FP32_MAX):
        raise ValueError(f"{name} must be a positive number representable in fp32 (got {value!r}); "
                         "use a power of two such as 2.**16")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_dynamic(scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale, *,
                   scale_name: str) -> None:
    """The dynamic scaler's settings, checked alike when it is built and when a saved state is loaded."""
    _check_scale_value(scale_name, scale)
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    if not (number(growth_factor) and growth_factor > 1.0):
        raise ValueError(f"growth_factor must be a finite number > 1 (got {growth_factor!r}); use e.g. 2.0")
    if not (number(backoff_factor) and 0.0 < backoff_factor < 1.0):
        raise ValueError(f"backoff_factor must lie in (0, 1) (got {backoff_factor!r}); use e.g. 0.5")
    if not (_is_int(growth_interval) and growth_interval >= 1):
        raise ValueError(f"growth_interval must be an integer >= 1 (got {growth_interval!r}); use e.g. 2000")
    if not (_is_int(hysteresis) and hysteresis >= 1):
        raise ValueError(f"hysteresis must be an integer >= 1 (got {hysteresis!r}); use 1 (GradScaler) "
                         "or 2 (DeepSpeed's default)")
    if min_scale is not None:
        _check_scale_value("min_scale", min_scale)
    if max_scale is not None:
        _check_scale_value("max_scale", max_scale)
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ValueError(f"min_scale ({min_scale}) must not exceed max_scale ({max_scale}); swap them")
    if (min_scale is not None and scale < min_scale) or (max_scale is not None and scale > max_scale):
        raise ValueError(f"{scale_name} ({scale}) must lie within [min_scale, max_scale] = "
                         f"[{min_scale}, {max_scale}]; pick an {scale_name} inside the bounds")


class NullScaler:
    """The scaler protocol with no scaling and no overflow check: every step is taken (fp32, bf16)."""

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

    def check_state_dict(self, state) -> None:
        if state != {}:
            raise ValueError("the state holds a loss scale, and this run has no loss scaler")

    def load_state_dict(self, state):
        self.check_state_dict(state)


class GradScalerAdapter:
    """``torch.amp.GradScaler`` behind the same protocol, to compare our scalers with PyTorch's.

    ``last_step_skipped`` is not tracked: reading it would add the host sync that GradScaler avoids.
    ``last_found_inf`` is therefore always 0, so a History of a run with this adapter records no skips.
    """

    def __init__(self, device):
        self.inner = torch.amp.GradScaler(torch.device(device).type)
        self.last_step_skipped = False
        self.last_found_inf = 0.0

    def scale(self, loss):
        return self.inner.scale(loss)

    def unscale_(self, optimizer):
        self.inner.unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):
        return self.inner.step(optimizer, *args, **kwargs)

    def update(self):
        self.inner.update()

    def get_scale(self) -> float:
        return self.inner.get_scale()

    def scale_tensor(self):
        return self.inner.get_scale()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def check_state_dict(self, state) -> None:
        """GradScaler's five keys, checked as DynamicLossScaler checks them (GradScaler checks none)."""
        DynamicLossScaler().check_state_dict(state)

    def load_state_dict(self, state) -> None:
        self.check_state_dict(state)
        self.inner.load_state_dict(state)


# The names a training config may use (mpgpt.trainer.TrainConfig.scaler, --scaler on the command line).
SCALERS = ("auto", "dynamic", "static", "gradscaler", "none")


def make_scaler(kind: str, policy, device, *, static_scale: float = 2.0 ** 10, init_scale: float = 2.0 ** 16,
                growth_interval: int = 2000, hysteresis: int = 1, min_scale: float | None = None):
    """The loss scaler for a run. ``kind`` is one of SCALERS; "auto" means dynamic scaling for the
    policies that need it (``policy.loss_scaling``: the fp16 ones) and none for the others.
    ``min_scale`` is the dynamic scaler's floor (None: none, as GradScaler); the trainer passes one."""
    if kind not in SCALERS:
        raise ValueError(f"unknown scaler {kind!r}; choose one of {', '.join(SCALERS)}")
    if kind == "auto":
        kind = "dynamic" if policy.loss_scaling else "none"
    if kind == "none":
        return NullScaler()
    if kind == "static":
        return StaticLossScaler(static_scale)
    if kind == "gradscaler":
        return GradScalerAdapter(device)
    return DynamicLossScaler(init_scale=init_scale, growth_interval=growth_interval, hysteresis=hysteresis,
                             min_scale=min_scale)
