"""``python -m eval quality``: the batched whole-dataset eval as an eval command (eval/quality.py), with the run
dir's lock, its report under run_dir/eval/<name>/quality.json and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from common.files import json_text
from drafter.sglang_checkpoint import save_checkpoint
from eval.commands import quality_command
from eval.quality import QualityError, parse_settings

REPO = Path(__file__).resolve().parents[1]


def write_config(tmp_path: Path) -> Path:
    cfg = {"run_dir": str(tmp_path / "run"),
           "target": {"name": "smollm2-135m-instruct", "device": "cpu", "aux_layer_ids": [2, 15, 27]},
           "data": {"sources": [{"kind": "lines", "path": "unused.txt"}]},
           "eval": {"num_steps": 3, "max_new_tokens": 8,
                    "datasets": [{"name": "mtbench", "kind": "mtbench", "path": "builtin", "limit": 1}]},
           "gate": {"promoted_dir": str(tmp_path / "promoted"), "history_file": str(tmp_path / "promotions.jsonl")}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_settings_are_k_colon_t_pairs():
    assert parse_settings(["3:0", "5:0.7"]) == [(3, 0.0), (5, 0.7)]
    for bad in (["3"], ["x:0"], ["0:0"], ["3:-1"], ["3:nan"], ["3:inf"], []):
        with pytest.raises(QualityError, match="--settings"):
            parse_settings(bad)


def test_bad_settings_are_one_line_and_exit_2(tmp_path, tiny_drafter):
    ckpt = save_checkpoint(tiny_drafter, tmp_path / "step-1", dtype="float32")
    r = subprocess.run([sys.executable, "-m", "eval", "quality", "--config", str(write_config(tmp_path)),
                        "--checkpoint", str(ckpt), "--settings", "3"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith("--settings 3: expected k:T, e.g. 3:0 "
                                                                            "(k drafts per cycle, temperature T)")


@pytest.mark.parametrize(("args", "line"), [
    (["--limit", "-1"], "python -m eval quality: error: argument --limit: must be a whole number >= 1, got -1"),
    (["--timing-prompts", "-5"],
     "python -m eval quality: error: argument --timing-prompts: must be a whole number >= 2, got -5"),
    (["--timing-prompts", "1"],
     "python -m eval quality: error: argument --timing-prompts: must be a whole number >= 2, got 1"),
    (["--context-prompts", "-1"],
     "python -m eval quality: error: argument --context-prompts: must be a whole number >= 0, got -1"),
    (["--settings", "3:nan"], "error: --settings 3:nan: expected k:T with k >= 1 and T a finite number >= 0, e.g. 3:0"),
    (["--settings", "3:inf"], "error: --settings 3:inf: expected k:T with k >= 1 and T a finite number >= 0, e.g. 3:0"),
])
def test_bad_counts_and_temperatures_are_refused_before_the_target_loads(args, line, tmp_path, monkeypatch, capsys):
    """--limit -1 would measure one prompt per dataset, a negative --timing-prompts all but the last few, T = nan
    nothing meaningful: each is one line and exit 2, and no model is loaded."""
    from eval import commands
    from eval.__main__ import main

    def no_target(*_a, **_k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(commands, "target_and_prompts", no_target)
    argv = ["quality", "--config", str(write_config(tmp_path)), "--checkpoint", str(tmp_path / "ckpt"), *args]
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == line


def test_records_skipped_as_short_stand_beside_each_datasets_prompts(tmp_path, monkeypatch):
    """quality.json counts, per dataset and setting, the records ``eval_prompts`` skipped for too few user turns
    (a tiny target and drafter, the drafter's load and fingerprint stubbed)."""
    from tiny_speculative import TinyTokenizer, tiny_target_and_drafter

    import eval.quality as q
    from eval.turns import EvalPrompts
    from target_model.hf_model import TargetModel

    aux = (0, 1, 2)
    model, drafter = tiny_target_and_drafter(12, aux)
    monkeypatch.setattr(q, "load_drafter", lambda *_a: (drafter, aux))
    monkeypatch.setattr(q, "fingerprint", lambda _p: "0" * 64)
    prompts = EvalPrompts({"mtbench": [[2, 3, 4], [5, 6, 7, 8]], "mt2": [[9, 10, 11]]}, {"mtbench": 0, "mt2": 3})
    target = TargetModel(model, TinyTokenizer(None), "tiny", None)  # no stop token: the timings get decode steps
    figures = q.quality(q.quality_config(write_config(tmp_path)), target, prompts, tmp_path / "ckpt",
                        [(3, 0.0), (2, 0.0)], timing_prompts=1, context_prompts=0)
    assert (figures["mt2"]["prompts"], figures["mt2"]["records_skipped_short"]) == (1, 3)
    assert figures["mtbench"]["records_skipped_short"] == 0
    assert {s["mt2"]["records_skipped_short"] for s in figures["settings"].values()} == {3}


@pytest.mark.real
def test_quality_measures_every_prompt_at_each_setting(tmp_path, smollm2, capsys, monkeypatch):
    from drafter.factory import fresh_drafter, shape_for_target
    from drafter.vocab_map import build_vocab_map

    d2t, t2d = build_vocab_map(torch.zeros(smollm2.vocab_size), 1024)
    drafter = fresh_drafter(shape_for_target(smollm2.hf_config, 1024, (2, 15, 27)), smollm2.embed_weight().detach(),
                            d2t, t2d)
    ckpt = save_checkpoint(drafter, tmp_path / "step-1", dtype="float32")
    assert quality_command(write_config(tmp_path), ckpt, settings=["3:0", "2:1"], timing_prompts=2, limit=2) == 0
    figures = json.loads((tmp_path / "run" / "eval" / "step-1" / "quality.json").read_text())
    assert set(figures["settings"]) == {"k3_T0", "k2_T1"} and set(figures["tau_star"]) == {"2", "3"}
    greedy = figures["settings"]["k3_T0"]["mtbench"]
    assert greedy["prompts"] == 2 and greedy["k"] == 3 and greedy["tau"] >= 1.0  # the config's limit (1) is lifted
    assert greedy["lossless_mismatches"] == 0  # fp32 target: speculative output equals greedy, token for token
    # a 1,024-id draft vocab (the lowest ids: no counts) misses some of the target's greedy tokens; T = 0 only
    missed = greedy["outside_draft_vocab"]
    assert 0 < missed["outside"] <= missed["tokens"] and missed["share"] == missed["outside"] / missed["tokens"]
    assert 1 <= missed["prompts_with_any"] <= 2 and missed["commonest"][0]["count"] >= 1
    assert figures["mtbench"] == greedy and figures["timing_prompts"] == 2
    assert isinstance(figures["gate"]["promote"], bool) and figures["gate"]["reasons"] is not None
    # every tau with its interval and prompts; tau* with its interval over the timing prompts
    for setting in figures["settings"].values():
        st = setting["mtbench"]
        assert st["prompts"] == 2 and st["ci"][0] <= st["tau"] <= st["ci"][1]
    low, high = figures["tau_star_ci"]["3"]
    assert low < figures["tau_star"]["3"] < high
    assert figures["gate"]["verdict"] in ("promote", "reject", "unresolved")
    # at T > 0 the oracle (the target's own greedy drafts) stands beside the drafter, the ceiling at that T
    sampled = figures["settings"]["k2_T1"]["mtbench"]
    assert sampled["oracle_tau"] >= 1.0 and len(sampled["oracle_alpha"]) == 2 and "oracle_tau" not in greedy
    assert "outside_draft_vocab" not in sampled
    assert figures["gate"]["intervals"]["mtbench"]["tau"]["prompts"] == 2
    assert "conversations.jsonl: not found" in figures["tau_by_context"]["skipped"]  # this run has none
    assert "quality: " in capsys.readouterr().out
    # every report of the run shares one store: under another name (a later gate with this drafter as its
    # incumbent, say) the same drafter is read, not measured again, and gives the same figures
    monkeypatch.setattr("eval.quality.acceptance", lambda *a, **k: pytest.fail("measured again under another name"))
    assert quality_command(write_config(tmp_path), ckpt, name="again", settings=["3:0", "2:1"], timing_prompts=2,
                           limit=2) == 0
    again = json.loads((tmp_path / "run" / "eval" / "again" / "quality.json").read_text())
    assert again["settings"] == figures["settings"]
    assert f"k=3 T=0: mtbench read from {tmp_path / 'run' / 'eval' / 'measured'}" in capsys.readouterr().out


def test_per_prompt_columns_add_up_to_tau_for_a_paired_comparison(tmp_path, smollm2):
    from drafter.factory import fresh_drafter, shape_for_target
    from drafter.vocab_map import build_vocab_map
    from eval.quality import quality, quality_config

    d2t, t2d = build_vocab_map(torch.zeros(smollm2.vocab_size), 1024)
    drafter = fresh_drafter(shape_for_target(smollm2.hf_config, 1024, (2, 15, 27)), smollm2.embed_weight().detach(),
                            d2t, t2d)
    ckpt = save_checkpoint(drafter, tmp_path / "step-1", dtype="float32")
    cfg = quality_config(write_config(tmp_path))
    prompts = {"mtbench": [smollm2.tokenizer("Name three colours.")["input_ids"],
                           smollm2.tokenizer("Count to five.")["input_ids"]]}

    figures = quality(cfg, smollm2, prompts, ckpt, [(3, 0.0)], timing_prompts=1, context_prompts=0,
                      per_prompt_columns=True)

    cols = figures["mtbench"]["per_prompt"]
    assert len(cols["tokens"]) == len(cols["cycles"]) == 2
    assert sum(cols["tokens"]) / sum(cols["cycles"]) == pytest.approx(figures["mtbench"]["tau"])


def test_an_incumbent_is_measured_on_the_same_prompts_and_the_gate_reads_the_paired_difference(tmp_path, smollm2):
    """A promotion must beat what serves: with ``incumbent`` the gate also holds the candidate to the incumbent's
    tau on the same prompts, so a drafter far below the shipped one is rejected whatever break-even says."""
    from drafter.factory import fresh_drafter, shape_for_target
    from drafter.sglang_checkpoint import fingerprint
    from drafter.vocab_map import build_vocab_map
    from eval.quality import quality, quality_config

    d2t, t2d = build_vocab_map(torch.zeros(smollm2.vocab_size), 1024)
    untrained = save_checkpoint(fresh_drafter(shape_for_target(smollm2.hf_config, 1024, (2, 15, 27)),
                                              smollm2.embed_weight().detach(), d2t, t2d),
                                tmp_path / "untrained", dtype="float32")
    shipped = REPO / "drafters" / "smollm2-135m-eagle3"
    cfg = quality_config(write_config(tmp_path))
    prompts = {"mtbench": [smollm2.tokenizer(text)["input_ids"] for text in  # 4: a loss real over 2 comparisons
                           ("Name three colours.", "Count to five.", "Say hello.", "List two fruits.")]}

    worse = quality(cfg, smollm2, prompts, untrained, [(3, 0.0)], timing_prompts=1, context_prompts=0,
                    incumbent=shipped)
    better = quality(cfg, smollm2, prompts, shipped, [(3, 0.0)], timing_prompts=1, context_prompts=0,
                     incumbent=untrained)

    for figures, candidate, incumbent in ((worse, untrained, shipped), (better, shipped, untrained)):
        iv = figures["gate"]["intervals"]["mtbench"]
        assert figures["gate"]["incumbent"] == str(incumbent) and figures["checkpoint"] == str(candidate)
        assert figures["gate"]["incumbent_fingerprint"] == fingerprint(incumbent) != figures["fingerprint"]
        assert iv["tau"]["point"] == pytest.approx(figures["mtbench"]["tau"])  # the candidate's own tau
        assert iv["vs_incumbent"]["point"] == pytest.approx(iv["tau"]["point"] - iv["incumbent_tau"]["point"])
    assert worse["gate"]["intervals"]["mtbench"]["vs_incumbent"]["ci"][1] < 0 and worse["gate"]["verdict"] == "reject"
    assert better["gate"]["intervals"]["mtbench"]["vs_incumbent"]["ci"][0] > 0
    assert "incumbent" not in quality(cfg, smollm2, prompts, shipped, [(3, 0.0)], timing_prompts=1,
                                      context_prompts=0)["gate"]


def test_sampling_at_t_above_zero_follows_the_configs_eval_seed(tmp_path, smollm2):
    """eval.seed sets sampling at T > 0: the drafter's figures and the oracle's beside them are those of that seed,
    and the report says which seed it was."""
    from drafter.factory import fresh_drafter, shape_for_target
    from drafter.vocab_map import build_vocab_map
    from eval.batched_eval import acceptance
    from eval.quality import load_drafter, quality, quality_config

    d2t, t2d = build_vocab_map(torch.zeros(smollm2.vocab_size), 1024)
    ckpt = save_checkpoint(fresh_drafter(shape_for_target(smollm2.hf_config, 1024, (2, 15, 27)),
                                         smollm2.embed_weight().detach(), d2t, t2d), tmp_path / "step-1",
                           dtype="float32")
    prompts = {"mtbench": [smollm2.tokenizer("Name three colours.")["input_ids"],
                           smollm2.tokenizer("Count to five.")["input_ids"]]}
    cfg = quality_config(write_config(tmp_path), overrides=["eval.seed=7", "eval.max_new_tokens=24"])
    drafter, aux = load_drafter(smollm2, cfg, ckpt)
    by_seed = {seed: acceptance(smollm2, drafter, aux, prompts, 2, 1.0, 24, seed=seed)["mtbench"]["per_prompt"]
               for seed in (0, 7)}
    assert by_seed[0] != by_seed[7]  # the two seeds sample differently, so the check below can tell them apart

    figures = quality(cfg, smollm2, prompts, ckpt, [(2, 1.0)], timing_prompts=1, context_prompts=0,
                      per_prompt_columns=True)

    assert figures["seed"] == 7 and figures["mtbench"]["per_prompt"] == by_seed[7]
    oracle = acceptance(smollm2, None, aux, prompts, 2, 1.0, 24, seed=7)["mtbench"]
    assert figures["mtbench"]["oracle_tau"] == pytest.approx(oracle["tau"])


def test_given_timings_set_the_break_even_the_gate_reads_without_timing_here(tmp_path, smollm2, monkeypatch):
    """With ``eval.timings`` (the deployment's decode and cycle ms) the gate's tau* is theirs, a constant with no
    timing prompts: acceptance measured on a CPU is gated against the serving machine's break-even, never the
    CPU's own; a k the timings lack is a one-line error."""
    import eval.quality as q

    shipped = REPO / "drafters" / "smollm2-135m-eagle3"
    prompts = {"mtbench": [smollm2.tokenizer("Name three colours.")["input_ids"],
                           smollm2.tokenizer("Count to five.")["input_ids"]]}
    monkeypatch.setattr(q, "timings", lambda *a, **k: pytest.fail("timed although eval.timings was given"))
    cfg = q.quality_config(write_config(tmp_path), overrides=["eval.timings={decode_ms: 20, cycle_ms: {3: 30}}"])

    figures = q.quality(cfg, smollm2, prompts, shipped, [(3, 0.0)], timing_prompts=2, context_prompts=0)

    assert figures["tau_star"]["3"] == pytest.approx(1.5) and figures["tau_star_ci"]["3"] == [1.5, 1.5]
    assert figures["timing_prompts"] == 0 and figures["timings_source"] == "config (eval.timings)"
    iv = figures["gate"]["intervals"]["mtbench"]
    assert iv["tau_star"]["point"] == pytest.approx(1.5) and iv["tau_star"]["prompts"] == 0
    assert iv["vs_breakeven"]["point"] == pytest.approx(figures["mtbench"]["tau"] - 1.5)
    assert "1.500 (given timings)" in iv["line"]
    monkeypatch.setattr(q, "load_drafter", lambda *a: pytest.fail("measured although the timings lack a k"))
    with pytest.raises(q.QualityError, match=r"eval.timings.cycle_ms has no entry for k = 5"):
        q.quality(cfg, smollm2, prompts, shipped, [(3, 0.0), (5, 0.0)], timing_prompts=2, context_prompts=0)


def test_a_cut_run_resumes_from_the_figures_it_kept(tmp_path, smollm2, monkeypatch, capsys):
    """With keep_dir every (drafter, dataset, setting) is kept as it lands: a rerun measures nothing it has, not
    even the greedy references, and gives the same figures; another drafter, setting or prompt set is measured."""
    import eval.batched_eval as be
    import eval.quality as q

    shipped = REPO / "drafters" / "smollm2-135m-eagle3"
    tok = smollm2.tokenizer
    prompts = {"a": [tok("Name three colours.")["input_ids"]],
               "b": [tok("Count to five.")["input_ids"], tok("Say hello.")["input_ids"]]}
    cfg = q.quality_config(write_config(tmp_path),
                           overrides=["eval.timings={decode_ms: 20, cycle_ms: {1: 24, 2: 27, 3: 30}}"])
    keep = tmp_path / "measured"

    first = q.quality(cfg, smollm2, prompts, shipped, [(3, 0.0), (2, 1.0)], timing_prompts=2, context_prompts=0,
                      keep_dir=keep, incumbent=shipped)
    # 2 datasets x 2 settings; the incumbent, the same weights and config at the gate's setting, reads the
    # candidate's own entries: the key names what the figures depend on, not which role measured them
    assert len(list(keep.glob("*.json"))) == 4

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again what was kept")

    monkeypatch.setattr(q, "acceptance", no_measuring)
    monkeypatch.setattr(be, "greedy_references", no_measuring)
    capsys.readouterr()
    again = q.quality(cfg, smollm2, prompts, shipped, [(3, 0.0), (2, 1.0)], timing_prompts=2, context_prompts=0,
                      keep_dir=keep, incumbent=shipped)
    assert json_text(again) == json_text(first)  # as written (a NaN, a 1-prompt alpha, is null on disk)
    assert f"{shipped} k=3 T=0: a, b read from {keep}" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="measured again"):  # another setting is another entry
        q.quality(cfg, smollm2, prompts, shipped, [(1, 0.0)], timing_prompts=2, context_prompts=0, keep_dir=keep)
