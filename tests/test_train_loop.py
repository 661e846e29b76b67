"""Training end to end on tiny random-target stores: it learns, saves servable checkpoints, keeps the
best, and handles non-finite losses."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

from accelerate import Accelerator
from train_fixtures import make_config, make_store

from drafter.sglang_checkpoint import check_checkpoint
from train.loop import run
from train.module import TTTModel


def _log(root: Path) -> list[dict]:
    return [json.loads(x) for x in (root / "run" / "train_log.jsonl").read_text().splitlines()]


def test_training_learns_and_saves_servable_checkpoints(tmp_path):
    cfg = make_config(tmp_path, epochs=8, lr=1e-2, ttt_length=2, save_every=20, eval_every=20, keep_last=1,
                      log_every=1)
    make_store(tmp_path / "run" / "store", n_samples=48, length=20)
    assert run(cfg) == 0
    log = _log(tmp_path)
    train_acc = [r["train/acc_0"] for r in log if "train/acc_0" in r]
    held = [r for r in log if "holdout/acc_0" in r]
    losses = [r["loss"] for r in log if "loss" in r]
    assert train_acc[0] < 0.2, train_acc
    assert held[-1]["holdout/acc_0"] > 0.6, held[-1]
    assert held[-1]["holdout/accept_length"] > held[0]["holdout/accept_length"]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])
    ckpts = tmp_path / "run" / "checkpoints"
    steps = sorted(p.name for p in ckpts.glob("step-*"))
    assert steps[-1] == f"step-{log[-1]['step']:06d}"
    best = json.loads((ckpts / "best.json").read_text())
    assert best["metric"] == "holdout/accept_length"
    assert (ckpts / "best").resolve().name == best["checkpoint"]
    assert len(steps) <= 2  # keep_last 1, plus the best when it is older
    for d in [ckpts / s for s in steps] + [ckpts / "best"]:
        assert check_checkpoint(d) == [], d
        assert (d / "run_config.json").is_file()


def test_the_model_is_freed_before_the_process_group_ends(tmp_path, monkeypatch):
    """Under DDP the wrapper's reducer holds the process group; one that outlives the group's end is torn down
    after it, when a peer may have exited, and can block its rank there. So none may be alive at end_training."""
    alive: list[int] = []
    end_training = Accelerator.end_training

    def counting(self: Accelerator) -> None:
        gc.collect()
        alive.append(sum(isinstance(o, TTTModel) for o in gc.get_objects()))
        end_training(self)

    monkeypatch.setattr(Accelerator, "end_training", counting)
    cfg = make_config(tmp_path, epochs=1, ttt_length=2)
    make_store(tmp_path / "run" / "store", n_samples=8, length=12)
    assert run(cfg) == 0
    assert alive == [0]


def test_nonfinite_steps_are_skipped_then_abort(tmp_path, capsys):
    cfg = make_config(tmp_path, max_steps=6, holdout_fraction=0.0, batch_tokens=20, max_nonfinite_in_row=50)
    make_store(tmp_path / "run" / "store", n_samples=12, length=20, nonfinite_samples=2)
    assert run(cfg) == 0
    log = [r for r in _log(tmp_path) if "loss" in r]
    skipped = [r for r in log if r["skipped_nonfinite"]]
    assert 0 < len(skipped) < len(log)
    assert all(r["loss"] is None and r["grad_norm"] is None for r in skipped)
    assert log[-1]["nonfinite_total"] == len(skipped)
    # a skipped window's non-finite gradients never reach the weights (the loss's backward runs; its step does not)
    assert all(r["grad_norm"] is not None and r["grad_norm"] < float("inf") for r in log if not r["skipped_nonfinite"])
    assert check_checkpoint(tmp_path / "run" / "checkpoints" / f"step-{log[-1]['step']:06d}") == []

    root = tmp_path / "all_bad"
    cfg = make_config(root, max_steps=8, holdout_fraction=0.0, batch_tokens=20, max_nonfinite_in_row=3)
    make_store(root / "run" / "store", n_samples=16, length=20, shard_samples=16, nonfinite_samples=16)
    assert run(cfg) == 2
    err = capsys.readouterr().err
    assert "3 non-finite losses/gradients in a row" in err and "last good checkpoint" in err
    assert len([r for r in _log(root) if "loss" in r]) == 3  # the steps, after the setup record


def test_warm_start_mismatch_is_one_line_error(tmp_path, capsys):
    cfg = make_config(tmp_path, max_steps=2, holdout_fraction=0.0, save_every=2)
    make_store(tmp_path / "run" / "store", n_samples=8, length=12)
    assert run(cfg) == 0
    ckpt = tmp_path / "run" / "checkpoints" / "best"
    other = tmp_path / "other"
    cfg2 = make_config(other, max_steps=1)
    text = cfg2.read_text().replace("aux_layer_ids:\n  - 0\n  - 1\n  - 2", "aux_layer_ids:\n  - 0\n  - 1\n  - 3")
    cfg2.write_text(text)
    make_store(other / "run" / "store", n_samples=8, length=12)
    manifest = json.loads((other / "run" / "store" / "manifest.json").read_text())
    manifest["aux_layer_ids"] = [0, 1, 3]
    (other / "run" / "store" / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert run(cfg2, [f"drafter.init_from={ckpt}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "aux" in err[0] and "[0, 1, 3]" in err[0], err


def test_wandb_tracking_offline_logs_config_and_metrics_without_secrets(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "secret-key-never-printed-0123456789abcdef")
    cfg = make_config(tmp_path, tracking={"report_to": "wandb", "project": "eagle3-test"}, max_steps=4, eval_every=2,
                      save_every=4, log_every=1)
    make_store(tmp_path / "run" / "store", n_samples=16, length=20)
    assert run(cfg) == 0
    out = capsys.readouterr()
    assert "secret-key-never-printed" not in out.out + out.err
    runs = list((tmp_path / "run" / "tracking" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # Offline runs keep config and history as records in the run's .wandb file (synced later). wandb's own
    # service process writes it and may still be flushing when finish() returns on a loaded machine: wait a while.
    keys = (b"ttt_length", b"draft_vocab_size", b"loss", b"train/acc_0", b"holdout/accept_length")
    deadline = time.monotonic() + 60
    while True:
        records = next(runs[0].glob("run-*.wandb")).read_bytes()
        if all(k in records for k in keys) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for key in keys:
        assert key in records, key
    assert b"secret-key-never-printed" not in records


def test_tensorboard_tracking_writes_loss_and_acc_i(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_config(tmp_path, tracking={"report_to": ["tensorboard"], "project": "tb-test"}, max_steps=4,
                      eval_every=2, save_every=4, log_every=1)
    make_store(tmp_path / "run" / "store", n_samples=16, length=20)
    assert run(cfg) == 0
    logdir = tmp_path / "run" / "tracking" / "train" / "tb-test"
    events = EventAccumulator(str(logdir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "lr", "train/acc_0", "train/acc_1", "train/acc_2", "holdout/acc_0", "holdout/acc_2",
            "holdout/accept_length"} <= tags, tags
    # The same numbers as train_log.jsonl, at the same steps.
    log = _log(tmp_path)
    for tag in ("loss", "train/acc_1", "holdout/accept_length"):
        want = {r["step"]: r[tag] for r in log if r.get(tag) is not None}
        got = {e.step: e.value for e in events.Scalars(tag)}
        assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-5 for k in want), (tag, got, want)


def test_resume_refuses_a_tampered_training_state(tmp_path, capsys):
    cfg = make_config(tmp_path, max_steps=2, save_every=2, eval_every=2, holdout_fraction=0.0)
    make_store(tmp_path / "run" / "store", n_samples=12, length=20)
    assert run(cfg) == 0
    rng = next((tmp_path / "run" / "checkpoints").glob("step-*/training_state/random_states_0.pkl"))
    rng.write_bytes(rng.read_bytes() + b"\0")
    cfg.write_text(cfg.read_text().replace("max_steps: 2", "max_steps: 4"))
    assert run(cfg) == 2
    err = capsys.readouterr().err
    assert "random_states_0.pkl" in err and "refusing to unpickle" in err


def test_max_train_samples_trains_on_a_prefix_and_keeps_the_holdout(tmp_path, capsys):
    cfg = make_config(tmp_path, epochs=1, holdout_fraction=0.25, max_train_samples=10, batch_tokens=40,
                      eval_every=1000, save_every=1000)
    make_store(tmp_path / "run" / "store", n_samples=48, length=20)
    assert run(cfg) == 0
    out = capsys.readouterr().out
    assert "10 train / " in out and "(first 10 training samples)" in out
    assert [r["step"] for r in _log(tmp_path) if "loss" in r] == [1, 2, 3, 4, 5]  # 10 samples, 2 a batch
