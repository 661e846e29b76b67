"""Regenerate over several devices (hf): the prompts shared out by id, one process and one part file per device,
the parts merged into conversations.jsonl at the end (idempotently, so a rerun after a kill finishes the merge)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from common import parent_death
from common.config import RunConfig, dump_config, parse_config
from common.files import cut_torn_tail, json_line, named_errors
from data_prep.id_hash import id_hash
from data_prep.regenerate_files import resume, whole_records
from data_prep.regenerate_loop import on_one_backend
from data_prep.regenerate_summary import RegenerateSummary, age_phase, seconds_since, validate


def hf_devices(cfg: RunConfig) -> list[str]:
    """Where the hf backend runs: regenerate.devices, else every visible GPU when the target may use one."""
    if cfg.regenerate.backend != "hf":
        return []
    if cfg.regenerate.devices:
        return list(cfg.regenerate.devices)
    import torch

    if cfg.target.device in ("auto", "cuda") and torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [cfg.target.device]


def part_path(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.stem}.part-{rank}{out.suffix}")


def merge_parts(out: Path) -> int:
    """Fold the per-device part files into ``out`` (ids already there are skipped), then delete them.
    Idempotent: a kill mid-merge leaves at most a torn last line, and the rerun merges the rest."""
    parts = sorted(out.parent.glob(f"{out.stem}.part-*{out.suffix}"))
    if not parts:
        return 0
    done, _ = resume(out)
    added = 0
    with named_errors(out), open(out, "ab") as f:
        for part in parts:
            cut_torn_tail(part)
            for rec in whole_records(part):
                if rec["id"] not in done:
                    f.write(json_line(rec).encode("utf-8"))  # the bytes the part's writer wrote (same json_line)
                    done.add(rec["id"])
                    added += 1
        f.flush()
        os.fsync(f.fileno())
    for part in parts:
        part.unlink()
    return added


def share_of(prompt_id: str, n: int) -> int:
    """The device a prompt goes to: stable across reruns, so a resumed part file is never re-asked."""
    return id_hash(prompt_id) % n


def device_shares(prompts: list[dict[str, Any]], n: int) -> list[list[dict[str, Any]]]:
    """``prompts`` split over ``n`` devices (``share_of``), each share in the prompts' order."""
    return [[p for p in prompts if share_of(p["id"], n) == r] for r in range(n)]


def _device_worker(tree: dict[str, Any], prompts: list[dict[str, Any]], device: str, part: str,
                   profile: bool) -> dict[str, Any]:
    """One device's share, in its own process (spawned: CUDA cannot be forked). It runs under the parent's
    run-dir lock (it takes none: the parent holds it) and dies with the parent (``_worker_init``). Its failures
    are counted, not raised: the limits apply to all devices together (``check_failures`` in the parent); it
    stops its own share after max_consecutive_failures in a row."""
    phases = age_phase("interpreter_and_imports_s")
    summary = on_one_backend(parse_config(tree), prompts, phases, device, Path(part), profile)
    summary.phases |= age_phase("process_s")
    return summary.to_dict()


def regenerate_on_devices(cfg: RunConfig, prompts: list[dict[str, Any]], devices: list[str],
                          phases: dict[str, float] | None = None, profile: bool = False) -> RegenerateSummary:
    """The prompts split over ``devices`` (one process and one part file each), merged at the end. ``phases``:
    the caller's so far (``PHASES``); the summary's go on from them, each worker's in ``device_phases``.
    ``profile``: each worker's step is profiled (``run_regenerate``)."""
    import multiprocessing as mp

    t = time.perf_counter()
    out = cfg.conversations_path
    out.parent.mkdir(parents=True, exist_ok=True)
    merge_parts(out)  # leftovers of a killed run
    done, torn = resume(out)
    pending = [p for p in prompts if p["id"] not in done]
    shares = device_shares(pending, len(devices))
    tree = dump_config(cfg)
    resume_s = seconds_since(t)
    phases = age_phase("startup_s") | (phases or {}) | {"resume_s": resume_s}
    start = time.perf_counter()
    # The workers die with this process (a pipeline killed with -9 takes its stages' workers along; the
    # run-dir lock they work under dies with it).
    with mp.get_context("spawn").Pool(len(devices), initializer=parent_death.die_with_parent) as pool:
        parts = pool.starmap(_device_worker, [(tree, share, dev, str(part_path(out, r)), profile)
                                              for r, (share, dev) in enumerate(zip(shares, devices, strict=True))])
    merge_parts(out)
    stopped = [f"{dev}: {p['stopped']}" for dev, p in zip(devices, parts, strict=True) if p["stopped"]]
    summary = RegenerateSummary(output=str(out), backend=f"hf x{len(devices)} ({', '.join(devices)})",
                                selected=len(prompts), already_done=len(prompts) - len(pending),
                                torn_bytes_dropped=torn, written=sum(p["written"] for p in parts),
                                turns_dropped_context_full=sum(p["turns_dropped_context_full"] for p in parts),
                                tool_calls_diverged=sum(p["tool_calls_diverged"] for p in parts),
                                loop_cuts=sum(p["loop_cuts"] for p in parts),
                                loop_tokens_generated=sum(p["loop_tokens_generated"] for p in parts),
                                loop_tokens_kept=sum(p["loop_tokens_kept"] for p in parts),
                                answer_tokens=sum(p["answer_tokens"] for p in parts),
                                engine={dev: p["engine"] for dev, p in zip(devices, parts, strict=True)},
                                spans={dev: p["spans"] for dev, p in zip(devices, parts, strict=True)},
                                tried=sum(p["tried"] for p in parts), stopped="; ".join(stopped) or None,
                                seconds=time.perf_counter() - start, device_phases=[p["phases"] for p in parts])
    summary.phases = phases | {"step_s": round(summary.seconds, 3)}
    for p in parts:
        summary.failed.update(p["failed"])
        for reason, example in p["failure_examples"].items():
            summary.failure_examples.setdefault(reason, example)
    t = time.perf_counter()
    validate(out, [p["id"] for p in prompts], summary)
    summary.phases["validate_s"] = seconds_since(t)
    return summary
