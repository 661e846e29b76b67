"""bench/regenerate_throughput.py --shares: each device's share of a several-device run, alone on one device (the
projection of a 2-GPU run where one GPU is lent). The shares are the prompts regenerate gives each device and add
up to the whole; a later call adds its ranks beside an earlier call's (after the same full run); the projection is
the full run's seconds over the slowest share's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import regenerate_throughput as bench
from data_prep.regenerate_devices import share_of


def write_prompts(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            turns = [{"role": "user", "content": f"Say the number {i}."}, {"role": "assistant", "content": "-"},
                     {"role": "user", "content": "And the next one?"}][: 1 + 2 * (i % 2)]
            f.write(json.dumps({"id": f"p{i}", "source": "test", "messages": turns}) + "\n")
    return path


def test_shares_are_the_devices_parts_and_add_up_to_the_whole(tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "prompts.jsonl", 60)
    whole = bench.share_lines(prompts, 50, None)
    parts = [bench.share_lines(prompts, 50, (r, 3)) for r in range(3)]
    assert len(whole) == 50 and all(parts)
    assert sorted(line for part in parts for line in part) == sorted(whole)
    for r, part in enumerate(parts):
        assert all(share_of(json.loads(line)["id"], 3) == r for line in part)
        assert part == [line for line in whole if line in part], "a share is not in the prompts' order"


def test_a_later_call_adds_its_ranks_and_a_call_with_a_full_run_starts_afresh() -> None:
    key = {"devices": 2, "prompts_file": "p.jsonl", "conversations": 100, "overrides": []}
    first = bench.shares_figures({}, key, {"0": {"seconds": 60.0}}, {"seconds": 100.0})
    assert first["ranks_measured"] == ["0"] and first["projected_speedup"] == pytest.approx(100 / 60, abs=1e-3)
    both = bench.shares_figures(first, key, {"1": {"seconds": 80.0}}, None)
    assert both["ranks_measured"] == ["0", "1"] and both["full"] == {"seconds": 100.0}
    assert both["projected_speedup"] == 1.25  # the slowest share decides
    again = bench.shares_figures(both, key, {"1": {"seconds": 50.0}}, {"seconds": 90.0})
    assert again["ranks_measured"] == ["1"] and again["projected_speedup"] == 1.8
    other = bench.shares_figures(both, key | {"conversations": 7}, {"1": {"seconds": 80.0}}, None)
    assert "full" not in other and "projected_speedup" not in other and list(other["ranks"]) == ["1"]


def test_cpu_runs_record_the_full_run_and_each_share_with_their_spans(bench_results: Path, tmp_path: Path) -> None:
    """The real regenerate command three times on SmolLM2 on the CPU, over two calls as on a GPU whose call
    cannot hold all three: the whole and the first half, then (no full run) the second half."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", 6)
    common = ["--config", "configs/smollm2-135m-h200.yaml", "--prompts-file", str(prompts), "--conversations", "4",
              "--exact-prompts", "0", "--shares", "2", "--out", str(tmp_path / "o"), "--set", "target.device=cpu",
              "--set", "target.dtype=float32", "--set", "regenerate.max_new_tokens=4"]
    assert bench.main([*common, "--share-ranks", "0"]) == 0
    whole = json.loads(bench_results.read_text())["regenerate"]
    assert bench.main([*common, "--gpus", "--share-ranks", "1"]) == 0
    results = json.loads(bench_results.read_text())
    shares = results["regenerate_shares"]
    assert results["regenerate"] == whole, "a call without a full run replaced the full run's object"
    assert whole["conversations"] == 4 and whole["spans"]["conversations"] == 4
    assert whole["host_samples"] and "timeline" in whole["engine"]  # the child's engine was profiled
    assert shares["ranks_measured"] == ["0", "1"] and shares["full"]["seconds"] == whole["seconds"]
    assert sum(shares["ranks"][r]["conversations"] for r in "01") == 4
    assert sum(shares["ranks"][r]["gen_tokens"] for r in "01") == whole["gen_tokens"]
    slowest = max(shares["ranks"][r]["seconds"] for r in "01")
    assert shares["projected_speedup"] == round(whole["seconds"] / slowest, 3)
    assert (bench_results.parent / "regenerate_timeline-share-1-of-2.png").stat().st_size > 0


def test_kept_caches_go_to_their_own_keys_and_outlive_the_run(bench_results: Path, tmp_path: Path) -> None:
    """--kept-caches: the runs compile over one folder that no run empties (a rerun's warm caches), and their
    figures go beside the fresh-cache ones, never over them."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", 4)
    kept = tmp_path / "kept"
    (kept / "triton").mkdir(parents=True)
    (kept / "triton" / "earlier-kernel").write_text("x")
    assert bench.main(["--config", "configs/smollm2-135m-h200.yaml", "--prompts-file", str(prompts),
                       "--conversations", "2", "--exact-prompts", "0", "--shares", "2", "--share-ranks", "0",
                       "--out", str(tmp_path / "o"), "--kept-caches", str(kept), "--set", "target.device=cpu",
                       "--set", "target.dtype=float32", "--set", "regenerate.max_new_tokens=4"]) == 0
    results = json.loads(bench_results.read_text())
    assert "regenerate" not in results and "regenerate_shares" not in results
    run, share = results["regenerate_kept_caches"], results["regenerate_shares_kept_caches"]
    assert run["compile_caches"].startswith("1 files at start in ") and str(kept) in run["compile_caches"]
    assert share["ranks"]["0"]["compile_caches"].endswith(str(kept)) and "projected_speedup" in share
    assert (kept / "triton" / "earlier-kernel").is_file()
