"""The main job: prep → train → eval → gate, one round per invocation, as a newcomer runs it.

    python -m pipeline --config configs/smollm2-135m.yaml        # what `make demo` runs; calls run_round

Every round fine-tunes the incumbent (``pick_incumbent``: the promoted drafter; before any promotion the
config's ``drafter.init_from``, which for the embedded default is the shipped SmolLM2 drafter under
drafters/; without one, round 1 trains from scratch) on *fresh* prompts (the next slice of the ingested
pool), and gates the result against the break-even τ* measured on this machine and against the incumbent:
the production loop in miniature. Each stage runs as the same CLI a user would type, in a subprocess, so a
kill at any point resumes where it stopped when the command is run again.

Exit codes: 0 the round finished (the gate promoted, rejected, or left it unresolved: the verdict says which and
why, one line per dataset with its intervals), 2 an error; a round is marked done only after its gate exited 0 or
1 and recorded its decision. A round's config (its incumbent included) is fixed when the round starts, and a rerun
of a round whose gate already recorded a decision for its candidate goes on to the verdict without gating again:
a second measurement (τ* is timed anew) could record a second, contradicting decision. The pipeline holds the
locks of the run's root and of the round's dir (``common.locking``) for the whole round, so a second
pipeline on the same run fails at once naming this one's pid; its stages run under those locks and die
with it (``common.parent_death``), so a killed pipeline leaves no stage writing behind it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from common import parent_death
from common.cli import EXIT_OK, EXIT_REJECTED, exit_reason, one_line_errors
from common.config import ConfigError, RunConfig, dump_config, load_config, parse_config, write_config
from common.dtypes import torch_dtype
from common.files import json_text, named_errors, write_text_atomic
from common.locking import inherit_env, run_lock
from common.wheels import BUILTIN_TARGET, MissingWheelError, builtin_data_path, builtin_gguf
from drafter.sglang_checkpoint import CheckpointError, fingerprint
from eval.gate import promotions_held, read_history
from eval.report import decimals
from target_model.hf_model import target_text_config


class PipelineError(ValueError):
    """A round that cannot go on; the message says what to do."""


def preflight(cfg: RunConfig) -> None:
    """Fail early, with the command that fixes it, on what a newcomer meets first."""
    if cfg.regenerate.num_prompts is None:  # the config's default: every prompt, which leaves none for round 2
        raise ConfigError("regenerate.num_prompts: not set; the pipeline regenerates this many fresh prompts per "
                          "round: set it, e.g. --set regenerate.num_prompts=200")
    if cfg.target.name == BUILTIN_TARGET:
        builtin_gguf()
    for src in [*cfg.data.sources, *cfg.eval.datasets]:
        if src.path == "builtin":
            builtin_data_path(src.kind)
    hf = target_text_config(cfg.target)  # an unknown name is the one-line error every stage gives
    n = cfg.regenerate.num_prompts
    # Upper bound of one round's store (every sample at max_length; per token aux 3H + last hidden H,
    # rounded up to 5H) plus 1 GiB for checkpoints.
    itemsize = torch_dtype(cfg.capture.dtype).itemsize
    need = n * cfg.capture.max_length * 5 * hf.hidden_size * itemsize + (1 << 30)
    cfg.root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cfg.root).free
    if free < need:
        raise PipelineError(f"{cfg.root} has {free / 2**30:.1f} GiB free, this run needs about "
                            f"{need / 2**30:.1f} GiB; free space or point elsewhere: --set run_dir=/big/disk/run")


def next_round(root: Path) -> int:
    done = sorted(int(p.name.split("-")[1]) for p in root.glob("round-*") if (p / "ROUND_DONE").exists())
    return (done[-1] + 1) if done else 1


def slice_prompts(pool: Path, out: Path, start: int, count: int) -> int:
    """This round's fresh prompts: lines [start, start+count) of the ingested pool."""
    lines = pool.read_text().splitlines()[start:start + count]
    if not lines:
        raise PipelineError(f"{pool} has no prompts left for this round (used {start}); raise "
                            "data.sources[].limit or start over with `make clean-runs`")
    write_text_atomic(out, "\n".join(lines) + "\n")
    return len(lines)


def run_stage(cmd: list[str], log: Path, env: dict[str, str] | None = None, gate: bool = False) -> int:
    """A stage as its own CLI; stdout/stderr go to the terminal (progress bars) and the failure message
    names the log and the command to rerun. The stage dies with this process (``common.parent_death``);
    ``env`` is added to its environment. Exit 0 is success; 1 too for the ``gate`` (rejected or unresolved); anything
    else is an error, and so is a stage killed by a signal."""
    print(f"\n$ {' '.join(cmd)}", flush=True)
    start = time.time()
    with subprocess.Popen(cmd, env=os.environ | (env or {}), **parent_death.stage_kwargs()) as proc:
        rc = proc.wait()
    with named_errors(log), log.open("a") as f:
        f.write(json_text({"cmd": cmd, "rc": rc, "seconds": round(time.time() - start, 1)}) + "\n")
    if rc != EXIT_OK and not (gate and rc == EXIT_REJECTED):
        raise PipelineError(f"stage failed ({exit_reason(rc)}); fix the message above and rerun the same command "
                            f"(stages resume): {' '.join(cmd)}")
    return rc


def round_decision(history: Path, candidate: Path) -> dict | None:
    """The last decision a gate recorded for ``candidate``'s weights (its fingerprint; a checkpoint rejected
    unmeasured has none on record, and is matched by its path)."""
    path = str(candidate.resolve())
    try:
        fp = fingerprint(candidate)
    except (CheckpointError, OSError):  # not a readable drafter: only an unmeasured rejection can be its decision
        fp = None

    def decides(r: dict) -> bool:
        if r.get("decision") == "reconciled":
            return False
        return r["fingerprint"] == fp if r.get("fingerprint") else r.get("checkpoint") == path

    return next((r for r in reversed(read_history(history)) if decides(r)), None)


def settle_promotions(cfg: RunConfig) -> None:
    """Reconcile the history with ``promoted`` as a gate does first (``eval.gate.reconcile``): a kill between a
    promotion's record and its switch leaves the switch to complete before the next round picks its incumbent."""
    with promotions_held(cfg.gate.promoted_dir, cfg.gate.history_file, "pipeline"):
        pass


def verdict(rec: dict, round_no: int, eval_dir: Path) -> str:
    """A gate decision record, for people: τ* with its interval, then one line per dataset (τ, the paired
    difference to the incumbent and the gap to break-even, each with its interval, and why the verdict follows;
    α_k, a dash where none was measured), then any other reason."""
    lines = [f"## Round {round_no} verdict: {rec['decision'].upper()}", ""]
    intervals = rec.get("intervals") or {}
    star = next(iter(intervals.values()), {}).get("tau_star")
    if rec.get("tau_star") is not None:
        spread = (f", {100 * star['level']:g}% interval [{decimals(star['ci'][0])}, {decimals(star['ci'][1])}] from "
                  f"{star['prompts']} timing prompts" if star and star["prompts"] else "")
        lines.append(f"- break-even τ* = {rec['tau_star']:.3f}{spread} (timings: {rec.get('timings_source', '?')})")
    for name, iv in intervals.items():
        alphas = ", ".join(decimals(a, 2) for a in (rec.get("alpha") or {}).get(name) or [])
        lines.append(f"- {iv['line']}; α_k = [{alphas}]")
    shown = {iv["line"] for iv in intervals.values()}
    lines += [f"- why: {r}" for r in rec.get("reasons", []) if r not in shown]
    lines.append(f"- report: {eval_dir}")
    return "\n".join(lines)


def pick_incumbent(cfg: RunConfig, round_no: int) -> Path | None:
    """What ships, which a round warm-starts from and must beat: the promoted drafter (its immutable copy);
    before anything was promoted, the drafter the config starts from (``drafter.init_from``: the one serving
    now, e.g. the embedded default's shipped drafter); without one, the previous round's best, so every
    later round must improve on the last one."""
    promoted = Path(cfg.gate.promoted_dir)
    configured = Path(cfg.drafter.init_from) if cfg.drafter.init_from else None
    if configured is not None and not (configured / "config.json").is_file():
        raise PipelineError(f"drafter.init_from: {configured} is no drafter dir (no config.json in it); point it at "
                            "an SGLang-layout drafter, or set it to null to train from scratch")
    previous_best = cfg.root / f"round-{round_no - 1}" / "checkpoints" / "best"
    found = (p for p in (promoted, configured, previous_best) if p is not None and (p / "config.json").is_file())
    return next((p.resolve() for p in found), None)


@one_line_errors(MissingWheelError)
def run_round(config: str | Path, overrides: Sequence[str] = ()) -> int:
    """The next round of the run in ``config`` (``overrides``: ``key.sub=value``); a problem the user can
    fix is one line on stderr and exit code 2, a failed stage exits 2 with the command to rerun."""
    base = load_config(config, list(overrides))
    preflight(base)
    root = base.root
    with run_lock(root, "pipeline") as root_lock:
        round_no = next_round(root)
        round_dir = root / f"round-{round_no}"
        with run_lock(round_dir, "pipeline") as round_lock:
            return _round(config, overrides, base, round_no, round_dir, inherit_env([root_lock, round_lock]))


def round_config(base: RunConfig, round_no: int, round_dir: Path) -> tuple[Path, Path | None, bool]:
    """The round's config.yaml and its incumbent (which it warm-starts from and is gated against), and whether
    the file was already there. It is written once, when the round starts: a rerun keeps it, since picking again
    could pick what this round's own gate promoted."""
    path = round_dir / "config.yaml"
    if path.is_file():
        init_from = load_config(path).drafter.init_from
        return path, Path(init_from) if init_from else None, True
    incumbent = pick_incumbent(base, round_no)
    tree = dump_config(base)
    tree["run_dir"] = str(round_dir)
    if incumbent is not None:
        tree["drafter"]["init_from"] = str(incumbent)
    write_config(parse_config(tree, str(path)), path)
    return path, incumbent, False


def _gate(cfg: RunConfig, round_cfg: Path, incumbent: Path | None, log: Path, env: dict[str, str]) -> dict:
    """The decision on this round's best checkpoint: gated now, or, when its gate already recorded one, that
    one, with the promotions reconciled as the gate would have done."""
    best = cfg.checkpoints_dir / "best"
    history = Path(cfg.gate.history_file)
    rec = round_decision(history, best)
    if rec is not None:
        print(f"\nthe gate already decided on {best}: {rec['decision']} at {rec.get('time')} ({history}); not "
              "measured again")
        settle_promotions(cfg)
        return rec
    gate = [sys.executable, "-m", "eval", "gate", "--config", str(round_cfg), "--checkpoint", str(best), "--promote"]
    if incumbent is not None:
        gate += ["--incumbent", str(incumbent)]
    run_stage(gate, log, env, gate=True)
    rec = round_decision(history, best)
    if rec is None:
        raise PipelineError(f"{history}: the gate exited without recording a decision; rerun the same command")
    return rec


def _round(config: str | Path, overrides: Sequence[str], base: RunConfig, round_no: int, round_dir: Path,
           env: dict[str, str]) -> int:
    t0 = time.time()
    root, py = base.root, sys.executable
    round_cfg, incumbent, kept = round_config(base, round_no, round_dir)
    start = f"warm start from {incumbent}" if incumbent else "from scratch"
    print(f"round {round_no}: {start}; incumbent: {incumbent or 'none'}; config {round_cfg}"
          + (" (kept from the round's start: edit it to change this round's settings)" if kept else ""))
    log = round_dir / "stages.jsonl"

    pool = root / "prompts.jsonl"
    if not pool.is_file():
        sets = [arg for s in overrides for arg in ("--set", s)]
        run_stage([py, "-m", "data_prep", "ingest", "--config", str(config), *sets], log, env)
    cfg = load_config(round_cfg)
    n = cfg.regenerate.num_prompts
    slice_prompts(pool, cfg.prompts_path, (round_no - 1) * n, n)
    for step in ("regenerate", "capture"):
        run_stage([py, "-m", "data_prep", step, "--config", str(round_cfg)], log, env)
    run_stage([py, "-m", "train", "--config", str(round_cfg)], log, env)
    summary = verdict(_gate(cfg, round_cfg, incumbent, log, env), round_no, cfg.eval_dir)
    write_text_atomic(round_dir / "ROUND_DONE", f"{time.time() - t0:.0f} s\n")  # only after a recorded decision
    print("\n" + summary)
    print(f"\nround {round_no} took {time.time() - t0:.0f} s. Run the same command again for round {round_no + 1} "
          "(warm start from the incumbent, fresh prompts, gated against it).")
    return EXIT_OK
