"""Tests for mpgpt/scaling.py: our loss scalers against torch.amp.GradScaler, and their own rules.

The reference is torch.amp.GradScaler("cpu"): with default arguments DynamicLossScaler must make the
same decisions bit for bit (scale after every update, skipped steps, final weights) on random
sequences of finite, inf and nan gradients. Seeds come fresh from the OS on every run and are printed
in every assertion message, so a failure can be replayed.
"""
import copy
import math
import os
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpgpt.scaling import BaseLossScaler, DynamicLossScaler, StaticLossScaler

INF, NAN = float("inf"), float("nan")


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


class _Net(nn.Module):
    """A small MLP plus a layer that forward never uses (its parameters never get a grad)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 3)
        self.unused = nn.Linear(3, 3)

    def forward(self, x):  # (B, 6) -> (B, 3)
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _one_optimizer(kind):
    def make(net):
        groups = [  # two param groups with different hyper-parameters; `unused` has no grads
            {"params": [*net.fc1.parameters(), *net.unused.parameters()], "lr": 1e-2},
            {"params": [*net.fc2.parameters(), *net.fc3.parameters()], "lr": 3e-3, "weight_decay": 0.1},
        ]
        if kind == "sgd":
            return [torch.optim.SGD(groups, momentum=0.9)]
        # fused AdamW takes the overflow flag itself and skips on the device (no sync in step()).
        return [torch.optim.AdamW(groups, fused=kind == "adamw-fused")]
    return make


def _two_optimizers(net):
    # GradScaler skips per optimizer: one may step while the other (with the overflow) is skipped.
    return [torch.optim.SGD([*net.fc1.parameters(), *net.unused.parameters()], lr=1e-2, momentum=0.9),
            torch.optim.AdamW([*net.fc2.parameters(), *net.fc3.parameters()], lr=3e-3)]


def _draw_plan(rng: random.Random, n_params: int) -> dict:
    """What happens to the gradients this step, drawn once and applied to both runs."""
    injections = []
    if rng.random() < 0.35:  # an overflow somewhere: inf, -inf or nan in a few random parameters
        for index in rng.sample(range(n_params), rng.randint(1, 3)):
            injections.append((index, rng.random(), rng.choice([INF, -INF, NAN])))
    return {"injections": injections,
            "unscale_first": rng.random() < 0.3,     # explicit unscale_ + clipping before step
            "drop_fc3_bias_grad": rng.random() < 0.1}  # a param that sometimes has no grad


def _grad_params(net):  # the parameters that get a gradient from forward
    return [*net.fc1.parameters(), *net.fc2.parameters(), *net.fc3.parameters()]


def _run_against_gradscaler(seed, make_optimizers, scaler_kwargs, steps=300, device="cpu"):
    torch.manual_seed(seed)
    net_ours = _Net().to(device)
    net_ref = copy.deepcopy(net_ours)
    runs = [(net_ours, make_optimizers(net_ours), DynamicLossScaler(**scaler_kwargs)),
            (net_ref, make_optimizers(net_ref), torch.amp.GradScaler(device, **scaler_kwargs))]
    rng = random.Random(seed)
    data = torch.Generator().manual_seed(seed)
    n_skipped = n_grown = 0
    last_scale = runs[0][2].get_scale()
    for step in range(steps):
        x, y = torch.randn(8, 6, generator=data).to(device), torch.randn(8, 3, generator=data).to(device)
        plan = _draw_plan(rng, len(_grad_params(net_ours)))
        outcome = []
        for net, optimizers, scaler in runs:
            for opt in optimizers:
                opt.zero_grad()
            loss = F.mse_loss(net(x), y)
            scaler.scale(loss).backward()
            grad_params = _grad_params(net)
            for index, where, value in plan["injections"]:
                flat = grad_params[index].grad.view(-1)
                flat[int(where * flat.numel())] = value
            if plan["drop_fc3_bias_grad"]:
                net.fc3.bias.grad = None
            if plan["unscale_first"]:
                for opt in optimizers:
                    scaler.unscale_(opt)
                    # Clip each optimizer's own grads: a global norm would smear one optimizer's inf
                    # (found by its unscale_) as nan into the other's already-checked grads.
                    params = [p for group in opt.param_groups for p in group["params"]]
                    torch.nn.utils.clip_grad_norm_(params, 1.0)
            before = [p.detach().clone() for p in net.parameters()]
            skipped = []
            for opt in optimizers:
                scaler.step(opt)
                if isinstance(scaler, DynamicLossScaler):
                    skipped.append(scaler.last_step_skipped)
                else:  # GradScaler's own decision, read the way its _maybe_opt_step reads it
                    skipped.append(sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0)
            scaler.update()
            unchanged = [torch.equal(b, p) for b, p in zip(before, net.parameters())]
            outcome.append((skipped, scaler.get_scale(), scaler.state_dict()["_growth_tracker"], unchanged))
        msg = f"seed={seed} step={step} plan={plan}"
        (skip_o, scale_o, track_o, unch_o), (skip_r, scale_r, track_r, unch_r) = outcome
        assert skip_o == skip_r, msg
        assert scale_o == scale_r, msg
        assert track_o == track_r, msg
        assert unch_o == unch_r, msg
        if all(skip_o):  # a skipped step leaves every parameter untouched, in both runs
            assert all(unch_o) and all(unch_r), msg
        for p_o, p_r in zip(net_ours.parameters(), net_ref.parameters()):
            assert torch.equal(p_o.view(torch.int32), p_r.view(torch.int32)), msg  # bit-identical
        n_skipped += any(skip_o)
        n_grown += scale_o > last_scale
        last_scale = scale_o
    return n_skipped, n_grown


@pytest.mark.parametrize("make_optimizers", [_one_optimizer("sgd"), _one_optimizer("adamw"),
                                             _one_optimizer("adamw-fused"), _two_optimizers],
                         ids=["sgd", "adamw", "adamw-fused", "two-optimizers"])
@pytest.mark.parametrize("repeat", range(2))
def test_matches_gradscaler_default_rule(make_optimizers, repeat):
    seed = _fresh_seed()
    # growth_interval=3 so the scale grows often; it climbs until real overflows appear (~2**120).
    n_skipped, n_grown = _run_against_gradscaler(seed, make_optimizers, {"growth_interval": 3})
    assert n_skipped > 20 and n_grown > 20, f"seed={seed}: sequence too tame ({n_skipped}, {n_grown})"


@pytest.mark.parametrize("kwargs", [
    {"init_scale": 1000.0, "growth_factor": 3.0, "backoff_factor": 0.3, "growth_interval": 2},
    {"init_scale": 2.0**-3, "growth_factor": 1.7, "backoff_factor": 0.9, "growth_interval": 1},
])
def test_matches_gradscaler_other_factors(kwargs):
    # Non-power-of-two factors: products must be rounded exactly as GradScaler's kernel rounds them
    # (fp64 product, one rounding to fp32), and 1/scale must be the fp64 reciprocal rounded to fp32.
    seed = _fresh_seed()
    _run_against_gradscaler(seed, _one_optimizer("sgd"), kwargs, steps=150)


@pytest.mark.gpu
@pytest.mark.parametrize("make_optimizers", [_one_optimizer("adamw"), _two_optimizers], ids=["adamw", "two"])
def test_matches_gradscaler_on_cuda(make_optimizers):
    seed = _fresh_seed()
    _run_against_gradscaler(seed, make_optimizers, {"growth_interval": 3}, steps=150, device="cuda")


@pytest.mark.gpu
def test_one_sync_per_step_on_cuda():
    """CUDA's own sync detector: each synchronising call in warn mode raises one UserWarning."""
    import warnings
    net = _Net().cuda()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    scaler = DynamicLossScaler(growth_interval=2, hysteresis=2)
    x, y = torch.randn(4, 6, device="cuda"), torch.randn(4, 3, device="cuda")
    for i in range(6):
        opt.zero_grad()
        scaler.scale(F.mse_loss(net(x), y)).backward()
        if i % 3 == 1:
            net.fc2.weight.grad[0, 0] = INF
        counts = []
        for call in (lambda: scaler.unscale_(opt), lambda: scaler.step(opt), scaler.update):
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    call()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            # (the first switch to warn mode also warns that the detector is a prototype: not a sync)
            counts.append(sum("called a synchronizing CUDA operation" in str(w.message) for w in caught))
        assert counts == [0, 1, 0], (i, counts)


# ------------------------------------------------------------------------------------- misuse errors
def _setup(scaler):
    net = nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler.scale(net(torch.randn(3, 4)).sum()).backward()
    return net, opt


def _misuse_unscale_twice(scaler):
    _, opt = _setup(scaler)
    scaler.unscale_(opt)
    scaler.unscale_(opt)


def _misuse_unscale_after_step(scaler):
    _, opt = _setup(scaler)
    scaler.step(opt)
    scaler.unscale_(opt)


def _misuse_step_twice(scaler):
    _, opt = _setup(scaler)
    scaler.step(opt)
    scaler.step(opt)


def _misuse_fp16_grads(scaler):
    net = nn.Linear(4, 2).half()  # fp16 weights without fp32 masters: their grads are fp16 too
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler.scale(net(torch.randn(3, 4, dtype=torch.float16)).float().sum()).backward()
    assert net.weight.grad.dtype == torch.float16
    scaler.step(opt)


def _misuse_step_without_grads(scaler):
    net, opt = _setup(scaler)
    opt.zero_grad(set_to_none=True)
    scaler.step(opt)


def _misuse_update_without_step(scaler):
    _setup(scaler)
    scaler.update()


def _misuse_closure(scaler):
    _, opt = _setup(scaler)
    scaler.step(opt, closure=lambda: None)


@pytest.mark.parametrize("misuse", [_misuse_unscale_twice, _misuse_unscale_after_step, _misuse_step_twice,
                                    _misuse_fp16_grads, _misuse_step_without_grads,
                                    _misuse_update_without_step, _misuse_closure])
@pytest.mark.parametrize("make_scaler", [DynamicLossScaler, lambda: StaticLossScaler(1024.0)],
                         ids=["dynamic", "static"])
def test_misuse_errors_match_gradscaler(misuse, make_scaler):
    with pytest.raises(Exception) as ref:
        misuse(torch.amp.GradScaler("cpu"))
    with pytest.raises(Exception) as ours:
        misuse(make_scaler())
    # Same text as GradScaler's, so what users find for its messages applies; ours adds what to do.
    assert str(ours.value).startswith(str(ref.value)), (str(ours.value), str(ref.value))
    # Same type, except GradScaler's AssertionErrors, which are usage errors: RuntimeError for us.
    expected = RuntimeError if ref.type is AssertionError else ref.type
    assert ours.type is expected


def test_step_before_scale_is_an_error():
    scaler = DynamicLossScaler()
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net(torch.randn(1, 2)).sum().backward()  # forgot scaler.scale(...)
    with pytest.raises(RuntimeError, match=r"scale\(loss\)"):
        scaler.step(opt)


@pytest.mark.parametrize("kwargs", [
    {"init_scale": 0.0}, {"init_scale": -1.0}, {"init_scale": INF}, {"init_scale": NAN}, {"init_scale": 1e39},
    {"growth_factor": 1.0}, {"growth_factor": 0.5},
    {"backoff_factor": 1.0}, {"backoff_factor": 0.0}, {"backoff_factor": 1.5},
    {"growth_interval": 0}, {"growth_interval": 2.5},
    {"hysteresis": 0}, {"hysteresis": 1.5},
    {"min_scale": 0.0}, {"max_scale": -2.0},
    {"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0},
    {"min_scale": 2.0**20},  # init_scale outside [min_scale, max_scale]
])
def test_invalid_dynamic_arguments(kwargs):
    with pytest.raises(ValueError, match=r"\(got|must"):
        DynamicLossScaler(**kwargs)


@pytest.mark.parametrize("scale", [0.0, -4.0, INF, NAN])
def test_invalid_static_scale(scale):
    with pytest.raises(ValueError, match="scale must be a positive number"):
        StaticLossScaler(scale)


# ------------------------------------------------------------------------------------- one sync per step
_SYNC_METHODS = ["item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu"]


class _SyncCounter:
    """Counts calls that bring a tensor's value to the host (each one is a GPU sync on CUDA).

    On a CPU there is nothing to wait for, so we count the Python calls that would wait. Counting is
    paused inside optimizer.step(): the optimizer's own reads (AdamW's step count) are not the scaler's.
    """

    def __init__(self, monkeypatch):
        self.count = 0
        self.active = False
        for name in _SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(original))

    def _wrap(self, original):
        def counted(tensor, *args, **kwargs):
            if self.active:
                self.count += 1
            return original(tensor, *args, **kwargs)
        return counted

    def measure(self, fn, *args, **kwargs):
        self.count, self.active = 0, True
        try:
            fn(*args, **kwargs)
        finally:
            self.active = False
        return self.count

    def pause_inside(self, optimizer):
        step = optimizer.step

        def paused_step(*args, **kwargs):
            self.active = False
            try:
                return step(*args, **kwargs)
            finally:
                self.active = True
        optimizer.step = paused_step


def _sync_counts(scaler, counter, steps=12, explicit_unscale=False, fused=False):
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=fused)
    counter.pause_inside(opt)
    counts = {"scale": [], "unscale_": [], "step": [], "update": [], "read_skipped": []}
    for i in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(net(torch.randn(4, 6)), torch.randn(4, 3))
        counts["scale"].append(counter.measure(lambda: scaler.scale(loss).backward()))
        if i % 3 == 1:
            net.fc2.weight.grad[0, 0] = INF  # overflow steps must not cost more syncs
        if explicit_unscale:
            counts["unscale_"].append(counter.measure(scaler.unscale_, opt))
        counts["step"].append(counter.measure(scaler.step, opt))
        counts["read_skipped"].append(counter.measure(lambda: scaler.last_step_skipped))
        counts["update"].append(counter.measure(scaler.update))
    return counts


@pytest.mark.parametrize("explicit_unscale", [False, True])
@pytest.mark.parametrize("make_scaler", [
    lambda: DynamicLossScaler(growth_interval=2),
    lambda: DynamicLossScaler(growth_interval=2, hysteresis=2, min_scale=1.0, max_scale=2.0**20,
                              found_inf_reducer=lambda t: t.clamp_(max=1.0)),
    lambda: StaticLossScaler(2.0**10),
], ids=["dynamic", "dynamic-hysteresis-bounds-reducer", "static"])
def test_exactly_one_sync_per_step(monkeypatch, make_scaler, explicit_unscale):
    counter = _SyncCounter(monkeypatch)
    counts = _sync_counts(make_scaler(), counter, explicit_unscale=explicit_unscale)
    assert all(c == 1 for c in counts["step"]), counts
    assert all(c == 0 for c in counts["scale"] + counts["unscale_"] + counts["update"]), counts
    assert all(c == 0 for c in counts["read_skipped"]), counts  # step() kept the bool it synced for


def test_no_sync_with_a_fused_optimizer(monkeypatch):
    # Fused AdamW receives found_inf and skips on the device: step() must not read any device value,
    # and overflow steps must still leave the weights and the optimizer state untouched.
    counter = _SyncCounter(monkeypatch)
    counts = _sync_counts(DynamicLossScaler(growth_interval=2), counter, fused=True)
    assert all(c == 0 for c in counts["step"] + counts["scale"] + counts["update"]), counts


def test_fused_optimizer_skip_leaves_weights_and_state_untouched():
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    scaler = DynamicLossScaler()
    for step in range(4):
        opt.zero_grad()
        scaler.scale(F.mse_loss(net(torch.randn(4, 6)), torch.randn(4, 3))).backward()
        before = [p.detach().clone() for p in net.parameters()]
        steps_before = [opt.state[p]["step"].clone() for p in net.parameters() if p in opt.state]
        if step == 2:
            net.fc1.weight.grad[0, 0] = NAN
        scaler.step(opt)
        scaler.update()
        if step == 2:
            assert scaler.last_step_skipped and scaler.last_found_inf.item() > 0
            assert all(torch.equal(b, p) for b, p in zip(before, net.parameters()))
            assert all(torch.equal(a, opt.state[p]["step"]) for a, p in zip(steps_before, net.parameters()))
        else:
            assert not scaler.last_step_skipped
            assert not all(torch.equal(b, p) for b, p in zip(before, net.parameters()))


def test_sync_counter_catches_extra_syncs(monkeypatch):
    """The counter is not vacuous: scalers that read device values where they should not are caught."""

    class PerParameterCheck(DynamicLossScaler):  # the naive check: one .item() per gradient
        def _check_and_unscale_grads(self, optimizer, inv_scale):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        torch.isfinite(p.grad).all().item()
            return super()._check_and_unscale_grads(optimizer, inv_scale)

    class SyncingUpdate(DynamicLossScaler):  # a Python `if` on a device value in update()
        def _update_scale(self, found_inf):
            if found_inf:
                pass
            super()._update_scale(found_inf)

    counter = _SyncCounter(monkeypatch)
    counts = _sync_counts(PerParameterCheck(), counter, steps=3)
    assert all(c == 1 + len(_grad_params(_Net())) for c in counts["step"]), counts
    counts = _sync_counts(SyncingUpdate(), counter, steps=3)
    assert all(c == 1 for c in counts["update"]), counts


# ------------------------------------------------------------------------------------- hysteresis, bounds
def _drive(scaler, pattern):
    """Feed a scaler a pattern of steps, 'O' = overflow (inf grad), 'F' = finite; return (scale, skipped) per step."""
    param = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([param], lr=0.1)
    history = []
    for kind in pattern:
        opt.zero_grad()
        scaler.scale((param * 1.0).sum()).backward()
        if kind == "O":
            param.grad[1] = INF
        before = param.detach().clone()
        scaler.step(opt)
        assert scaler.last_step_skipped == (kind == "O")
        assert torch.equal(before, param) == (kind == "O")  # skipped steps leave the weights alone
        scaler.update()
        history.append(scaler.get_scale())
    return history


def test_hysteresis_one_overflow_tolerated():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=100, hysteresis=2)
    # first overflow: skipped, scale kept; second: backs off; allowance used up, so the third too
    assert _drive(s, "OOO") == [1024.0, 512.0, 256.0]
    assert s.state_dict()["_hysteresis_tracker"] == 1  # spent, but never below 1


def test_hysteresis_not_refilled_by_a_clean_step():
    # DeepSpeed's default rule: only growth refills the allowance, so O F O backs off on the second O
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=100, hysteresis=2)
    assert _drive(s, "OFO") == [1024.0, 1024.0, 512.0]


def test_hysteresis_refilled_by_growth():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=2, hysteresis=2)
    # O (kept, allowance 1) F F (grow to 2048, allowance refilled to 2) O (kept) O (back off)
    assert _drive(s, "OFFOO") == [1024.0, 1024.0, 2048.0, 2048.0, 1024.0]
    # and an overflow restarts the growth window: F O F does not grow at interval 2
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=2, hysteresis=3)
    assert _drive(s, "FOF") == [1024.0, 1024.0, 1024.0]


def test_consecutive_hysteresis_refilled_by_every_clean_step():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=100, hysteresis=2, consecutive_hysteresis=True)
    assert _drive(s, "OFOFOO") == [1024.0] * 5 + [512.0]


def test_hysteresis_three_needs_three_overflows():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=100, hysteresis=3)
    assert _drive(s, "OOOO") == [1024.0, 1024.0, 512.0, 256.0]


def test_min_scale_clamps_backoff_and_max_scale_clamps_growth():
    s = DynamicLossScaler(init_scale=4.0, growth_interval=1, min_scale=2.0, max_scale=24.0)
    assert _drive(s, "OOO") == [2.0, 2.0, 2.0]
    assert _drive(s, "FFFFF") == [4.0, 8.0, 16.0, 24.0, 24.0]


def test_growth_stops_below_fp32_infinity():
    s = DynamicLossScaler(init_scale=2.0**126, growth_interval=1)
    assert _drive(s, "FFF") == [2.0**127] * 3  # 2**128 is inf in fp32: keep 2**127, like GradScaler


def test_static_scaler_skips_but_never_changes_scale():
    s = StaticLossScaler(512.0)
    rng = random.Random(_fresh_seed())
    pattern = "".join(rng.choice("OF") for _ in range(40))
    assert _drive(s, pattern) == [512.0] * 40
    assert s.state_dict() == {"scale": 512.0}


# ------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("kwargs", [
    {"growth_interval": 3},
    {"init_scale": 2.0**10, "growth_interval": 2, "hysteresis": 3, "min_scale": 4.0, "max_scale": 2.0**14},
    {"growth_interval": 2, "hysteresis": 2, "consecutive_hysteresis": True},
])
def test_state_dict_round_trip_continues_identically(kwargs):
    seed = _fresh_seed()
    rng = random.Random(seed)
    pattern = "".join("O" if rng.random() < 0.3 else "F" for _ in range(80))
    cut = rng.randint(10, 70)
    straight = DynamicLossScaler(**kwargs)
    expected = _drive(straight, pattern)

    first = DynamicLossScaler(**kwargs)
    head = _drive(first, pattern[:cut])
    state = first.state_dict()
    resumed = DynamicLossScaler()  # built with defaults: everything must come from the state dict
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state, f"seed={seed}"
    assert head + _drive(resumed, pattern[cut:]) == expected, f"seed={seed} cut={cut} pattern={pattern}"


def test_state_dict_interoperates_with_gradscaler():
    ours = DynamicLossScaler(growth_interval=2)
    _drive(ours, "FFFOF")
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())  # a superset of GradScaler's keys
    assert theirs.state_dict() == {k: ours.state_dict()[k] for k in theirs.state_dict()}
    back = DynamicLossScaler(hysteresis=2)
    back.load_state_dict(theirs.state_dict())  # GradScaler's keys only: hysteresis kept as built
    assert back.get_scale() == ours.get_scale() and back.hysteresis == 2
    assert back.state_dict()["_growth_tracker"] == 1 and back.state_dict()["_hysteresis_tracker"] == 2


def test_load_state_dict_after_first_scale_updates_device_tensors():
    s = DynamicLossScaler(growth_interval=2)
    _drive(s, "F")
    s.load_state_dict({**s.state_dict(), "scale": 8.0, "_growth_tracker": 1})
    assert _drive(s, "F") == [16.0]
    with pytest.raises(RuntimeError, match="empty"):
        s.load_state_dict({})


# ------------------------------------------------------------------------------------- unscale numerics
def test_unscale_is_exact_for_power_of_two_scale():
    torch.manual_seed(_fresh_seed())
    net = _Net()
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    F.mse_loss(net(x), y).backward()
    reference = [p.grad.clone() for p in _grad_params(net)]
    net.zero_grad()
    scaler = DynamicLossScaler(init_scale=2.0**16)
    scaler.scale(F.mse_loss(net(x), y)).backward()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler.unscale_(opt)
    # Multiplying by 2**16 and later by 2**-16 only shifts exponents: every rounding in backward
    # happens at the same relative place, so the unscaled grads equal the unscaled backward bit for bit.
    for ref, p in zip(reference, _grad_params(net)):
        assert torch.equal(ref, p.grad)


def test_unscale_non_power_of_two_within_one_ulp():
    g = torch.randn(1000, dtype=torch.float64)
    scale = 1000.0
    grad = (g * scale).float()  # the scaled grad as backward would store it
    param = nn.Parameter(torch.zeros(1000))
    param.grad = grad.clone()
    scaler = StaticLossScaler(scale)
    scaler.scale(torch.ones(()))
    scaler.unscale_(torch.optim.SGD([param], lr=0.1))
    expected = (grad.double() / scale).float()  # exact quotient, rounded once
    ulp = torch.finfo(torch.float32).eps * expected.abs()
    assert ((param.grad - expected).abs() <= ulp).all()


def test_sparse_gradients_are_unscaled():
    emb = nn.Embedding(10, 4, sparse=True)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    scaler.scale(emb(torch.tensor([1, 3, 3])).sum()).backward()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    scaler.unscale_(opt)
    dense = emb.weight.grad.to_dense()
    assert torch.equal(dense[3], torch.full((4,), 2.0)) and torch.equal(dense[1], torch.ones(4))


# ------------------------------------------------------------------------------------- extras
def test_found_inf_reducer_makes_ranks_agree():
    """A reducer that reports another rank's overflow makes this rank skip and back off too."""
    calls = []

    def other_rank_overflowed(flag):  # what dist.all_reduce(flag, MAX) does when a peer saw an inf
        calls.append(flag.dtype)
        flag.fill_(1.0)

    s = DynamicLossScaler(init_scale=64.0, found_inf_reducer=other_rank_overflowed)
    assert _drive_finite_steps(s, 3) == [(32.0, True), (16.0, True), (8.0, True)]
    assert calls == [torch.float32] * 3  # once per optimizer per iteration, on the fp32 flag


def _drive_finite_steps(scaler, n):
    param = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    out = []
    for _ in range(n):
        opt.zero_grad()
        scaler.scale(param.sum()).backward()
        scaler.unscale_(opt)  # explicit unscale_, then step: the reducer still runs once
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), scaler.last_step_skipped))
    return out


def test_disabled_scaler_is_a_pass_through():
    s = DynamicLossScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert s.scale(loss) is loss and not s.is_enabled()
    param = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.5)
    param.grad = torch.full((2,), INF)
    s.unscale_(opt)
    s.step(opt)  # no checks at all when disabled, like GradScaler(enabled=False)
    s.update()
    assert math.isinf(param[0].item()) and s.get_scale() == 1.0 and s.state_dict() == {}


def test_scale_lists_tuples_and_lazy_init():
    s = DynamicLossScaler(init_scale=4.0)
    assert s.get_scale() == 4.0  # before the first scale(): the initial value, no tensor yet
    a, b = torch.tensor(1.0), torch.tensor(2.0)
    out = s.scale([a, (b, a)])
    assert isinstance(out, list) and isinstance(out[1], tuple)
    assert out[0].item() == 4.0 and out[1][0].item() == 8.0
    assert s._scale.dtype == torch.float32 and s._growth_tracker.dtype == torch.int32


def test_update_with_new_scale():
    s = DynamicLossScaler(growth_interval=100)
    _drive(s, "F")
    s.update(new_scale=128.0)
    assert s.get_scale() == 128.0
    s.update(new_scale=torch.tensor(32.0))
    assert s.get_scale() == 32.0


def test_base_class_is_abstract():
    s = BaseLossScaler(8.0)
    with pytest.raises(NotImplementedError):
        _drive(s, "F")


# ------------------------------------------------------------------------------ make_scaler


def test_make_scaler_picks_by_name_and_policy():
    from mpgpt.precision import resolve_precision
    from mpgpt.scaling import GradScalerAdapter, NullScaler, make_scaler

    fp16, fp32 = resolve_precision("fp16", "cpu"), resolve_precision("fp32", "cpu")
    assert isinstance(make_scaler("auto", fp16, "cpu"), DynamicLossScaler)
    assert isinstance(make_scaler("auto", fp32, "cpu"), NullScaler)
    static = make_scaler("static", fp16, "cpu", static_scale=2.0**7)
    assert isinstance(static, StaticLossScaler) and static.get_scale() == 2.0**7
    dynamic = make_scaler("dynamic", fp32, "cpu", init_scale=2.0**5, growth_interval=3)
    assert dynamic.get_scale() == 2.0**5
    assert isinstance(make_scaler("gradscaler", fp16, "cpu"), GradScalerAdapter)
    with pytest.raises(ValueError, match="choose one of auto, dynamic, static, gradscaler, none"):
        make_scaler("amp", fp16, "cpu")


def test_gradscaler_adapter_speaks_the_protocol_and_resumes():
    from mpgpt.scaling import GradScalerAdapter

    p = torch.nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(3)))
    opt = torch.optim.SGD([p], lr=0.1)
    a = GradScalerAdapter("cpu")
    a.inner = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
    a.scale((p * p).sum()).backward()
    a.step(opt)
    a.update()
    assert a.get_scale() == 2.0**5  # one clean step with growth_interval 1: doubled
    b = GradScalerAdapter("cpu")
    b.load_state_dict(a.state_dict())
    assert b.get_scale() == a.get_scale()


def test_backoff_below_min_scale_sets_floor_hit():
    # 4 -> 2 is within the floor; the next overflow wants 1 < min_scale 2: flagged, scale held at 2.
    s = DynamicLossScaler(init_scale=4.0, growth_interval=100, min_scale=2.0)
    assert s.floor_hit is False  # nothing scaled yet
    assert _drive(s, "O") == [2.0] and not bool(s.floor_hit)
    assert _drive(s, "F") == [2.0] and not bool(s.floor_hit)
    assert _drive(s, "O") == [2.0] and bool(s.floor_hit)
    # without a floor nothing is ever flagged (GradScaler's behaviour: the scale just keeps halving)
    s = DynamicLossScaler(init_scale=4.0, growth_interval=100)
    assert _drive(s, "OOOO") == [2.0, 1.0, 0.5, 0.25] and not bool(s.floor_hit)


class _FusedLikeSGD(torch.optim.Optimizer):
    """Plain SGD that advertises the fused-optimizer protocol and records the attributes a scaler sets."""

    _step_supports_amp_scaling = True

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        self.seen = (getattr(self, "grad_scale", "unset"), getattr(self, "found_inf", "unset"))
        if self.found_inf.item() == 0:
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad, alpha=-group["lr"])


def test_fused_protocol_keeps_a_callers_grad_scale_like_gradscaler():
    # GradScaler, once the grads are unscaled, hands a fused optimizer the caller's own grad_scale
    # unchanged (torch/amp/grad_scaler.py, UNSCALED case); ours always unscales first, so must do the same.
    param = nn.Parameter(torch.ones(3))
    opt = _FusedLikeSGD([param], lr=0.1)
    ref_param = nn.Parameter(torch.ones(3))
    ref_opt = _FusedLikeSGD([ref_param], lr=0.1)
    ours, ref = DynamicLossScaler(init_scale=8.0), torch.amp.GradScaler("cpu", init_scale=8.0)
    for scaler, p, o in [(ours, param, opt), (ref, ref_param, ref_opt)]:
        scaler.scale((p * 2.0).sum()).backward()
        scaler.unscale_(o)  # GradScaler would otherwise fold its scale into grad_scale (see the docstring)
        o.grad_scale = torch.tensor(1.0)  # the caller's own factor, as GradScaler's comment allows
        scaler.step(o)
        scaler.update()
    assert isinstance(opt.seen[0], torch.Tensor) and torch.equal(opt.seen[0], ref_opt.seen[0])
    assert float(opt.seen[1]) == float(ref_opt.seen[1]) == 0.0
    assert not hasattr(opt, "grad_scale") and not hasattr(ref_opt, "grad_scale")  # both delete it after
    assert torch.equal(param, ref_param)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_deferred_unscale_gives_the_unscaled_update_bit_for_bit(device):
    """defer_unscale_ leaves the gradients scaled and lets torch's fused AdamW divide by the scale
    times the caller's clipping factor. With a power-of-two scale every step, skipped or not, must
    leave exactly the weights and moments of unscale_ followed by the same factor: (g*S)/(S*c) and
    (g*S*(1/S))/c round the same exact quotient once. Fresh random gradients, one of them inf on
    some steps; the check is the scaled gradients' norm, as the trainer computes it. On the CPU and
    with CUDA's fused AdamW kernel, which the trainer runs."""
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    params = {mode: [nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(seed + n)).to(device))
                     for n in (7, 33, 130)] for mode in ("unscale_", "defer")}
    opts = {mode: torch.optim.AdamW(ps, lr=1e-2, fused=True) for mode, ps in params.items()}
    scalers = {mode: DynamicLossScaler(init_scale=2.0**12, growth_interval=3) for mode in params}
    for step in range(10):
        grads = [(torch.randn(p.shape, generator=gen) * 10 ** torch.empty(()).uniform_(-6, 2, generator=gen)).to(device)
                 for p in params["defer"]]
        if step in (2, 6):
            grads[1][5] = INF
        for mode, ps in params.items():
            scaler, opt = scalers[mode], opts[mode]
            scaler.scale(torch.zeros((), device=device, requires_grad=True).sum())  # creates the scale on first use
            for p, g in zip(ps, grads):
                p.grad = g * scaler.scale_tensor()
            if mode == "unscale_":
                scaler.unscale_(opt)
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ps]))
            else:
                scaled = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ps]))
                norm = scaled / scaler.defer_unscale_(opt, found_inf=~torch.isfinite(scaled))
            opt.grad_scale = ((norm + 1e-6) / 0.5).clamp(min=1.0)
            scaler.step(opt)
            scaler.update()
            assert not hasattr(opt, "grad_scale")
        assert scalers["defer"].get_scale() == scalers["unscale_"].get_scale(), f"seed {seed}, step {step}"
        for a, b in zip(params["defer"], params["unscale_"]):
            assert torch.equal(a, b), f"seed {seed}, step {step}"
            assert all(torch.equal(opts["defer"].state[a][k], opts["unscale_"].state[b][k]) for k in ("exp_avg", "exp_avg_sq"))
    assert scalers["defer"].get_scale() < 2.0**12 * 2**3  # the two overflows backed it off


def test_deferred_unscale_is_refused_where_the_gradients_would_stay_scaled():
    """An optimizer that does not divide by grad_scale itself would step on scaled gradients; and
    the check happens once per iteration, before step()."""
    scaler = DynamicLossScaler(init_scale=8.0)
    p = nn.Parameter(torch.ones(3))
    scaler.scale((p * 2.0).sum()).backward()
    with pytest.raises(ValueError, match=r"call unscale_\(optimizer\) instead, or use a fused optimizer"):
        scaler.defer_unscale_(torch.optim.SGD([p], lr=0.1), found_inf=torch.tensor(False))
    fused = torch.optim.AdamW([p], lr=0.1, fused=True)
    scaler.unscale_(fused)
    with pytest.raises(RuntimeError, match="once per iteration"):
        scaler.defer_unscale_(fused, found_inf=torch.tensor(False))



# ------------------------------------------------------------------------------------- saved states checked
@pytest.mark.parametrize("bad", [
    {"scale": NAN}, {"scale": INF}, {"scale": -5.0}, {"scale": 0.0}, {"scale": "2"}, {"scale": True},
    {"growth_interval": 0}, {"growth_interval": -3}, {"growth_interval": 2.7},
    {"growth_factor": 0.1}, {"growth_factor": NAN}, {"growth_factor": INF}, {"backoff_factor": 3.0},
    {"hysteresis": 0}, {"min_scale": 1e9}, {"max_scale": -1.0}, {"max_scale": 2.0},
    {"_growth_tracker": -10 ** 6}, {"_growth_tracker": 10 ** 12}, {"_hysteresis_tracker": 5},
    {"consecutive_hysteresis": "yes"},
], ids=repr)
def test_load_state_dict_refuses_a_state_that_cannot_run_and_changes_nothing(bad):
    s = DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=4, hysteresis=2, min_scale=1.0)
    _drive(s, "FFI")
    before = s.state_dict()
    with pytest.raises(ValueError, match="must|no '"):
        s.load_state_dict({**before, **bad})
    assert s.state_dict() == before
    assert s.get_scale() == before["scale"]


def test_the_other_scalers_check_a_saved_state_too():
    static = StaticLossScaler(8.0)
    for bad in [NAN, 0.0, -1.0, INF]:
        with pytest.raises(ValueError, match="scale must be a positive number"):
            static.load_state_dict({"scale": bad})
    assert static.get_scale() == 8.0
    from mpgpt.scaling import GradScalerAdapter, NullScaler

    adapter = GradScalerAdapter("cpu")
    with pytest.raises(ValueError, match="growth_interval must be"):
        adapter.load_state_dict({**torch.amp.GradScaler("cpu").state_dict(), "growth_interval": 0})
    with pytest.raises(ValueError, match="this run has no loss scaler"):
        NullScaler().load_state_dict({"scale": 4.0})
