"""Where a GPU step's time goes, by kernel: one home for the profiler summaries of bench/train_step_profile.py and
bench/decode_step.py.

A step is run ``repeats`` times under ``torch.profiler`` (CUDA activity only) and each kernel's device time is
summed and divided by ``repeats``: ms per step, per kernel name, then per coarse class (``KERNEL_CLASSES``, first
match wins, matched on the lower-cased name). The classes are a reading aid; the top kernels keep their names, so a
reader can check what a class holds. On a CPU the profiler records no kernels: the summary says so (tests run the
plumbing there).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

# (class, pattern) in match order: Inductor names its fused kernels after their ops (``triton_red_fused__to_copy_
# add_mean_...``), so casts and norms are told apart by those words; templates (flex attention) are ``triton_tem``.
KERNEL_CLASSES: list[tuple[str, str]] = [
    ("attention", r"flex|attention|fmha|flash|triton_tem"),
    ("gemm", r"gemm|xmma|nvjet|cutlass|cublas|wgmma|splitk|sm90_|sm80_"),
    ("optimizer", r"adam|multi_tensor"),
    ("cross_entropy", r"logsumexp|_ce_|softmax"),
    ("norm", r"rsqrt|norm"),
    ("cast_or_copy", r"_to_copy|copy|memcpy|cast|convert"),
    ("gather_scatter", r"index|gather|scatter|embedding"),
    ("memset", r"memset|fill|zero"),
    ("reduction", r"reduce|_red_|_per_|sum|mean"),
]


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((cls for cls, pattern in KERNEL_CLASSES if re.search(pattern, low)), "elementwise_other")


def kernel_times(step: Callable[[], Any], repeats: int) -> dict[str, float]:
    """Device ms per call of ``step`` by kernel name (``repeats`` calls profiled, synchronised at the end)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            step()
        if cuda:
            torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.events():
        us = getattr(e, "device_time", None)
        if us is None:
            us = getattr(e, "cuda_time", 0.0)
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and us:
            times[e.name] = times.get(e.name, 0.0) + us / 1e3 / repeats
    return times


def summarize(times: dict[str, float], top: int = 12) -> dict[str, Any]:
    """The figures a profile records: total kernel ms per step, ms per class (largest first), the ``top`` kernels
    (name cut to 120 characters, class, ms) and how many kernel names there were."""
    by_class: dict[str, float] = {}
    for name, ms in times.items():
        cls = kernel_class(name)
        by_class[cls] = by_class.get(cls, 0.0) + ms
    ranked = sorted(times.items(), key=lambda kv: -kv[1])[:top]
    return {"kernel_ms": round(sum(times.values()), 3), "kernels": len(times),
            "by_class_ms": {k: round(v, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": n[:120], "class": kernel_class(n), "ms": round(ms, 3)} for n, ms in ranked],
            "profiled": bool(times)}
