"""A learner's solution to lab-nans-hooks.

The grading tests plant bugs into this file by replacing the lines marked # PLANT: name."""
import torch


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):  # PLANT: nested
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def first_nonfinite_module(model, run):
    found = []
    names = {id(m): name for name, m in model.named_modules()}

    def hook(module, inputs, output):
        bad = any(not torch.isfinite(t).all() for t in _tensors(output))  # PLANT: test
        if bad and not found:  # PLANT: first
            found.append(names[id(module)])

    handles = [m.register_forward_hook(hook) for m in model.modules()]  # PLANT: which
    try:
        run()
    finally:
        for h in handles:  # PLANT: remove
            h.remove()
    return found[0] if found else None
