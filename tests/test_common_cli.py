"""Exit codes and error lines shared by every command: a crash is exit 2 (never 1, the gate's "rejected"),
and OS errors name the file and the fix in one line."""

from __future__ import annotations

import errno
import signal

import pytest

from common.cli import EXIT_ERROR, LLAMA_CPP_CAUSES, exit_reason, one_line_errors


class Ours(RuntimeError):
    pass


@pytest.mark.parametrize("exc, line", [
    (ValueError("cfg.yaml: train.lr: must be > 0"), "error: cfg.yaml: train.lr: must be > 0"),
    (Ours("store: something to fix"), "error: store: something to fix"),
    (PermissionError(errno.EACCES, "Permission denied", "/runs/x/.lock"),
     "error: /runs/x/.lock: permission denied: make it writable or point run_dir elsewhere (--set run_dir=...)"),
    (OSError(errno.EROFS, "Read-only file system", "/ro/run"),
     "error: /ro/run: read-only file system: point run_dir somewhere writable (--set run_dir=...)"),
    (OSError(errno.ENOSPC, "No space left on device", "/runs/x/store/shard-00003.safetensors"),
     "error: /runs/x/store/shard-00003.safetensors: no space left on the device: free some, or point run_dir at a "
     "bigger disk (--set run_dir=/big/disk/run), then rerun (stages resume)"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/nope"), "error: /nope: no such file or directory"),
])
def test_our_errors_and_os_errors_are_one_line_exit_2(capsys, exc, line):
    @one_line_errors(Ours)
    def command() -> int:
        raise exc

    assert command() == EXIT_ERROR
    assert capsys.readouterr().err.strip().splitlines() == [line]


def test_an_os_error_naming_no_file_shows_where_instead_of_a_question_mark(capsys):
    """Our writers name their file (``common.files.named_errors``); one that forgot leaves an OSError without a
    file name, whose line then points at its traceback, never at a ``?``."""
    @one_line_errors()
    def command() -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    assert command() == EXIT_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("Traceback") and "?" not in err[-1]
    assert err[-1] == ("error: no space left on the device: free some, or point run_dir at a bigger disk "
                       "(--set run_dir=/big/disk/run), then rerun (stages resume) (no file named: the traceback "
                       "above says where)")


def test_a_bug_shows_its_traceback_then_the_line_and_still_exits_2(capsys):
    @one_line_errors()
    def command() -> int:
        raise KeyError("oops")

    assert command() == EXIT_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("Traceback") and err[-1] == (
        "error: unexpected KeyError: 'oops' (the traceback above says where)")


def test_a_return_code_reads_as_an_exit_or_a_named_signal_with_its_cause():
    assert exit_reason(0) == "exit 0" and exit_reason(3) == "exit 3"
    assert exit_reason(-signal.SIGKILL).startswith("killed by SIGKILL (signal 9): killed from outside")
    assert exit_reason(-signal.SIGILL) == ("killed by SIGILL (signal 4): an instruction this CPU does not allow (a "
                                          "native library built for another CPU)")
    assert exit_reason(-signal.SIGILL, LLAMA_CPP_CAUSES).endswith("rebuild llama-cpp-python with "
                                                                  "CMAKE_ARGS=-DGGML_NATIVE=OFF (make setup does)")
    assert exit_reason(-signal.SIGUSR1) == "killed by SIGUSR1 (signal 10)"
    assert exit_reason(-200) == "killed by signal 200"


def test_every_command_runs_under_one_line_errors():
    """What each ``python -m <package>`` calls is wrapped, so that a crash anywhere in it is exit 2, never 1."""
    import data_prep.steps
    import drafter.__main__
    import eval.commands
    import pipeline.rounds
    import train.loop

    wrapped = one_line_errors()(lambda: 0).__code__
    commands = [data_prep.steps.run_steps, train.loop.run, pipeline.rounds.run_round, drafter.__main__.main,
                *(getattr(eval.commands, n) for n in dir(eval.commands) if n.endswith("_command"))]
    assert len(commands) == 11  # eval: run, gate, quality, coverage, breakeven, sglang, sweep
    assert [c.__qualname__ for c in commands if c.__code__ is not wrapped] == []


def test_sigterm_sets_the_stop_request_and_a_stuck_exit_prints_its_stacks():
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, signal, sys, time
        from common import cli
        cli.StopRequest.__init__.__defaults__ = (0.3,)
        with cli.stop_on_sigterm() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            print("stop" if stop else "no stop", flush=True)
            time.sleep(1.0)  # stuck on the way out: the stacks come after 0.3 s
        print("handler restored:", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["stop", "handler restored: True"]
    assert r.stderr.splitlines()[0] == "Timeout (0:00:00.300000)!", r.stderr
    assert 'File "<string>", line 9 in <module>' in r.stderr, r.stderr  # the sleep it was stuck in
