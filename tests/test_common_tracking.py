"""Trackers by accelerate's names: the names we accept are accelerate's, one name is a list of one, the
config reaches every tracker flat, and a tracker that is not installed is an error, not a silent drop."""

from __future__ import annotations

from pathlib import Path

import pytest
from accelerate.tracking import LOGGER_TYPE_TO_CLASS

from common.config import TrackingConfig
from common.tracking import TRACKERS, TrackerError, flat_config, make_trackers


def test_tracker_names_are_accelerates() -> None:
    assert set(TRACKERS) == set(LOGGER_TYPE_TO_CLASS)


def test_one_name_or_none() -> None:
    assert TrackingConfig(report_to="tensorboard").report_to == ["tensorboard"]
    assert TrackingConfig(report_to="none").report_to == [] == TrackingConfig().report_to


def test_flat_config() -> None:
    assert flat_config({"train": {"lr": 0.1, "max_steps": None}, "target": {"aux_layer_ids": [2, 15, 27]},
                        "run_dir": "r"}) == {"train.lr": 0.1, "train.max_steps": None,
                                             "target.aux_layer_ids": "[2, 15, 27]", "run_dir": "r"}


def test_tracker_arguments_and_a_missing_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tracking = TrackingConfig(report_to=["tensorboard", "wandb"], project="p",
                              init_kwargs={"wandb": {"entity": "team", "dir": str(tmp_path / "w")}})
    tb, wb = make_trackers(tracking, tmp_path / "tracking", "eval", "round-1")
    assert tb.logging_dir_param == str(tmp_path / "tracking" / "eval-round-1") and tb.run_name == "p"
    assert wb.run_name == "p"
    assert wb.init_kwargs == {"dir": str(tmp_path / "w"), "job_type": "eval", "name": "round-1", "entity": "team"}
    monkeypatch.setattr("accelerate.tracking._available_trackers", [])
    with pytest.raises(TrackerError, match="tracking.report_to: tensorboard, wandb not installed here; "
                                           "pip install tensorboard wandb"):
        make_trackers(tracking, tmp_path, "train")
