"""The float dtypes a run config may name (target, capture, saved checkpoints), listed once.

torch is imported only when a name becomes a torch dtype: the config schema uses these names, and
``python -m data_prep ingest`` loads the config without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

DTypeName = Literal["float32", "bfloat16", "float16"]
FLOAT_DTYPE_NAMES: tuple[str, ...] = get_args(DTypeName)


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (its ``itemsize`` gives the bytes per element)."""
    if name not in FLOAT_DTYPE_NAMES:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(FLOAT_DTYPE_NAMES)}")
    import torch

    return getattr(torch, name)
