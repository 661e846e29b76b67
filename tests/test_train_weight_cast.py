"""train.weight_cast: under bf16 autocast the TTT unroll reads one bf16 copy of each matmul weight.

The loss equals eager autocast's (whose cast cache already casts whole weights once per forward) bit for bit, and
so do the gradients of the weights it reads whole;
the fp32 parameters are back after the step and get their gradients through the one cast; a compiled drafter
step takes the cast weights without recompiling as they change from step to step; without autocast nothing
is cast."""

from __future__ import annotations

import copy

import pytest
import torch
from test_train_ttt import _batch, mapped  # noqa: F401 (a fixture)
from torch import nn

from train.module import TTTModel
from train.optim import make_optimizer
from train.weight_cast import matmul_weights_cast_once


def model_and_batch(drafter, seed: int = 1) -> tuple[TTTModel, dict]:
    ids, aux, last, lm_head, mask = _batch(drafter.shape, seed)
    rows = lm_head[drafter.to_target_ids(torch.arange(drafter.shape.draft_vocab_size))]
    argmax = (last @ lm_head.t()).argmax(-1)
    model = TTTModel(drafter, rows.to(torch.bfloat16), 4, 0.8)
    drafter.embed_tokens.to(torch.bfloat16)
    return model, {"input_ids": ids, "loss_mask": mask, "aux": aux.to(torch.bfloat16),
                   "last_hidden": last.to(torch.bfloat16), "target_argmax": argmax}


def loss_and_grads(model: TTTModel, batch: dict, cast_once: bool, monkeypatch) -> tuple[float, dict]:
    monkeypatch.setattr("train.module.worth_routing", lambda *a: False)  # the one cast alone (no routed layers)
    if not cast_once:  # the step as it was: each Linear casts at each call (autocast's cache still shares them)
        monkeypatch.setattr("train.module.matmul_weights_cast_once", lambda *a, **k: _nothing())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res = model(**batch)
    res.loss.backward()
    monkeypatch.undo()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(res.loss), grads


class _nothing:
    def __enter__(self):
        return 0

    def __exit__(self, *exc):
        return False


def test_without_autocast_nothing_is_cast(mapped) -> None:  # noqa: F811
    before = dict(mapped.named_parameters())
    with matmul_weights_cast_once(mapped, "cpu") as n:
        assert n == 0 and dict(mapped.named_parameters()) == before


def test_inside_the_block_linears_read_one_bf16_copy_and_the_parameters_come_back(mapped) -> None:  # noqa: F811
    linears = [m for m in mapped.modules() if isinstance(m, nn.Linear)]
    params = [m.weight for m in linears]
    with torch.autocast("cpu", dtype=torch.bfloat16), matmul_weights_cast_once(mapped, "cpu") as n:
        assert n == len(linears) == 9  # fc, q, k, v, o, gate, up, down, lm_head
        assert all(m.weight.dtype == torch.bfloat16 and m.weight.grad_fn is not None for m in linears)
        assert mapped.embed_tokens.weight.dtype == torch.float32  # not a matmul weight: untouched
    assert [m.weight for m in linears] == params and all(isinstance(p, nn.Parameter) for p in params)
    with pytest.raises(RuntimeError, match="boom"), torch.autocast("cpu", dtype=torch.bfloat16):
        with matmul_weights_cast_once(mapped, "cpu"):
            raise RuntimeError("boom")
    assert [m.weight for m in linears] == params  # back after an error too


def test_loss_equals_eager_autocast_and_gradients_its_up_to_bf16_sums(mapped, monkeypatch) -> None:  # noqa: F811
    """The forward is eager autocast's bit for bit. Gradients: eager autocast caches the cast of a whole weight,
    so those of fc, o, the MLP and lm_head are bit for bit too; q, k and v are read in two slices (embeddings,
    hidden: ``Eagle3Drafter.embed_projections``), which autocast casts afresh at each use and sums in fp32, where
    the one cast copy sums its draft steps' gradients in bf16: equal to bf16 rounding."""
    model, batch = model_and_batch(mapped)
    want_loss, want = loss_and_grads(model, batch, False, monkeypatch)
    loss, got = loss_and_grads(model, batch, True, monkeypatch)
    assert loss == want_loss and got.keys() == want.keys() and len(got) == 13  # 9 weights + 4 norms
    for name in want:
        assert got[name].dtype == torch.float32
        if any(f"{p}_proj" in name for p in "qkv"):
            torch.testing.assert_close(got[name], want[name], rtol=0.02, atol=0.01 * float(want[name].abs().max()))
        else:
            assert torch.equal(got[name], want[name]), name


def test_a_compiled_step_takes_the_cast_weights_without_recompiling(mapped, monkeypatch) -> None:  # noqa: F811
    """Three optimizer steps with the drafter's step compiled (aot_eager: the graph, not the kernels, is under
    test): the same losses as eager, and no graph after the first training step (each draft step of the unroll
    has its own: its number of earlier steps' keys differs)."""
    torch._dynamo.reset()
    eager_model, batch = model_and_batch(copy.deepcopy(mapped))
    model, _ = model_and_batch(mapped)
    compiled = torch.compile(mapped.step, backend="aot_eager", dynamic=False)
    monkeypatch.setattr(mapped, "step", compiled)
    monkeypatch.setattr("train.module.worth_routing", lambda *a: False)
    losses, graphs = {}, []
    base = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # (a process-wide count)
    for name, m in (("eager", eager_model), ("compiled", model)):
        opt = make_optimizer(m, 1e-2, 0.0, fused=False)
        losses[name] = []
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                res = m(**batch)
            res.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(float(res.loss))
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=2e-2)
    assert losses["compiled"][2] < losses["compiled"][0]  # the fp32 weights moved through the cast
    assert graphs[:3] == [base] * 3 and graphs[3] == graphs[5] > base, graphs


@pytest.mark.parametrize("cast_once", [True, False])
def test_a_compiled_draft_step_casts_no_weight_of_its_own(mapped, monkeypatch, cast_once) -> None:  # noqa: F811
    """What the H200 profile showed, read off the compiled graphs: without the one cast, every draft step's graph
    casts the fp32 weights it reads whole to bf16 (o and the MLP's three; q, k and v are read in slices, fc and
    lm_head outside the step); with it, none does."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    casts: list[int] = []

    def forward_graph(gm: torch.fx.GraphModule, inputs):
        def weight_cast(node: torch.fx.Node) -> bool:
            src = node.args[0] if node.args else None
            val = getattr(src, "meta", {}).get("val")
            return (node.op == "call_function" and isinstance(src, torch.fx.Node) and src.op == "placeholder"
                    and val is not None and val.dim() == 2
                    and val.dtype == torch.float32 and node.target in (torch.ops.prims.convert_element_type.default,
                                                                       torch.ops.aten._to_copy.default))
        casts.append(sum(weight_cast(n) for n in gm.graph.nodes))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    model, batch = model_and_batch(mapped)
    backend = aot_autograd(fw_compiler=forward_graph, bw_compiler=lambda gm, _: make_boxed_func(gm.forward))
    monkeypatch.setattr(mapped, "step", torch.compile(mapped.step, backend=backend, dynamic=False))
    monkeypatch.setattr("train.module.worth_routing", lambda *a: False)
    if not cast_once:
        monkeypatch.setattr("train.module.matmul_weights_cast_once", lambda *a, **k: _nothing())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch).loss.backward()
    assert len(casts) == 4  # one graph per draft step (each sees one more step's keys)
    assert casts == ([0] * 4 if cast_once else [4] * 4), casts
