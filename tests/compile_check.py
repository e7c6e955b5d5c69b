"""Shared check for the package's custom operators under torch.compile (test_mlp, test_qkv,
test_layernorm): the function traces into one graph with no break, the compiled forward and
backward give eager's gradients bit for bit, and the backward graph's code comes back so a test
can check which custom operator it calls.

The backend is aot_autograd with eager boxed functions, not Inductor: the point is what Dynamo and
AOTAutograd make of the autograd Functions and custom operators, on any machine in seconds; the
benchmarks run the same code through Inductor on the GPU."""
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd


def assert_compiles_like_eager(step, args, leaves):
    """``step(*args)`` returns a scalar; ``leaves`` are the tensors whose gradients are compared.
    Returns (the forward graph's code with the autograd Functions' bodies, the backward graph's code)."""
    explanation = torch._dynamo.explain(step)(*args)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons
    forward_code = "".join(m.code for m in explanation.graphs[0].modules() if hasattr(m, "code"))
    backward_code = []

    def keep_backward(gm, example_inputs):
        backward_code.append(gm.code)
        return make_boxed_func(gm)

    compiled = torch.compile(step, fullgraph=True, backend=aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm),
                                                                         bw_compiler=keep_backward))
    compiled(*args).backward()
    got = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    step(*args).backward()
    for g, t in zip(got, leaves):
        assert torch.equal(g, t.grad)  # the same operators on the same inputs
    assert len(backward_code) == 1
    return forward_code, backward_code[0]
