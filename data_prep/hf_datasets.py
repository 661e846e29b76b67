"""Prompt records through Hugging Face `datasets`: parquet and arrow files, ``save_to_disk`` directories,
directories of data files (a hub snapshot from ``hf download --repo-type dataset``, or any folder
``load_dataset`` reads), and hub ids.

Files and data directories are streamed: rows are read as they are needed, so a large parquet file costs
no Arrow copy in the cache and a ``limit`` stops the reading early. ``save_to_disk`` directories and a hub
dataset's cache are memory-mapped Arrow, read in place. A hub id is loaded the way ``load_dataset`` loads
it: from the hub when online, from the local `datasets` cache (``HF_DATASETS_CACHE``, default
``$HF_HOME/datasets``) under ``HF_HUB_OFFLINE=1`` or when the hub cannot be reached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from common.config import PromptSource
from data_prep.readers import Messages, Record, Tools, to_record
from data_prep.source_fields import Fields, SourceError

DEFAULT_SPLIT = "train"
BATCH_ROWS = 256


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def load(src: PromptSource, key: str, path: Path) -> tuple[Any, str]:
    """The split to read (a Dataset or an IterableDataset) and a label naming it in messages."""
    import datasets

    split = src.split or DEFAULT_SPLIT
    if path.is_file():  # a single .parquet or .arrow file: its one split
        ds = _call(src, key, datasets.load_dataset, path.suffix[1:], data_files=str(path), split="train",
                   streaming=True)
        return ds, path.name
    if path.is_dir() and _saved(path):
        return _saved_split(_call(src, key, datasets.load_from_disk, str(path)), src, key, path)
    if path.is_dir():
        ds = _call(src, key, datasets.load_dataset, str(path), name=src.subset, split=split, streaming=True)
        return ds, f"{path.name}:{split}"
    ds = _call(src, key, datasets.load_dataset, src.path, name=src.subset, split=split)
    return ds, f"{src.path}:{split}"


def _call(src: PromptSource, key: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, its failure one line naming the source and the key."""
    from datasets.exceptions import DatasetsError

    try:
        return fn(*args, **kwargs)
    except (OSError, ValueError, DatasetsError) as e:
        hint = "" if Path(src.path).expanduser().exists() else (
            "; it is no local path, and a hub id is read from the datasets cache when offline (HF_DATASETS_CACHE, "
            "default $HF_HOME/datasets)")
        raise SourceError(f"{src.path}: datasets cannot load it ({key}.path): {_one_line(e)}{hint}") from None


def _saved(path: Path) -> bool:
    """A ``save_to_disk`` directory: a Dataset (state.json) or a DatasetDict (dataset_dict.json)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _saved_split(saved: Any, src: PromptSource, key: str, path: Path) -> tuple[Any, str]:
    import datasets

    if src.subset is not None:
        raise SourceError(f"{key}.subset: {path} is a save_to_disk directory, with no subsets")
    if not isinstance(saved, datasets.DatasetDict):
        if src.split is not None:
            raise SourceError(f"{key}.split: {path} holds one save_to_disk Dataset, with no splits")
        return saved, path.name
    split = src.split or DEFAULT_SPLIT
    if split not in saved:
        raise SourceError(f"{key}.split: {path} has no split {split!r}; its splits: {', '.join(saved)}")
    return saved[split], f"{path.name}:{split}"


def fields(ds: Any, column: str) -> Fields | None:
    """The columns and, where ``column`` holds a list of records, the fields of those records, from the
    schema; None when the schema is not known before reading (a streamed JSON directory)."""
    features = ds.features
    if features is None:
        return None
    inner = getattr(features.get(column), "feature", None)
    return Fields(set(features), set(inner) if isinstance(inner, dict) else None)


def read_rows(ds: Any, label: str, convert: Callable[[Any], Messages],
              tools: Callable[[Any], Tools] | None = None) -> Iterator[Record]:
    """Records ``label[i]``, read in batches of decoded rows (5x faster than one row at a time). A file that
    breaks midway is an error naming the row (rows cannot be skipped past a broken Arrow or parquet block).
    ``tools``: the kind's reader of the tools a record offers (data_prep.readers.JSON_TOOLS)."""
    from datasets.exceptions import DatasetsError

    batches = ds.iter(batch_size=BATCH_ROWS)
    index = 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (OSError, ValueError, DatasetsError) as e:
            raise SourceError(f"{label}[{index}]: datasets cannot read on: {_one_line(e)}") from None
        names = list(batch)
        for values in zip(*batch.values(), strict=True):
            row = absent_nulls(dict(zip(names, values, strict=True)))
            yield to_record(f"{label}[{index}]", row, convert, tools)
            index += 1


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def absent_nulls(row: dict[str, Any]) -> dict[str, Any]:
    """Arrow gives every row every field of a struct, None where a record had none. Inside a record's ``tools``
    and a turn's ``tool_calls`` (JSON schemas and arguments of any shape, which the chat template renders
    verbatim) those Nones are fields the record never had: dropped. Elsewhere the readers treat None as
    absent already (a turn's reasoning_content, tool_calls, tool_call_id)."""
    out = dict(row)
    if out.get("tools") is not None:
        out["tools"] = _without_nulls(out["tools"])
    for name, value in row.items():
        if isinstance(value, list) and any(isinstance(t, dict) and t.get("tool_calls") for t in value):
            out[name] = [t | {"tool_calls": _without_nulls(t["tool_calls"])}
                         if isinstance(t, dict) and t.get("tool_calls") else t for t in value]
    return out
