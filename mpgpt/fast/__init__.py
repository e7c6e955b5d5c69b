"""The fast path: the reference GPT converted from outside, and the Hopper/GPT-2 kernels it calls.

    from mpgpt.fast import convert
    convert(model, triton="mlp+qkv", fused_loss=True, fused_ln=True)

``convert.py`` swaps the modules (``model.py`` holds their fast forward passes) and keeps every
Parameter and state_dict key. ``mpgpt.recipe`` names each switch as a token of a recipe, with the
file that implements it and the chapter that teaches it.
"""
from .convert import TRITON_LAYERS, convert, to_reference
from .model import FastAttention, FastGPT, FastMLP

__all__ = ["convert", "to_reference", "TRITON_LAYERS", "FastGPT", "FastAttention", "FastMLP"]
