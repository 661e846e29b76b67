"""A target's decoder layers compiled for its right-padded forwards (online training's, capture's) on CUDA.

HF's eager layer runs its norms (in fp32), rotary embedding and gated activation as tens of small kernels: for a
small target most of its forward is that elementwise work, read and written to memory kernel by kernel, and about as
long again goes to the host launching them. Fused by the compiler, they read and write once. Each layer's
``forward`` is compiled with dynamic shapes, which every layer shares (dynamo does not specialise on the module)
and every padded batch shape reuses after a first few graphs. Only ``forward`` is swapped in, and only for the
duration of the call: the layer's ``__call__`` still runs the forward hooks that capture the aux states, and
every other use of the model (generation, the KV cache) stays eager.

A compile that fails, or dynamo's recompile limit, turns it off for the rest of the process, said once on
stderr; the forward then runs eagerly (``state``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from common.compile_guard import CompileSwitch


class CompiledLayers:
    """``run(fn)``: ``fn()`` with the layers' compiled forwards swapped in (eagerly once they are off)."""

    def __init__(self, layers: torch.nn.ModuleList):
        self.layers = layers
        self.compiled: list[Callable[..., Any]] | None = None
        self.switch = CompileSwitch("the target's compiled layers")

    @property
    def state(self) -> str:
        return self.switch.state

    def run(self, fn: Callable[[], Any]) -> Any:
        return self.switch.run(lambda: self._swapped(fn), fn)

    def _swapped(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` with each layer's compiled forward in place of its own, for this call only."""
        if self.compiled is None:
            self.compiled = [torch.compile(layer.forward, dynamic=True) for layer in self.layers]
        try:
            for layer, forward in zip(self.layers, self.compiled, strict=True):
                layer.forward = forward
            return fn()
        finally:
            for layer in self.layers:
                layer.__dict__.pop("forward", None)
