"""The reference GPT's fast forms: the same modules and parameters, forward passes that call fused kernels.

``mpgpt.fast.convert`` turns a reference :class:`mpgpt.model.GPT` into these classes in place (the
same objects, so every Parameter, the state_dict keys and an optimizer built before stay as they
are) and back. Each class reads the switches the converter set on it and otherwise runs its parent's
forward pass:

    FastMLP        ``fused``: the MLP as one function of its weights (mpgpt.fast.mlp.gelu_mlp)
    FastAttention  ``fused_qkv``: c_attn and the head split (mpgpt.fast.qkv.qkv_heads)
    FastGPT        ``fused_embedding``, ``fused_layer_norm`` (with ``bias_in_add``), and the loss:
                   ``fused_loss`` (mpgpt.fast.cross_entropy) or ``loss_chunk_rows`` (mpgpt.fused_loss)

A fused path never calls the forward of the modules it stands for, so where hooks are registered on
them (or on every module) the module takes the plain path, or the model refuses in one line.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mpgpt.fused_loss import chunked_linear_cross_entropy
from mpgpt.model import GPT, MLP, Block, CausalSelfAttention

__all__ = ["FastGPT", "FastAttention", "FastMLP", "has_hooks"]

_BACK = "convert the model back with mpgpt.fast.convert(model)"


def has_hooks(module: nn.Module | None) -> bool:
    """Whether forward or backward hooks are registered on ``module`` (None: on every module)."""
    _m = nn.modules.module  # where torch keeps the hooks registered for every module
    if module is None:
        return bool(_m._global_forward_pre_hooks or _m._global_forward_hooks or _m._global_backward_hooks
                    or _m._global_backward_pre_hooks)
    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_hooks
                or module._backward_pre_hooks)


class FastAttention(CausalSelfAttention):
    """CausalSelfAttention with c_attn and the head split optionally in one function (``fused_qkv``)."""

    fused_qkv = None  # mpgpt.fast.qkv.qkv_heads, set by the converter

    def forward(self, x: torch.Tensor, proj_bias: bool = True) -> torch.Tensor:
        """proj_bias=False leaves c_proj's bias out, for FastGPT's residual add to add (bias_in_add)."""
        B, T, C = x.shape
        # The fused form never calls c_attn's forward: with hooks on it (or on every module), take
        # the plain path so that they run.
        if self.fused_qkv is not None and not (has_hooks(self.c_attn) or has_hooks(None)):
            q, k, v = self.fused_qkv(x, self.c_attn.weight, self.c_attn.bias, self.n_head)  # 3 x (B, nh, T, hs)
        else:
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
            hs = C // self.n_head
            q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
            k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
            v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = self.attend(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y) if proj_bias else F.linear(y, self.c_proj.weight))  # (B, T, C)


class FastMLP(MLP):
    """The MLP, optionally as one function of its weights (``fused``: GELU fused into c_fc's product)."""

    fused = None  # mpgpt.fast.mlp.gelu_mlp (or a partial of it with its options), set by the converter

    def forward(self, x: torch.Tensor, proj_bias: bool = True) -> torch.Tensor:
        """proj_bias=False leaves c_proj's bias out, as FastAttention.forward does."""
        # The fused form never calls c_fc's, act's or c_proj's forward: with hooks on them (or on
        # every module), take the plain path so that they run.
        if self.fused is not None and not any(has_hooks(m) for m in (self.c_fc, self.act, self.c_proj, None)):
            return self.dropout(self.fused(x, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight,
                                           self.c_proj.bias if proj_bias else None))
        x = self.act(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x) if proj_bias else F.linear(x, self.c_proj.weight))  # (B, T, C)


class FastGPT(GPT):
    """GPT with the fused embedding, residual-add + LayerNorm and output-layer loss the converter switched on."""

    loss_chunk_rows = 0        # > 0: output layer + loss that many rows at a time (mpgpt.fused_loss)
    fused_loss = None          # mpgpt.fast.cross_entropy.fused_linear_cross_entropy
    fused_layer_norm = None    # mpgpt.fast.layernorm.residual_layer_norm
    bias_in_add = False        # c_proj's bias added in that residual add
    fused_embedding = None     # mpgpt.fast.embedding.tied_embedding

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """As GPT.forward; with a fused or chunked loss and targets given, ``(None, loss)``: no full
        logits exist in that mode."""
        self._check_idx(idx, targets)
        B, T = idx.shape
        if self.fused_embedding is not None:
            # the same sum; the output layer then multiplies by head_weight, the tied matrix as a view
            x, head_weight = self.fused_embedding(idx, self._tied_weight(), self.transformer.wpe.weight)  # (B, T, C)
        else:
            pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
            tok_emb = self.transformer.wte(idx)  # (B, T, C)
            pos_emb = self.transformer.wpe(pos)  # (T, C), broadcast over the batch
            x, head_weight = tok_emb + pos_emb, self.lm_head.weight
        x = self.transformer.drop(x)  # (B, T, C)
        checkpointing = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        if self.fused_layer_norm is not None and not checkpointing:
            x = self._blocks_with_fused_layer_norm(x)  # ln_f(blocks(x)): (B, T, C)
        else:
            for block in self.transformer.h:
                if checkpointing:
                    x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)  # (B, T, C)
                else:
                    x = block(x)  # (B, T, C)
            x = self.transformer.ln_f(x)  # (B, T, C)
        if targets is not None and (self.loss_chunk_rows or self.fused_loss is not None):
            if self.fused_loss is not None:
                loss = self.fused_loss(x.reshape(B * T, -1), head_weight, targets.reshape(-1))
            else:
                loss = chunked_linear_cross_entropy(x.reshape(B * T, -1), head_weight, targets.reshape(-1),
                                                    self.loss_chunk_rows)
            return None, loss
        logits = self.lm_head(x) if head_weight is self.lm_head.weight else F.linear(x, head_weight)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
            )  # mean over the B*T positions
        return logits, loss

    def _blocks_with_fused_layer_norm(self, x: torch.Tensor) -> torch.Tensor:
        """ln_f(blocks(x)), the same sums as Block.forward, regrouped so that each residual add
        meets the LayerNorm that reads its result (the next block's ln_1, or ln_f after the last
        block): one `mpgpt.fast.layernorm.residual_layer_norm` per pair."""
        add_ln = self.fused_layer_norm
        blocks = self.transformer.h
        # The regrouped loop never calls Block.forward or the LayerNorms' forward. So a module whose
        # own forward would then not run is refused: a wrapper (checkpoint_wrapper replaces each block
        # with one), a subclass, or another kind of norm in nn.LayerNorm's place.
        odd = [type(b).__name__ for b in blocks if type(b).forward is not Block.forward]
        norms = [self.transformer.ln_f] + ([ln for b in blocks for ln in (b.ln_1, b.ln_2)] if not odd else [])
        odd += [type(ln).__name__ for ln in norms if type(ln).forward is not nn.LayerNorm.forward]
        if odd:
            raise RuntimeError(f"the fused LayerNorm regroups Block.forward and nn.LayerNorm.forward, but the model "
                               f"holds {odd[0]} in their place, whose own forward would not run; {_BACK}")
        # Nor would their hooks run (FSDP2's fully_shard registers one on each block).
        if any(has_hooks(m) for m in [*blocks, *norms]) or has_hooks(None):
            raise RuntimeError("the fused LayerNorm skips Block.forward and LayerNorm.forward, and hooks are "
                               f"registered on them (FSDP2's fully_shard adds some); {_BACK}")
        y = add_ln(x, None, blocks[0].ln_1)  # (B, T, C)
        for i, block in enumerate(blocks):
            a, bias = self._branch(block.attn, y)
            x, y = add_ln(x, a, block.ln_2, branch_bias=bias)  # x + attn(ln_1(x)), and its ln_2
            m, bias = self._branch(block.mlp, y)
            if i + 1 < len(blocks):
                x, y = add_ln(x, m, blocks[i + 1].ln_1, branch_bias=bias)  # x + mlp(ln_2(x)), the next block's ln_1
            else:
                # ln_f's output goes to the loss, not a matmul: in the dtype nn.LayerNorm returns
                # (fp32 under autocast, which runs LayerNorm in fp32), as the unfused model has it.
                out = torch.float32 if torch.is_autocast_enabled(x.device.type) else x.dtype
                x, y = add_ln(x, m, self.transformer.ln_f, out, branch_bias=bias)
        return y

    def _branch(self, branch: nn.Module, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(branch output, None), or with bias_in_add, (the output without c_proj's bias, that bias)
        for the residual add to add, where that is the same sum: c_proj a plain nn.Linear with a
        bias and no hooks, and no dropout after it in training."""
        proj = branch.c_proj
        dropout = branch.resid_dropout if isinstance(branch, CausalSelfAttention) else branch.dropout
        if (self.bias_in_add and type(proj) is nn.Linear and proj.bias is not None and not has_hooks(proj)
                and (dropout.p == 0 or not dropout.training)):
            return branch(y, proj_bias=False), proj.bias
        return branch(y), None

    def _tied_weight(self) -> torch.Tensor:
        """The matrix wte and lm_head share, for the fused embedding, which skips both modules' forward."""
        wte, head = self.transformer.wte, self.lm_head
        odd = [type(m).__name__ for m, kind in ((wte, nn.Embedding), (self.transformer.wpe, nn.Embedding),
                                                (head, nn.Linear)) if type(m) is not kind]
        if odd:
            raise RuntimeError(f"the fused embedding replaces the embeddings' and lm_head's forward, but the model "
                               f"holds {odd[0]} in their place, whose own forward would not run; {_BACK}")
        if head.weight is not wte.weight:
            raise RuntimeError("the fused embedding adds the embedding's gradient into the output layer's, which "
                               "needs the two to share one matrix (lm_head.weight is transformer.wte.weight); "
                               f"{_BACK}")
        if any(has_hooks(m) for m in (wte, self.transformer.wpe, head, None)):
            raise RuntimeError("the fused embedding skips the embeddings' and lm_head's forward, and hooks are "
                               f"registered on them; {_BACK}")
        return wte.weight
