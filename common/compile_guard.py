"""What a compiled kernel does when dynamo cannot compile it: raise, so its owner chooses the fallback.

Past its recompile limit dynamo would otherwise run the function uncompiled without a word: for flex attention
that is a dense score matrix that does not fit in a GPU's memory, for a target's layers
a silently slower forward. Every owner of a compiled function calls it under ``no_uncompiled_fallback`` and
names, once, what it falls back to. Beside that: how a compiled piece is traced (no duck sizing, floats as
constants) and how long this process's compiles took (``compile_seconds``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.fx.experimental._config as fx_config

from common.cli import exception_line

T = TypeVar("T")


def no_uncompiled_fallback() -> Any:
    """Past dynamo's recompile limit, raise (``is_recompile_limit``) rather than run uncompiled."""
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)


def no_duck_sizing() -> Any:
    """Trace with every dynamic size a symbol of its own. Dynamo's duck sizing gives sizes that are equal at trace
    time one symbol (a batch of 3 rows and 3 kv heads, 64 rows and a head of 64) and guards on the equality, so each
    call where they differ compiles again: seconds each, and a step toward the recompile limit. Read at
    trace time only, so a call that traces nothing pays only the patch (~20 us)."""
    return fx_config.patch(use_duck_shape=False)


def no_float_symbols() -> Any:
    """Trace Python floats as constants. With dynamic shapes dynamo first traces a float (an attention's scale, a
    norm's epsilon read off its module) as a symbol, fails to turn it into a tensor in a pass after the trace and
    traces the whole function again: each compiled layer piece was traced twice (on a CPU, 7.6 s of dynamo and AOT
    for the suffix layer, 2.5 s with ``layer_pieces.LayerPieces`` and this). Read at trace time only (~17 us a
    call)."""
    return torch._dynamo.config.patch(specialize_float=True)


def is_recompile_limit(e: BaseException) -> bool:
    """Whether ``e`` is dynamo refusing one more compile (``no_uncompiled_fallback``). By name: the class has
    moved between torch versions."""
    return type(e).__name__ == "FailOnRecompileLimitHit"


def is_compile_failure(e: BaseException) -> bool:
    """Whether ``e`` came from compiling rather than from running: dynamo's own errors (an unsupported construct,
    a backend that failed) or its recompile limit."""
    return isinstance(e, torch._dynamo.exc.TorchDynamoException) or is_recompile_limit(e)


class CompileSwitch:
    """Whether an owner's compiled code still runs: until compiling it fails once (dynamo's errors or its recompile
    limit, ``is_compile_failure``), then never again in this process, said once on stderr with what runs instead.
    Anything that fails while running is raised."""

    def __init__(self, what: str):
        self.what = what
        self.state = "compiled"  # or "off: <why>"

    def run(self, compiled: Callable[[], T], eager: Callable[[], T]) -> T:
        """``compiled()`` under ``no_uncompiled_fallback``, ``no_duck_sizing`` and ``no_float_symbols`` while on;
        ``eager()`` once off (the call that turned it off included: what the compiled call had done must be safe to
        redo eagerly)."""
        if self.state == "compiled":
            try:
                with no_uncompiled_fallback(), no_duck_sizing(), no_float_symbols():
                    return compiled()
            except Exception as e:  # noqa: BLE001 - only a compile failure falls back; anything else is raised
                if not is_compile_failure(e):
                    raise
                self.state = f"off: {exception_line(e)}"
                print(f"warning: {self.what} are {self.state}; eager from here on", file=sys.stderr)
        return eager()


def compile_seconds(top: int = 10) -> dict[str, float]:
    """Dynamo's compile seconds in this process so far by phase (``torch._dynamo.utils.compile_times``, summed per
    function, nested phases counted in their callers too; the ``top`` largest): which of tracing, AOT or inductor a
    first call waits on, and how much of a run its compiles took."""
    from torch._dynamo.utils import compile_times

    got = compile_times(repr="csv", aggregate=True)
    if not isinstance(got, tuple):
        return {}
    names, values = got
    pairs = sorted(((n, float(v)) for n, v in zip(names, values, strict=True)), key=lambda p: -p[1])
    return {n: round(v, 3) for n, v in pairs[:top]}
