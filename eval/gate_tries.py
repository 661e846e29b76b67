"""How many candidates have been gated against one incumbent on one set of prompts, and the level each try's intervals
are read at, so that shipping whichever candidate promotes keeps the error one gate promises.

Each try is another chance for a candidate that is no better than the incumbent to clear its intervals by luck:
gate c such candidates on the same prompts at 95 % each and the chance that one of them promotes grows towards
c × 2.5 %. So the gate reads try c at 1 - (1 - gate.confidence) / c (Bonferroni). It counts the distinct candidates
its history records against the same incumbent, on the same prompts, settings and target (a *family*, keyed by
``family_key``); a candidate gated again is the same try, and a promotion changes the incumbent, which starts a new
family. Records written without a family are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.config import RunConfig
from common.files import sha256_json
from eval.gate import read_history


@dataclass(frozen=True)
class Tries:
    """This try's family, the candidates gated in it before (their fingerprints) and the level of one try."""

    family: str
    earlier: tuple[str, ...]
    confidence: float

    @property
    def count(self) -> int:
        return len(self.earlier) + 1

    @property
    def level(self) -> float:
        return 1 - (1 - self.confidence) / self.count

    def record(self) -> dict:
        return {"family": self.family, "count": self.count, "level": self.level, "earlier": list(self.earlier)}

    def line(self, history_file: str | Path) -> str:
        if self.count == 1:
            return (f"tries: the first candidate against this incumbent on these prompts ({history_file}): "
                    f"{100 * self.level:.4g}% intervals")
        return (f"tries: candidate {self.count} against this incumbent on these prompts ({self.count - 1} earlier in "
                f"{history_file}): {100 * self.level:.4g}% intervals, 1 - {100 * (1 - self.confidence):g}%/"
                f"{self.count}, so that shipping whichever promotes stays within one gate's error")


def family_key(cfg: RunConfig, incumbent: str | None, mode: str) -> str:
    """What makes two tries comparable: the incumbent (its fingerprint, or None for break-even only), how they are
    measured (``mode``: hf or live), the target and the eval prompts and settings."""
    key = {"incumbent": incumbent, "mode": mode, "target": cfg.target.name, "dtype": cfg.target.dtype,
           "datasets": [d.model_dump(mode="json") for d in cfg.eval.datasets], "gate_datasets": cfg.gate.datasets,
           "num_steps": cfg.eval.num_steps, "temperature": cfg.eval.temperature,
           "max_new_tokens": cfg.eval.max_new_tokens}
    return sha256_json(key)[:16]


def tries(cfg: RunConfig, candidate: str, incumbent: str | None, mode: str) -> Tries:
    """This try of ``candidate`` (a fingerprint) against ``incumbent``: the distinct other candidates the history
    records in the same family."""
    family = family_key(cfg, incumbent, mode)
    earlier = dict.fromkeys(r["fingerprint"] for r in read_history(cfg.gate.history_file)
                            if (r.get("tries") or {}).get("family") == family and r.get("fingerprint")
                            and r["fingerprint"] != candidate)
    return Tries(family, tuple(earlier), cfg.gate.confidence)


def at_level(cfg: RunConfig, level: float) -> RunConfig:
    """The config whose gate reads every interval at ``level``."""
    return cfg.model_copy(update={"gate": cfg.gate.model_copy(update={"confidence": level})})
