"""The target's decoder layers compiled for right-padded forwards: the same aux and final states as eager, a few
graphs for every batch shape, the aux hooks still run, and a compile that fails falls back to eager once."""

from __future__ import annotations

import pytest
import torch
from tiny_target import tiny_target_model

from target_model.compiled_layers import CompiledLayers
from target_model.hf_model import TargetModel

IDS = (0, 2, 4)


@pytest.fixture
def tiny_target() -> TargetModel:
    return tiny_target_model()


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA only"))])
def test_compiled_layers_give_the_eager_states_for_every_batch_shape(tiny_target: TargetModel, device: str) -> None:
    """On CUDA ``forward_right_padded`` itself runs them; on a CPU only ``run`` does."""
    t = tiny_target
    t.model.to(device)
    before = _graphs()
    for b, s in [(2, 32), (3, 48), (1, 64), (5, 16), (4, 80), (2, 112)]:
        ids = torch.randint(0, 100, (b, s))
        want = t.forward(ids, IDS, logits=False)
        got = (t.forward_right_padded(ids, IDS) if device == "cuda" else
               t.compiled_layers.run(lambda ids=ids: t.forward(ids, IDS, logits=False)))
        torch.testing.assert_close(got.aux, want.aux, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.last_hidden, want.last_hidden, rtol=1e-4, atol=1e-4)
        assert all("forward" not in layer.__dict__ for layer in t.layers)  # swapped back after each call
    assert t.compiled_layers.state == "compiled"
    assert 1 <= _graphs() - before <= 4  # six layers and six shapes share them (a batch of one row specialises)


def test_a_compile_that_fails_falls_back_to_eager_once(tiny_target: TargetModel, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    def broken(fn, **_kw):
        def run(*_a, **_k):
            raise torch._dynamo.exc.TorchRuntimeError("no kernel for this")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    t = tiny_target
    ids = torch.randint(0, 100, (2, 16))
    want = t.forward(ids, IDS, logits=False)
    layers = CompiledLayers(t.layers)
    for _ in range(2):
        got = layers.run(lambda: t.forward(ids, IDS, logits=False))
        assert torch.equal(got.aux, want.aux)  # exact: the eager fallback is the same kernels on the same data
    assert layers.state.startswith("off: TorchRuntimeError") and "no kernel for this" in layers.state
    assert capsys.readouterr().err.count("compiled layers are off") == 1
    assert all("forward" not in layer.__dict__ for layer in t.layers)


def test_errors_that_are_not_compile_failures_are_raised(tiny_target: TargetModel) -> None:
    layers = CompiledLayers(tiny_target.layers)
    with pytest.raises(IndexError):
        layers.run(lambda: tiny_target.forward(torch.tensor([[1000]]), IDS, logits=False))  # an id past the vocab
    assert layers.state == "compiled"
