"""A pipeline's stages die with it, whole process trees included.

Linux's ``PR_SET_PDEATHSIG`` asks the kernel to send a signal to a process when its parent dies, even when
the parent is killed with ``kill -9`` and can run no cleanup. The pipeline sets it (SIGKILL) in each stage
it starts (``stage_kwargs``: in the child between fork and exec); a process further down the tree, such as
a training worker under ``accelerate launch``, sets it on itself when it finds it runs under the
pipeline's lock (``common.locking.run_lock`` calls ``die_with_parent``). So the chain pipeline → launcher
→ worker unwinds link by link: no stage keeps writing into a run dir whose lock died with the pipeline.
Elsewhere than Linux these are no-ops.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1


def _prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):
        return None


def _set_pdeathsig(prctl: Any) -> bool:
    return prctl is not None and prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0


def die_with_parent() -> None:
    """Be killed when the parent process dies. If it died already (before the request took effect),
    this process is an orphan (re-parented): exit now instead."""
    parent = os.getppid()
    if _set_pdeathsig(_prctl()) and os.getppid() != parent:
        os._exit(137)


def stage_kwargs() -> dict[str, Any]:
    """``subprocess.Popen`` keyword arguments for a stage that must not outlive this process."""
    prctl, parent = _prctl(), os.getpid()  # looked up here: the child, between fork and exec, only calls it
    if prctl is None:
        return {}

    def in_child() -> None:
        if _set_pdeathsig(prctl) and os.getppid() != parent:
            os._exit(137)

    return {"preexec_fn": in_child}
