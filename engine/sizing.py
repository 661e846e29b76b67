"""How large a stream is: the rows it decodes at once, its pool of pages (on a GPU from the device's free memory),
and the padded batch a decode step runs at."""

from __future__ import annotations

import torch

from engine.batched import BatchedTarget

MEMORY_SHARE = 0.80  # of the free device memory, for the cache (the rest: weights' activations, logits)
MAX_ROWS = 4096  # rows decoded at once on a GPU (regenerate.slots overrides)
CPU_START_POSITIONS = 512  # a CPU pool starts with this many positions per row and grows as rows need more


def plan_rows(target: BatchedTarget, wanted: int, cpu_rows: int, rows: int | None = None) -> int:
    """How many rows decode at once: ``rows`` if given, else MAX_ROWS on a GPU and ``cpu_rows`` on a CPU,
    never more than ``wanted`` (the requests known)."""
    if rows is None:
        rows = MAX_ROWS if target.device.type == "cuda" else cpu_rows
    return max(1, min(wanted, rows))


def plan_pages(target: BatchedTarget, rows: int, max_len: int, page: int) -> int:
    """Pages of the pool (scratch included): on a GPU as many as MEMORY_SHARE of its free memory holds after the
    rows' logits, never more than every row at ``max_len``; on a CPU, CPU_START_POSITIONS per row to start."""
    per_row = -(-max_len // page)
    most = 1 + rows * per_row
    if target.device.type != "cuda":
        return min(most, 1 + rows * -(-min(max_len, CPU_START_POSITIONS) // page))
    free, _ = torch.cuda.mem_get_info(target.device)
    free += torch.cuda.memory_reserved(target.device) - torch.cuda.memory_allocated(target.device)  # cached, unused
    logits = rows * target.lm_head.weight.shape[0] * 4 * 3  # fp32 logits and sampling temporaries per row
    fits = int((free - logits) * MEMORY_SHARE) // (page * target.kv_bytes_per_token())
    return max(1 + per_row, min(most, fits))


def decode_rows(hi: int, rows: int, buckets: int) -> int:
    """The batch a decode step of rows [0, hi) runs at: the smallest of rows, rows/2, ... (``buckets`` sizes)
    holding them, so compiled kernels see a few fixed shapes; ``buckets`` 0: exactly ``hi``."""
    if buckets <= 0:
        return hi
    size = rows
    for _ in range(buckets - 1):
        if -(-size // 2) < hi:
            break
        size = -(-size // 2)
    return size
