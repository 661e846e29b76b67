"""The gate fed by live SGLang servers, against local HTTP servers that answer ``/generate`` and
``/server_info`` with bodies shaped like SGLang 0.5.23's (field names from sglang
srt/managers/tokenizer_manager.py ``_calculate_spec_decoding_metrics``, srt/observability/req_time_stats.py,
srt/entrypoints/http_server.py ``server_info`` = the resolved server args), and the serving sweep on a
hand-made cost table."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.config import ConfigError, GateConfig, parse_config
from common.locking import LockBusy, run_lock
from data_prep.dataset import in_holdout
from drafter.sglang_checkpoint import fingerprint, save_checkpoint
from eval import gate as gate_module
from eval.commands import gate_command, sweep_command
from eval.gate import promotions_dir, read_history
from eval.live_gate import decide_live, live_gate, live_tokenizer, measure_live
from eval.serving_sweep import Cost, ServingSetting, chain_tau, recommend
from eval.sglang_client import ServerError

PROMPTS = {"mtbench": [[1, 2, 3], [4, 5, 6, 7], [8, 9]], "humaneval": [[10, 11], [12, 13, 14]]}
DECODE_MS, CYCLE_MS, TTFT_MS = 12.1, 29.8, 80.0  # tau* = 2.463


def info(draft: str | None, steps: int = 3, topk: int = 1, draft_tokens: int = 4) -> dict:
    """/server_info: SGLang's resolved server args (a few of its ~300 fields) plus its extras."""
    spec = ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": draft, "speculative_num_steps": steps,
             "speculative_eagle_topk": topk, "speculative_num_draft_tokens": draft_tokens} if draft else
            {"speculative_algorithm": None, "speculative_draft_model_path": None, "speculative_num_steps": None,
             "speculative_eagle_topk": None, "speculative_num_draft_tokens": None})
    return {"model_path": "/models/moonshotai/Kimi-K2.5", "tp_size": 8, "ep_size": 8, "enable_metrics": True,
            "speculative_accept_threshold_single": 1.0, "speculative_accept_threshold_acc": 1.0, **spec,
            "launch_command": "python -m sglang.launch_server ...",
            "internal_states": [{"avg_spec_accept_length": 2.9}], "version": "0.5.23", "frontend": "python"}


def generate_body(hist: list[int] | None, metrics: bool, old_names: bool = False) -> dict:
    """One /generate response: ``hist`` (verify steps that kept exactly a drafts) for a speculating server; ``[]``
    for a request that ended at its prefill token (no verify cycle: SGLang then leaves every spec_* field out,
    tokenizer_manager.py ``_calculate_spec_decoding_metrics`` runs only when spec_verify_ct > 0)."""
    if hist == []:
        tokens, decode_s = 1, 0.0
    elif hist is None:
        tokens = 24
        decode_s = (tokens - 1) * DECODE_MS / 1000
    else:
        verify = sum(hist)
        tokens = 1 + sum((a + 1) * n for a, n in enumerate(hist))  # the prefill token + each cycle's tokens
        decode_s = verify * CYCLE_MS / 1000
    ttft = TTFT_MS / 1000
    meta: dict[str, Any] = {"id": "0f3c", "finish_reason": {"type": "length", "length": tokens}, "prompt_tokens": 7,
                            "weight_version": "default", "num_retractions": 0, "completion_tokens": tokens,
                            "cached_tokens": 0, "e2e_latency": ttft + decode_s}
    if hist:
        correct = sum(a * n for a, n in enumerate(hist))
        meta |= {"spec_accept_rate": correct / (3 * sum(hist)), "spec_accept_length": tokens / sum(hist),
                 "spec_num_correct_drafts": correct, "spec_num_proposed_drafts": 3 * sum(hist),
                 "spec_verify_ct": sum(hist), "spec_accepted_drafts": correct, "spec_proposed_drafts": 3 * sum(hist),
                 ("spec_accept_histogram" if old_names else "spec_correct_drafts_histogram"): hist}
    if metrics:  # --enable-metrics
        meta |= {"request_received_ts": 1.76e9, "first_token_latency": ttft, "request_finished_ts": 1.76e9 + 1,
                 "decode_throughput": (tokens - 1) / decode_s if decode_s else 0.0, "queue_time": 0.001}
    return {"text": "…", "output_ids": list(range(tokens)), "meta_info": meta}


class FakeSGLang(ThreadingHTTPServer):
    def __init__(self, server_info: dict, hist: list[int] | None, metrics: bool = True, old_names: bool = False,
                 first_token_only: frozenset[int] = frozenset(), long_hist: list[int] | None = None):
        super().__init__(("127.0.0.1", 0), Handler)
        self.info, self.hist, self.metrics, self.old_names = server_info, hist, metrics, old_names
        self.first_token_only = first_token_only  # prompts (by their first id) answered by the prefill token alone
        self.long_hist = long_hist  # the histogram of a prompt of 1,024 tokens or more (else ``hist``)
        self.lock, self.in_flight, self.max_in_flight, self.requests = threading.Lock(), 0, 0, []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: FakeSGLang

    def _send(self, code: int, obj: Any) -> None:
        payload = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/server_info" and not self.server.old_names or self.path == "/get_server_info":
            self._send(200, self.server.info)
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        with srv.lock:
            srv.requests.append(body)
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        time.sleep(0.05)
        with srv.lock:
            srv.in_flight -= 1
        ids = body["input_ids"]
        hist = ([] if ids[0] in srv.first_token_only else
                srv.long_hist if srv.long_hist is not None and len(ids) >= 1024 else srv.hist)
        self._send(200, generate_body(hist, srv.metrics, srv.old_names))

    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    started = []

    def start(*args, **kwargs) -> FakeSGLang:
        srv = FakeSGLang(*args, **kwargs)
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        started.append(srv)
        return srv

    yield start
    for s in started:
        s.shutdown()
        s.server_close()


CAND_GOOD = [1, 1, 1, 3]  # tau = (1 + 2 + 3 + 12) / 6 = 3.0
INC_K2 = [2, 2, 2, 0]  # tau = 2.0, the K2 drafter on K2.5


def cfg_tree(tmp_path: Path, sglang: dict, **eval_extra) -> dict:
    return {"run_dir": str(tmp_path / "run"), "target": {"name": "smollm2-135m-instruct"},
            "data": {"sources": [{"kind": "lines", "path": "unused"}]},
            "eval": {"num_steps": 3, "max_new_tokens": 24, "sglang": sglang,
                     "datasets": [{"name": "mtbench", "kind": "mtbench", "limit": 2},
                                  {"name": "humaneval", "kind": "humaneval", "limit": 2}], **eval_extra},
            "gate": {"margin": 0.02, "min_delta": 0.05, "promoted_dir": str(tmp_path / "promoted"),
                     "history_file": str(tmp_path / "promotions.jsonl")}}


@pytest.fixture
def ckpts(tmp_path, tiny_drafter) -> dict[str, Path]:
    return {name: save_checkpoint(tiny_drafter, tmp_path / name, dtype="float32")
            for name in ("Kimi-K25-eagle3", "Kimi-K2-Instruct-eagle3")}


def three_servers(serve, ckpts, cand_hist, inc_hist, **kw) -> dict:
    cand = serve(info(f"/models/AQ-MedAI/{ckpts['Kimi-K25-eagle3'].name}"), cand_hist, **kw)
    inc = serve(info(f"/models/AQ-MedAI/{ckpts['Kimi-K2-Instruct-eagle3'].name}"), inc_hist, **kw)
    base = serve(info(None), None, **kw)
    return {"server_url": cand.url, "incumbent_url": inc.url, "baseline_url": base.url, "concurrency": [1, 3],
            "_servers": (cand, inc, base)}


def test_live_gate_promotes_k25_drafter_over_k2_drafter(tmp_path, serve, ckpts):
    urls = three_servers(serve, ckpts, CAND_GOOD, INC_K2)
    cand, inc, base = urls.pop("_servers")
    cfg = parse_config(cfg_tree(tmp_path, urls))
    decision = live_gate(cfg, str(ckpts["Kimi-K25-eagle3"]), str(ckpts["Kimi-K2-Instruct-eagle3"]), True, "k25",
                         prompts=PROMPTS)
    assert decision == "promoted" and (tmp_path / "promoted" / "model.safetensors").is_file()
    report = json.loads((tmp_path / "run" / "eval" / "k25" / "report.json").read_text())
    for c in ("1", "3"):
        row = report["by_concurrency"][c]
        assert row["baseline"]["decode_ms"] == pytest.approx(DECODE_MS)  # (e2e - ttft) / (tokens - 1)
        assert row["breakeven"]["tau_star"] == pytest.approx(CYCLE_MS / DECODE_MS)
        c_ds, i_ds = (row["drafters"][r]["datasets"]["mtbench"] for r in ("candidate", "incumbent"))
        assert c_ds["tau"] == pytest.approx(3.0) and i_ds["tau"] == pytest.approx(2.0)
        assert c_ds["cycle_ms"] == pytest.approx(CYCLE_MS) and c_ds["tau_source"] == "spec_correct_drafts_histogram"
        # hist [1, 1, 1, 3] x 3 prompts: 18 cycles, 15 keep draft 1, 12 draft 2, 9 draft 3
        assert c_ds["alpha_conditional"] == pytest.approx([15 / 18, 12 / 15, 9 / 12])
        assert c_ds["sglang_accept_length"] == pytest.approx(19 / 6)  # SGLang's figure counts the prefill token
    assert report["gate"]["decision"] == "promoted" and report["settings"]["num_steps"] == 3
    assert cand.requests[0] == {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0.0, "max_new_tokens": 24}}
    assert len(base.requests) == 2 * 5 and cand.max_in_flight >= 2 and inc.max_in_flight <= 3
    row = json.loads((tmp_path / "promotions.jsonl").read_text().splitlines()[-1])
    assert row["decision"] == "promoted" and row["mode"] == "live" and set(row["tau_star"]) == {"1", "3"}
    assert row["incumbent"]["served"].endswith("Kimi-K2-Instruct-eagle3")
    reasons = "\n".join(report["gate"]["reasons"])
    assert "concurrency 3: mtbench: PASS (3 prompts, 95% intervals): tau 3.000 [3.000, 3.000]" in reasons
    assert report["intervals"]["3"]["mtbench"]["vs_incumbent"]["ci"] == pytest.approx([1.0, 1.0])
    assert row["intervals"]["1"]["humaneval"]["tau_star"]["prompts"] == 5  # every request to the baseline
    assert row["tries"]["count"] == 1 and row["tries"]["level"] == 0.95 and report["gate"]["tries"] == row["tries"]
    assert "tries: the first candidate against this incumbent on these prompts" in reasons


def test_live_promotion_is_the_crash_safe_one(tmp_path, serve, ckpts, monkeypatch, capsys):
    """The live gate promotes as the HF gate does: the report (which says its decision takes effect once recorded),
    the record (fsynced), then ``promoted`` switched to an immutable copy, and only then the printed PROMOTED, so a
    decision on record always has its report and a kill before the switch prints no promotion. The next gate
    finishes the switch and does not measure a drafter that is already serving; a second gate fails at once on the
    promotions lock."""
    urls = three_servers(serve, ckpts, CAND_GOOD, INC_K2)
    cand, _, _ = urls.pop("_servers")
    cfg = parse_config(cfg_tree(tmp_path, urls))
    k25, promoted, history = str(ckpts["Kimi-K25-eagle3"]), tmp_path / "promoted", tmp_path / "promotions.jsonl"
    fp = fingerprint(k25)

    def killed(*args: Any) -> None:
        raise KeyboardInterrupt("killed before the switch")

    monkeypatch.setattr(gate_module, "_switch", killed)
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        live_gate(cfg, k25, None, True, "k25", prompts=PROMPTS)
    report = json.loads((tmp_path / "run" / "eval" / "k25" / "report.json").read_text())
    assert report["gate"]["decision"] == "promoted"  # the report precedes the record it names
    out = capsys.readouterr().out
    assert "PROMOTED" not in out.splitlines() and "takes effect once recorded in" in out  # the report, no verdict
    assert [(r["decision"], r["fingerprint"], r["mode"]) for r in read_history(history)] == [("promoted", fp, "live")]
    assert not promoted.exists()  # the record is on disk, the switch never happened
    monkeypatch.undo()
    measured = len(cand.requests)
    capsys.readouterr()
    assert live_gate(cfg, k25, None, True, "k25-again", prompts=PROMPTS) == "promoted"
    out = capsys.readouterr().out
    assert "completed the promotion" in out and "PROMOTED (already" in out
    assert len(cand.requests) == measured and len(read_history(history)) == 1
    assert promoted.is_symlink() and os.readlink(promoted) == f"promotions/{fp[:16]}"
    assert (promoted / "model.safetensors").stat().st_mode & 0o777 == 0o444  # the immutable copy
    with run_lock(promotions_dir(promoted), "another gate"), pytest.raises(LockBusy, match="in use by pid"):
        live_gate(cfg, k25, None, True, "k25-third", prompts=PROMPTS)


@pytest.mark.parametrize(("cand_hist", "inc_hist", "why"), [
    ([2, 2, 2, 0], None, "is below 0 (a real loss)"),  # tau 2.0 < tau* 2.46 x 1.02: speculation would be slower
    (CAND_GOOD, [0, 1, 1, 4], "is below min_delta 0.05"),  # clears break-even, loses to a better incumbent (3.5)
])
def test_live_gate_rejects(tmp_path, serve, ckpts, cand_hist, inc_hist, why):
    urls = three_servers(serve, ckpts, cand_hist, inc_hist or INC_K2)
    urls.pop("_servers")
    cfg = parse_config(cfg_tree(tmp_path, urls))
    assert live_gate(cfg, str(ckpts["Kimi-K25-eagle3"]), None, True, "k25", prompts=PROMPTS) == "rejected"
    assert not (tmp_path / "promoted").exists()
    reasons = json.loads((tmp_path / "promotions.jsonl").read_text())["reasons"]
    assert any(why in r for r in reasons), reasons


def test_one_failing_concurrency_rejects():
    """decide at every concurrency: at 8 requests in flight the cycle costs more than speculation earns."""
    def row(tau_star: float) -> dict:  # tau* from eval.timings (no baseline server): no spread
        return {"breakeven": {"tau_star": tau_star},
                "drafters": {"candidate": {"datasets": {"mtbench": {"tau": 3.0, "per_prompt": {
                    "tokens": [30, 33, 27], "cycles": [10, 11, 9]}}}}}}

    gate = GateConfig()
    verdict, reasons, taus, intervals = decide_live({"by_concurrency": {"1": row(2.46), "8": row(3.2)}}, ["mtbench"],
                                                    gate)
    assert verdict == "reject" and taus == {"1": {"mtbench": 3.0}, "8": {"mtbench": 3.0}}
    assert any(r.startswith("concurrency 8: mtbench: FAIL") and "is below 0 (a real loss) at the 97.5% level 2 "
               "comparisons call for" in r for r in reasons)  # one per concurrency: a loss is read over both
    assert intervals["1"]["mtbench"]["vs_breakeven"]["ci"] == pytest.approx([0.54, 0.54])
    assert decide_live({"by_concurrency": {"1": row(2.46)}}, ["mtbench"], gate)[0] == "promote"
    assert decide_live({"by_concurrency": {"1": row(3.0)}}, ["mtbench"], gate)[0] == "unresolved"  # on the bar: a tie


def test_requests_without_a_verify_cycle_are_counted_not_fatal(tmp_path, serve, ckpts):
    """A request that ends at its prefill token (an immediate end of turn) has no verify cycle, and SGLang then
    sends no spec_verify_ct at all. It says nothing about the drafter: counted in the report, left out of tau and
    the cycle time; the run goes on."""
    urls = three_servers(serve, ckpts, CAND_GOOD, INC_K2)
    cand, inc, _ = urls.pop("_servers")
    cand.first_token_only = inc.first_token_only = frozenset({8})  # mtbench's third prompt [8, 9]
    cfg = parse_config(cfg_tree(tmp_path, urls))
    assert live_gate(cfg, str(ckpts["Kimi-K25-eagle3"]), str(ckpts["Kimi-K2-Instruct-eagle3"]), True, "k25",
                     prompts=PROMPTS) == "promoted"
    out = tmp_path / "run" / "eval" / "k25"
    report = json.loads((out / "report.json").read_text())
    for c in ("1", "3"):
        cand_row = report["by_concurrency"][c]["drafters"]["candidate"]
        mt, he = cand_row["datasets"]["mtbench"], cand_row["datasets"]["humaneval"]
        assert (mt["requests"], mt["requests_without_cycles"], he["requests_without_cycles"]) == (3, 1, 0)
        assert mt["tau"] == pytest.approx(3.0) and mt["cycle_ms"] == pytest.approx(CYCLE_MS)
        assert mt["spec_verify_ct"] == 2 * sum(CAND_GOOD) and cand_row["all"]["requests_without_cycles"] == 1
    assert "1 of 3 requests ended at their first token" in (out / "report.md").read_text()


def test_live_gate_reports_tau_by_history_length_on_held_out_turns(tmp_path, serve, ckpts):
    """With the run's conversations at hand, every assistant turn of the held-out ones (never the training split)
    goes to the candidate's and the incumbent's servers as the server renders it (the real SmolLM2 chat template),
    once, at the highest concurrency, bucketed by its history's tokens; the gate still decides on its datasets."""
    urls = three_servers(serve, ckpts, CAND_GOOD, INC_K2)
    cand, inc, base = urls.pop("_servers")
    cand.long_hist, inc.long_hist = [4, 0, 0, 0], [2, 2, 0, 0]  # tau 1.0 and 1.5 on histories of 1k tokens or more
    cfg = parse_config(cfg_tree(tmp_path, urls) | {"train": {"holdout_fraction": 0.5}})
    held = [c for c in (f"c{i}" for i in range(40)) if in_holdout(c, 0.5)]
    trained = next(c for c in (f"c{i}" for i in range(40)) if not in_holdout(c, 0.5))

    def chat(cid: str, *turns: str) -> dict:
        return {"id": cid, "messages": [{"role": ("user", "assistant")[i % 2], "content": t}
                                        for i, t in enumerate(turns)]}

    convs = [chat(held[0], "Hi", "Hello!", "Summarise:" + " word" * 1500, "A summary."),
             chat(held[1], "What is 2+2?", "4."), chat(trained, "Trained on", "so never measured")]
    cfg.conversations_path.parent.mkdir(parents=True)
    cfg.conversations_path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    assert live_gate(cfg, str(ckpts["Kimi-K25-eagle3"]), str(ckpts["Kimi-K2-Instruct-eagle3"]), True, "k25",
                     prompts=PROMPTS) == "promoted"  # the long histories' lower tau is not in the decision
    out = tmp_path / "run" / "eval" / "k25"
    ctx = json.loads((out / "report.json").read_text())["tau_by_context"]
    assert (ctx["holdout_conversations"], ctx["concurrency"], ctx["beyond_last_bucket"]) == (2, 3, 0)
    short, mid, long = (ctx["drafters"]["candidate"][b] for b in ("<1k", "1-2k", "2-4k"))
    assert (short["prompts"], short["conversations"], mid["prompts"], long["prompts"]) == (2, 2, 1, 0)
    assert short["tau"] == pytest.approx(3.0) and mid["tau"] == pytest.approx(1.0) and long["tau"] is None  # NaN
    assert 1500 < mid["history_tokens"][0] < 2048
    assert ctx["drafters"]["incumbent"]["1-2k"]["tau"] == pytest.approx(1.5)
    # 5 eval prompts at each of 2 concurrencies, then the 3 held-out turns once; the baseline gets no history
    assert len(cand.requests) == len(inc.requests) == 2 * 5 + 3 and len(base.requests) == 2 * 5
    tok = live_tokenizer(cfg)  # each history rendered as the server renders it, ready for the answer
    rendered = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                       add_generation_prompt=True)
    assert {"input_ids": tok(rendered, add_special_tokens=False).input_ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 24}} in cand.requests[-3:]
    text = (out / "report.md").read_text()
    assert "| 1-2k | 1 | 1 | 1.000 [–, –] | 1.500 [–, –] |" in text  # one prompt: no interval


def test_no_request_with_a_verify_cycle_is_an_error(tmp_path, serve, ckpts):
    cand = serve(info(f"/m/{ckpts['Kimi-K25-eagle3'].name}"), CAND_GOOD, first_token_only=frozenset({1, 4, 8}))
    cfg = parse_config(cfg_tree(tmp_path, {"server_url": cand.url}, timings={"decode_ms": 12.1, "cycle_ms": {3: 29.8}}))
    with pytest.raises(ServerError, match=r"none of the 3 mtbench requests at concurrency 1 had a verify cycle"):
        measure_live(cfg, PROMPTS, {"candidate": str(ckpts["Kimi-K25-eagle3"])})


def test_cli_exit_codes_and_server_checks(tmp_path, serve, ckpts):
    urls = three_servers(serve, ckpts, CAND_GOOD, INC_K2)
    cand, inc, base = urls.pop("_servers")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg_tree(tmp_path, urls)))
    k25 = ckpts["Kimi-K25-eagle3"]
    assert gate_command(path, k25, live=True, incumbent=str(ckpts["Kimi-K2-Instruct-eagle3"])) == 0
    # the candidate's server serves another drafter than the checkpoint being gated
    assert gate_command(path, ckpts["Kimi-K2-Instruct-eagle3"], live=True) == 2
    # the baseline speculates; the incumbent runs other --speculative-* flags
    bad = dict(urls, baseline_url=cand.url)
    path.write_text(yaml.safe_dump(cfg_tree(tmp_path, bad)))
    assert gate_command(path, k25, live=True) == 2
    other = serve(info(f"/models/{ckpts['Kimi-K2-Instruct-eagle3'].name}", steps=5, draft_tokens=6), INC_K2)
    path.write_text(yaml.safe_dump(cfg_tree(tmp_path, dict(urls, incumbent_url=other.url))))
    with pytest.raises(ServerError, match=r"different \(num_steps, topk, draft_tokens\): \(3, 1, 4\) vs \(5, 1, 6\)"):
        measure_live(parse_config(cfg_tree(tmp_path, dict(urls, incumbent_url=other.url))), PROMPTS,
                     {"candidate": str(k25)})
    with pytest.raises(ServerError, match="speculates"):
        measure_live(parse_config(cfg_tree(tmp_path, bad)), PROMPTS, {})


def test_the_production_gate_on_a_machine_without_the_target_says_so(tmp_path, ckpts, capsys):
    """The README's production gate (configs/kimi-k25-from-k2.yaml) where target.name, a local path, does not exist
    yet: one line naming the key and the fix, not the hub's "Repo id must be in the form ..."; nothing recorded."""
    config = Path(__file__).resolve().parents[1] / "configs" / "kimi-k25-from-k2.yaml"
    target = f"{tmp_path}/models/moonshotai/Kimi-K2.5"
    overrides = [f"run_dir={tmp_path / 'run'}", f"target.name={target}", f"gate.promoted_dir={tmp_path / 'promoted'}",
                 f"gate.history_file={tmp_path / 'promotions.jsonl'}"]
    assert gate_command(config, ckpts["Kimi-K25-eagle3"], overrides, live=True) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: target.name: no such directory {target}; point it at the local checkpoint"]
    assert not (tmp_path / "promotions.jsonl").exists()


def test_without_baseline_the_configured_timings_for_the_served_k(tmp_path, serve, ckpts):
    """Older servers: /get_server_info, spec_accept_histogram, no first_token_latency; t_decode and t_cycle from
    eval.timings at the k the server runs."""
    cand = serve(info(f"/m/{ckpts['Kimi-K25-eagle3'].name}"), CAND_GOOD, metrics=False, old_names=True)
    sglang = {"server_url": cand.url}
    cfg = parse_config(cfg_tree(tmp_path, sglang, timings={"decode_ms": 12.1, "cycle_ms": {3: 29.8}}))
    report = measure_live(cfg, PROMPTS, {"candidate": str(ckpts["Kimi-K25-eagle3"])})
    row = report["by_concurrency"]["1"]
    assert row["breakeven"]["source"] == "config (eval.timings, k = 3)"
    assert row["breakeven"]["tau_star"] == pytest.approx(29.8 / 12.1)
    ds = row["drafters"]["candidate"]["datasets"]["mtbench"]
    assert ds["tau"] == pytest.approx(3.0) and "prefill and queueing included" in ds["cycle_source"]
    cfg = parse_config(cfg_tree(tmp_path, sglang, num_steps=5, timings={"decode_ms": 12.1, "cycle_ms": {5: 35.0}}))
    with pytest.raises(ConfigError, match="eval.timings has no cycle time for the served k = 3"):
        measure_live(cfg, PROMPTS, {})


# ---------------------------------------------------------------- the serving sweep
def test_chain_tau_from_alpha():
    assert chain_tau([0.8, 0.5, 0.5], 0) == 1.0
    assert chain_tau([0.8, 0.5, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)


def test_sweep_picks_the_best_flags_on_a_hand_made_cost_table():
    """k=3 chain: 3.0 tokens / 29.8 ms = 100.7 tok/s; k=5 chain (tau predicted 3.43) / 36 ms = 95.4; a topk-4
    tree with 8 draft tokens: 3.3 / 31 ms = 106.5 -> the tree wins at concurrency 1. At 32 in flight the verify
    of 8 draft tokens per request is dear (60 ms): k=3 wins there; at 64 nothing beats plain decoding."""
    k3, k5, tree = ServingSetting(3, 1, 4), ServingSetting(5, 1, 6), ServingSetting(4, 4, 8)
    costs = [Cost(k3, 1, 29.8, 3.0), Cost(k5, 1, 36.0), Cost(tree, 1, 31.0, 3.3),
             Cost(k3, 32, 40.0, 3.0), Cost(k5, 32, 50.0), Cost(tree, 32, 60.0, 3.3),
             Cost(k3, 64, 70.0, 3.0), Cost(tree, 64, 95.0, 3.3)]
    alpha = [0.85, 0.8, 0.7, 0.6, 0.5]  # measured at the longest chain: k=3 -> 3.006, k=5 -> 3.4344
    out = recommend(costs, {1: 12.1, 32: 15.0, 64: 22.0}, alpha)
    assert out[1]["recommended"] == tree.flags() == ("--speculative-num-steps 4 --speculative-eagle-topk 4 "
                                                     "--speculative-num-draft-tokens 8")
    assert [s["flags"] for s in out[1]["settings"]] == [tree.flags(), k3.flags(), k5.flags()]
    k5_row = next(s for s in out[1]["settings"] if s["num_steps"] == 5)
    assert k5_row["tau"] == pytest.approx(3.4344) and k5_row["tau_source"] == "predicted from alpha"
    assert out[32]["recommended"] == k3.flags() and out[32]["settings"][0]["speedup"] == pytest.approx(3.0 * 15 / 40)
    assert out[64]["recommended"] is None and "serve without speculation" in out[64]["why"]


@pytest.mark.parametrize(("table", "says"), [
    ({"decode_ms": {"1": 0}}, 'decode_ms["1"] must be a finite number > 0, got 0'),  # a ZeroDivisionError
    ({"decode_ms": {"1": -12}}, 'decode_ms["1"] must be a finite number > 0, got -12'),
    ({"decode_ms": {"0": 12.1}}, "decode_ms key (a concurrency) must be >= 1, got '0'"),
    ({"settings": [{"num_steps": 3, "topk": 1, "draft_tokens": 4, "cycle_ms": float("nan"), "tau": 2.5}]},
     "settings[0].cycle_ms must be a finite number > 0, got nan"),
    ({"settings": [{"num_steps": 3, "topk": 1, "draft_tokens": 4, "cycle_ms": 30, "tau": -1}]},
     "settings[0].tau must be a finite number >= 1, got -1"),
    ({"settings": [{"num_steps": 0, "topk": 1, "draft_tokens": 4, "cycle_ms": 30}]},
     "settings[0].num_steps must be >= 1, got 0"),
    ({"settings": []}, "settings: empty; give at least one serving setting to rank"),
])
def test_sweep_refuses_a_table_that_would_rank_nonsense(table, says, tmp_path, capsys):
    """A zero, negative or NaN time (or count) is one line naming the file and the field, exit 2, and no sweep."""
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"decode_ms": {"1": 12.1}, "settings": [
        {"num_steps": 3, "topk": 1, "draft_tokens": 4, "cycle_ms": 29.8, "tau": 2.5}]} | table))
    assert sweep_command(table=path, out=tmp_path / "out") == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {path}: {says}"]
    assert not (tmp_path / "out").exists()


def test_sweep_cli_on_a_table_file(tmp_path, capsys):
    table = tmp_path / "costs.json"
    table.write_text(json.dumps({"decode_ms": {"1": 12.1}, "settings": [
        {"num_steps": 3, "topk": 1, "draft_tokens": 4, "cycle_ms": 29.8, "tau": 2.0},
        {"num_steps": 2, "topk": 1, "draft_tokens": 3, "cycle_ms": 24.0, "tau": 1.9}]}))
    assert sweep_command(table=table, out=tmp_path / "out") == 0
    out = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert out["1"]["recommended"] is None  # tau 2.0 < tau* 2.46: the team's K2-drafter situation
    assert "no speculation" in capsys.readouterr().out
    table.write_text(json.dumps({"decode_ms": {"1": 12.1}, "settings": [{"num_steps": 3, "topk": 2,
                                                                         "draft_tokens": 6, "cycle_ms": 30}]}))
    assert sweep_command(table=table, out=tmp_path / "out") == 2  # a tree's tau cannot be predicted from alpha
