"""bench/peer_quality.py's record: our tau minus each peer row's, with a paired interval over the same prompts;
the per-prompt columns stay in the rows' own files."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import eval.quality as eval_quality
from bench import peer_quality
from bench.peer_quality import TRAINED, ours_minus, without_columns
from bench.peer_specforge import loss_tenths
from common.config import GateConfig
from eval.intervals import Bootstrap

BOOT = Bootstrap(level=0.95, samples=2000, seed=0)


def row(tokens: list[float], cycles: list[float]) -> dict:
    return {"training": {"tokens_seen": 100},
            "mtbench": {"tau": sum(tokens) / sum(cycles), "per_prompt": {"tokens": tokens, "cycles": cycles}}}


def test_a_drafter_ahead_on_every_prompt_clears_zero_and_a_tie_straddles_it() -> None:
    cycles = [10.0, 20.0, 15.0, 30.0, 12.0, 18.0, 25.0, 9.0]
    hard = [1.5, 3.0, 2.0, 4.0, 1.2, 2.5, 3.5, 1.0]  # prompt difficulty both drafters share
    ours = row([c * (h + 0.2) for c, h in zip(cycles, hard, strict=True)], cycles)
    ahead = row([c * h for c, h in zip(cycles, hard, strict=True)], cycles)
    mixed = row([c * (h + (0.3 if i % 2 else 0.1)) for i, (c, h) in enumerate(zip(cycles, hard, strict=True))],
                cycles)

    got = ours_minus({"ours": ours, "specforge": ahead, "specforge_shipped": mixed}, BOOT)

    better = got["specforge"]["mtbench"]
    assert better["point"] == pytest.approx(0.2) and 0 < better["ci"][0] <= 0.2 <= better["ci"][1]
    tie = got["specforge_shipped"]["mtbench"]
    assert tie["ci"][0] < 0 < tie["ci"][1] and tie["prompts"] == 8


def test_a_row_without_columns_has_no_difference_and_columns_leave_the_record() -> None:
    ours = row([3.0, 4.0], [1.0, 2.0])
    old = {"training": {"tokens_seen": 100}, "mtbench": {"tau": 2.0}}  # a row without per-prompt columns

    assert ours_minus({"ours": ours, "specforge": old}, BOOT) == {}
    assert without_columns(ours)["mtbench"] == {"tau": ours["mtbench"]["tau"]}


def test_each_row_is_measured_before_the_next_trains_and_a_measured_row_is_not_trained_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call cut while the second row trains keeps the first row's figures; a row measured elsewhere (its file
    carried into --out) is read, not trained or measured again. The training processes and the measuring are
    stood in for; the order and the files are what is checked."""
    events: list[str] = []
    out = tmp_path / "peer"
    out.mkdir()
    carried = {"checkpoint": "elsewhere", "training": {"tokens_seen": 100}, "mtbench": {"tau": 1.5}}
    (out / "row-specforge_shipped.json").write_text(json.dumps(carried))

    def train_process(cmd: list[str], log: Path) -> None:  # the row's training process: its TRAINED file
        name = log.parent.name
        events.append(f"train {name}")
        if name != "ours":  # ours' is written by train_row from its checkpoints
            (log.parent / TRAINED).write_text(json.dumps({"checkpoint": f"ckpt-{name}", "tokens_seen": 100}))

    def quality(cfg, target, prompts, ckpt, settings, timing, **kw) -> dict:
        events.append(f"measure {ckpt}")
        return {"mtbench": {"tau": 1.7, "ci": [1.6, 1.8], "alpha": [0.4], "prompts": 2, "lossless_mismatches": 0,
                            "per_prompt": {"tokens": [3.0, 4.0], "cycles": [2.0, 2.0]}}}

    def setup(config, limit) -> tuple:
        events.append("load target")
        return SimpleNamespace(gate=GateConfig()), object(), {"mtbench": []}

    recorded: list[dict] = []
    monkeypatch.setattr(peer_quality, "row_config", lambda args, name: (out / name).mkdir() or out / name / "c.yaml")
    monkeypatch.setattr(peer_quality, "run", train_process)
    monkeypatch.setattr(peer_quality, "ours_trained", lambda row_dir: {"checkpoint": "ckpt-ours", "tokens_seen": 100})
    monkeypatch.setattr(eval_quality, "quality", quality)
    monkeypatch.setattr(eval_quality, "setup", setup)
    monkeypatch.setattr(peer_quality, "record", lambda name, obj: recorded.append(obj))
    monkeypatch.setattr(sys, "argv", ["peer_quality.py", "--config", "c.yaml", "--conversations", "x.jsonl",
                                      "--out", str(out)])

    assert peer_quality.main() == 0
    assert events == ["train ours", "load target", "measure ckpt-ours", "train specforge", "measure ckpt-specforge"]
    assert recorded[0]["rows_pending"] == ["specforge", "specforge_shipped"]  # what a cut call would have kept
    assert recorded[-1]["rows_pending"] == [] and recorded[-1]["specforge_shipped"]["mtbench"]["tau"] == 1.5
    ours = json.loads((out / "row-ours.json").read_text())
    assert ours["mtbench"]["per_prompt"]["tokens"] == [3.0, 4.0] and {"device", "date"} <= ours.keys()


def test_a_row_reports_the_mean_loss_of_its_first_and_last_tenth_not_one_noisy_step() -> None:
    swings = [27.0, 6.0] * 10 + [5.0, 3.0] * 10  # 40 steps: tenths of 4; single steps swing with their batch
    assert loss_tenths(swings) == {"loss_first_tenth": 16.5, "loss_last_tenth": 4.0}
    assert loss_tenths([2.0, 1.0]) == {"loss_first_tenth": 2.0, "loss_last_tenth": 1.0}  # fewer than 10: one step
    assert loss_tenths([]) == {"loss_first_tenth": None, "loss_last_tenth": None}
