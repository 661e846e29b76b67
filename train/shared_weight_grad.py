"""A weight that the TTT unroll uses at every draft step gets its gradient from one matmul over all the steps' rows.

Autograd gives a weight used ``ttt_length`` times one gradient per use and sums them two at a time: at the
Kimi-K2.5 drafter shape (1.2 B weights in bf16, 2,048 rows a step) each sum is a pass over the weight
(``"train_step_profile"`` in bench/results.json: the bf16 ``add`` kernel), and the sum then goes through a
bf16-to-fp32 cast into the master weight's gradient. A routed layer instead keeps each use's input
rows and output gradient; the backward of its last use stacks them and computes the weight's gradient as one
matmul over every use's rows (fp32 accumulation, written in fp32 straight into the master weight's gradient).

That trades the sums (a pass over the weight per use) for stacking the rows (a pass over the activations), so
it pays only where a weight outweighs its rows: ``worth_routing``. At 16,384 rows of the SmolLM2 drafter the
rows are 40 times the weight and nothing is routed.

Uses are counted in the forward; the last use's backward computes the gradient. A use whose backward never
runs (its output never reached the loss) would lose its share: the first backward call queues a check that
fails the backward loudly instead. One backward per forward (no ``retain_graph`` reuse).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

Cols = tuple[int, int]


def worth_routing(layer: nn.Linear, rows: int) -> bool:
    """Routing reads each use's rows twice (kept, then stacked) instead of summing weight-sized gradients: it
    pays when the rows (inputs and output gradients) are smaller than the weight."""
    return rows * (layer.in_features + layer.out_features) < layer.in_features * layer.out_features


_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch >= 2.8


def _mm_into(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out = a @ b`` written in place (``out`` may be a column slice: cuBLAS takes its row stride), accumulated in
    fp32: cuBLAS writes bf16 inputs' product in fp32 directly (without that overload, an older torch, it is rounded
    to bf16 once); the CPU has no such kernel and multiplies fp32 copies."""
    if a.dtype == out.dtype:
        torch.mm(a, b, out=out)
    elif a.is_cuda and out.dtype == torch.float32 and _MM_OUT_DTYPE:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif a.is_cuda:
        out.copy_(torch.mm(a, b))
    else:
        torch.mm(a.float(), b.float(), out=out)


class WeightUses:
    """One routed layer's compute copy of its weight (cast once) and the rows of its uses so far."""

    def __init__(self, layer: nn.Linear, dtype: torch.dtype):
        self.param = layer.weight
        self.weight = layer.weight.detach().to(dtype)
        self.pending = 0
        self.kept: dict[Cols, list[tuple[Tensor, Tensor]]] = {}
        self.checked = False

    def cols(self, cols: slice) -> Cols:
        start, stop, step = cols.indices(self.weight.shape[1])
        if step != 1:
            raise ValueError(f"a routed matmul takes contiguous weight columns, not {cols}")
        return start, stop

    def keep(self, cols: Cols, x: Tensor, g: Tensor) -> None:
        self.pending -= 1
        self.kept.setdefault(cols, []).append((x, g))
        if not self.checked:  # once per backward: every use counted in the forward must have come back
            self.checked = True
            torch.autograd.Variable._execution_engine.queue_callback(self._check)  # noqa: SLF001

    def _check(self) -> None:
        if self.pending:
            raise RuntimeError(f"{self.pending} use(s) of a routed drafter weight {tuple(self.weight.shape)} got no "
                               f"gradient: their outputs never reached the loss, so the weight's gradient was "
                               f"never computed (train.shared_weight_grad)")

    def gradient(self) -> Tensor:
        """The master weight's gradient: per column range, its uses' output gradients by their inputs, all rows
        in one matmul. Ranges that tile the columns (all of them at once; q, k and v: the embeddings' half, the
        hidden's) are written in place, the matmul's output strided into its columns; columns no use read are
        zero, and overlapping ranges add up."""
        groups = self.kept
        self.kept = {}
        width = self.weight.shape[1]
        ranges = sorted(groups)
        tiled = ranges[0][0] == 0 and ranges[-1][1] == width and all(
            b == c for (_, b), (c, _) in zip(ranges, ranges[1:], strict=False))
        grad = self.param.new_empty(self.param.shape) if tiled else self.param.new_zeros(self.param.shape)
        for (a, b), pairs in groups.items():
            if tiled:
                _mm_into(grad[:, a:b], *_stacked(pairs))
            else:
                part = grad.new_empty(grad.shape[0], b - a)
                _mm_into(part, *_stacked(pairs))
                grad[:, a:b] += part
        return grad


def _stacked(pairs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """(G^T, X) over every use's rows: the weight's gradient is their product."""
    if len(pairs) == 1:
        x, g = pairs[0]
    else:
        x, g = torch.cat([x for x, _ in pairs]), torch.cat([g for _, g in pairs])
    return g.t(), x


class _RoutedLinear(torch.autograd.Function):
    """``x @ W[:, cols].T (+ add)`` with the compute copy of W; W's gradient comes from ``WeightUses``."""

    @staticmethod
    def forward(ctx, x: Tensor, param: Tensor, add: Tensor | None, uses: WeightUses, cols: Cols) -> Tensor:
        w = uses.weight[:, cols[0]:cols[1]]
        rows = x.reshape(-1, x.shape[-1]).to(w.dtype)
        out = torch.mm(rows, w.t()) if add is None else add.reshape(-1, w.shape[0]).to(w.dtype).addmm(rows, w.t())
        ctx.save_for_backward(rows)
        ctx.uses, ctx.cols, ctx.x_shape, ctx.x_dtype, ctx.has_add = uses, cols, x.shape, x.dtype, add is not None
        uses.pending += 1
        return out.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN205 (autograd's own signature)
        (rows,) = ctx.saved_tensors
        uses: WeightUses = ctx.uses
        a, b = ctx.cols
        g = grad.reshape(-1, grad.shape[-1]).to(uses.weight.dtype)
        grad_x = torch.mm(g, uses.weight[:, a:b]).view(ctx.x_shape).to(ctx.x_dtype)
        uses.keep(ctx.cols, rows, g)
        grad_param = uses.gradient() if uses.pending == 0 else None
        return grad_x, grad_param, grad if ctx.has_add else None, None, None


@torch.compiler.disable  # Python state in its backward: a compiled drafter step runs it between its graphs
def _routed(x: Tensor, uses: WeightUses, cols: slice, add: Tensor | None) -> Tensor:
    return _RoutedLinear.apply(x, uses.param, add, uses, uses.cols(cols))


@contextmanager
def routed_weight_grads(layers: Sequence[nn.Linear], dtype: torch.dtype) -> Iterator[int]:
    """Within the block, ``drafter.model.linear`` on each of ``layers`` runs through ``_RoutedLinear`` with its
    weight cast once to ``dtype``, when gradients are being recorded for it (otherwise as before). Yields how
    many layers were routed."""
    routed = [m for m in layers if torch.is_grad_enabled() and m.weight.requires_grad]
    try:
        for m in routed:
            uses = WeightUses(m, dtype)
            m.__dict__["route"] = lambda x, cols, add, u=uses: _routed(x, u, cols, add)
        yield len(routed)
    finally:
        for m in routed:
            m.__dict__.pop("route", None)
