"""Capture against the real SmolLM2: stored states equal a direct forward, resume is byte-exact, the
Dataset returns what was stored."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from common.config import parse_config
from data_prep.capture import run_capture
from data_prep.dataset import ShardDataset, TokenBudgetSampler, collate
from data_prep.loss_mask import render_with_mask
from data_prep.store import StoreError, load_target_head, read_manifest, token_counts

AUX = [2, 15, 27]
# Batched with right padding vs alone, or on another CPU (SIMD width, threads): the same fp32 sums in another
# order. Reordering a sum of n terms moves it by about eps * sqrt(n) of its terms' size (a random walk of
# roundings); SmolLM2's longest sums are the MLP's 1536 terms, and each of its 30 layers adds its own such error
# to the residual stream, so a token's states agree to eps * sqrt(1536) * sqrt(30) = 2.6e-5 of that token's
# largest state (measured: at most 2.4e-6 of it, on AVX-512, AVX2 and no SIMD, 1 and 2 threads). Relative to the
# token's largest state, not each element: one dimension of the residual stream reaches 2.5e4 while most stay
# under 100, and the small ones carry the large one's rounding.
ROW_TOL = torch.finfo(torch.float32).eps * (1536 * 30) ** 0.5


def assert_close_per_token(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Every element within ROW_TOL of its token's (row's) largest ``want``; returns the rows' tolerances."""
    tol = ROW_TOL * want.abs().amax(-1, keepdim=True)
    worst = ((got - want).abs() / tol).max()
    assert worst <= 1, f"off by {float(worst):.2f}x the tolerance (ROW_TOL of each token's largest state)"
    return tol


def _convs(n: int) -> list[dict]:
    words = "the cat sat on a warm mat and looked at birds outside".split()
    out = []
    for i in range(n):
        q = " ".join(words[: 2 + i % 9]) + f"? ({i})"
        a = " ".join(reversed(words[: 3 + (i * 7) % 10])) + "."
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q},
                {"role": "assistant", "content": a}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": f"Because {i}."}]
        # odd ones were cut at a loop (no end-of-turn in the loss); the others were never regenerated
        answers = sum(m["role"] == "assistant" for m in msgs)
        out.append({"id": f"conv-{i}", "source": "test", "messages": msgs}
                   | ({"finish_reasons": ["loop"] * answers} if i % 2 else {}))
    out.append({"id": "no-answer", "source": "test", "messages": [{"role": "user", "content": "hi"}]})
    return out


def _tree(run_dir: Path, **capture) -> dict:
    return {"run_dir": str(run_dir),
            "target": {"name": "smollm2-135m-instruct", "dtype": "float32", "device": "cpu", "aux_layer_ids": AUX},
            "data": {"sources": [{"kind": "lines", "path": "unused"}]},
            "capture": {"max_length": 40, "batch_tokens": 100, "dtype": "float32", "teacher": "hidden",
                        "shard_samples": 3, **capture},
            "eval": {"datasets": [{"name": "x", "kind": "lines"}]}}


def _setup(tmp: Path, n: int, **capture):
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in _convs(n)))
    return parse_config(_tree(tmp, **capture))


def _digests(store: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(store.iterdir())}


@pytest.mark.real
def test_stored_states_equal_direct_forward(smollm2, tmp_path):
    cfg = _setup(tmp_path, 5, shard_samples=2)
    summary = run_capture(cfg, target=smollm2)
    assert summary.skipped == {"no_loss_tokens": 1} and summary.samples == 5 and summary.shards == 3
    manifest = read_manifest(cfg.store_dir)
    assert manifest["end_of_turn_loss"] == "ended_answers" and manifest["unlocated_ends"] == summary.unlocated_ends == 0
    ds = ShardDataset(cfg.store_dir)
    head = load_target_head(cfg.store_dir)
    assert torch.equal(head["lm_head.weight"], smollm2.lm_head_weight())
    for i, conv in enumerate(_convs(5)[:5]):
        item = ds[i]
        assert item["id"] == conv["id"]
        r = render_with_mask(smollm2.tokenizer, conv["messages"], 40, finish_reasons=conv.get("finish_reasons"))
        assert item["input_ids"].tolist() == r.input_ids and item["loss_mask"].tolist() == r.loss_mask
        assert (2 in item["input_ids"][item["loss_mask"].bool()].tolist()) == (i % 2 == 0)  # <|im_end|>
        ref = smollm2.forward(torch.tensor([r.input_ids]), AUX)
        for j in range(len(AUX)):  # each aux layer's states against their own scale
            assert_close_per_token(item["aux"][:, j * 576:(j + 1) * 576], ref.aux[0][:, j * 576:(j + 1) * 576])
        assert_close_per_token(item["last_hidden"], ref.last_hidden[0])
        tol = assert_close_per_token(item["last_hidden"] @ head["lm_head.weight"].T, ref.logits[0])
        # the stored greedy token is the direct forward's, but where its top two logits are closer than the
        # rounding (a near-tie) either may win
        top2 = ref.logits[0].topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 2 * tol[:, 0]
        same = item["target_argmax"].long() == ref.logits[0].argmax(-1)
        assert bool((same | ~decided).all()) and int(decided.sum()) >= 0.9 * len(decided)
    counts = token_counts(cfg.store_dir, smollm2.vocab_size)
    assert counts.sum() == summary.loss_tokens == sum(int(ds[i]["loss_mask"].sum()) for i in range(len(ds)))

    # A corrupt shard is found by its checksum and rewritten to the same bytes; the others are kept.
    before = _digests(cfg.store_dir)
    shard = cfg.store_dir / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    again = run_capture(cfg, target=smollm2)
    assert (again.shards_reused, again.shards_written) == (2, 1)
    assert _digests(cfg.store_dir) == before

    # Another teacher on the same store is refused with what to do.
    with pytest.raises(StoreError, match="delete"):
        run_capture(parse_config(_tree(tmp_path, teacher="topk", topk=8)), target=smollm2)


@pytest.mark.real
def test_topk_teacher_matches_full_distribution(smollm2, tmp_path):
    cfg = _setup(tmp_path, 3, teacher="topk", topk=8, dtype="bfloat16")
    run_capture(cfg, target=smollm2)
    m = read_manifest(cfg.store_dir)
    assert m["dtypes"]["aux"] == "bfloat16" and m["topk"] == 8
    item = ShardDataset(cfg.store_dir)[0]
    assert item["aux"].dtype == torch.bfloat16 and "last_hidden" not in item
    ref = smollm2.forward(item["input_ids"].long()[None], AUX)
    logp = torch.log_softmax(ref.logits[0], -1)
    top = logp.topk(8, dim=-1)
    # the stored ids are the direct forward's top 8, in order, up to near-ties (see ROW_TOL): their log-probs
    # there are its top 8 values, and the ids match wherever their neighbours' values are further apart
    tol = ROW_TOL * ref.logits[0].abs().amax(-1, keepdim=True)
    ids = item["topk_ids"].long()
    torch.testing.assert_close(logp.gather(-1, ids), top.values, rtol=0, atol=float(2 * tol.max()))
    gaps = top.values[:, :-1] - top.values[:, 1:]
    apart = torch.cat([gaps[:, :1], torch.minimum(gaps[:, 1:], gaps[:, :-1]), gaps[:, -1:]], -1) > 2 * tol
    assert bool(((ids == top.indices) | ~apart).all())
    torch.testing.assert_close(item["topk_logprobs"].float(), top.values, rtol=2**-8, atol=1e-3)  # bf16 storage


@pytest.mark.real
def test_kill9_resume_is_byte_identical(tmp_path):
    def start(run: Path) -> subprocess.Popen:
        cfg = _setup(run, 12, shard_samples=1)
        path = run / "cfg.yaml"
        path.write_text(yaml.safe_dump(_tree(run, shard_samples=1)))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        assert cfg.store_dir == run / "store"
        return subprocess.Popen([sys.executable, "-m", "data_prep", "capture", "--config", str(path)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    ref = start(tmp_path / "ref")
    assert ref.wait(timeout=300) == 0, ref.stderr.read().decode()[-2000:]

    run = tmp_path / "killed"
    proc = start(run)
    manifest = run / "store" / "manifest.json"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if manifest.is_file() and json.loads(manifest.read_text())["shards"]:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    state = json.loads(manifest.read_text())
    assert not state["complete"] and 1 <= len(state["shards"]) < 12, "killed too late to test resume"

    again = start(run)
    assert again.wait(timeout=300) == 0, again.stderr.read().decode()[-2000:]
    assert "kept" in again.stdout.read().decode()
    assert _digests(run / "store") == _digests(tmp_path / "ref" / "store")
    summary = json.loads((run / "data_prep_summary.json").read_text())["capture"]
    assert summary["shards_reused"] >= 1 and summary["skipped"] == {"no_loss_tokens": 1}


def test_token_budget_batches_waste_little():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 2000, (3000,), generator=g).tolist()
    sampler = TokenBudgetSampler(lengths, batch_tokens=8192, window=512)
    batches = sampler.batches()
    assert sorted(i for b in batches for i in b) == list(range(3000))  # every sample once
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert all(len(b) * max(lengths[i] for i in b) <= 8192 for b in batches)
    assert sum(lengths) / padded > 0.95  # < 5 % padding
    sampler.set_epoch(1)
    assert sampler.batches() != batches
    halves = [TokenBudgetSampler(lengths, 8192, num_replicas=2, rank=r).batches() for r in (0, 1)]
    assert len(halves[0]) == len(halves[1])


def test_collate_pads_right_with_masks():
    samples = [{"id": str(n), "input_ids": torch.arange(1, n + 1, dtype=torch.int32),
                "loss_mask": torch.ones(n, dtype=torch.uint8), "aux": torch.randn(n, 6)} for n in (3, 5)]
    b = collate(samples, pad_id=7)
    assert b["input_ids"].tolist() == [[1, 2, 3, 7, 7], [1, 2, 3, 4, 5]]
    assert b["attention_mask"].sum().item() == 8 and b["loss_mask"].sum().item() == 8
    assert torch.equal(b["aux"][0, :3], samples[0]["aux"]) and b["aux"][0, 3:].abs().sum() == 0


def test_cli_config_errors_exit_2(tmp_path):
    bad = _tree(tmp_path)
    bad["capture"] |= {"dtype": "int8", "shard_samples": 0}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    p = subprocess.run([sys.executable, "-m", "data_prep", "capture", "--config", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith(str(path)) for line in lines)


def test_conversations_that_are_empty_or_not_utf8_are_errors_naming_file_and_line(tmp_path):
    from data_prep.capture import read_conversations
    from data_prep.capture_sample import CaptureError

    path = tmp_path / "conversations.jsonl"
    path.write_bytes(b"")
    with pytest.raises(CaptureError, match=r"conversations\.jsonl: no conversations in it; rerun regenerate"):
        read_conversations(path)
    good = json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}).encode()
    path.write_bytes(good + b"\n" + good.replace(b"hi", b"h\xffi") + b"\n")
    with pytest.raises(CaptureError, match=r"conversations\.jsonl:2: invalid UTF-8 at byte \d+ of the line"):
        read_conversations(path)


def test_capture_reports_what_max_length_and_the_answer_cap_take(tmp_path, monkeypatch, capsys):
    """A stub target (the real tokenizer, zero states): the printed summary, data_prep_summary.json and the manifest
    count the chat cut at capture.max_length (its tokens and loss tokens), the answer tokens train.max_answer_tokens
    takes out of the loss, and the chat skipped because every loss token lay past max_length."""
    import types

    from data_prep import capture
    from data_prep.loss_mask import Cuts
    from data_prep.steps import run_steps
    from target_model.hf_model import load_tokenizer, resolve_source

    tok = load_tokenizer(resolve_source("smollm2-135m-instruct", None), False)
    count = [{"role": "user", "content": "Count to ten."}, {"role": "assistant", "content": "1 2 3 4 5 6 7 8 9 10"},
             {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "1 2 3 4 5 6 7 8 9 10"}]
    late = [{"role": "user", "content": " ".join(["word"] * 60)}, {"role": "assistant", "content": "Yes."}]
    short = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello there, friend."}]
    (tmp_path / "conversations.jsonl").write_text("".join(
        json.dumps({"id": i, "messages": m}) + "\n" for i, m in (("count", count), ("late", late), ("short", short))))
    h, v = 8, len(tok)

    def forward(ids: torch.Tensor, aux_ids: list[int]) -> types.SimpleNamespace:
        return types.SimpleNamespace(aux=torch.zeros(*ids.shape, 3 * h), last_hidden=torch.zeros(*ids.shape, h))

    stub = types.SimpleNamespace(tokenizer=tok, name="stub", num_layers=30, hidden_size=h, vocab_size=v,
                                 fingerprint=lambda: "stub", embed_weight=lambda: torch.zeros(v, h),
                                 lm_head_weight=lambda: torch.zeros(v, h), forward_right_padded=forward)
    monkeypatch.setattr(capture, "load_capture_target", lambda cfg: stub)
    tree = _tree(tmp_path, max_length=64) | {"train": {"max_answer_tokens": 5}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(tree))
    assert run_steps("capture", tmp_path / "cfg.yaml") == 0

    kept = [(render_with_mask(tok, m, 4096), render_with_mask(tok, m, 4096, max_answer_tokens=5))
            for m in (count, short)]
    want = Cuts(1, len(kept[0][0].input_ids) - 64, sum(kept[0][1].loss_mask[64:]),
                sum(full.num_loss_tokens - capped.num_loss_tokens for full, capped in kept))
    assert want.truncated_tokens > 0 and want.truncated_loss_tokens > 0 and want.capped_loss_tokens > 0
    out = capsys.readouterr().out
    assert "skipped: loss_past_max_length: 1\n" in out and f"  {want}\n" in out
    summary = json.loads((tmp_path / "data_prep_summary.json").read_text())["capture"]
    manifest = read_manifest(tmp_path / "store")
    for record in (summary, manifest):
        assert record["skipped"] == {"loss_past_max_length": 1} and record["cuts"] == {
            "truncated_samples": 1, "truncated_tokens": want.truncated_tokens,
            "truncated_loss_tokens": want.truncated_loss_tokens, "capped_loss_tokens": want.capped_loss_tokens}
    # what was stored plus what the two caps took is the uncapped, uncut loss of the stored samples
    assert summary["loss_tokens"] + want.truncated_loss_tokens + want.capped_loss_tokens == sum(
        full.num_loss_tokens for full, _ in kept)
