"""The ship/no-ship decision (``decide``, pure) and what follows it: atomic promotion and the history.

A candidate ships iff, on every gate dataset, tau > tau* (1 + margin) — speculation must beat plain decoding — and
tau > incumbent tau + min_delta — it must beat what is serving now, each comparison read through its bootstrap
interval (``eval.intervals``: the candidate and the incumbent paired prompt by prompt, tau* from its timing
prompts): the lower end must lie above the bar. A rejection calls a loss real, so it reads the upper ends
family-wise (Bonferroni: each at level 1 - (1 - level) / m over all m comparisons), so that some loss among m is
called real no more often than one in a single comparison; an interval that holds a bar is **unresolved**, a third
verdict: nothing is promoted, the exit code is 1 as for a rejection, and the reason names the comparison and about
how many prompts would resolve it. A checkpoint SGLang would serve wrongly (``check_checkpoint``: config, dtypes,
vocab map) or a T=0 output that differs from the target's own greedy output is rejected whatever its tau.

Promotion layout: ``promoted`` is a symlink to ``promotions/<fingerprint[:16]>/`` beside it, an immutable
copy of the servable files. The decision record is appended (fsynced) before the link is switched by one
rename, and ``reconcile`` makes the two agree after a kill (docs/gate-and-promotion.md, "Promotion").
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from common.files import (
    append_jsonl,
    copy_file_durable,
    cut_torn_tail,
    exchange,
    fsync_dir,
    remove_temps,
    replace_symlink,
    temp_path,
)
from common.locking import run_lock
from drafter.sglang_checkpoint import CheckpointError, fingerprint
from eval.intervals import RESOLVE_CAP, RESOLVE_POWER, Estimate, Interval, prompts_to_resolve
from eval.report import ci_text

SERVABLE_SKIP = ("training_state",)  # resume state stays with the run; SGLang needs the rest
PROMOTIONS = "promotions"
FP_CHARS = 16  # fingerprint characters in a promotions/ directory name
SERVING = ("promoted", "reconciled")  # decisions that say what promoted/ serves


@dataclass(frozen=True)
class Evidence:
    """What the gate reads for one dataset, every figure with its interval (``eval.intervals``): tau, tau*, the gap
    tau - tau* (1 + margin) (its bar is 0) and, given an incumbent measured on the same prompts, its tau and the
    paired difference tau - incumbent tau (its bar is min_delta). ``gap`` and ``difference``: the two comparisons'
    estimates, from which ``decide`` reads their upper ends at the family-wise level. ``influential``: the prompts
    the paired difference leans on most (``eval.gate_stats.influential_prompts``), for the record, not the decision."""

    tau: Interval
    tau_star: Interval
    vs_breakeven: Interval
    incumbent_tau: Interval | None = None
    vs_incumbent: Interval | None = None
    gap: Estimate | None = field(default=None, repr=False, compare=False)
    difference: Estimate | None = field(default=None, repr=False, compare=False)
    influential: list[dict] = field(default_factory=list, repr=False, compare=False)

    @property
    def comparisons(self) -> int:
        return 1 + (self.vs_incumbent is not None)


@dataclass
class Decision:
    """``verdict``: promote, reject or unresolved; ``lines``: one per dataset, its intervals and why the verdict
    follows; ``reasons``: every problem and every line, for the history and the report."""

    verdict: str
    reasons: list[str] = field(default_factory=list)
    lines: dict[str, str] = field(default_factory=dict)

    @property
    def promote(self) -> bool:
        return self.verdict == "promote"


@dataclass(frozen=True)
class Family:
    """How the reject side is read: ``m`` comparisons in the decision, each upper end at ``level`` = 1 - (1 -
    confidence) / m (Bonferroni; the confidence itself when m is 1)."""

    m: int
    level: float

    @classmethod
    def of(cls, m: int, confidence: float) -> Family:
        return cls(max(m, 1), 1 - (1 - confidence) / max(m, 1))

    def high(self, iv: Interval, estimate: Estimate | None) -> float:
        """The comparison's upper end at the family level (its own when m is 1 or no estimate came with it)."""
        if self.m == 1 or estimate is None or not math.isfinite(iv.high):
            return iv.high
        return estimate.interval(self.level).high


def _status(iv: Interval, bar: float, family_high: float) -> str:
    """pass: the whole interval lies above the bar; fail: its family-wise upper end (``Family.high``) is below it
    (or nothing was measured); unresolved: otherwise, a tie on the bar included, or no interval (under 2 prompts)."""
    if not math.isfinite(iv.point):
        return "fail"
    if not (math.isfinite(iv.low) and math.isfinite(iv.high)):
        return "unresolved"
    return "pass" if iv.low > bar else "fail" if family_high < bar else "unresolved"


def _ci(iv: Interval, signed: bool = False) -> str:
    """``1.234 [1.100, 1.400]``; a bound that is not finite (no interval) as a dash."""
    return f"{iv.point:{'+' if signed else ''}.3f} {ci_text((iv.low, iv.high), signed=signed)}"


def _outcome(status: str, iv: Interval, bar: float, bar_name: str, family: Family, family_high: float,
             timing_prompts: int = 0) -> str:
    """What the interval says against its bar, and for an unresolved one about how many prompts would settle it."""
    if not math.isfinite(iv.point):
        return "not measured (no verify cycle): a failure"
    if status == "pass":
        return f"clears {bar_name}"
    wide = f"the {100 * family.level:.4g}% level {m_comparisons(family.m)} call for"
    if status == "fail":
        return f"is below {bar_name} (a real loss)" + (f" at {wide}" if family.m > 1 else "")
    if not (math.isfinite(iv.low) and math.isfinite(iv.high)):
        return f"unresolved: fewer than 2 prompts{' or timing prompts' if timing_prompts else ''} give no interval"
    if iv.high < bar:
        return (f"lies below {bar_name} on its own, but not at {wide} (upper end {family_high:+.3f}): "
                "unresolved, not a real loss")
    need = prompts_to_resolve(iv, bar)
    if need:
        more = (f"about {need} prompts in all" + (f" (and {math.ceil(timing_prompts * need / iv.prompts)} timing "
                                                 "prompts)" if timing_prompts else "")
                + f" would resolve the observed difference {RESOLVE_POWER:.0%} of the time")
    elif iv.point == bar:
        more = "no number of prompts resolves a zero difference"
    else:
        more = f"not even {RESOLVE_CAP}x these prompts would resolve so small a difference: a tie"
    return f"holds {bar_name}: unresolved, {more}"


def m_comparisons(m: int) -> str:
    return f"{m} comparisons" if m > 1 else "1 comparison"


def dataset_line(name: str, e: Evidence, margin: float, min_delta: float, family: Family) -> tuple[str, str]:
    """(status, one line for people): tau, each comparison with its interval, and its outcome."""
    be_high = family.high(e.vs_breakeven, e.gap)
    be = _status(e.vs_breakeven, 0.0, be_high)
    parts = [f"tau {_ci(e.tau)}"]
    statuses = [be]
    if e.vs_incumbent is not None:
        inc_high = family.high(e.vs_incumbent, e.difference)
        inc = _status(e.vs_incumbent, min_delta, inc_high)
        statuses.append(inc)
        outcome = _outcome(inc, e.vs_incumbent, min_delta, f"min_delta {min_delta:g}", family, inc_high)
        parts.append(f"vs incumbent {_ci(e.incumbent_tau) if e.incumbent_tau else '?'}: difference "
                     f"{_ci(e.vs_incumbent, True)} {outcome}")
    tau_star = (_ci(e.tau_star) + f" ({e.tau_star.prompts} timing prompts)" if e.tau_star.prompts
                else f"{e.tau_star.point:.3f} (given timings)")
    parts.append(f"vs break-even tau* {tau_star} x (1 + {margin:g}): gap {_ci(e.vs_breakeven, True)} "
                 + _outcome(be, e.vs_breakeven, 0.0, "0", family, be_high, e.tau_star.prompts))
    status = "fail" if "fail" in statuses else "unresolved" if "unresolved" in statuses else "pass"
    head = f"{name}: {status.upper()} ({e.tau.prompts} prompts, {100 * e.tau.level:g}% intervals)"
    return status, f"{head}: " + "; ".join(parts)


def decide(evidence: Mapping[str, Evidence], margin: float, min_delta: float = 0.0,
           checkpoint_problems: Sequence[str] = (), lossless_mismatches: Sequence[str] = (),
           comparisons: int | None = None) -> Decision:
    """Promote when, on every dataset, every interval's lower end lies above its bar (break-even: tau - tau*
    (1 + margin) > 0; the incumbent: tau - incumbent tau > min_delta); reject on a checkpoint or lossless problem, or
    when a comparison's upper end, read at the family-wise level of all ``comparisons`` in the decision (default:
    those in ``evidence``; the live gate counts every concurrency's), is below its bar (a real loss); otherwise
    unresolved: what serves now keeps serving, and each line says which comparison is unresolved and about how many
    prompts would resolve it. Every check is run and explained, so the reasons list every cause at once.

    Promotion needs no such correction: every lower end must clear at once, so a drafter that truly misses one bar
    is promoted only if that one interval errs, which it does at most (1 - level) / 2 of the time."""
    reasons = [f"checkpoint: {p}" for p in checkpoint_problems]
    reasons += [f"lossless: {m}" for m in lossless_mismatches]
    if not evidence:
        reasons.append("no gate dataset was measured")
    failed = bool(reasons)
    lines, statuses = {}, []
    level = next((e.tau.level for e in evidence.values()), 0.95)
    family = Family.of(comparisons or sum(e.comparisons for e in evidence.values()), level)
    for name, e in evidence.items():
        status, lines[name] = dataset_line(name, e, margin, min_delta, family)
        statuses.append(status)
    verdict = ("reject" if failed or "fail" in statuses else "unresolved" if "unresolved" in statuses
               else "promote")
    reasons += lines.values()
    if verdict == "unresolved":
        reasons.append("unresolved: nothing promoted, what serves now keeps serving; each unresolved line says about "
                       "how many prompts would resolve it (eval.datasets[].limit)")
    return Decision(verdict, reasons, lines)


class GateError(ValueError):
    """Promotion state the gate cannot use as is; the message says what to do."""


def promotions_dir(promoted_dir: str | Path) -> Path:
    """Where the immutable promoted copies live: ``promotions/`` beside the ``promoted`` link."""
    return Path(promoted_dir).parent / PROMOTIONS


def promotion_path(promoted_dir: str | Path, fp: str) -> Path:
    """The immutable copy a drafter of fingerprint ``fp`` is served from once promoted."""
    return promotions_dir(promoted_dir) / fp[:FP_CHARS]


@contextmanager
def promotions_held(promoted_dir: str | Path, history_file: str | Path, what: str) -> Iterator[None]:
    """Hold the promotions lock (``promotions/.lock``) for a whole gate, HF or live, and ``reconcile`` first:
    the incumbent stays the incumbent until the decision is recorded, and no second gate promotes in between."""
    with run_lock(promotions_dir(promoted_dir), what):
        for note in reconcile(promoted_dir, history_file):
            print(f"note: {note}")
        yield


def read_history(path: str | Path) -> list[dict]:
    """The decision records, oldest first; a torn last line (a kill mid-append) is left out."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:  # no newline after it: torn by a kill; the next append cuts it off
                continue
            raise GateError(f"{path}:{i + 1}: not a JSON record; the history is damaged: fix or move that line "
                            "away, then rerun") from None
    return records


def serving_record(history_file: str | Path) -> dict | None:
    """The last record that says which drafter ``promoted`` serves."""
    return next((r for r in reversed(read_history(history_file)) if r.get("decision") in SERVING), None)


def already_serving(history_file: str | Path, fp: str) -> dict | None:
    """The serving record when the drafter of fingerprint ``fp`` is what ``promoted`` serves (a gate rerun after a
    kill that came after its promotion); else None."""
    serving = serving_record(history_file)
    return serving if serving is not None and serving.get("fingerprint") == fp else None


def serving_id(promoted_dir: str | Path) -> str | None:
    """Short fingerprint (``FP_CHARS``) of the drafter at ``promoted_dir``; None when nothing is there. Read
    from the link for our own layout, hashed for a real directory (not this tool's link) or a foreign link."""
    path = Path(promoted_dir)
    if path.is_symlink():
        target = Path(os.readlink(path))
        if not target.is_absolute() and target.parent == Path(PROMOTIONS) and (path.parent / target).is_dir():
            return target.name
    if not path.is_dir():
        return None
    try:
        return fingerprint(path)[:FP_CHARS]
    except (CheckpointError, OSError) as e:
        raise GateError(f"{path}: holds no readable drafter ({e}); move it away, then rerun") from None


def _build(checkpoint: Path, dst: Path) -> None:
    """The immutable copy: servable files copied and fsynced into a temp dir, renamed into place whole."""
    tmp = temp_path(dst)
    os.mkdir(tmp)
    dirs = [tmp]
    for src in sorted(checkpoint.rglob("*")):
        rel = src.relative_to(checkpoint)
        if rel.parts[0] in SERVABLE_SKIP:
            continue
        if src.is_dir():
            os.mkdir(tmp / rel)
            dirs.append(tmp / rel)
        else:
            copy_file_durable(src, tmp / rel)
            os.chmod(tmp / rel, 0o444)
    for d in dirs:
        fsync_dir(d)
    os.rename(tmp, dst)
    fsync_dir(dst.parent)


def _switch(promoted: Path, name: str) -> None:
    """Point ``promoted`` at ``promotions/<name>`` in one step. A real directory there (not this tool's
    link) is exchanged with the new link atomically where the kernel can (renameat2); elsewhere it is renamed
    away first, and a kill between the two renames leaves the history to ``reconcile`` from."""
    target = f"{PROMOTIONS}/{name}"
    if promoted.is_symlink() or not promoted.exists():
        replace_symlink(promoted, target)
        return
    link = temp_path(promoted)
    link.unlink(missing_ok=True)
    os.symlink(target, link)
    if exchange(link, promoted):  # the old directory now sits at the link's temp name
        fsync_dir(promoted.parent)
        remove_temps(promoted.parent, of=promoted.name)
        return
    os.rename(promoted, temp_path(promoted, tag="old"))
    os.replace(link, promoted)
    fsync_dir(promoted.parent)
    remove_temps(promoted.parent, of=promoted.name)


def reconcile(promoted_dir: str | Path, history_file: str | Path) -> list[str]:
    """Make the history and ``promoted`` agree after a kill or a hand edit, and clear the temps of killed
    promotions; returns notes for the report. Call it holding the promotions lock, before deciding.

    - the last serving record names a drafter that ``promoted`` does not serve yet, while it still serves
      the one the record replaced (or nothing): the switch was interrupted, so it is completed;
    - ``promoted`` serves something no record names (a real directory, not this tool's link; a change by hand): a
      "reconciled" record says so, and that drafter is the incumbent from now on.
    """
    promoted, store = Path(promoted_dir), promotions_dir(promoted_dir)
    remove_temps(store)
    remove_temps(promoted.parent, of=promoted.name)
    record = serving_record(history_file)
    want = record["fingerprint"][:FP_CHARS] if record and record.get("fingerprint") else None
    current = serving_id(promoted)
    if want == current:
        return []
    previous = (record or {}).get("previous")
    if want is not None and (store / want).is_dir() and current in (None, previous):
        _switch(promoted, want)
        return [f"completed the promotion of {want} recorded at {record.get('time')} (it was interrupted)"]
    fp = fingerprint(promoted) if current is not None else None
    why = (f"{promoted} serves {current}, which no promotion record names (promoted outside this tool, or "
           "changed by hand); recorded as serving" if current is not None else
           f"{promoted} is empty, and {store / str(want)} is gone; recorded as serving nothing")
    append_history(history_file, {"decision": "reconciled", "fingerprint": fp, "reasons": [why],
                                  "checkpoint": str(promoted.resolve()) if current is not None else None})
    return [why]


def promote(checkpoint: str | Path, fp: str, promoted_dir: str | Path, history_file: str | Path,
            record: dict) -> Path:
    """Ship ``checkpoint`` (fingerprint ``fp``): its servable files become the immutable
    ``promotions/<fp[:16]>/``, the decision ``record`` is appended and fsynced, and only then ``promoted``
    is switched to it with one rename. A kill at any point leaves ``promoted`` serving the old drafter or
    the new one, and ``reconcile`` finishes the job. Call it holding the promotions lock, after
    ``reconcile``; returns the immutable directory."""
    src, promoted = Path(checkpoint), Path(promoted_dir)
    dst = promotion_path(promoted, fp)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.is_dir():
        _build(src, dst)
    previous = serving_id(promoted)
    if previous is not None and not promoted.is_symlink() and not (dst.parent / previous).is_dir():
        _build(promoted, dst.parent / previous)  # keep a real directory's copy, so a rollback can find it
    append_history(history_file, record | {"decision": "promoted", "fingerprint": fp, "previous": previous,
                                           "promoted_path": str(dst)})
    _switch(promoted, dst.name)
    return dst


def record_decision(checkpoint: str | Path, record: dict, promoted_dir: str | Path, history_file: str | Path) -> None:
    """Append a gate's decision ``record`` to the history; a "promoted" one through ``promote``, so the record is
    on disk before ``promoted`` switches. Call it holding the promotions lock, after the report is saved."""
    if record["decision"] == "promoted":
        promote(checkpoint, record["fingerprint"], promoted_dir, history_file, record)
    else:
        append_history(history_file, record)


def append_history(path: str | Path, record: dict) -> None:
    """One whole JSON line per decision, on disk before returning (a torn tail of a killed append is cut
    off first, so it cannot swallow this record)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    cut_torn_tail(path)
    with open(path, "ab") as f:
        append_jsonl(f, {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **record}, sort_keys=True)
    if new:
        fsync_dir(path.parent)
