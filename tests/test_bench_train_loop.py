"""bench/train_loop.py on CPU over a tiny store: the real ``python -m train`` runs its steps and the bench step runs
at the drafter that loop trains (shape, draft vocab and TTT from the config; rows x length = batch_tokens), and
the object says what was compared."""

from __future__ import annotations

import json
import statistics

from train_fixtures import DRAFT_V, H, V, make_config, make_store

from bench import train_loop


def test_the_loop_and_the_step_at_the_same_drafter(bench_results, tmp_path) -> None:
    cfg = make_config(tmp_path, epochs=4, batch_tokens=192, ttt_length=3)  # the store source
    out = tmp_path / "bench"
    make_store(out / "store", n_samples=48, length=24)
    convs = tmp_path / "conversations.jsonl"
    convs.write_text("")
    assert train_loop.main(["--config", str(cfg), "--conversations", str(convs), "--out", str(out), "--steps", "6",
                            "--skip", "2", "--seq", "48", "--bench-steps", "2", "--bench-warmup", "1"]) == 0
    obj = json.loads(bench_results.read_text())["train_loop_smollm2"]
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "tokens_per_s" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6] and not any("holdout/acc_0" in r for r in log)
    assert obj["loop_steps"] == 6 and obj["loop_tokens_per_s"] > 0 and obj["bench_tokens_per_s"] > 0
    assert obj["loop_real_tokens_per_step"] == 192  # 8 samples of 24 tokens, no padding
    assert obj["ratio"] == round(obj["loop_tokens_per_s"] / obj["bench_tokens_per_s"], 3)
    # no padding here: the real tokens' rate is the padded one's, step by step
    assert all(r["real_tokens_per_s"] == r["tokens_per_s"] for r in steps)
    assert obj["loop_real_tokens_per_s"] == round(statistics.median(r["real_tokens_per_s"] for r in steps[2:]), 1)
    assert obj["ratio_real"] == round(obj["loop_real_tokens_per_s"] / obj["bench_tokens_per_s"], 3)
    # each step's split (the store's batches need no target forward), and its medians over the same steps
    assert all(r["drafter_ms"] > 0 and 0 <= r["target_ms"] < r["drafter_ms"] for r in steps)
    assert obj["loop_target_ms"] == statistics.median(r["target_ms"] for r in steps[2:])
    assert obj["loop_drafter_ms"] == statistics.median(r["drafter_ms"] for r in steps[2:])
    c = obj["compared"]
    assert (c["source"], c["ttt_length"], c["batch_tokens"]) == ("store", 3, 192)
    assert (c["bench_batch"], c["bench_seq"]) == (4, 48)
    assert c["shape"]["hidden_size"] == H and c["shape"]["vocab_size"] == V
    assert c["shape"]["draft_vocab_size"] == DRAFT_V and c["shape"]["intermediate_size"] == 64
    raw = obj["bench_raw"]
    assert (raw["batch"], raw["seq"], raw["ttt_length"], raw["compile"]) == (4, 48, 3, False)


def test_a_row_length_that_does_not_divide_the_batch_is_one_line(tmp_path, capsys) -> None:
    cfg = make_config(tmp_path, batch_tokens=192)
    convs = tmp_path / "conversations.jsonl"
    convs.write_text("")
    assert train_loop.main(["--config", str(cfg), "--conversations", str(convs), "--out", str(tmp_path / "b"),
                            "--seq", "100"]) == 2
    assert capsys.readouterr().err == "train_loop: --seq 100 does not divide train.batch_tokens 192\n"
