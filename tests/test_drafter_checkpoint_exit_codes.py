"""The exit-code contract for checkpoints, at every entry point that reads one: a directory that is not a readable,
finite drafter checkpoint is an error (exit 2, one line on stderr naming the file and what to do), never a
rejection (exit 1, which the gate records in the promotion history and the pipeline takes as a verdict). The
pipeline's side (it stops with exit 2 when the gate errors) is in tests/test_pipeline.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

import drafter.__main__
import eval.__main__
import eval.commands
from drafter.sglang_checkpoint import save_checkpoint
from eval.commands import gate_command, quality_command, run_command


def _edit_weights(weights: Path, edit) -> None:
    t = load_file(weights)
    edit(t)
    save_file(t, weights)


def _damage(ckpt: Path, kind: str) -> tuple[Path, str]:
    """Damage ``ckpt`` in place; returns the file the error line must name and a fragment of what it says."""
    cfg, weights = ckpt / "config.json", ckpt / "model.safetensors"
    if kind == "no_dir":
        shutil.rmtree(ckpt)
        return ckpt, "no such directory"
    if kind == "no_config":
        cfg.unlink()
        return cfg, "missing"
    if kind == "config_not_json":
        cfg.write_text('{"architectures": [')
        return cfg, "invalid JSON"
    if kind == "config_not_utf8":
        cfg.write_bytes(b"\xff\xfe{not utf-8}")
        return cfg, "not UTF-8"
    if kind == "no_weights":
        weights.unlink()
        return weights, "missing"
    if kind == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
        return weights, "unreadable safetensors file"
    if kind == "nan":
        _edit_weights(weights, lambda t: t["fc.weight"].__setitem__((0, 0), float("nan")))
        return weights, "non-finite weights (NaN/inf) in fc.weight"
    if kind == "inf":
        _edit_weights(weights, lambda t: t["norm.weight"].__setitem__(0, float("inf")))
        return weights, "non-finite weights (NaN/inf) in norm.weight"
    if kind == "missing_key":
        _edit_weights(weights, lambda t: t.pop("norm.weight"))
        return weights, "missing tensor norm.weight"
    if kind == "unknown_key":
        _edit_weights(weights, lambda t: t.__setitem__("midlayer.self_attn.qkv_proj.weight", t["norm.weight"].clone()))
        return weights, "unexpected tensor midlayer.self_attn.qkv_proj.weight"
    raise AssertionError(kind)


KINDS = ["no_dir", "no_config", "config_not_json", "config_not_utf8", "no_weights", "truncated", "nan", "inf",
         "missing_key", "unknown_key"]


@pytest.fixture(params=KINDS)
def damaged(request, tmp_path, tiny_drafter) -> tuple[Path, Path, str]:
    """(the checkpoint dir, the file its error must name, what the error says)."""
    ckpt = save_checkpoint(tiny_drafter, tmp_path / "step-1", dtype="float32")
    return (ckpt, *_damage(ckpt, request.param))


def assert_one_error_line(rc: int, err: str, file: Path, fragment: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith(f"error: {file}:"), line  # names the file, never "?"
    assert fragment in line, line
    assert "; " in line.split(fragment, 1)[1], f"says what is wrong but not what to do: {line}"


def write_config(tmp_path: Path, live: bool = False) -> Path:
    evals = {"num_steps": 3, "max_new_tokens": 8,
             "datasets": [{"name": "mtbench", "kind": "mtbench", "path": "builtin", "limit": 1}]}
    if live:  # never contacted: the checkpoint is refused first
        evals["sglang"] = {"server_url": "http://127.0.0.1:9"}
    tree = {"run_dir": str(tmp_path / "run"),
            "target": {"name": "smollm2-135m-instruct", "device": "cpu", "aux_layer_ids": [2, 15, 27]},
            "data": {"sources": [{"kind": "lines", "path": "unused.txt"}]}, "eval": evals,
            "gate": {"promoted_dir": str(tmp_path / "promoted"), "history_file": str(tmp_path / "promotions.jsonl")}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.fixture
def no_measuring(monkeypatch):
    """A damaged checkpoint must be refused before any target is loaded or server asked."""
    def refuse(*_a, **_k):
        raise AssertionError("measured a damaged checkpoint")

    for name in ("evaluate", "run_live", "target_and_prompts"):
        monkeypatch.setattr(eval.commands, name, refuse)
    monkeypatch.setattr("eval.gate_flow.evaluate", refuse)
    monkeypatch.setattr("eval.live_gate.measure_live", refuse)


def test_drafter_check(damaged, capsys):
    ckpt, file, fragment = damaged
    rc = drafter.__main__.main(["check", str(ckpt)])
    out, err = capsys.readouterr()
    assert_one_error_line(rc, err, file, fragment)
    assert "FAIL" not in out


@pytest.mark.parametrize("live", [False, True], ids=["hf", "live"])
def test_eval_run(damaged, live, tmp_path, no_measuring, capsys):
    ckpt, file, fragment = damaged
    rc = run_command(write_config(tmp_path, live), ckpt, live=live)
    assert_one_error_line(rc, capsys.readouterr().err, file, fragment)


@pytest.mark.parametrize("live", [False, True], ids=["hf", "live"])
def test_eval_gate_records_nothing(damaged, live, tmp_path, no_measuring, capsys):
    ckpt, file, fragment = damaged
    rc = gate_command(write_config(tmp_path, live), ckpt, promote=True, live=live)
    out, err = capsys.readouterr()
    assert_one_error_line(rc, err, file, fragment)
    assert "REJECTED" not in out
    assert not (tmp_path / "promotions.jsonl").exists(), (tmp_path / "promotions.jsonl").read_text()
    assert not (tmp_path / "promoted").exists()


def test_eval_quality(damaged, tmp_path, no_measuring, capsys):
    ckpt, file, fragment = damaged
    rc = quality_command(write_config(tmp_path), ckpt)
    assert_one_error_line(rc, capsys.readouterr().err, file, fragment)


def test_eval_quality_incumbent(damaged, tmp_path, no_measuring, capsys):
    """A damaged incumbent is an error too, through the command line, before any target is loaded."""
    ckpt, file, fragment = damaged
    good = Path(__file__).resolve().parents[1] / "drafters" / "smollm2-135m-eagle3"
    rc = eval.__main__.main(["quality", "--config", str(write_config(tmp_path)), "--checkpoint", str(good),
                             "--incumbent", str(ckpt)])
    assert_one_error_line(rc, capsys.readouterr().err, file, fragment)
