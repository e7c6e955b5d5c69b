"""The repaired pieces of the lab's broken scripts (``--fixed`` swaps them in). A spoiler: read it
after you have written your diagnosis."""
import math

import torch

from mpgpt.model import GPT


def clipping_train_step(model, optimizer, scaler, x, y, device):
    """Unscale before clipping, so that clip_grad_norm_ sees (and reports) the true gradients."""
    with torch.autocast(device, dtype=torch.float16):
        _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # the repair: divide by the scale first; step() will not do it again
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()
    return loss.item(), norm.item()


def resume_save(path, model, optimizer, scaler, step):
    """Save the scaler's state with the model and the optimizer: its scale and growth tracker are
    part of the training state, learned over the run."""
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "step": step}, path)


def resume_load(path, model, optimizer, scaler):
    state = torch.load(path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])  # the repair: continue from the learned scale
    return state["step"]


def mask_attend(q, k, v, keep):
    """Mask and softmax in fp32, as SDPA and the course GPT do. A row with nothing to attend to
    (a padding position: it sees only padding) then gets a uniform, finite softmax instead of
    -inf everywhere and 0/0 = NaN; its output is ignored by the loss either way."""
    scores = (q @ k.transpose(1, 2)).float() / math.sqrt(q.size(-1))  # the repair: fp32 scores
    scores = scores.masked_fill(~keep, -1e9)  # -1e9 is finite in fp32 (in fp16 it is -inf)
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


def adam_eps_build(config, device):
    """The smallest change: an eps that fp16 can hold. Adam divides by sqrt(v) + eps, and 1e-8 is
    below half of fp16's smallest subnormal (2**-24, about 6e-8), so in fp16 it rounds to 0; where a
    gradient is 0 or tiny (g**2 underflowing), v is 0 and the update is
    m / 0 = inf or 0 / 0 = NaN. 1e-4 is representable (a normal fp16 number is >= 6.1e-5). The
    better fix is the course's: fp32 master weights and optimizer state (chapter 3)."""
    model = GPT(config).to(device).half()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    return model, optimizer
