"""train.shared_weight_grad: a routed weight's gradient is one matmul over all the draft steps' rows.

Against autograd's own (every use's gradient, summed): equal in fp32, as close or closer to the fp32 gradient under
bf16 autocast, across micro-batches accumulated into ``.grad``, and through a compiled drafter step (the route runs
between its graphs). A use whose output never reaches the loss fails the backward. The routing rule picks the
weights of the K2.5 drafter at 2,048 rows and none of the SmolLM2 drafter's at 16,384."""

from __future__ import annotations

import copy
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_train_ttt import mapped  # noqa: F401 (a fixture)
from test_train_weight_cast import model_and_batch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from drafter.model import linear
from train.shared_weight_grad import routed_weight_grads, worth_routing

REPO = str(Path(__file__).resolve().parents[1])


def grads_of(model, batch: dict, routed: bool, monkeypatch, autocast: bool, micro_batches: int = 1
             ) -> tuple[list[float], dict[str, torch.Tensor]]:
    monkeypatch.setattr("train.module.worth_routing", lambda *a: routed)
    losses = []
    for _ in range(micro_batches):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            res = model(**batch)
        res.loss.backward()
        losses.append(float(res.loss))
    monkeypatch.undo()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return losses, grads


def fp32_batch(batch: dict) -> dict:
    return {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}


def test_the_rule_routes_the_k25_drafter_at_2048_rows_and_not_smollm2_at_16384() -> None:
    k25 = {"q": (14336, 8192), "o": (8192, 7168), "gate": (7168, 18432), "down": (18432, 7168), "head": (7168, 32000)}
    assert all(worth_routing(nn.Linear(i, o, bias=False, device="meta"), 2048) for i, o in k25.values())
    assert not any(worth_routing(nn.Linear(i, o, bias=False, device="meta"), 8 * 2048) for i, o in k25.values())
    smol = {"q": (1152, 576), "o": (576, 576), "gate": (576, 1536), "down": (1536, 576), "head": (576, 16384)}
    assert not any(worth_routing(nn.Linear(i, o, bias=False, device="meta"), 16384) for i, o in smol.values())


def test_fp32_gradients_equal_autograd_sums(mapped, monkeypatch) -> None:  # noqa: F811
    model, batch = model_and_batch(mapped)
    batch, model.head_rows = fp32_batch(batch), model.head_rows.float()
    mapped.embed_tokens.float()
    want_loss, want = grads_of(model, batch, False, monkeypatch, autocast=False)
    loss, got = grads_of(model, batch, True, monkeypatch, autocast=False)
    assert loss == pytest.approx(want_loss, rel=1e-6) and got.keys() == want.keys() and len(got) == 13
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6 * float(want[name].abs().max()))


def test_bf16_gradients_are_as_close_to_fp32_as_autograd_sums(mapped, monkeypatch) -> None:  # noqa: F811
    """Under bf16 autocast autograd sums the draft steps' bf16 gradients in bf16; the route accumulates every row
    in fp32 once: its error against the fp32 gradient is no larger (within a margin), and small."""
    model, batch = model_and_batch(mapped)
    exact_model = copy.deepcopy(model)
    exact_model.head_rows = exact_model.head_rows.float()
    exact_model.drafter.embed_tokens.float()
    _, exact = grads_of(exact_model, fp32_batch(batch), False, monkeypatch, autocast=False)
    want_loss, want = grads_of(model, batch, False, monkeypatch, autocast=True)
    loss, got = grads_of(model, batch, True, monkeypatch, autocast=True)
    assert loss == pytest.approx(want_loss, rel=1e-2)
    for layer in ("q_proj", "o_proj", "down_proj", "lm_head"):
        name = next(n for n in want if layer in n)
        err_got = float((got[name] - exact[name]).norm() / exact[name].norm())
        err_want = float((want[name] - exact[name]).norm() / exact[name].norm())
        assert got[name].dtype == torch.float32 and err_got < 0.02 and err_got <= 1.25 * err_want, (name, err_got,
                                                                                                     err_want)


def test_micro_batches_accumulate_into_grad_as_before(mapped, monkeypatch) -> None:  # noqa: F811
    model, batch = model_and_batch(mapped)
    batch, model.head_rows = fp32_batch(batch), model.head_rows.float()
    mapped.embed_tokens.float()
    _, want = grads_of(model, batch, False, monkeypatch, autocast=False, micro_batches=2)
    _, got = grads_of(model, batch, True, monkeypatch, autocast=False, micro_batches=2)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6 * float(want[name].abs().max()))


def test_a_compiled_step_runs_the_route_between_its_graphs(mapped, monkeypatch) -> None:  # noqa: F811
    """The bench compiles the drafter's step; the route (Python state in its backward) must run eagerly between
    the compiled graphs and give the eager route's gradients."""
    torch._dynamo.reset()
    model, batch = model_and_batch(copy.deepcopy(mapped))
    _, want = grads_of(model, batch, True, monkeypatch, autocast=True)
    compiled_model, _ = model_and_batch(mapped)
    monkeypatch.setattr(mapped, "step", torch.compile(mapped.step, backend="aot_eager", dynamic=False))
    monkeypatch.setattr("train.module.worth_routing", lambda *a: True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res = compiled_model(**batch)
    res.loss.backward()
    got = {n: p.grad for n, p in compiled_model.named_parameters() if p.grad is not None}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0.02, atol=0.02 * float(want[name].abs().max()))


def test_a_use_that_never_reaches_the_loss_fails_the_backward() -> None:
    layer = nn.Linear(8, 4, bias=False)
    x = torch.randn(3, 8)
    with routed_weight_grads([layer], torch.float32) as n:
        used, unused = linear(x, layer), linear(x, layer)
    assert n == 1 and unused.requires_grad
    with pytest.raises(RuntimeError, match="1 use"):
        used.sum().backward()


def test_columns_and_add_match_plain_autograd_and_no_grad_routes_nothing() -> None:
    """A weight read in two column ranges (the embeddings' share, then the hidden's with the share added, as
    ``qkv_split`` reads q, k and v): its gradient in one tensor, the unread columns' zero when one range is read."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 5, bias=False)
    e, h = torch.randn(2, 4, 3, requires_grad=True), torch.randn(2, 4, 3, requires_grad=True)

    def loss() -> torch.Tensor:
        share = linear(e, layer, slice(None, 3))
        return (linear(h, layer, slice(3, None), add=share) ** 2).sum() + linear(h, layer, slice(3, None)).sum()

    want = torch.autograd.grad(loss(), [layer.weight, e, h])
    with routed_weight_grads([layer], torch.float32):
        got = torch.autograd.grad(loss(), [layer.weight, e, h])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    with routed_weight_grads([layer], torch.float32):
        only = torch.autograd.grad(linear(h, layer, slice(3, None)).sum(), layer.weight)[0]
    assert torch.equal(only[:, :3], torch.zeros(5, 3))
    with torch.no_grad(), routed_weight_grads([layer], torch.float32) as n:
        assert n == 0 and "route" not in layer.__dict__
    assert "route" not in layer.__dict__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fp32-output matmul of bf16 rows is CUDA's")
def test_cuda_bf16_route_matches_autograd(mapped, monkeypatch) -> None:  # noqa: F811
    torch.manual_seed(0)
    layer = nn.Linear(256, 512, bias=False, device="cuda")
    x = torch.randn(7, 64, 256, device="cuda", requires_grad=True)

    def loss() -> torch.Tensor:
        h = x
        out = 0
        for _ in range(4):  # four uses, each feeding the next, as draft steps do
            y = linear(h, layer)
            out = out + y.float().square().mean()
            h = y[..., :256]
        return out

    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = torch.autograd.grad(loss(), [layer.weight, x])
        with routed_weight_grads([layer], torch.bfloat16):
            got = torch.autograd.grad(loss(), [layer.weight, x])
    assert got[0].dtype == torch.float32
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0.03, atol=0.03 * float(b.abs().max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fp32-output matmul of bf16 rows is CUDA's")
def test_cuda_bf16_column_ranges_are_written_in_place_as_autograd_sums() -> None:
    """q, k and v's pattern on CUDA: the embeddings' columns once, the hidden's at every step (the share added); the
    two ranges tile the weight, so each range's fp32 matmul writes straight into its strided columns."""
    torch.manual_seed(0)
    layer = nn.Linear(512, 256, bias=False, device="cuda")
    e = torch.randn(2, 64, 256, device="cuda", requires_grad=True)
    x = torch.randn(2, 64, 256, device="cuda", requires_grad=True)

    def loss() -> torch.Tensor:
        share, h, out = linear(e, layer, slice(None, 256)), x, 0
        for _ in range(3):
            h = linear(h, layer, slice(256, None), add=share)
            out = out + h.float().square().mean()
        return out

    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = torch.autograd.grad(loss(), [layer.weight, e, x])
        with routed_weight_grads([layer], torch.bfloat16):
            got = torch.autograd.grad(loss(), [layer.weight, e, x])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0.03, atol=0.03 * float(b.abs().max()))


class _Casts(TorchDispatchMode):
    """Every dtype-changing copy of a step, as (caller's file:function, source dtype, result dtype, numel)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, torch.dtype, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's own)
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].dtype != out.dtype:
            frame = sys._getframe(1)  # the first frame of ours (train/, drafter/): "" for the autograd engine's
            while frame and not frame.f_code.co_filename.startswith(REPO):
                frame = frame.f_back
            where = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}" if frame else ""
            self.seen.append((where, args[0].dtype, out.dtype, out.numel()))
        return out


def test_a_bf16_step_casts_each_weight_once_and_no_activation_at_the_routes(mapped, monkeypatch) -> None:  # noqa: F811
    """Under bf16 autocast the routed matmuls read bf16 activations: RMSNorm returns its input's dtype. Its fp32
    output (fp32 master weight times bf16) had every routed matmul cast its input to bf16 and its input's gradient
    back to fp32 (here 31 of each a step; 52 at the K2.5 shape, eager kernels between the compiled graphs: the
    ``bfloat16_copy`` and ``direct_copy_kernel_cuda ... lambda(float)`` lines of bench/results.json). What remains:
    one cast of each matmul weight, one of fc's gradient."""
    model, batch = model_and_batch(mapped)
    monkeypatch.setattr("train.module.worth_routing", lambda *a: True)
    weights = {m.weight.numel() for m in mapped.modules() if isinstance(m, nn.Linear)}
    with _Casts() as casts:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            res = model(**batch)
        res.loss.backward()
    at_routes = [c for c in casts.seen if c[0].startswith("shared_weight_grad.py:") and c[0].endswith(("forward",
                                                                                                      "backward"))]
    assert at_routes == []
    weight_casts = Counter((c[1], c[2]) for c in casts.seen if c[3] in weights)
    assert weight_casts == {(torch.float32, torch.bfloat16): 9, (torch.bfloat16, torch.float32): 1}, casts.seen
