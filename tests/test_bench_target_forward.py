"""bench/target_forward.py on CPU (plumbing: two layers of SmolLM2's shape, two lengths): each way meets each
length as a new shape, runs as named (cuDNN allowed or not, layers compiled or not), and the object says so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import target_forward  # noqa: E402


def test_each_way_runs_as_named(bench_results: Path) -> None:
    target = target_forward.smollm2_shaped(2, torch.device("cpu"), torch.float32)
    seen: list[bool] = []
    target.layers[0].register_forward_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    ids = torch.randint(0, 100, (2, 16))
    outs = {}
    for way in target_forward.WAYS:
        seen.clear()
        outs[way] = target_forward.forward_by_way(target, way, (0, 1))(ids)
        assert seen == [way == "cudnn_allowed"], way
    assert target.compiled_layers.compiled is not None  # the compiled way compiled the layers
    for way in ("no_cudnn", "compiled"):
        torch.testing.assert_close(outs[way].aux, outs["cudnn_allowed"].aux, rtol=1e-4, atol=1e-4)

    assert target_forward.main(["--device", "cpu", "--layers", "2", "--tokens", "96", "--lengths", "16", "32",
                                "--dtype", "float32"]) == 0
    obj = json.loads(bench_results.read_text())["target_forward"]
    assert (obj["layers"], obj["tokens"], obj["lengths"], obj["compiled_state"]) == (2, 96, [16, 32], "compiled")
    for way in target_forward.WAYS:
        assert len(obj[way]["first_ms"]) == len(obj[way]["again_ms"]) == 2 and obj[way]["again_ms_median"] > 0
    assert obj["again_speedup_compiled_over_no_cudnn"] == round(
        obj["no_cudnn"]["again_ms_median"] / obj["compiled"]["again_ms_median"], 3)
