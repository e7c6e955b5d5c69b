"""TritonLinear: nn.Linear (optionally + GELU/ReLU) whose three GEMMs run in Triton (chapter 6).

    y = act(x @ W^T + b)          x: (..., in)   W: (out, in)   b: (out,)   y: (..., out)

Forward is one `matmul` launch with the bias and activation fused into its epilogue (with GELU
and training on sm_90, the warp-specialised kernel's GELU epilogue, which also writes Z; ops.py). Backward
runs the two gradient GEMMs through the same kernel, reading transposed operands in place
(strided views, no copies):

    dZ = dY * act'(Z)             (M, out)   elementwise, in fp32 (GELU: one Triton pass, gelu.py,
                                             which also sums dZ's columns for db)
    dX = dZ @ W                   (M, in)    Triton
    dW = dZ^T @ X                 (out, in)  Triton: dZ^T is dZ with its strides swapped; split
                                             along K (= tokens) when out x in is too few tiles
                                             (WEIGHT_GRAD_KERNEL picks the matmul kernel, and
                                             INPUT_GRAD_KERNEL dX's)
    db = sum over rows of dZ      (out,)     beside dZ in GELU's pass; otherwise one torch sum

Which dtype runs, so the layer is a drop-in for nn.Linear in every setting the course uses:
* under `torch.autocast(device_type, dtype)`: x, W and b are cast to the autocast dtype, like
  autocast does for nn.Linear. Backward gets that dtype from the saved weight, not from the
  autocast state, so it computes the same inside autocast or outside it (see _TritonLinearFunction);
* bf16/fp16 inputs outside autocast (a model converted with .to(torch.bfloat16)): that dtype;
* fp32 inputs outside autocast (the fp32 reference model): F.linear in fp32, i.e. exactly
  nn.Linear (+ activation). The Triton kernel has no fp32 path, and silently computing an fp32
  model in bf16 would change its numerics; turn on autocast to use the kernel.
Weight and bias gradients come back in the parameters' dtype: fp32 master weights receive fp32
gradients, and dW is written in fp32 straight from the fp32 accumulator (autocast's nn.Linear
rounds dW to bf16 first, then casts it up).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mpgpt.fused_loss import first_derivative_only

from . import ops
from .matmul import ACTIVATIONS, checked_2d

_LOW_PRECISION = (torch.bfloat16, torch.float16)
# The matmul kernels (matmul.KERNELS) of the two gradient products: "auto", or a kernel to use
# wherever it can run ("auto" elsewhere: ops.matmul_impl decides), e.g. "tma" for dW = dZ^T @ X
# and "ws" for dX = dZ @ W. Read at every backward pass, so the kernel benchmark can time the layer
# each way.
INPUT_GRAD_KERNEL = "auto"
WEIGHT_GRAD_KERNEL = "auto"
_SQRT_2_OVER_PI = 0.7978845608028654


def gelu_tanh_grad(z: torch.Tensor) -> torch.Tensor:
    """d/dz of GELU's tanh approximation, in fp32 (returns fp32).

    gelu(z) = z * s, s = sigmoid(v), v = 2 sqrt(2/pi) (z + 0.044715 z^3), so
    gelu'(z) = s + z * s (1 - s) * 2 sqrt(2/pi) (1 + 3 * 0.044715 z^2)."""
    z = z.float()
    v = 2.0 * _SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)
    s = torch.sigmoid(v)
    return s + z * s * (1.0 - s) * (2.0 * _SQRT_2_OVER_PI) * (1.0 + 3.0 * 0.044715 * z * z)


def _compute_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype the kernel should run in, or None for the fp32 (nn.Linear) path."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype if x.dtype in _LOW_PRECISION else None


class _TritonLinearFunction(torch.autograd.Function):
    """The layer's forward and backward passes.

    PyTorch's recipe for a custom Function under autocast is to decorate forward and backward with
    torch.amp.custom_fwd/custom_bwd, which run backward inside the autocast state forward saw.
    This Function does without them. Every operation in backward names its dtype (the weight's
    low-precision copy saved by forward, the parameters' own dtypes for their gradients), so the
    autocast state cannot change what it computes. And the pair has costs: custom_bwd builds a
    torch.autocast context on every backward call (host time, though too little to stand out of
    the host's run-to-run noise),
    and under torch.compile the pair makes Dynamo fail ("Global autocast state changed while
    dynamo tracing"), which had needed a second copy of this class without it."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation, dtype):
        # Cast like autocast would (a no-op when already in dtype). Autocast's cast happens
        # outside the Function, so the casts' own backward would route gradients back; here
        # we return gradients in the original dtypes ourselves (see backward).
        x_lp = x.to(dtype)
        w_lp = weight.to(dtype)
        b_lp = bias.to(dtype) if bias is not None else None
        x2, out_shape = checked_2d(x_lp, w_lp.t(), b_lp, activation)  # x2: (M, in)
        # GELU's backward needs Z = x W^T + b. We keep Z (written by the same epilogue, one
        # extra (M, out) store) instead of recomputing it: recomputing costs a whole extra GEMM
        # in backward (+50 % backward FLOPs), while keeping it costs M*out*2 bytes, the same
        # memory nn.Linear followed by nn.GELU holds (GELU saves its input). ReLU needs no Z:
        # relu'(z) = (y > 0), read from the output itself.
        need_z = activation == "gelu" and any(ctx.needs_input_grad[:3])
        y, z = _op(ops.linear_forward, ops.linear_forward_impl)(x2, w_lp, b_lp, activation, need_z)
        ctx.activation = activation
        ctx.x_shape = x.shape
        ctx.has_bias = bias is not None
        ctx.w_dtype = weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        saved = z if need_z else (y if activation == "relu" else None)
        ctx.save_for_backward(x2, w_lp, saved)
        return y.view(out_shape)

    @staticmethod
    def backward(ctx, grad_out):
        first_derivative_only("TritonLinear", "mpgpt.fast.convert(model)")
        x2, w_lp, saved = ctx.saved_tensors
        dtype = w_lp.dtype
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)  # (M, out)
        want_db = ctx.has_bias and ctx.needs_input_grad[2]
        db32 = None
        if ctx.activation == "gelu":
            # dZ, and with a bias its column sums, in one Triton pass (gelu.py)
            g, db32 = _op(ops.gelu_backward, ops.gelu_backward_impl)(g, saved, want_db)
            db32 = db32 if want_db else None
        elif ctx.activation == "relu":
            g = g * (saved > 0)  # exact in any dtype
        if not g.is_contiguous():
            g = g.contiguous()
        dx = dw = db = None
        mm = _op(ops.matmul, ops.matmul_impl)
        if ctx.needs_input_grad[0]:
            dx = mm(g, w_lp, dtype, INPUT_GRAD_KERNEL).view(ctx.x_shape)  # (M, out) @ (out, in)
        if ctx.needs_input_grad[1]:
            # fp32 accumulator written straight to the weight's dtype (fp32 master weights).
            # (out, M) @ (M, in): g.t() is a strided view.
            dw = mm(g.t(), x2, ctx.w_dtype if ctx.w_dtype == torch.float32 else dtype, WEIGHT_GRAD_KERNEL)
        if want_db:
            if db32 is None:
                db32 = g.sum(0, dtype=torch.float32)  # fp32 sum, no fp32 copy of g
            db = db32.to(ctx.b_dtype)
        return dx, dw, db, None, None


def _op(custom_op, impl):
    """The custom operator while torch.compile traces (an opaque node in its graph, see ops.py),
    the plain function otherwise (the dispatcher's round trip costs host time in eager mode)."""
    return custom_op if torch.compiler.is_compiling() else impl


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None) -> torch.Tensor:
    """Functional form of TritonLinear: act(x @ weight.T + bias), dtype chosen as the module docstring says."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None, 'gelu' (tanh approximation) or 'relu', got {activation!r}")
    dtype = _compute_dtype(x)
    if dtype is None:  # fp32 outside autocast: exactly nn.Linear
        y = F.linear(x, weight, bias)
        if activation == "gelu":
            return F.gelu(y, approximate="tanh")
        return F.relu(y) if activation == "relu" else y
    return _TritonLinearFunction.apply(x, weight, bias, activation, dtype)


class TritonLinear(nn.Module):
    """nn.Linear with an optional fused activation, computed by the Triton kernels.

    Same parameters (`weight` (out, in), `bias` (out,)), same initialisation and same state_dict
    keys as nn.Linear. `activation`: None, "gelu" (tanh approximation) or "relu".
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 activation: str | None = None, device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be None, 'gelu' (tanh approximation) or 'relu', got {activation!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.activation = activation
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation: kaiming_uniform(a=sqrt(5)) for W, U(-1/sqrt(in), 1/sqrt(in)) for b."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation: str | None = None) -> "TritonLinear":
        """Wrap an existing nn.Linear, sharing its Parameter objects (no copy, same state_dict)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be None, 'gelu' (tanh approximation) or 'relu', got {activation!r}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features = linear.in_features
        new.out_features = linear.out_features
        new.activation = activation
        new.weight = linear.weight
        if linear.bias is not None:
            new.bias = linear.bias
        else:
            new.register_parameter("bias", None)
        new.train(linear.training)
        return new

    def to_linear(self) -> nn.Linear:
        """An nn.Linear sharing this layer's Parameter objects. The activation is not part of
        nn.Linear: put nn.GELU(approximate="tanh") / nn.ReLU after it yourself."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight = self.weight
        if self.bias is not None:
            lin.bias = self.bias
        lin.train(self.training)
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return triton_linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activation={self.activation!r}")
