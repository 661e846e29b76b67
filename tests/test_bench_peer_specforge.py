"""SpecForge's trainer on our batches (bench/peer_specforge.py): with the mask aligned it supervises exactly the rows
ours does, our drafter's weights cross into its draft model and back, and one of its steps on the real target's
online batches saves a drafter SGLang's checker accepts, after the same tokens our own trainer sees."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import specforge_on_cpu
import torch
from test_train_online import write_run

from bench import peer_specforge
from common.config import load_config
from drafter.model import Eagle3Drafter
from drafter.sglang_checkpoint import check_checkpoint, expected_tensors, load_tensors
from train.build import build_drafter
from train.data import training_data
from train.loop import run as run_training
from train.ttt import supervision, teacher_from_hidden

specforge_on_cpu.install()


@pytest.fixture
def eager() -> Iterator[None]:
    """SpecForge's torch.compile'd helpers run eagerly here (a CPU compile costs more than the test)."""
    with torch._dynamo.config.patch(disable=True):
        yield


def mapped(drafter: Eagle3Drafter, seed: int = 1) -> Eagle3Drafter:
    """``drafter`` with a scattered vocab map (draft id i -> a sorted random target id), as a real one is."""
    g = torch.Generator().manual_seed(seed)
    s = drafter.shape
    ids = torch.randperm(s.vocab_size, generator=g)[: s.draft_vocab_size].sort().values
    t2d = torch.zeros(s.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    drafter.set_vocab_map(ids - torch.arange(s.draft_vocab_size), t2d)
    return drafter


def test_aligned_mask_supervises_the_rows_ours_does(tiny_drafter: Eagle3Drafter, eager: None) -> None:
    from specforge.algorithms.eagle3.model import _compute_target_p
    from specforge.modeling.target.target_head import TargetHead

    d = mapped(tiny_drafter)
    s = d.shape
    torch.manual_seed(0)
    b, t = 3, 24
    hidden = torch.randn(b, t, s.hidden_size)
    lm_head = torch.randn(s.vocab_size, s.hidden_size)
    loss_mask = torch.zeros(b, t, dtype=torch.long)
    loss_mask[0, 5:18], loss_mask[1, 2:9], loss_mask[1, 14:23], loss_mask[2, 10:] = 1, 1, 1, 1
    argmax = (hidden @ lm_head.t()).argmax(-1)
    ours = supervision(teacher_from_hidden(hidden, lm_head[d.to_target_ids(torch.arange(s.draft_vocab_size))]),
                       argmax, loss_mask, d.t2d)
    ours_rows = (ours.label & ours.in_vocab)[:, 1:]  # our row t is scored at j = t + 1

    def specforge_rows(mask: torch.Tensor) -> torch.Tensor:
        ids, target, m = TargetHead.preprocess(None, torch.zeros(b, t, dtype=torch.long), hidden, mask)
        _, _, _, position_mask = _compute_target_p(target @ lm_head.t(), d.t2d, m)
        return position_mask[..., 0].bool()[:, :-1]

    assert ours_rows.any()
    assert torch.equal(specforge_rows(peer_specforge.aligned_mask(loss_mask)), ours_rows)
    # SpecForge's own offset supervises other rows (its first answer rows, and rows past the answer's end)
    assert not torch.equal(specforge_rows(loss_mask), ours_rows)


def test_weights_cross_into_specforge_and_back(tiny_drafter: Eagle3Drafter) -> None:
    d = mapped(tiny_drafter)
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    draft = peer_specforge.specforge_draft(d, init_from_ours=True, attention_backend="sdpa")
    assert not draft.embed_tokens.weight.requires_grad
    back = peer_specforge.back_to_ours(draft, d)
    for name in expected_tensors(d.shape):
        a, b = back.state_dict()[name], d.state_dict()[name]
        if a.is_floating_point():  # through SpecForge's bf16 weights
            torch.testing.assert_close(a, b.to(torch.bfloat16).float(), rtol=0, atol=0, msg=name)
        else:
            assert torch.equal(a, b), name
    fresh = peer_specforge.specforge_draft(d, init_from_ours=False, attention_backend="sdpa")
    assert torch.equal(fresh.d2t, d.d2t) and torch.equal(fresh.t2d, d.t2d)
    assert not torch.allclose(fresh.fc.weight.float(), d.fc.weight.to(torch.bfloat16).float())


@pytest.mark.real
def test_specforge_trains_on_our_batches_and_saves_a_servable_drafter(tmp_path: Path, eager: None) -> None:
    config = write_run(tmp_path / "ours", "online")
    assert run_training(config) == 0
    ours = [json.loads(line) for line in (tmp_path / "ours" / "train_log.jsonl").read_text().splitlines()]
    ours_tokens = max(r.get("tokens_seen", 0) for r in ours)
    ours_steps = max(r["step"] for r in ours if "loss" in r)

    out = tmp_path / "specforge" / "drafter"
    done = peer_specforge.train(load_config(config), peer_specforge.RECIPES["ours"], out, torch.device("cpu"))
    assert (done["steps"], done["tokens_seen"]) == (ours_steps, ours_tokens)
    assert done["loss_first_tenth"] > 0 and done["loss_last_tenth"] == done["loss_last_tenth"]  # finite
    assert check_checkpoint(out) == []
    names = ["fc.weight", "midlayer.mlp.down_proj.weight", "lm_head.weight"]
    saved = load_tensors(out, names)
    ours_last = load_tensors(sorted((tmp_path / "ours" / "checkpoints").glob("step-*"))[-1], names)
    cfg = load_config(config)
    initial, _ = build_drafter(cfg, training_data(cfg, torch.device("cpu")))
    for name in names:  # trained (moved from the shared start), and by another trainer than ours
        start = initial.state_dict()[name].to(torch.bfloat16)
        assert not torch.equal(saved[name], start), name
        assert not torch.equal(saved[name], ours_last[name]), name


@pytest.mark.real
def test_specforge_as_it_ships_trains_from_its_own_init_at_its_own_lr(tmp_path: Path, eager: None) -> None:
    config = write_run(tmp_path / "run", "online")
    cfg = load_config(config)
    out = tmp_path / "shipped" / "drafter"

    done = peer_specforge.train(cfg, peer_specforge.RECIPES["shipped"], out, torch.device("cpu"))

    total, _ = peer_specforge.our_batches(cfg, training_data(cfg, torch.device("cpu")), torch.device("cpu"))
    assert done["steps"] == total and done["lr"] == 1e-4 and done["warmup_ratio"] == 0.015
    assert done["mask"] == "SpecForge's (unshifted)" and done["initial"].startswith("SpecForge's random init")
    assert done["loss_last_tenth"] == done["loss_last_tenth"]  # finite
    assert check_checkpoint(out) == []
    initial, _ = build_drafter(cfg, training_data(cfg, torch.device("cpu")))
    saved = load_tensors(out, ["midlayer.self_attn.q_proj.weight"])["midlayer.self_attn.q_proj.weight"]
    start = initial.state_dict()["midlayer.self_attn.q_proj.weight"].to(torch.bfloat16)
    assert not torch.allclose(saved.float(), start.float(), atol=1e-2)  # not our init: SpecForge's random one
