"""train/holdout_curve.py: the held-out points come from the log in step order, the PNG is drawn, and a damaged
or curve-less log is one line naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from train.holdout_curve import holdout_points, main, plot_holdout_curve, read_train_log

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_log(run_dir: Path, lines: list[str]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "train_log.jsonl").write_text("".join(line + "\n" for line in lines))


def step(n: int, seen: int) -> str:
    return json.dumps({"step": n, "loss": 1.0, "tokens_seen": seen})


def held(n: int, accept: float, acc0: float) -> str:
    return json.dumps({"step": n, "holdout/accept_length": accept, "holdout/acc_0": acc0})


def test_points_carry_the_tokens_seen_by_their_step_and_the_png_is_drawn(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_log(run, [step(1, 100), step(2, 200), held(2, 3.5, 0.7), "", step(3, 300), step(4, 400), held(4, 4.25, 0.8)])
    points = holdout_points(read_train_log(run))
    assert points == [{"step": 2, "tokens_seen": 200, "accept_length": 3.5, "acc_0": 0.7},
                      {"step": 4, "tokens_seen": 400, "accept_length": 4.25, "acc_0": 0.8}]
    png = plot_holdout_curve(run)
    assert png == run / "holdout_curve.png" and png.read_bytes()[:8] == PNG_MAGIC
    assert not list(run.glob("*.part*")), "the atomic write left its temporary file"


def test_a_damaged_line_names_the_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    write_log(run, [step(1, 100), '{"step": 2, "loss"', held(2, 3.0, 0.5)])
    assert main([str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and f"{run / 'train_log.jsonl'}:2: not JSON" in err and "\n" not in err


def test_a_log_without_held_out_evals_says_why_and_draws_nothing(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    write_log(run, [step(1, 100), step(2, 200)])
    assert main([str(run), "--out", str(tmp_path / "x.png")]) == 2
    assert "no held-out eval in the log" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_the_cli_draws_where_it_is_told(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    write_log(run, [step(1, 100), held(1, 2.0, 0.4)])
    out = tmp_path / "plots" / "curve.png"
    assert main([str(run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out) and out.read_bytes()[:8] == PNG_MAGIC


def test_a_resumed_log_drops_the_steps_past_the_checkpoint_and_a_torn_last_line(tmp_path: Path) -> None:
    from train.loop import JsonlLog

    run = tmp_path / "run"
    write_log(run, [step(1, 10), step(2, 20), step(3, 30)])
    with open(run / "train_log.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # a kill in the middle of an append

    JsonlLog(run / "train_log.jsonl", enabled=True, resume_step=2).write({"step": 3, "loss": 0.5})

    assert [(r["step"], r["loss"]) for r in read_train_log(run)] == [(1, 1.0), (2, 1.0), (3, 0.5)]
