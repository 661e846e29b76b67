"""Where a GPU step's time goes, by kernel: one home for the profiler summaries of bench/train_step_profile.py,
bench/decode_step.py and bench/prefill_step.py.

A step is run ``repeats`` times under ``torch.profiler`` (CUDA activity only) and each kernel's device time and
launches are summed and divided by ``repeats``: ms and launches per step, per kernel name, then ms per coarse class
(``KERNEL_CLASSES``, first match wins, matched on the lower-cased name). The classes are a reading aid; the top
kernels keep their names, so a reader can check what a class holds. On a CPU the profiler records no kernels: the
summary says so (tests run the plumbing there).
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


def kernel_times(step: Callable[[], Any], repeats: int) -> dict[str, tuple[float, float]]:
    """Per kernel name, (device ms, launches) per call of ``step`` (``repeats`` calls profiled, synchronised at the
    end). The launches tell a kernel run once a step from one run at every draft step or layer."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            step()
        if cuda:
            torch.cuda.synchronize()
    times: dict[str, tuple[float, float]] = {}
    for e in prof.events():
        us = getattr(e, "device_time", None)
        if us is None:
            us = getattr(e, "cuda_time", 0.0)
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and us:
            ms, calls = times.get(e.name, (0.0, 0.0))
            times[e.name] = (ms + us / 1e3 / repeats, calls + 1 / repeats)
    return times


NAME_CHARS = 200  # of a kernel's name kept: templated names carry their dtypes and functors past 120


def summarize(times: dict[str, tuple[float, float]], top: int = 12) -> dict[str, Any]:
    """The figures a profile records: total kernel ms per step, ms per class (largest first), the ``top`` kernels
    (name cut to ``NAME_CHARS``, class, ms, launches per step) and how many kernel names there were."""
    by_class: dict[str, float] = {}
    for name, (ms, _) in times.items():
        cls = kernel_class(name)
        by_class[cls] = by_class.get(cls, 0.0) + ms
    ranked = sorted(times.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kernel_ms": round(sum(ms for ms, _ in times.values()), 3), "kernels": len(times),
            "by_class_ms": {k: round(v, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": n[:NAME_CHARS], "class": kernel_class(n), "ms": round(ms, 3),
                             "calls": round(calls, 2)} for n, (ms, calls) in ranked],
            "profiled": bool(times)}


def host_times(step: Callable[[], Any], repeats: int, top: int = 12) -> dict[str, Any]:
    """Where the host's time in ``step`` goes: per op or region name recorded by ``torch.profiler`` on the CPU,
    self ms per call (the ``top`` largest), and the kernel launches per call. Why: a forward whose call returns
    long after its kernels would have finished is bound by the host, and only the host's own profile says whether
    guards, the compiled wrapper, eager ops or the launches take it."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            step()
        if cuda:
            torch.cuda.synchronize()
    rows = [(e.key, e.self_cpu_time_total / 1e3 / repeats, e.count / repeats) for e in prof.key_averages()
            if e.self_cpu_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    launches = sum(count for key, _, count in rows if re.search(r"LaunchKernel|cuLaunch", key))
    return {"host_profiled_ms": round(sum(ms for _, ms, _ in rows), 3), "launches": round(launches, 1),
            "host_top": [{"name": key[:NAME_CHARS], "self_ms": round(ms, 3), "calls": round(count, 2)}
                         for key, ms, count in rows[:top]]}
