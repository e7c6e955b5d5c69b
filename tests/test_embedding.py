"""The tied embedding's gradient added into the output layer's (mpgpt.fast.embedding): the kernels
against float64 over runs of one token that span many tiles, the same bits on every run, untouched
rows left as they were; and the model option against the unfused model, eager and traced."""
import re

import pytest
import torch

from mpgpt.kernels import env as kenv
from mpgpt.fast import convert
from mpgpt.model import GPT, GPTConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter without a GPU


def _kernels():
    ok, why = kenv.kernels_available()
    if not ok:
        pytest.skip(why)
    if DEVICE == "cpu" and not kenv.interpreting():
        pytest.skip("CPU tensors run the kernels in Triton's interpreter, which is off where a GPU is")
    from mpgpt.fast import embedding

    return embedding


def _zipf_tokens(shape, V):
    """Token ids as text has them: a few very frequent (runs of dozens after sorting), many rare."""
    ranks = torch.arange(1, V + 1, dtype=torch.float64)
    ids = torch.multinomial(1.0 / ranks, int(torch.tensor(shape).prod()), replacement=True)
    return ids[torch.randperm(ids.numel())].view(shape)


@pytest.mark.parametrize("config", [None, (4, 16, 1), (8, 32, 2)])
@pytest.mark.parametrize("dw_dtype, d_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float32)])
def test_the_rows_of_each_token_are_summed_and_added_into_its_row(config, dw_dtype, d_dtype):
    """dW_head plus the embedding's gradient against float64. Tiles of 4 to 16 sorted positions make
    the frequent tokens' runs span many tiles, so the walk back through the tiles' tails is
    exercised. Bound: each touched row is an fp32 sum of at most M terms, rounded once into dw's
    dtype: |error| <= u |exact| + M 2^-24 sum |terms|, with u dw's unit roundoff (2^-24 for fp32).
    Rows of tokens that do not occur keep their bits."""
    emb = _kernels()
    if DEVICE == "cuda" and dw_dtype is torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 kernels need sm_80")
    V, C, shape = 97, 40, (3, 50)
    idx = _zipf_tokens(shape, V)
    idx.view(-1)[::4] = 7  # and one token at every fourth position: a run of at least 38
    idx = idx.to(DEVICE)
    d = torch.randn(*shape, C, device=DEVICE).to(d_dtype)
    dw = torch.randn(V, C, device=DEVICE).to(dw_dtype)
    before = dw.clone()
    exact = dw.double().index_add(0, idx.reshape(-1), d.reshape(-1, C).double())
    terms = dw.double().abs().index_add(0, idx.reshape(-1), d.reshape(-1, C).double().abs())
    out = emb.embedding_grad_into_(dw, idx, d, config)
    assert out is dw and dw.dtype is dw_dtype
    u = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dw_dtype]
    bound = u * exact.abs() + idx.numel() * 2.0**-24 * terms
    assert ((dw.double() - exact).abs() <= bound).all()
    counts = torch.bincount(idx.reshape(-1), minlength=V)
    assert counts.max() > 2 * (config or emb._INTERPRET_CONFIG)[0]  # some run spans three tiles or more
    untouched = counts == 0
    assert untouched.any() and torch.equal(dw[untouched], before[untouched])
    again = before.clone()
    emb.embedding_grad_into_(again, idx, d, config)
    assert torch.equal(again, dw)  # fixed order of sums: the same bits


@pytest.mark.parametrize("counts", [{3: 8, 5: 6, 7: 1, 9: 9}, {4: 13}, {1: 1, 2: 4, 6: 3}])
def test_runs_that_end_on_a_tile_edge_or_fill_every_tile(counts):
    """Tiles of 4 sorted positions: a run of 8 that ends exactly on a tile's edge, one of 6 that
    ends inside the next tile, one that reaches the last position; a single token everywhere (13,
    a ragged last tile); and short runs only. Same bound as above."""
    emb = _kernels()
    C = 24
    idx = torch.tensor([t for t, n in counts.items() for _ in range(n)])
    idx = idx[torch.randperm(idx.numel())].view(1, -1).to(DEVICE)
    d = torch.randn(1, idx.numel(), C, device=DEVICE)
    dw = torch.randn(10, C, device=DEVICE)
    exact = dw.double().index_add(0, idx.reshape(-1), d.reshape(-1, C).double())
    terms = dw.double().abs().index_add(0, idx.reshape(-1), d.reshape(-1, C).double().abs())
    emb.embedding_grad_into_(dw, idx, d, (4, 16, 1))
    assert ((dw.double() - exact).abs() <= 2.0**-24 * exact.abs() + idx.numel() * 2.0**-24 * terms).all()


def test_bad_input_is_refused():
    emb = _kernels()
    dw, idx, d = torch.zeros(10, 4, device=DEVICE), torch.zeros(2, 3, dtype=torch.long, device=DEVICE), \
        torch.zeros(2, 3, 4, device=DEVICE)
    with pytest.raises(ValueError, match="same C"):
        emb.embedding_grad_into_(dw, idx, d[..., :3])
    with pytest.raises(ValueError, match="integer token ids"):
        emb.embedding_grad_into_(dw, idx.float(), d)
    with pytest.raises(ValueError, match="contiguous"):
        emb.embedding_grad_into_(torch.zeros(4, 10, device=DEVICE).t(), idx, d)
    with pytest.raises(ValueError, match="exceeds"):
        emb.tied_embedding(torch.zeros(1, 9, dtype=torch.long), torch.zeros(10, 4), torch.zeros(8, 4))


def test_the_operator_passes_opcheck():
    emb = _kernels()
    dw, idx, d = torch.randn(30, 8, device=DEVICE), torch.randint(0, 30, (2, 5), device=DEVICE), \
        torch.randn(2, 5, 8, device=DEVICE)
    torch.library.opcheck(emb.embedding_grad_op, (dw, idx, d))


def _model(vocab=120, **kw):
    cfg = GPTConfig.preset("tiny", vocab_size=vocab, n_layer=1, n_embd=32, n_head=2, block_size=16, **kw)
    return GPT(cfg).to(DEVICE)


@pytest.mark.parametrize("loss, dtype", [("logits", torch.float32), ("fused", torch.float32),
                                         ("fused", torch.bfloat16)])
def test_the_model_option_gives_the_unfused_models_loss_and_gradients(loss, dtype, monkeypatch):
    """Eager: the output layer through the view, the embedding's gradient added by the kernels (the
    interpreter here; forced on, as on a GPU), with the full logits or the fused loss, and a
    sequence shorter than block_size (wpe's gradient is zero past it). For an fp32 model only the
    order of fp32 sums differs from the unfused model. For a model held in bf16 (the 16-bit AdamW's)
    the unfused model rounds the two gradients of the tied matrix to bf16 before adding them, and on
    the CPU its embedding backward adds a token's k rows in bf16, one rounding each; this one rounds
    the sum once. So a row of the matrix's gradient agrees to within k + 2 roundings of the largest
    gradient (2^-9 each) plus 2^-7 of its own value; dropping the embedding's part breaks that bound
    (checked over 150 seeds), and every other gradient agrees to within 2^-7."""
    emb = _kernels()
    monkeypatch.setattr(emb, "_triton_pass", lambda t: True)
    model = convert(_model().to(dtype), fused_loss=loss == "fused")
    idx = _zipf_tokens((3, 12), 120).to(DEVICE)
    tgt = torch.randint(0, 120, (3, 12), device=DEVICE)
    _, ref = model(idx, tgt)
    ref.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    _, got = convert(model, fused_loss=loss == "fused", fused_emb=True)(idx, tgt)
    got.backward()
    assert model.fused_embedding is not None
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        if dtype is torch.float32:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-7, msg=n)
        else:
            want = grads[n].float()
            scale = want.abs().max().item()
            k = 0
            if n == "transformer.wte.weight":  # rows summed over k occurrences of their token
                k = torch.bincount(idx.reshape(-1).cpu(), minlength=want.shape[0]).float()[:, None].to(DEVICE)
            bound = 2.0**-7 * want.abs() + (k + 2) * 2.0**-9 * scale
            assert ((p.grad.float() - want).abs() <= bound).all(), n
    assert model.transformer.wpe.weight.grad[12:].eq(0).all()
    logits, _ = model(idx)
    torch.testing.assert_close(logits, convert(model, fused_loss=loss == "fused")(idx)[0], rtol=0, atol=0)


def _eager_run(model):
    """Text-like tokens and random targets, and the eager loss and gradients of ``model`` on them
    (the gradients then cleared, for a traced run to fill)."""
    idx, tgt = _zipf_tokens((2, 16), 120).to(DEVICE), torch.randint(0, 120, (2, 16), device=DEVICE)
    _, ref = model(idx, tgt)
    ref.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    return idx, tgt, ref, grads


def test_traced_it_is_one_graph_with_the_same_gradients(monkeypatch):
    """torch.compile (backend aot_eager: Dynamo and AOTAutograd trace as for Inductor, then the graph
    runs op by op) takes the view the Function returns and the in-place operator in one graph."""
    emb = _kernels()
    monkeypatch.setattr(emb, "_triton_pass", lambda t: True)
    model = convert(_model(), fused_emb=True)
    idx, tgt, ref, grads = _eager_run(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    _, got = compiled(idx, tgt)
    got.backward()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-7, msg=n)


def test_inductor_adds_into_the_output_layers_gradient_buffer_itself(monkeypatch):
    """torch.compile with Inductor (on the CPU): the in-place operator must be handed the buffer the
    output layer's weight-gradient product wrote, not a copy of it (a copy of GPT-2's 77 MB matrix
    would cost about as much as what the operator saves), and the gradients must be eager's."""
    from torch._inductor.utils import run_and_get_code

    emb = _kernels()
    monkeypatch.setattr(emb, "_triton_pass", lambda t: False)  # torch's ops inside the operator: the
    # question here is what Inductor hands it
    model = convert(_model(), fused_emb=True)
    idx, tgt, _, grads = _eager_run(model)
    compiled = torch.compile(model, fullgraph=True)
    _, codes = run_and_get_code(lambda: compiled(idx, tgt)[1].backward())
    code = "\n".join(codes)
    call = re.search(r"torch\.ops\.mpgpt\.embedding_grad_into\.default\((buf\d+),", code)
    assert call and "auto_functionalized" not in code, code[-3000:]
    assert re.search(rf"extern_kernels\.mm\([^\n]*out={call.group(1)}\)", code), code[-3000:]
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6, msg=n)
    torch._dynamo.reset()


def test_the_option_refuses_an_untied_model_other_modules_and_hooks():
    _kernels()
    model = _model()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with pytest.raises(RuntimeError, match="share one matrix"):
        convert(model, fused_emb=True)

    class Head(torch.nn.Linear):  # e.g. a layer swapped in for the output layer, sharing its weight
        pass

    model = _model()
    head = Head(32, 120, bias=False, device=DEVICE)
    head.weight = model.lm_head.weight
    model.lm_head = head
    with pytest.raises(RuntimeError, match="holds Head"):
        convert(model, fused_emb=True)
    model = convert(_model(), fused_emb=True)
    handle = model.lm_head.register_forward_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="hooks"):
        model(torch.zeros(1, 4, dtype=torch.long, device=DEVICE))
    handle.remove()
    assert type(convert(model)) is GPT  # back to the reference


def test_the_bench_rows_add_the_option_to_the_fastest_rows_and_train():
    """The two fused-emb rows of the training benchmark are the fastest rows with and without biases
    plus this option, and the trainer they build looks its input up through it and trains (no
    compile, no recording: the benchmark on a GPU does both)."""
    _kernels()
    from mpgpt.bench.training import make_trainer
    from mpgpt.recipe import parse

    for bias, mlp in (("", "triton-mlp-qkv"), ("-nobias", "triton-mlp")):
        base = f"bf16+compile{bias}+fused-ce+optim16-mantissa+{mlp}+fused-ln+step-graph+no-mix-order"
        row = base.replace("+fused-ln+", "+fused-ln+fused-emb+")
        assert parse(row).settings() == {**parse(base).settings(), "fused_emb": True}
    trainer = make_trainer("bf16+compile+fused-ce+optim16-mantissa+triton-mlp-qkv+fused-ln+fused-emb+step-graph+"
                           "no-mix-order", preset="tiny", batch_size=2, block_size=16, device=DEVICE, cuda_graph=False,
                           compile=False, steps=2, warmup_steps=0)
    assert trainer.model.fused_embedding is not None
    wte = trainer.model.transformer.wte.weight.detach().clone()
    trainer.run()
    assert not torch.equal(trainer.model.transformer.wte.weight, wte) and len(trainer.history.loss) == 2


@pytest.mark.gpu
@pytest.mark.sm80
def test_gpu_compiled_and_recorded_it_trains_like_the_unfused_model():
    """The option under torch.compile (Inductor runs the in-place operator on the output layer's
    gradient buffer) in a step recorded as a CUDA graph (the sort and both kernels replayed), with
    the fused loss and the 16-bit AdamW, against the same run unfused and eager. The two add the
    tied matrix's gradients in another order and with other roundings, so they agree to rounding,
    not bit for bit: 12 steps' losses within 2e-3. (The gradient itself is compared element by
    element in the next test.)"""
    from mpgpt.data import TextDataset, default_corpus
    from mpgpt.train import TrainConfig, Trainer

    small = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64}

    def build(fused, **kw):
        cfg = TrainConfig(preset="tiny", steps=12, batch_size=8, progress=False, sample_tokens=0, eval_interval=100,
                          eval_batches=2, warmup_steps=6, lr=1e-3, model_overrides=dict(small), seed=1234,
                          log_interval=4, precision="bf16", grad_clip=0.5, device="cuda", optim16="fp32-master", **kw)
        torch.manual_seed(0)
        model = convert(GPT(GPTConfig.preset("tiny", vocab_size=128, **small)), fused_loss=True, fused_emb=fused)
        return Trainer(cfg, model=model, dataset=TextDataset(default_corpus()))

    ref, fused = build(False), build(True, compile=True, cuda_graph=True)
    lr, lf = torch.tensor(ref.run().loss), torch.tensor(fused.run().loss)
    assert fused.graphed.recorded and fused.model.fused_embedding is not None
    torch.testing.assert_close(lf, lr, rtol=2e-3, atol=0)
    assert lf[-1] < lf[0] - 0.3, lf


@pytest.mark.gpu
@pytest.mark.sm80
def test_gpu_compiled_the_tied_matrixs_gradient_is_the_unfused_models():
    """A model held in bf16 with the fused loss, compiled by Inductor with the option, against the
    same model eager without it: the tied matrix's gradient within the CPU test's bound (the unfused
    model rounds the two gradients before adding them; cuBLAS's own split-K sums may differ between
    the two graphs), on text-like tokens whose long runs span many tiles."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=512, n_layer=2, n_embd=128, n_head=4, block_size=256))
    model = convert(model.to("cuda", torch.bfloat16), fused_loss=True)
    idx, tgt = _zipf_tokens((8, 256), 512).cuda(), torch.randint(0, 512, (8, 256), device="cuda")
    _, ref = model(idx, tgt)
    ref.backward()
    want = model.transformer.wte.weight.grad.float().clone()
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    _, got = torch.compile(convert(model, fused_loss=True, fused_emb=True))(idx, tgt)
    got.backward()
    have = model.transformer.wte.weight.grad.float()
    scale = want.abs().max().item()
    k = torch.bincount(idx.reshape(-1), minlength=want.shape[0]).float()[:, None]  # as in the CPU test's bound
    assert ((have - want).abs() <= 2.0**-7 * want.abs() + (k + 2) * 2.0**-9 * scale).all()
    torch._dynamo.reset()
