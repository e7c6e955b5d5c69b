"""A learner's solution to ch5-scaler: chapter 5's OpenScaler grown to GradScaler's protocol.

The grading tests plant bugs into this file by replacing the lines marked # PLANT: name."""
import torch


class DynamicLossScaler:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale_value, self.tracker = float(init_scale), 0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.found_inf, self.unscaled = None, False

    def scale(self, loss):
        return loss * self.scale_value

    def unscale_(self, optimizer):
        if self.unscaled:  # PLANT: twice_guard
            raise RuntimeError("unscale_() has already been called since the last update()")
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.found_inf = any(not torch.isfinite(g).all() for g in grads)  # PLANT: check
        for g in grads:
            g.div_(self.scale_value)
        self.unscaled = True

    def step(self, optimizer):
        if not self.unscaled:  # PLANT: unscale_in_step
            self.unscale_(optimizer)
        if self.found_inf:  # PLANT: skip
            return None
        return optimizer.step()

    def update(self):
        if self.found_inf:
            self.scale_value *= self.backoff_factor
            self.tracker = 0  # PLANT: reset
        else:
            self.tracker += 1
            if self.tracker == self.growth_interval:  # PLANT: growth
                self.scale_value *= self.growth_factor
                self.tracker = 0
        self.found_inf, self.unscaled = None, False  # PLANT: end_of_iteration

    def get_scale(self):
        return self.scale_value

    def state_dict(self):
        return {"scale": self.scale_value, "growth_tracker": self.tracker,  # PLANT: state
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval}

    def load_state_dict(self, state):
        self.scale_value, self.tracker = state["scale"], state.get("growth_tracker", 0)
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval = state["growth_interval"]
