"""How the three aux states the drafter's fc reads compare in scale: the case for normalizing them before fc.

    python bench/aux_scales.py --config configs/smollm2-135m-h200.yaml --set target.device=cpu

fc reads the concatenated outputs of three target layers as they are. Residual streams grow with depth, and
small models carry "massive activations" (a few dimensions thousands of times the typical value, on a few
tokens), so fc's input is dominated by the top layer and by a few rows and dimensions; with Adam's per-weight
steps that is an uneven effective learning rate across fc's inputs. EAGLE 3.1's ``fc_norm`` (an RMSNorm per aux
state before fc) addresses it; the SGLang versions our format targets do not read that field, so a fix would
have to live inside fc's weights (a fixed per-state scale folded in at save time).

Every prompt of the config's eval datasets (first turn, chat-templated, their limits lifted), one target pass
each in float32, the aux ids the config resolves to. Per aux id, under "aux_scales" in bench/results.json:
rows (tokens), median / p99 / max row L2 norm, max_abs and the dimension holding it, that dimension's median
|value| over all rows (its typical size), and massive_row_share (rows whose norm exceeds 10x the median);
plus median_norm_ratio_top_to_bottom (the last aux id's median row norm over the first's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import record  # noqa: E402
from eval.quality import setup  # noqa: E402
from target_model.aux_layers import resolve_aux_layer_ids  # noqa: E402


def layer_figures(rows: torch.Tensor) -> dict[str, Any]:
    """Scale figures of one aux state over all its rows (tokens x hidden)."""
    norms = rows.norm(dim=-1)
    median = float(norms.median())
    peak = rows.abs().amax(dim=0)
    dim = int(peak.argmax())
    return {"rows": rows.shape[0], "median_row_norm": round(median, 2),
            "p99_row_norm": round(float(norms.quantile(0.99)), 2), "max_row_norm": round(float(norms.max()), 2),
            "max_abs": round(float(peak[dim]), 2), "max_abs_dim": dim,
            "max_abs_dim_median_abs": round(float(rows[:, dim].abs().median()), 3),
            "massive_row_share": round(float((norms > 10 * median).float().mean()), 5)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--limit", type=int, help="prompts per dataset (smoke runs; figures are for all)")
    args = ap.parse_args()
    cfg, target, prompts = setup(args.config, args.limit, overrides=args.set)
    ids = resolve_aux_layer_ids(cfg.target.aux_layer_ids, None, target.num_layers)
    per_layer: list[list[torch.Tensor]] = [[] for _ in ids]
    with torch.no_grad():
        for sets in prompts.values():
            for prompt in sets:
                aux = target.forward(torch.tensor([prompt]), ids, logits=False).aux[0].float().cpu()
                for rows, state in zip(per_layer, aux.chunk(len(ids), dim=-1), strict=True):
                    rows.append(state)
    layers = {str(i): layer_figures(torch.cat(rows)) for i, rows in zip(ids, per_layer, strict=True)}
    first, last = layers[str(ids[0])], layers[str(ids[-1])]
    record("aux_scales", {"target": cfg.target.name, "aux_layer_ids": list(ids),
                          "prompts": {n: len(p) for n, p in prompts.items()}, "layers": layers,
                          "median_norm_ratio_top_to_bottom": round(last["median_row_norm"] / first["median_row_norm"],
                                                                   2)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
