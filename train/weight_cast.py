"""The drafter's matmul weights cast to the autocast dtype once per TTT step, not once per unrolled draft step.

Under bf16 autocast over fp32 master weights (accelerate's bf16 path), every ``nn.Linear`` casts its weight at
each call. Eager autocast caches those casts for the length of one forward, but a compiled drafter step is its
own graph and casts again at each of the ``ttt_length`` draft steps; its backward then casts each step's weight
gradient to fp32 and adds it into ``.grad`` in fp32: at the Kimi-K2.5 drafter shape (1.2 B trainable parameters)
a pass over every weight per draft step, each way (``"train_step_profile"`` in bench/results.json measures the
step). With the weights cast here, once, the unrolled steps share one bf16 copy: autograd sums
their gradients in bf16 on that copy, and one cast takes the sum back to the fp32 master weight, as eager
autocast's cache already does.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def matmul_weights_cast_once(model: nn.Module, device_type: str, skip: Collection[nn.Module] = ()) -> Iterator[int]:
    """Within the block, each ``nn.Linear`` of ``model`` (but those in ``skip``, which cast their own:
    ``train.shared_weight_grad``) reads its weight cast (differentiably) to the autocast dtype of ``device_type``;
    outside it, the parameters are back. Nothing changes without autocast, or where a weight already has that
    dtype (DeepSpeed's bf16 engine). Yields how many weights were cast."""
    if not torch.is_autocast_enabled(device_type):
        yield 0
        return
    dtype = torch.get_autocast_dtype(device_type)
    swapped: list[tuple[nn.Linear, nn.Parameter]] = []
    try:
        for m in model.modules():
            w = m._parameters.get("weight") if isinstance(m, nn.Linear) and m not in skip else None
            if w is not None and w.dtype != dtype and w.is_floating_point():
                m._parameters["weight"] = w.to(dtype)  # noqa: SLF001 (a plain tensor for the block: no Parameter)
                swapped.append((m, w))
        yield len(swapped)
    finally:
        for m, w in swapped:
            m._parameters["weight"] = w  # noqa: SLF001
