"""The GPT model: a decoder-only transformer in fp32, the reference every faster variant is checked against.

Chapter 2 ("The fp32 GPT") explains this module. It imports nothing of the fast path: the Triton
layers and fused kernels are applied from outside by ``mpgpt.fast.convert`` (chapters 6 and 7), which
keeps every parameter and state_dict key, so a checkpoint moves between this model and a converted one.

The architecture is GPT-2's (Radford et al. 2019) as written in Karpathy's nanoGPT (model.py):
pre-norm blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> MLP -> residual),
learned position embeddings, a GELU (tanh) MLP four times as wide as the model, and an output
layer that shares its weight with the token embedding. Module names follow nanoGPT, so a
state_dict lines up with nanoGPT's and with Hugging Face's GPT-2 (up to its Conv1D transposes).

    cfg = GPTConfig.preset("tiny", vocab_size=tokenizer.vocab_size)
    model = GPT(cfg)
    logits, loss = model(x, y)          # x, y: (B, T) int64 -> logits (B, T, vocab_size)
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from torch.nn.attention import SDPBackend, sdpa_kernel

from mpgpt import runtime

# SDPA's backends with cuDNN's first, for attention="cudnn" (the rest keep their usual order).
# set_priority arrived in torch 2.6; before it the list only enables backends (all of them here).
_CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.MATH]
_PRIORITY = {"set_priority": True} if "set_priority" in inspect.signature(sdpa_kernel).parameters else {}

__all__ = ["GPTConfig", "GPT", "PRESETS"]

# Each preset names a model size used in the course. tiny and small are for character-level
# data: pass your tokenizer's vocab_size as an override (256 covers any byte-level alphabet).

# Dense bf16 (fp16 before sm_80) tensor-core peaks from the vendors' datasheets, in FLOP/s. MFU
# (model FLOPs utilisation) is always reported against the bf16 peak, whatever the precision
# policy, so the precisions can be compared; nanoGPT's estimate_mfu does the same with the A100's.
PEAK_BF16 = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
    "T4": 65e12, "V100": 125e12, "RTX 4090": 165e12, "RTX 3090": 71e12,
}


def peak_flops(device) -> float | None:
    """Datasheet dense bf16 (fp16 before sm_80) tensor-core FLOP/s of a CUDA device, or None if unknown."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = runtime.device_name(device)
    for key, value in PEAK_BF16.items():
        if key in name:
            return value
    return None


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: the share of ``peak`` FLOP/s that the model's own arithmetic uses."""
    return flops_per_token * tokens_per_s / peak if peak else None

PRESETS = {
    # Trains on two CPU cores to a visibly falling loss in about a minute (chapter 2).
    "tiny": dict(n_layer=2, n_head=4, n_embd=128, block_size=64, vocab_size=256),
    # nanoGPT's shakespeare_char model: minutes on a GPU.
    "small": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=256),
    # GPT-2 small (124M parameters). GPT-2's vocabulary has 50257 tokens; 50304 = 786 * 64 is
    # the next multiple of 64, so the embedding and output matmuls get shapes that tile evenly
    # on tensor cores (nanoGPT measured ~25% faster). The 47 extra rows are never used as targets.
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
}


@dataclass
class GPTConfig:
    """Sizes and switches of a GPT. The defaults are GPT-2 small's."""

    block_size: int = 1024  # the longest sequence the model can see (number of positions)
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as GPT-2
    attention: str = "sdpa"  # "sdpa": fused kernel; "math": explicit softmax(QK^T/sqrt(d))V;
    # "cudnn": sdpa, trying cuDNN's fused attention first on CUDA (else as "sdpa")

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                "each head gets n_embd // n_head channels"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.attention not in ("sdpa", "math", "cudnn"):
            raise ValueError(f"attention must be 'sdpa', 'cudnn' or 'math', got {self.attention!r}")

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """A named size ("tiny", "small", "gpt2"), with any field overridden by keyword."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(map(repr, PRESETS))}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s) {unknown}; the fields are {sorted(fields)}")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t attends only to positions <= t."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.attention = config.attention
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        # Lower-triangular mask for the "math" path. Not persistent: it is derived from
        # block_size, so state_dicts do not depend on which attention path was used.
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", mask.view(1, 1, config.block_size, config.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # batch, sequence length, channels (n_embd)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        # Split channels into heads and move the head dimension next to the batch.
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = self.attend(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads side by side: (B, T, C)
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of q, k, v (B, nh, T, hs) -> (B, nh, T, hs), by the configured path."""
        if self.attention == "math":
            return self._math_attention(q, k, v, q.size(2))
        # One fused kernel (flash / memory-efficient attention where available). "cudnn" puts
        # cuDNN's fused attention first in SDPA's order of preference on CUDA.
        cudnn_first = self.attention == "cudnn" and q.is_cuda
        with sdpa_kernel(_CUDNN_FIRST, **_PRIORITY) if cudnn_first else contextlib.nullcontext():
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )  # (B, nh, T, hs)

    def _math_attention(self, q, k, v, T):
        """softmax(q k^T / sqrt(hs) + causal mask) v, spelled out."""
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        # Mask future positions with -inf rather than a large negative sentinel: -1e9 does not
        # fit in fp16 (max 65504) and becomes -inf on the cast anyway, and finfo(fp16).min
        # overflows to -inf once a score of -16 or less is added to it, so a sentinel's behaviour would
        # depend on the dtype (transformers PR 17306). -inf is exact in every dtype and
        # exp(-inf) = 0. No row is all -inf (a position always sees itself), so softmax never
        # divides 0 by 0.
        att = att.masked_fill(~self.causal_mask[:, :, :T, :T], float("-inf"))
        # Softmax in fp32 even under autocast: exp and the row sum lose accuracy in 16 bits.
        att = F.softmax(att.float(), dim=-1).to(q.dtype)
        att = self.attn_dropout(att)
        return att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)


class MLP(nn.Module):
    """Position-wise feed-forward network: expand 4x, GELU, project back."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.act = nn.GELU(approximate="tanh")  # GPT-2's GELU is the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    """One transformer block, pre-norm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    """A GPT-2-style language model: token ids (B, T) -> next-token logits (B, T, vocab_size)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),  # token embedding
                wpe=nn.Embedding(config.block_size, config.n_embd),  # position embedding
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017): the output layer scores a hidden state against every
        # token's embedding. One (vocab_size, n_embd) matrix instead of two: 38.6M fewer
        # parameters for gpt2. Both names stay in the state_dict, pointing at one tensor.
        self.lm_head.weight = self.transformer.wte.weight
        # Off by default; see set_activation_checkpointing (a run-time switch, not part of the config,
        # so a checkpoint written with it on resumes with it off and vice versa).
        self.activation_checkpointing = False

        # GPT-2 / nanoGPT initialisation: N(0, 0.02) for weights, zeros for biases...
        self.apply(self._init_weights)
        # ...and the projections that write into the residual stream scaled by 1/sqrt(2 * n_layer):
        # each block adds two such outputs, so the stream's variance stays O(1) with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    # ---------------------------------------------------------------------------------- forward

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits (B, T, vocab_size) and, when `targets` (B, T) is given, the mean cross-entropy.

        The loss is computed from fp32 logits even under autocast: log-softmax over a large
        vocabulary in 16 bits loses the small probabilities that carry the gradient. Targets
        equal to -1 are ignored.
        """
        self._check_idx(idx, targets)
        T = idx.size(1)
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        tok_emb = self.transformer.wte(idx)  # (B, T, C)
        pos_emb = self.transformer.wpe(pos)  # (T, C), broadcast over the batch
        x = self.transformer.drop(tok_emb + pos_emb)  # (B, T, C)
        checkpointing = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.transformer.h:
            if checkpointing:
                # Keep only each block's input; recompute its insides during backward.
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)  # (B, T, C)
            else:
                x = block(x)  # (B, T, C)
        x = self.transformer.ln_f(x)  # (B, T, C)
        logits = self.lm_head(x)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
            )  # mean over the B*T positions
        return logits, loss

    def _check_idx(self, idx, targets=None) -> None:
        """Refuse, in one line that says what to do, inputs the forward pass cannot take."""
        if not isinstance(idx, torch.Tensor):
            raise ValueError(f"idx must be a torch.Tensor of token ids, got {type(idx).__name__}")
        if idx.dim() != 2:
            raise ValueError(f"idx must be 2-D (batch, sequence), got shape {tuple(idx.shape)}; add a batch dim with idx[None]")
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise ValueError(f"idx must hold integer token ids, got dtype {idx.dtype}; use idx.long()")
        T = idx.size(1)
        if T == 0:
            raise ValueError("idx has sequence length 0; give at least one token")
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size {self.config.block_size}; "
                "crop the input or use a larger block_size"
            )
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} must match idx shape {tuple(idx.shape)}")

    # ------------------------------------------------------------------------------- generation

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None, generator=None):
        """Append `max_new_tokens` sampled tokens to idx (B, T) and return the (B, T + new) tensor.

        Only the last block_size tokens are fed back. temperature == 0 picks the most likely
        token (greedy); top_k keeps only the k most likely tokens before sampling. Pass a seeded
        ``torch.Generator`` (on idx's device) for reproducible samples. Dropout is off while
        generating; the training mode is restored afterwards.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                idx_cond = idx[:, -self.config.block_size :]  # (B, <=block_size)
                logits, _ = self(idx_cond)
                logits = logits[:, -1, :].float()  # (B, V): only the last position predicts the next token
                if temperature == 0:
                    idx_next = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))  # (B, k)
                        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
                    probs = F.softmax(logits, dim=-1)  # (B, V)
                    idx_next = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
                idx = torch.cat((idx, idx_next), dim=1)  # (B, T + 1)
        finally:
            self.train(was_training)
        return idx

    # -------------------------------------------------------------------------------- counting

    def num_params(self, non_embedding: bool = True) -> int:
        """Number of parameters (the tied embedding counted once).

        With non_embedding=True the position embedding is left out, as in nanoGPT; the token
        embedding stays in because, tied to lm_head, it does a matmul's work at the output.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token: 6 N + 12 L H Q T.

        From PaLM (Chowdhery et al. 2022, appendix B), as used by nanoGPT's estimate_mfu:
        - N = num_params(non_embedding=True): every weight takes part in one multiply-add per
          token in the forward pass (2 FLOPs) and two in the backward pass (gradients with
          respect to the input and to the weight, 4 FLOPs): 6 N. N includes the tied
          wte/lm_head matrix (the output matmul) and, negligibly, biases and LayerNorm gains.
        - 12 L H Q T for attention, which has no weights: per layer and token, q k^T and att v
          are each 2 H Q T FLOPs forward (Q = n_embd // n_head, T = sequence length), times 3 for
          forward + backward. Like PaLM, it counts the full T x T score matrix, not the causal half.
        `seq_len` defaults to block_size.
        """
        cfg = self.config
        T = cfg.block_size if seq_len is None else seq_len
        N = self.num_params(non_embedding=True)
        return 6 * N + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T

    # --------------------------------------------------------------------------------- training

    def set_activation_checkpointing(self, enable: bool = True) -> "GPT":
        """Trade compute for memory: store only each block's input in the forward pass and recompute
        the block during backward (torch.utils.checkpoint, non-reentrant). Costs about one extra
        forward pass (~+33% FLOPs); saves the activations inside every block. Returns self."""
        self.activation_checkpointing = bool(enable)
        return self
