"""A kill after a checkpoint's rename, before its best update or pruning finished: the rerun of the same command
finishes them (``run_checkpoints.finish_save``), so ``best`` exists and names the best evaluated step, and a
half-deleted checkpoint is a temp that the rerun removes."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
from train_fixtures import make_config, make_store

from train import run_checkpoints
from train.loop import best_line, run

TRAIN = dict(epochs=10, grad_accum=1, batch_tokens=60, log_every=1)


class Killed(BaseException):
    """Stands for SIGKILL: nothing in the trainer catches it, and nothing after it runs."""


def _kill_at_first_best_update(monkeypatch: pytest.MonkeyPatch) -> None:
    def killed(*args: object, **kwargs: object) -> bool:
        raise Killed

    monkeypatch.setattr(run_checkpoints, "update_best", killed)


def _spy_best_updates(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    steps: list[int] = []
    real = run_checkpoints.update_best

    def spy(root: Path, ckpt: Path, step: int, metric: str, value: float | None) -> bool:
        steps.append(step)
        return real(root, ckpt, step, metric, value)

    monkeypatch.setattr(run_checkpoints, "update_best", spy)
    return steps


def _holdout(root: Path) -> dict[int, float]:
    lines = (root / "run" / "train_log.jsonl").read_text().splitlines()
    return {r["step"]: r["holdout/accept_length"] for r in map(json.loads, lines) if "holdout/accept_length" in r}


def _assert_best_consistent(ckpts: Path) -> dict:
    record = json.loads((ckpts / "best.json").read_text())
    assert (ckpts / "best").is_symlink() and (ckpts / "best").exists()
    assert (ckpts / "best").resolve().name == record["checkpoint"] == f"step-{record['step']:06d}"
    trainer = run_checkpoints.read_trainer_state(ckpts / "best")
    assert trainer["position"]["step"] == record["step"]
    assert trainer["candidate"] == {"metric": record["metric"], "value": record["value"]}
    return record


def test_kill_before_the_only_best_update_then_rerun_makes_best(tmp_path, monkeypatch, capsys):
    cfg = make_config(tmp_path, max_steps=2, save_every=2, eval_every=2, **TRAIN)
    make_store(tmp_path / "run" / "store", n_samples=20, length=16)
    ckpts = tmp_path / "run" / "checkpoints"
    _kill_at_first_best_update(monkeypatch)
    with pytest.raises(Killed):
        run(cfg)
    assert (ckpts / "step-000002" / "training_state" / "trainer.json").is_file()
    assert not (ckpts / "best").exists() and not (ckpts / "best.json").exists()

    monkeypatch.undo()
    capsys.readouterr()
    assert run(cfg) == 0
    out = capsys.readouterr().out
    assert "drafter: resume from" in out and "done: 2 steps" in out, out
    record = _assert_best_consistent(ckpts)
    assert record["step"] == 2 and record["metric"] == "holdout/accept_length"
    assert record["value"] == _holdout(tmp_path)[2]
    assert f"(best: {ckpts / 'best'})" in out, out


def test_kill_at_an_earlier_save_then_rerun_lets_it_compete_for_best(tmp_path, monkeypatch):
    cfg = make_config(tmp_path, max_steps=4, save_every=2, eval_every=2, keep_last=1, **TRAIN)
    make_store(tmp_path / "run" / "store", n_samples=20, length=16)
    ckpts = tmp_path / "run" / "checkpoints"
    _kill_at_first_best_update(monkeypatch)
    with pytest.raises(Killed):
        run(cfg)
    assert run_checkpoints.latest(ckpts) == ckpts / "step-000002" and not (ckpts / "best.json").exists()

    monkeypatch.undo()
    considered = _spy_best_updates(monkeypatch)
    assert run(cfg) == 0
    assert considered == [2, 4]  # the resumed step-2 first, before step 4 is trained
    held = _holdout(tmp_path)
    record = _assert_best_consistent(ckpts)
    assert record["value"] == max(held[2], held[4])
    assert record["step"] == max((2, 4), key=lambda s: held[s])
    assert {p.name for p in ckpts.iterdir()} == {"best", "best.json", "step-000004", record["checkpoint"]}


def test_kill_while_pruning_leaves_a_temp_the_rerun_removes(tmp_path, monkeypatch):
    # no held-out split: the newest checkpoint is the best, so the step-4 save prunes step-2
    cfg = make_config(tmp_path, max_steps=4, save_every=2, holdout_fraction=0.0, keep_last=1, **TRAIN)
    make_store(tmp_path / "run" / "store", n_samples=20, length=16)
    ckpts = tmp_path / "run" / "checkpoints"

    def half_rmtree(path: Path, *args: object, **kwargs: object) -> None:
        (Path(path) / "training_state" / "trainer.json").unlink()
        (Path(path) / "model.safetensors").unlink()
        raise Killed

    monkeypatch.setattr(run_checkpoints, "shutil", types.SimpleNamespace(rmtree=half_rmtree))
    with pytest.raises(Killed):
        run(cfg)
    assert (ckpts / "step-000004" / "training_state" / "trainer.json").is_file()

    monkeypatch.undo()
    assert run(cfg) == 0
    assert {p.name for p in ckpts.iterdir()} == {"best", "best.json", "step-000004"}
    record = _assert_best_consistent(ckpts)
    assert record["step"] == 4 and record["value"] is None


def test_a_trainer_json_without_candidate_reads_its_claim_from_metrics():
    metric = run_checkpoints.HOLDOUT_METRIC
    assert run_checkpoints.recorded_candidate({"metrics": {metric: 2.5}}) == {"metric": metric, "value": 2.5}
    assert run_checkpoints.recorded_candidate({"metrics": {}}) is None
    assert run_checkpoints.recorded_candidate({"candidate": None, "metrics": {metric: 2.5}}) is None


def test_the_done_line_names_best_only_when_it_exists(tmp_path):
    assert "no best checkpoint" in best_line(tmp_path)
    (tmp_path / "step-000001").mkdir()
    (tmp_path / "best").symlink_to("step-000001")
    assert best_line(tmp_path) == f"best: {tmp_path / 'best'}"
