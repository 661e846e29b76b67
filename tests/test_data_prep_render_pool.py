"""render_all's worker pool: forked while the process holds no CUDA context, started from a fork server once it
does (a fork of a CUDA process is the known hazard where trainers started side by side on the H200 all stopped);
the samples are the same either way."""

from __future__ import annotations

import multiprocessing as mp

import torch

from data_prep import capture

CONVS = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Name {i} colours."},
                                      {"role": "assistant", "content": "Red, green and blue." * (i + 1)}]}
         for i in range(6)]


def test_the_pool_leaves_fork_once_cuda_is_initialized(smollm2, monkeypatch) -> None:
    tok = smollm2.tokenizer
    alone, _ = capture.render_all(CONVS, tok, 4096, workers=1)
    monkeypatch.setattr(capture, "RENDER_POOL_MIN", 1)
    started: list[str | None] = []
    real = mp.get_context
    monkeypatch.setattr(mp, "get_context", lambda method=None: started.append(method) or real(method))
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda cuda=cuda: cuda)
        before = len(started)
        pooled, _ = capture.render_all(CONVS, tok, 4096, workers=2)
        assert started[before] == ("forkserver" if cuda else "fork")
        assert [(s.id, s.input_ids, s.loss_mask) for s in pooled] == [(s.id, s.input_ids, s.loss_mask) for s in alone]
