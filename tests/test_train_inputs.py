"""What training does with bad inputs: a store that changed after capture, a damaged shard or checkpoint,
an impossible config, an unusable run dir or a full disk are each one line on stderr and exit 2, never a
traceback and never quiet training on wrong data."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_fixtures import make_config, make_store

import data_prep.store as store_mod
from data_prep.store import StoreError, read_manifest, verify_store
from drafter.sglang_checkpoint import CheckpointError
from train.loop import run
from train.run_checkpoints import update_best

ROOT = Path(__file__).resolve().parents[1]


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err and "Traceback" not in "\n".join(err), err
    return err[-1]


def _flip_a_data_byte(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01  # inside the tensor data, past the header: safetensors itself cannot tell
    shard.write_bytes(bytes(data))


def test_one_flipped_byte_in_a_shard_makes_train_exit_2_naming_it(tmp_path):
    cfg = make_config(tmp_path, max_steps=2, holdout_fraction=0.0)
    store = make_store(tmp_path / "run" / "store", n_samples=32, length=12)
    shard = store / "shard-00001.safetensors"
    _flip_a_data_byte(shard)
    r = subprocess.run([sys.executable, "-m", "train", "--config", str(cfg)], capture_output=True, text=True,
                       cwd=ROOT, timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == (f"error: {shard}: sha256 differs from {store / 'manifest.json'} (the file changed after capture); "
                    "rerun `python -m data_prep capture` (it rewrites shards that do not match)"), last
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("damage, words", [
    (lambda b: b[: len(b) // 2], "bytes, "),  # truncated: the manifest's size says so before any hashing
    (lambda b: b[:8] + b"{\"x" + b[11:], "sha256 differs"),  # a damaged header
])
def test_truncated_or_damaged_shards_are_one_line_errors(tmp_path, capsys, damage, words):
    cfg = make_config(tmp_path, max_steps=2, holdout_fraction=0.0)
    store = make_store(tmp_path / "run" / "store", n_samples=16, length=12)
    manifest = read_manifest(store)
    for s in manifest["shards"]:  # what capture records (the fixture leaves sizes out)
        s["bytes"] = (store / s["file"]).stat().st_size
    (store / "manifest.json").write_text(json.dumps(manifest))
    shard = store / "shard-00000.safetensors"
    shard.write_bytes(damage(shard.read_bytes()))
    assert run(cfg) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: {shard}: ") and words in line and "rerun `python -m data_prep capture`" in line


def test_verification_is_cached_by_size_and_mtime(tmp_path, monkeypatch):
    store = make_store(tmp_path / "store", n_samples=32, length=12)
    manifest = read_manifest(store)
    past = time.time() - 60  # older than the racy window: a cached match can be trusted
    for f in store.glob("*.safetensors"):
        os.utime(f, (past, past))
    hashed: list[str] = []
    real = store_mod.sha256_file
    monkeypatch.setattr(store_mod, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    verify_store(store, manifest)
    assert sorted(hashed) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    cache = json.loads((store / ".verified.json").read_text())
    assert set(cache) == {"shard-00000.safetensors", "shard-00001.safetensors"}
    monkeypatch.setattr(store_mod, "_verified_here", set())  # a new process: only the sidecar remembers
    hashed.clear()
    verify_store(store, manifest)
    assert hashed == []
    _flip_a_data_byte(store / "shard-00001.safetensors")  # a write moves the mtime: hashed again, and caught
    with pytest.raises(StoreError, match=r"shard-00001\.safetensors: sha256 differs"):
        verify_store(store, manifest)
    assert hashed == ["shard-00001.safetensors"]


def test_draft_vocab_larger_than_the_vocab_is_one_line(tmp_path, capsys):
    cfg = make_config(tmp_path, max_steps=1, holdout_fraction=0.0)
    make_store(tmp_path / "run" / "store", n_samples=8, length=12)
    assert run(cfg, ["drafter.draft_vocab_size=1000"]) == 2
    line = _one_error_line(capsys)
    assert "drafter.draft_vocab_size 1000 is larger than the target's vocab_size 80" in line
    assert "--set drafter.draft_vocab_size=80" in line


def test_epochs_true_is_rejected(tmp_path, capsys):
    cfg = make_config(tmp_path, epochs=True)
    assert run(cfg) == 2
    assert "train.epochs: must be a number, not true" in _one_error_line(capsys)


def test_warm_start_from_a_truncated_checkpoint_is_one_line(tmp_path, capsys):
    cfg = make_config(tmp_path, max_steps=2, holdout_fraction=0.0, save_every=2)
    make_store(tmp_path / "run" / "store", n_samples=8, length=12)
    assert run(cfg) == 0
    ckpt = tmp_path / "copy"
    best = (tmp_path / "run" / "checkpoints" / "best").resolve()
    ckpt.mkdir()
    (ckpt / "config.json").write_bytes((best / "config.json").read_bytes())
    (ckpt / "model.safetensors").write_bytes((best / "model.safetensors").read_bytes()[:1000])
    capsys.readouterr()
    assert run(cfg, [f"drafter.init_from={ckpt}"], resume="never") == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: {ckpt / 'model.safetensors'}: unreadable safetensors file") and \
        "damaged" in line, line


def test_unusable_run_dir_and_full_disk_are_one_line_and_temps_are_cleaned(tmp_path, capsys, monkeypatch):
    cfg = make_config(tmp_path, max_steps=2, holdout_fraction=0.0, save_every=1)
    make_store(tmp_path / "run" / "store", n_samples=8, length=12)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert run(cfg, [f"run_dir={blocker / 'run'}"]) == 2  # run_dir under a file: cannot exist
    line = _one_error_line(capsys)
    assert line.startswith(f"error: {blocker / 'run'}") and "not a directory" in line, line

    import train.run_checkpoints as ckpt_mod

    real_save = ckpt_mod.save_checkpoint

    def disk_fills(model, out_dir, **kw):  # the weights land, then the disk is full
        real_save(model, out_dir, **kw)
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(out_dir) / "run_config.json"))

    monkeypatch.setattr(ckpt_mod, "save_checkpoint", disk_fills)
    assert run(cfg) == 2
    line = _one_error_line(capsys)
    assert line.startswith("error: ") and "run_config.json: no space left on the device" in line, line
    ckpts = tmp_path / "run" / "checkpoints"
    assert [p.name for p in ckpts.iterdir()] == [".step-000001.tmp"]  # the killed save's temp dir
    monkeypatch.setattr(ckpt_mod, "save_checkpoint", real_save)
    assert run(cfg) == 0  # space freed: the rerun cleans the temp dir up and trains
    assert not [p.name for p in ckpts.iterdir() if ".tmp" in p.name or ".old" in p.name]


def test_a_damaged_trainer_json_is_one_line_naming_it_and_the_checkpoint_to_delete(tmp_path, capsys):
    cfg = make_config(tmp_path, max_steps=2, holdout_fraction=0.0, save_every=2)
    make_store(tmp_path / "run" / "store", n_samples=8, length=12)
    assert run(cfg) == 0
    (ckpt,) = (tmp_path / "run" / "checkpoints").glob("step-*")
    trainer = ckpt / "training_state" / "trainer.json"
    trainer.write_text('{"position": {"step": 2')  # cut off mid-write
    capsys.readouterr()
    assert run(cfg) == 2
    assert _one_error_line(capsys) == (f"error: {trainer}:1: invalid JSON (Expecting ',' delimiter); delete {ckpt} "
                                       "to resume from an older checkpoint, or pass --resume never")


@pytest.mark.parametrize(("text", "problem"), [
    ('{\n"metric": "x",\n"value": 0.5', ":3: invalid JSON (Expecting ',' delimiter)"),
    ("[1]", ": a JSON list, not an object"),
])
def test_a_damaged_best_json_is_an_error_naming_it(tmp_path, text: str, problem: str):
    (tmp_path / "best.json").write_text(text)
    with pytest.raises(CheckpointError) as e:
        update_best(tmp_path, tmp_path / "step-000004", 4, "holdout/accept_length", 0.6)
    assert str(e.value) == (f"{tmp_path / 'best.json'}{problem}; delete it; training then records the next "
                            "checkpoint it saves as the best")
