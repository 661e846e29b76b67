"""drafter/average.py (`python -m drafter average`): the weighted average of drafters of one lineage, saved in the
SGLang layout; drafters whose tensors mean different things (another vocab map, shape or aux layers) are refused
with one line naming the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_drafter_sglang_checkpoint import randomize

import drafter.__main__
from drafter.average import average_checkpoints
from drafter.model import Eagle3Drafter
from drafter.sglang_checkpoint import CheckpointError, check_checkpoint, load_tensors, save_checkpoint


def lineage(tmp_path: Path, tiny_drafter: Eagle3Drafter) -> tuple[Path, Path]:
    """A drafter and a 'later stage' of it: other weights, the same vocab map and config (what a warm start keeps)."""
    a = save_checkpoint(randomize(tiny_drafter, seed=0), tmp_path / "a", dtype="float32")
    with torch.no_grad():
        for p in tiny_drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return a, save_checkpoint(tiny_drafter, tmp_path / "b", dtype="float32")


def test_the_average_is_the_weighted_mean_of_every_float_tensor(tmp_path, tiny_drafter, capsys) -> None:
    a, b = lineage(tmp_path, tiny_drafter)
    out = tmp_path / "avg"
    assert drafter.__main__.main(["average", str(a), str(b), "--out", str(out), "--weights", "1", "3"]) == 0
    assert f"averaged: {tmp_path / 'avg'}" in capsys.readouterr().out
    assert check_checkpoint(tmp_path / "avg") == []
    ta, tb, avg = load_tensors(a), load_tensors(b), load_tensors(tmp_path / "avg")
    assert set(avg) == set(ta)
    for name in ta:
        if ta[name].is_floating_point():
            torch.testing.assert_close(avg[name], 0.25 * ta[name] + 0.75 * tb[name])
        else:
            assert torch.equal(avg[name], ta[name])  # the vocab map is kept as it is
    assert json.loads((tmp_path / "avg" / "config.json").read_text()) == json.loads((a / "config.json").read_text())
    equal = average_checkpoints([a, b], tmp_path / "equal")  # no weights: the plain mean
    torch.testing.assert_close(load_tensors(equal)["fc.weight"], (ta["fc.weight"] + tb["fc.weight"]) / 2)


def test_drafters_of_another_lineage_or_bad_weights_are_refused(tmp_path, tiny_drafter, capsys) -> None:
    a, b = lineage(tmp_path, tiny_drafter)
    other = save_checkpoint(randomize(tiny_drafter, seed=7), tmp_path / "other", dtype="float32")  # its own map
    with pytest.raises(CheckpointError, match=f"{other}: its vocabulary map"):
        average_checkpoints([a, other], tmp_path / "out")
    with pytest.raises(CheckpointError, match="every weight must be positive"):
        average_checkpoints([a, b], tmp_path / "out", [1.0, 0.0])
    with pytest.raises(CheckpointError, match="2 given for 3 checkpoints"):
        average_checkpoints([a, b, b], tmp_path / "out", [1.0, 1.0])
    with pytest.raises(CheckpointError, match="is one of the checkpoints averaged"):
        average_checkpoints([a, b], b)
    assert drafter.__main__.main(["average", str(a), str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()
