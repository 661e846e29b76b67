"""Live SGLang mode on recorded /generate bodies, served by a local http.server on 127.0.0.1."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eval.sglang_client import ServerError, live_eval

DATA = Path(__file__).parent / "data"


def serve(bodies: list[dict], seen: list[dict]):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            seen.append({"path": self.path, **json.loads(self.rfile.read(int(self.headers["Content-Length"])))})
            payload = json.dumps(bodies[(len(seen) - 1) % len(bodies)]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def servers():
    started = []

    def start(name: str, seen: list[dict]) -> str:
        server, url = serve(json.loads((DATA / name).read_text()), seen)
        started.append(server)
        return url

    yield start
    for s in started:
        s.shutdown()
        s.server_close()


def test_tau_alpha_and_decode_from_recorded_bodies(servers):
    spec_seen, base_seen = [], []
    spec = servers("sglang_generate_eagle3.json", spec_seen)
    base = servers("sglang_generate_baseline.json", base_seen)
    out = live_eval(spec, base, {"mtbench": [[1, 2, 3]], "humaneval": [[4, 5]]}, 0.0, 13)
    assert spec_seen[0] == {"path": "/generate", "input_ids": [1, 2, 3],
                            "sampling_params": {"temperature": 0.0, "max_new_tokens": 13}}
    mt, he = out["datasets"]["mtbench"], out["datasets"]["humaneval"]
    assert mt["tau"] == 13 / 4 and he["tau"] == 11 / 5  # completion_tokens / spec_verify_ct, as SGLang
    assert mt["tau_histogram"] == 3.0  # (8 accepted + 4 target tokens) / 4 cycles: no prefill token
    # histogram [1, 0, 1, 2]: 4 cycles, 3 reach draft 1, 3 reach draft 2, 2 reach draft 3
    assert mt["alpha_conditional"] == pytest.approx([3 / 4, 1.0, 2 / 3])
    assert mt["alpha_unconditional"] == pytest.approx([0.75, 0.75, 0.5])
    assert he["histogram"] == [2, 1, 2, 0]
    assert out["baseline"]["decode_ms"] == pytest.approx(1000 * (0.1452 + 0.1210) / 24)
    assert out["baseline"]["source"] == ["meta_info.e2e_latency"]


def test_missing_spec_fields_and_dead_server_are_clear_errors(servers):
    url = servers("sglang_generate_baseline.json", [])
    with pytest.raises(ServerError, match="spec_verify_ct missing"):
        live_eval(url, None, {"mtbench": [[1]]}, 0.0, 8)
    with pytest.raises(ServerError, match="127.0.0.1:9/generate"):
        live_eval("http://127.0.0.1:9", None, {"mtbench": [[1]]}, 0.0, 8)
