"""Tiny capture stores for the train tests, written with data_prep's own writer in the store format.

The task is learnable: aux at t is a fixed vector of token t (plus a little noise) and the target's
argmax at j = t + 1 is a fixed function of token t, so step 0 can read it straight from fc(aux[t]).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from transformers import LlamaConfig

from common.files import write_json_atomic
from data_prep.store import (
    MANIFEST,
    SCHEMA_VERSION,
    TARGET_HEAD,
    ShardWriter,
    shard_name,
)

H, V, LAYERS, DRAFT_V, USED = 32, 80, 4, 64, 64


def make_target(root: Path) -> Path:
    d = root / "target"
    LlamaConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                vocab_size=V, num_hidden_layers=LAYERS, rope_theta=10000.0).save_pretrained(d)
    return d


def make_store(store: Path, n_samples: int = 48, length: int = 24, shard_samples: int = 16, seed: int = 0,
               nonfinite_samples: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, H, generator=g)
    lm_head = torch.randn(V, H, generator=g)
    code = torch.randn(V, H, generator=g)  # token -> teacher hidden direction
    aux_code = torch.randn(V, 3 * H, generator=g)
    teacher_of = (torch.arange(V) * 5 + 3) % USED
    store.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file({"embed_tokens.weight": embed, "lm_head.weight": lm_head}, store / TARGET_HEAD)
    shards, sid = [], 0
    for k in range(0, n_samples, shard_samples):
        n = min(shard_samples, n_samples - k)
        t = n * length
        ids = torch.randint(0, USED, (t,), generator=g)
        prev = torch.roll(ids, 1)  # the target's next token after j follows from token j - 1
        last = 0.5 * lm_head[teacher_of[prev]] + 0.1 * code[ids]
        argmax = (last @ lm_head.t()).argmax(-1)
        aux = aux_code[ids] + 0.05 * torch.randn(t, 3 * H, generator=g)  # like real states: token-driven
        if nonfinite_samples and k == 0:
            aux[: nonfinite_samples * length] = float("nan")
        mask = torch.ones(t, dtype=torch.uint8)
        mask[torch.arange(t) % length < 4] = 0  # the "prompt"
        specs = {"offsets": (torch.int64, (n + 1,)), "input_ids": (torch.int32, (t,)),
                 "loss_mask": (torch.uint8, (t,)), "aux": (torch.float32, (t, 3 * H)),
                 "target_argmax": (torch.int32, (t,)), "last_hidden": (torch.float32, (t, H))}
        ids_meta = [f"s{sid + i}" for i in range(n)]
        sid += n
        w = ShardWriter(store / shard_name(len(shards)), specs,
                        {"ids": json.dumps(ids_meta), "schema_version": str(SCHEMA_VERSION)})
        w.write("offsets", 0, torch.arange(n + 1, dtype=torch.int64) * length)
        w.write("input_ids", 0, ids.int())
        w.write("loss_mask", 0, mask)
        w.write("aux", 0, aux)
        w.write("target_argmax", 0, argmax.int())
        w.write("last_hidden", 0, last)
        shards.append({"file": shard_name(len(shards)), "sha256": w.finish(), "num_samples": n, "num_tokens": t,
                       "num_loss_tokens": int(mask.sum())})
    manifest = {"schema_version": SCHEMA_VERSION,
                "target": {"name": "tiny", "fingerprint": f"tiny-{seed}", "num_layers": LAYERS, "hidden_size": H,
                           "vocab_size": V},
                "aux_layer_ids": [0, 1, 2], "teacher": "hidden", "topk": None,
                "dtypes": {"input_ids": "int32", "loss_mask": "uint8", "aux": "float32", "target_argmax": "int32",
                           "last_hidden": "float32"},
                "max_length": length, "end_of_turn_loss": "ended_answers", "shards": shards,
                "totals": {"num_samples": n_samples, "num_tokens": n_samples * length}, "complete": True}
    write_json_atomic(store / MANIFEST, manifest)
    return store


def make_config(root: Path, tracking: dict | None = None, drafter: dict | None = None, **train: object) -> Path:
    """A run config over a tiny store in root/run/store and a tiny target config in root/target; ``train``
    keys go to the train section, ``drafter`` keys to the drafter section."""
    tree = {
        "run_dir": str(root / "run"),
        "target": {"name": str(make_target(root)), "aux_layer_ids": [0, 1, 2]},
        "drafter": {"draft_vocab_size": DRAFT_V, "intermediate_size": 64, **(drafter or {})},
        "data": {"sources": [{"kind": "lines", "path": "unused.txt"}]},
        "train": {"epochs": 1, "batch_tokens": 192, "lr": 3e-3, "warmup_ratio": 0.05, "ttt_length": 3,
                  "holdout_fraction": 0.15, "eval_every": 1000, "save_every": 1000, "log_every": 5,
                  **train},
        "tracking": tracking or {},
        "eval": {"datasets": [{"name": "x", "kind": "lines", "path": "unused.txt"}]},
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path
