"""train.optim.clip_into_step: the clip folded into the fused AdamW step (torch's fused kernels run on CPU too) takes
the same steps and returns the same norms as clip_grad_norm_ then the step; other optimizers clip as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from torch import nn
from train_fixtures import make_config, make_store

import train.loop
from train.optim import clip_into_step, fused_adam, make_optimizer, trainable


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    model[0].bias.requires_grad_(False)  # a frozen parameter: outside the optimizer, as the embedding is
    return model


def _backward(model: nn.Module, k: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(k)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g)
    dev = next(model.parameters()).device
    x, y = x.to(dev), y.to(dev)
    (scale * nn.functional.mse_loss(model(x), y)).backward()


def _train(fold: bool, max_norm: float, steps: int = 6, scale: float = 1.0,
           nonfinite_at: int | None = None) -> tuple[nn.Module, list[torch.Tensor]]:
    """``steps`` steps of AdamW(fused) clipped at ``max_norm``, either way; the step whose norm is not finite is
    skipped, as the loop skips it."""
    model = _model()
    opt = make_optimizer(model, lr=1e-2, weight_decay=0.1, fused=True)
    norms = []
    for k in range(steps):
        _backward(model, k, scale)
        if k == nonfinite_at:
            model[2].weight.grad[0, 0] = float("nan")
        params = trainable(model)
        norm = clip_into_step(opt, params, max_norm) if fold else nn.utils.clip_grad_norm_(params, max_norm)
        if torch.isfinite(norm):
            opt.step()
            assert not hasattr(opt, "grad_scale")  # the step took it: no later step is divided by it
        opt.zero_grad(set_to_none=True)
        norms.append(norm)
    return model, norms


@pytest.mark.parametrize("max_norm, clipping", [(0.05, True), (1e3, False)])
def test_the_fold_steps_as_clip_then_step(max_norm, clipping):
    folded, folded_norms = _train(True, max_norm)
    plain, plain_norms = _train(False, max_norm)
    assert all((n > max_norm) == clipping for n in plain_norms), plain_norms
    torch.testing.assert_close(torch.stack(folded_norms), torch.stack(plain_norms), rtol=1e-6, atol=0)
    assert torch.equal(folded_norms[0], plain_norms[0])  # the same grads: the same norm, bit for bit
    for a, b in zip(folded.parameters(), plain.parameters(), strict=True):
        if clipping:  # x / (1 / c) against x * c: an ulp apart per step
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        else:  # divided by exactly 1 against multiplied by exactly 1
            assert torch.equal(a, b)


def test_a_nonfinite_norm_is_returned_and_its_skipped_step_leaves_nothing_behind():
    folded, folded_norms = _train(True, 0.05, nonfinite_at=2)
    plain, plain_norms = _train(False, 0.05, nonfinite_at=2)
    assert folded_norms[2].isnan() and plain_norms[2].isnan()
    torch.testing.assert_close(torch.stack(folded_norms[3:]), torch.stack(plain_norms[3:]), rtol=1e-6, atol=0)
    for a, b in zip(folded.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kwargs", [{"fused": False}, {"foreach": True}, {"foreach": False}])
def test_an_unfused_optimizer_clips_the_gradients_first(kwargs):
    model = _model()
    opt = torch.optim.AdamW(trainable(model), lr=1e-2, **kwargs)
    assert fused_adam(opt) is None
    _backward(model, 0)
    before = [p.grad.clone() for p in trainable(model)]
    calls = []
    norm = clip_into_step(opt, trainable(model), 0.05,
                          lambda params, m: calls.append(m) or nn.utils.clip_grad_norm_(params, m))
    assert calls == [0.05] and not hasattr(opt, "grad_scale")
    coef = 0.05 / (norm + 1e-6)
    for g, p in zip(before, trainable(model), strict=True):
        torch.testing.assert_close(p.grad, g * coef)
    sgd = torch.optim.SGD(trainable(_model()), lr=1e-2, fused=True)  # fused, but not Adam
    assert fused_adam(sgd) is None


def test_params_other_than_the_optimizers_are_refused():
    model = _model()
    opt = make_optimizer(model, lr=1e-2, weight_decay=0.0, fused=True)
    _backward(model, 0)
    with pytest.raises(ValueError, match="optimizer's own"):
        clip_into_step(opt, trainable(model)[:1], 0.05)


def test_accelerates_optimizer_folds_without_a_grad_scaler():
    # as the loop makes it: accelerate's state is one per process, and the loop tests make theirs after this one
    accelerator = Accelerator(mixed_precision=train.loop.mixed_precision("auto"))
    model = _model()
    model, opt = accelerator.prepare(model, make_optimizer(model, lr=1e-2, weight_decay=0.0, fused=True))
    assert fused_adam(opt) is opt.optimizer
    _backward(model, 0)
    before = [p.grad.clone() for p in trainable(model)]
    norm = clip_into_step(opt, trainable(model), 0.05, accelerator.clip_grad_norm_)
    assert opt.optimizer.grad_scale == (norm + 1e-6) / 0.05
    assert all(torch.equal(g, p.grad) for g, p in zip(before, trainable(model), strict=True))  # not touched here
    opt.step()
    assert not hasattr(opt.optimizer, "grad_scale")
    opt.scaler = torch.amp.GradScaler("cpu")  # fp16: accelerate unscales before the clip and scales the step itself
    assert fused_adam(opt) is None
    opt.scaler = None


def _log(root: Path) -> list[dict]:
    return [json.loads(x) for x in (root / "run" / "train_log.jsonl").read_text().splitlines() if '"loss"' in x]


def test_the_loop_with_a_fused_optimizer_logs_as_a_separate_clip_does(tmp_path, monkeypatch):
    """train.loop through accelerate's optimizer, fused on CPU: the clip folded into the step against a separate
    clip_grad_norm_, with a window of non-finite gradients skipped, clipped and unclipped steps."""
    monkeypatch.setattr(train.loop, "make_optimizer", lambda model, lr, wd, fused: make_optimizer(model, lr, wd, True))
    folds = []

    def spy(optimizer, params, max_norm, clip):
        folds.append(fused_adam(optimizer) is not None)
        return clip_into_step(optimizer, params, max_norm, clip)

    logs = {}
    for name, clip in (("fold", spy), ("apart", lambda optimizer, params, max_norm, clip: clip(params, max_norm))):
        root = tmp_path / name
        cfg = make_config(root, max_steps=10, holdout_fraction=0.0, batch_tokens=40, max_nonfinite_in_row=50,
                          lr=1e-2, save_every=100, log_every=100, max_grad_norm=3.1)
        make_store(root / "run" / "store", n_samples=24, length=20, nonfinite_samples=2)
        monkeypatch.setattr(train.loop, "clip_into_step", clip)
        assert train.loop.run(cfg) == 0
        logs[name] = _log(root)
    assert folds and all(folds)
    fold, apart = logs["fold"], logs["apart"]
    assert [r["skipped_nonfinite"] for r in fold] == [r["skipped_nonfinite"] for r in apart]
    assert any(r["skipped_nonfinite"] for r in apart)
    norms = [r["grad_norm"] for r in apart if r["grad_norm"] is not None]
    assert min(norms) < 3.1 < max(norms), norms  # clipped steps and unclipped ones
    for a, b in zip(fold, apart, strict=True):
        for key in ("loss", "grad_norm"):
            assert (a[key] is None) == (b[key] is None)
            if b[key] is not None:
                assert a[key] == pytest.approx(b[key], rel=1e-5), (key, a, b)
