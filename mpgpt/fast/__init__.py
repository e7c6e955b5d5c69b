"""The fast path: the reference GPT converted from outside, and the Hopper/GPT-2 kernels it calls.

    from mpgpt.fast import convert
    convert(model, triton="mlp+qkv", fused_loss=True, fused_ln=True)

``convert.py`` swaps the modules (``model.py`` holds their fast forward passes) and keeps every
Parameter and state_dict key. ``mpgpt.recipe`` names each switch as a token of a recipe, with the
file that implements it and the chapter that teaches it. The GPT-2 kernels they call, one file each:

    mlp.py            the MLP with GELU fused into its first product (the ws kernel's epilogue)
    qkv.py            c_attn and the head split, with heads.py's pass in the backward
    heads.py          the attention's dq, dk, dv merged into c_attn's gradient, its bias gradient in one pass
    layernorm.py      the residual add with its LayerNorm, the backward (weight and bias gradients too) in one pass
    cross_entropy.py  the output layer's loss and logit gradients in one pass over 16-bit logits
    embedding.py      the tied embedding's gradient added into the output layer's, only the rows that occur
"""
from .convert import TRITON_LAYERS, convert, to_reference
from .model import FastAttention, FastGPT, FastMLP

__all__ = ["convert", "to_reference", "TRITON_LAYERS", "FastGPT", "FastAttention", "FastMLP"]
