"""A real llama.cpp OpenAI-compatible server on loopback (the embedded default's server), for the tests that talk
to one: regeneration and synthesis through the openai backend."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from common.cli import LLAMA_CPP_CAUSES, exit_reason


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """``python -m llama_cpp.server`` on loopback with the builtin GGUF; always stopped by the caller."""

    def __init__(self, log: Path, argv: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        if argv is None:
            from common.wheels import builtin_gguf

            # One thread: on a shared 2-core machine, spinning thread pools run several times slower.
            argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(builtin_gguf()), "--host", "127.0.0.1",
                    "--port", str(self.port), "--n_ctx", "2048", "--n_threads", "1", "--n_threads_batch", "1"]
        self.proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT)

    def wait_ready(self, limit_s: float = 90) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"llama.cpp server exited early ({exit_reason(self.proc.returncode, LLAMA_CPP_CAUSES)}): "
                            f"{self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        pytest.fail(f"llama.cpp server not ready in {limit_s} s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
