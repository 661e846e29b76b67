"""drafter.aux_scale: per_state. fc reads standardized aux states while training; the drafter's function is the
same as before the scale was set, and a saved checkpoint has the scale folded into fc, so SGLang (which reads fc
alone) and our own loader compute what the training drafter computed."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from train_fixtures import H, make_config, make_store

from common.config import load_config
from drafter.model import Eagle3Drafter
from drafter.sglang_checkpoint import check_checkpoint, load_checkpoint, save_checkpoint
from train.build import aux_state_scales
from train.data import store_data


def test_the_scale_keeps_the_function_and_is_folded_into_fc_at_save(tiny_drafter: Eagle3Drafter,
                                                                     tmp_path: Path) -> None:
    h = tiny_drafter.shape.hidden_size
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(2, 5, 3 * h, generator=g) * torch.tensor([1.0, 8.0, 40.0]).repeat_interleave(h)
    before = tiny_drafter.project_aux(aux)
    scale = torch.tensor([1.0, 1 / 8, 1 / 40]).repeat_interleave(h)
    tiny_drafter.set_aux_scale(scale)
    torch.testing.assert_close(tiny_drafter.project_aux(aux), before, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # a training step's worth of change, on the standardized-input weight
        tiny_drafter.fc.weight.add_(0.01 * torch.randn(tiny_drafter.fc.weight.shape, generator=g))
    trained = tiny_drafter.project_aux(aux)
    assert copy.deepcopy(tiny_drafter).to(torch.bfloat16).aux_scale.dtype == torch.float32  # folded exactly
    save_checkpoint(tiny_drafter, tmp_path / "ckpt", dtype="float32")
    assert check_checkpoint(tmp_path / "ckpt") == []  # no extra tensor: the strict checker passes
    served = load_checkpoint(tmp_path / "ckpt")
    served.set_embeddings(tiny_drafter.embed_tokens.weight)
    assert torch.equal(served.aux_scale, torch.ones(3 * h))
    torch.testing.assert_close(served.project_aux(aux), trained, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(served.fc.weight @ aux[0, 0], trained[0, 0], rtol=1e-5, atol=1e-4)  # fc alone


def test_the_scales_come_from_the_median_row_norm_of_each_state(tmp_path: Path) -> None:
    make_store(tmp_path / "run" / "store", n_samples=20, length=16)
    data = store_data(load_config(make_config(tmp_path)))
    scale = aux_state_scales(data, torch.device("cpu"), samples=8)
    rows = torch.cat([data.train[i]["aux"].float() for i in range(8)])  # (tokens, 3H)
    want = [H ** 0.5 / float(state.norm(dim=-1).median()) for state in rows.chunk(3, dim=-1)]
    assert scale.shape == (3 * H,)
    torch.testing.assert_close(scale[::H], torch.tensor(want), rtol=1e-5, atol=0)
    assert torch.equal(scale, scale[::H].repeat_interleave(H))
