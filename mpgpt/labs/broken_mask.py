"""Train a one-layer attention model on left-padded batches of text, in fp32 and then in fp16.

    python -m mpgpt.labs.broken_mask            # the script as written
    python -m mpgpt.labs.broken_mask --fixed    # with the repaired attention (mpgpt/labs/repaired.py)

Sequences of different lengths are padded on the left to one length, as a batch for generation
often is; attention is causal and must not look at padding; the loss ignores padded positions.
The fp32 run trains. Switch to fp16 autocast with a GradScaler and it does not: why?
"""
import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

from mpgpt.data import TextDataset, default_corpus
from mpgpt.labs import repaired

PAD = 0


def attend(q, k, v, keep):
    """softmax(q k^T / sqrt(d) + mask) v. q, k, v: (B, T, d); keep: (B, T, T) bool, True = may attend."""
    scores = q @ k.transpose(1, 2) / math.sqrt(q.size(-1))   # (B, T, T)
    mask = torch.zeros(keep.shape, device=keep.device).masked_fill(~keep, -1e9)  # additive mask: 0 or a large negative number
    scores = scores + mask.to(scores.dtype)
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v     # (B, T, d)


class TinyAttentionLM(nn.Module):
    def __init__(self, vocab: int, d: int = 32, attention=attend):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(64, d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, vocab)
        self.attention = attention

    def forward(self, x, lengths):
        B, T = x.shape
        h = self.emb(x) + self.pos(torch.arange(T, device=x.device))
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        is_token = torch.arange(T, device=x.device)[None, :] >= (T - lengths)[:, None]     # (B, T) left padding
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
        keep = causal[None] & is_token[:, None, :]                                           # (B, T, T)
        return self.out(h + self.attention(q, k, v, keep)), is_token


def batch(data, gen, B=16, T=32):
    """Left-padded sequences of 8..T+1 characters; targets are the next characters, -100 at padding."""
    x = torch.full((B, T), PAD)
    y = torch.full((B, T), -100)
    lengths = torch.randint(8, T + 1, (B,), generator=gen)
    for i, n in enumerate(lengths.tolist()):
        start = torch.randint(0, len(data.train) - n - 1, (1,), generator=gen).item()
        chunk = data.train[start:start + n + 1]
        x[i, T - n:], y[i, T - n:] = chunk[:-1], chunk[1:]
    return x, y, lengths


def run(data, fp16: bool, attention, steps: int, device: str):
    torch.manual_seed(0)
    model = TinyAttentionLM(data.tokenizer.vocab_size, attention=attention).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler(device, enabled=fp16)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        x, y, lengths = (t.to(device) for t in batch(data, gen))
        with torch.autocast(device, dtype=torch.float16, enabled=fp16):
            logits, _ = model(x, lengths)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    scale = f", final loss scale {scaler.get_scale():g}" if fp16 else ""
    print(f"{'fp16' if fp16 else 'fp32'}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} steps{scale}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="use the repaired attention")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)  # tiny tensors: one thread is as fast, and the run repeats exactly
    data = TextDataset(default_corpus())
    attention = repaired.mask_attend if args.fixed else attend
    run(data, False, attention, args.steps, device)
    run(data, True, attention, args.steps, device)


if __name__ == "__main__":
    main()
