"""Regenerate: the target rewrites every assistant turn, so the drafter learns the target's own text.

Turn by turn: the chat is system? + user1 -> answer1, then + answer1 + user2 -> answer2, ..., each
answer the target's (the source's answers are dropped). Each finished conversation is appended to
``conversations.jsonl`` as one whole line, flushed at once (fsynced at least every second and at the end:
``common.files.JsonlAppender``), so after a kill -9 a rerun drops a torn last line, skips the ids already there
and ends with every id exactly once.

A failed prompt is counted and left for the next run, but failure is not success: the step stops after
``regenerate.max_consecutive_failures`` prompts in a row failed (a dead server, a broken engine) and exits 2
when more than ``regenerate.max_failure_share`` of the prompts it tried failed. A failure that is a verdict
on the prompt itself (``regenerate_summary.PROMPT_VERDICTS``: its first user turn alone fills the target's context) says
nothing about the engine: it is counted and reported like any other, and counts towards the share, but it
neither counts towards a run of failures in a row nor ends one. With several devices (hf), each
device's process writes its own part file (merged into ``conversations.jsonl`` at the end, idempotently);
a device stops its share after the consecutive-failure limit, and the share limit applies to the failures
of all devices together.

This module is the stage (``run_regenerate``); its parts: the input and resumed output (``regenerate_files``),
one prompt's turns (``conversation``), the loop on one backend (``regenerate_loop``), the summary and failure
verdict (``regenerate_summary``) and the fan-out over devices (``regenerate_devices``).
"""

from __future__ import annotations

import time

from common.config import RunConfig
from data_prep.regenerate_devices import hf_devices, regenerate_on_devices
from data_prep.regenerate_files import load_prompt_records
from data_prep.regenerate_loop import on_one_backend
from data_prep.regenerate_summary import RegenerateSummary, age_phase, check_failures, seconds_since


def run_regenerate(cfg: RunConfig, profile: bool = False) -> RegenerateSummary:
    """Regenerate on one backend or over several devices; StepFailed when too many prompts failed. ``profile`` (a
    benchmark's, never the command's): each process's step measures where its seconds go (``EngineProfile``, the
    host's stack sampled) into the summary's ``engine``."""
    phases = age_phase("interpreter_and_imports_s")
    t = time.perf_counter()
    # Read first: a bad input fails before the model loads.
    prompts = load_prompt_records(cfg.prompts_path, cfg.regenerate.num_prompts)
    phases["prompts_read_s"] = seconds_since(t)
    t = time.perf_counter()
    devices = hf_devices(cfg)
    phases["devices_s"] = seconds_since(t)
    if len(devices) > 1:
        summary = regenerate_on_devices(cfg, prompts, devices, phases, profile)
    else:
        summary = on_one_backend(cfg, prompts, phases, devices[0] if devices else None, profile=profile)
    summary.phases |= age_phase("process_s")
    check_failures(cfg, summary)
    return summary
