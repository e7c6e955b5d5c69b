"""The converter: the reference GPT made fast from outside, as torchao's ``convert_to_float8_training``.

    from mpgpt.fast import convert
    convert(model, triton="mlp+qkv", fused_loss=True, fused_ln=True)   # in place; returns model
    convert(model)                                                     # back to the reference

``convert`` sets exactly the switches it is given (every other one off), each on the module it
belongs to: Triton layers in the blocks (``triton``: "all" or "gelu" swap nn.Linear for the
chapter-6 ``TritonLinear``; "mlp" and "mlp+qkv" run each MLP, and each attention input, as one
fused function), then the chunked or fused loss, the fused residual add + LayerNorm and the fused
embedding. The model keeps every Parameter object, so its ``state_dict`` keys do not change and a
checkpoint moves between the reference and the converted model; an optimizer built before keeps
working. The classes it swaps in are in ``mpgpt.fast.model``; ``mpgpt.recipe`` names each switch.
"""
from __future__ import annotations

import functools

import torch.nn as nn

from mpgpt.fast.model import FastAttention, FastGPT, FastMLP
from mpgpt.kernels import TritonLinear, env, kernels_available
from mpgpt.fast.cross_entropy import fused_linear_cross_entropy
from mpgpt.fast.embedding import tied_embedding
from mpgpt.fast.layernorm import residual_layer_norm
from mpgpt.fast.mlp import check_gelu_backward, check_weight_grad_kernel, gelu_mlp
from mpgpt.fast.qkv import qkv_heads
from mpgpt.model import GPT, MLP, CausalSelfAttention

__all__ = ["convert", "to_reference", "TRITON_LAYERS"]

# triton= values: which of the blocks' layers run Triton kernels.
TRITON_LAYERS = {
    "all": "every nn.Linear in the blocks becomes a TritonLinear, c_fc with GELU in its epilogue",
    "gelu": "only mlp.c_fc becomes a TritonLinear, GELU in its epilogue",
    "mlp": "each MLP as one function, GELU fused into c_fc's product (mpgpt.fast.mlp.gelu_mlp)",
    "mlp+qkv": "as 'mlp', and each c_attn with the head split (mpgpt.fast.qkv.qkv_heads)",
}


def convert(model: GPT, *, triton: str | None = None, weight_grad_kernel: str = "cublas",
            gelu_backward: str = "pass", chunked_loss: int = 0, fused_loss: bool = False,
            fused_ln: bool = False, bias_in_add: bool = False, fused_emb: bool = False) -> GPT:
    """Switch ``model``'s fast paths to exactly these settings, in place; returns the model.

    triton: None, or a key of TRITON_LAYERS. weight_grad_kernel ("cublas" or a kernel of
    mpgpt.kernels.matmul) and gelu_backward ("pass" or "epilogue": GELU's backward in the epilogue
    of dOut W_proj, sm_90) apply to the fused MLP (triton "mlp" or "mlp+qkv").
    chunked_loss: rows per chunk of the output layer + loss (mpgpt.fused_loss), 0 for full logits.
    fused_loss: the output layer + loss in one Triton pass over 16-bit logits (fast/cross_entropy.py).
    fused_ln: each residual add with the LayerNorm after it, the backward in one pass
    (fast/layernorm.py); bias_in_add: c_proj's biases added in that add, their gradients summed
    by LayerNorm's backward. fused_emb: the tied embedding's gradient added into the output
    layer's where it lies (fast/embedding.py). With a fused or chunked loss and targets given,
    forward returns ``(None, loss)``.
    """
    _check(model, triton, weight_grad_kernel, gelu_backward, chunked_loss, fused_loss, fused_ln, bias_in_add,
           fused_emb)
    to_reference(model)
    options = {k: v for k, v, default in (("weight_grad_kernel", weight_grad_kernel, "cublas"),
                                          ("gelu_backward", gelu_backward, "pass")) if v != default}
    fused_mlp = triton in ("mlp", "mlp+qkv")
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        if triton in ("all", "gelu"):
            plain = ((attn, "c_attn"), (attn, "c_proj"), (mlp, "c_proj")) if triton == "all" else ()
            for parent, name in plain:
                setattr(parent, name, TritonLinear.from_linear(getattr(parent, name), activation=None))
            mlp.c_fc = TritonLinear.from_linear(mlp.c_fc, activation="gelu")
            mlp.act = nn.Identity()  # the GELU now runs inside c_fc's kernel
        if fused_mlp or fused_ln:
            attn.__class__, mlp.__class__ = FastAttention, FastMLP
        if fused_mlp:
            mlp.fused = functools.partial(gelu_mlp, **options) if options else gelu_mlp
        if triton == "mlp+qkv":
            attn.fused_qkv = qkv_heads
    if chunked_loss or fused_loss or fused_ln or fused_emb:
        model.__class__ = FastGPT
    if chunked_loss:
        model.loss_chunk_rows = int(chunked_loss)
    if fused_loss:
        model.fused_loss = fused_linear_cross_entropy
    if fused_ln:
        model.fused_layer_norm, model.bias_in_add = residual_layer_norm, bias_in_add
    if fused_emb:
        model.fused_embedding = tied_embedding
    return model


def to_reference(model: GPT) -> GPT:
    """Undo every conversion, in place: the blocks' nn.Linear and nn.GELU back, the reference classes
    and forward passes. The Parameters are the same objects throughout. Returns the model."""
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        for parent, name in ((attn, "c_attn"), (attn, "c_proj"), (mlp, "c_proj"), (mlp, "c_fc")):
            layer = getattr(parent, name)
            if isinstance(layer, TritonLinear):
                setattr(parent, name, layer.to_linear())
        if isinstance(mlp.act, nn.Identity):
            mlp.act = nn.GELU(approximate="tanh")
        for module, fast, plain, switches in ((attn, FastAttention, CausalSelfAttention, ("fused_qkv",)),
                                              (mlp, FastMLP, MLP, ("fused",))):
            if type(module) is fast:
                module.__class__ = plain
                for name in switches:
                    vars(module).pop(name, None)
    if type(model) is FastGPT:
        model.__class__ = GPT
        for name in ("loss_chunk_rows", "fused_loss", "fused_layer_norm", "bias_in_add", "fused_embedding"):
            vars(model).pop(name, None)
    return model


def _check(model, triton, weight_grad_kernel, gelu_backward, chunked_loss, fused_loss, fused_ln, bias_in_add,
           fused_emb) -> None:
    """Refuse, before anything changes, what cannot be converted: one line that says what to do."""
    if type(model) not in (GPT, FastGPT):
        raise TypeError(f"convert takes an mpgpt.model.GPT, got {type(model).__name__}; convert the GPT inside it")
    odd = [type(m).__name__ for b in model.transformer.h
           for m, kinds in ((b.attn, (CausalSelfAttention, FastAttention)), (b.mlp, (MLP, FastMLP)))
           if type(m) not in kinds]
    if odd:
        raise TypeError(f"convert swaps the blocks' attention and MLP, but the model holds {odd[0]} in their "
                        "place; convert a model built by mpgpt.model.GPT")
    if triton is not None and triton not in TRITON_LAYERS:
        raise ValueError(f"triton must be None or one of {', '.join(map(repr, TRITON_LAYERS))}, got {triton!r}")
    check_weight_grad_kernel(weight_grad_kernel)
    check_gelu_backward(gelu_backward)
    tuned = [k for k, v, default in (("weight_grad_kernel", weight_grad_kernel, "cublas"),
                                     ("gelu_backward", gelu_backward, "pass")) if v != default]
    if tuned and triton not in ("mlp", "mlp+qkv"):
        raise ValueError(f"{', '.join(tuned)}: applies to the fused MLP (triton='mlp' or 'mlp+qkv'), not "
                         f"triton={triton!r}; TritonLinear takes its kernels from mpgpt.kernels.linear")
    if chunked_loss < 0:
        raise ValueError(f"chunked_loss must be >= 0 rows, got {chunked_loss}")
    if chunked_loss and fused_loss:
        raise ValueError("chunked_loss and fused_loss are two ways to compute one loss; choose one")
    if bias_in_add and not fused_ln:
        raise ValueError("bias_in_add adds c_proj's bias in the fused residual add; pass fused_ln=True too")
    if (fused_loss or fused_ln or fused_emb) and env.TRITON_IMPORT_ERROR is not None:
        raise RuntimeError("the fused loss, LayerNorm and embedding need Triton, which is not installed here (it "
                           "ships for Linux only); leave them off")
    if fused_loss:
        ok, why = kernels_available()
        if not ok:
            raise RuntimeError(f"the fused loss needs Triton's kernels: {why.rstrip('.')}; use chunked_loss or the "
                               "default loss instead")
    if fused_ln and not all(ln.elementwise_affine for ln in model.modules() if isinstance(ln, nn.LayerNorm)):
        raise ValueError("fused_ln needs LayerNorms with a weight (elementwise_affine=True)")
    if fused_emb:
        FastGPT._tied_weight(model)  # refuses a model whose wte and lm_head do not share one matrix
