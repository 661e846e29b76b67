"""What a compiled kernel does when dynamo cannot compile it: raise, so its owner chooses the fallback.

Past its recompile limit dynamo would otherwise run the function uncompiled without a word: for flex attention
that is a dense score matrix that does not fit (the eighth H200 session's out-of-memory), for a target's layers
a silently slower forward. Every owner of a compiled function calls it under ``no_uncompiled_fallback`` and
names, once, what it falls back to.
"""

from __future__ import annotations

from typing import Any

import torch


def no_uncompiled_fallback() -> Any:
    """Past dynamo's recompile limit, raise (``is_recompile_limit``) rather than run uncompiled."""
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)


def is_recompile_limit(e: BaseException) -> bool:
    """Whether ``e`` is dynamo refusing one more compile (``no_uncompiled_fallback``). By name: the class has
    moved between torch versions."""
    return type(e).__name__ == "FailOnRecompileLimitHit"


def is_compile_failure(e: BaseException) -> bool:
    """Whether ``e`` came from compiling rather than from running: dynamo's own errors (an unsupported construct,
    a backend that failed) or its recompile limit."""
    return isinstance(e, torch._dynamo.exc.TorchDynamoException) or is_recompile_limit(e)
