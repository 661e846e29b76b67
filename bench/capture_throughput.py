"""Capture cost: tokens/s against a plain target forward, store bytes/token against SpecForge's 8·H,
and what the top-k teacher loses against the full distribution.

    python bench/capture_throughput.py [--device auto] [--convs 12] [--max-length 192] [--out FILE]

Uses SmolLM2-135M-Instruct and the first ShareGPT conversations (both from PyPI wheels); < 2 min on
CPU. Prints JSON (also written to --out) and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from common.batching import length_batches
from common.config import PromptSource, parse_config
from data_prep.capture import render_all, run_capture
from data_prep.sources import open_source
from target_model.hf_model import TargetModel, load_target

AUX = [2, 15, 27]


def sharegpt(n: int) -> list[dict]:
    out = []
    for rec in open_source(PromptSource(kind="sharegpt", path="builtin"), "bench")[1]:
        if rec.messages and any(m["role"] == "assistant" for m in rec.messages):
            out.append({"id": f"bench-{len(out)}", "messages": rec.messages[:4]})
            if len(out) == n:
                break
    return out


def padded(batch: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(map(len, batch))
    ids = torch.full((len(batch), longest), pad)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    return ids, mask


def sync(target: TargetModel) -> None:
    if target.device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def plain_forward_tps(target: TargetModel, seqs: list[list[int]], batch_tokens: int) -> float:
    """The target's own forward (logits for every position, as a prefill) on capture's batches."""
    batches = [[seqs[i] for i in b] for b in length_batches([len(s) for s in seqs], batch_tokens)]
    sync(target)
    start = time.perf_counter()
    for b in batches:
        ids, mask = padded(b, target.tokenizer.pad_token_id)
        target.model(input_ids=ids.to(target.device), attention_mask=mask.to(target.device))
    sync(target)
    return sum(map(len, seqs)) / (time.perf_counter() - start)


@torch.no_grad()
def teacher_gaps(target: TargetModel, seqs: list[list[int]], masks: list[list[int]], ks: list[int]) -> dict:
    """At loss positions: tail mass 1-Σ_topk p, KL(p_k‖p) = -log Σ_topk p (p_k = renormalised top-k),
    the loss bias of a top-k soft-CE at the optimum (student = p), and KL(p‖p_bf16) of the hidden
    teacher stored in bf16."""
    acc = {k: {"tail_mass": [], "kl_topk_vs_full": [], "ce_bias": []} for k in ks}
    bf16_kl = []
    for seq, m in zip(seqs, masks, strict=True):
        out = target.forward(torch.tensor([seq]), AUX)
        keep = torch.tensor(m, dtype=torch.bool, device=out.logits.device)
        logp = torch.log_softmax(out.logits[0][keep].float(), -1)
        full_ce = -(logp.exp() * logp).sum(-1)
        for k in ks:
            top = logp.topk(k, dim=-1).values
            mass = top.exp().sum(-1)
            pk = top.exp() / mass[:, None]
            acc[k]["tail_mass"].append(1 - mass)
            acc[k]["kl_topk_vs_full"].append(-mass.log())
            acc[k]["ce_bias"].append(-(pk * top).sum(-1) - full_ce)
        h16 = out.last_hidden[0][keep].to(torch.bfloat16).float()
        logq = torch.log_softmax(target.logits_from_hidden(h16).float(), -1)
        bf16_kl.append((logp.exp() * (logp - logq)).sum(-1))
    res = {f"top{k}": {name: torch.cat(v).mean().item() for name, v in d.items()} for k, d in acc.items()}
    res["hidden_bf16"] = {"kl_full_vs_stored": torch.cat(bf16_kl).mean().item()}
    res["positions"] = int(sum(sum(m) for m in masks))
    return res


def capture_run(target: TargetModel, convs: list[dict], tmp: Path, teacher: str, dtype: str, topk: int,
                max_length: int, batch_tokens: int) -> dict:
    run = tmp / f"{teacher}-{dtype}"
    run.mkdir()
    (run / "conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    cfg = parse_config({"run_dir": str(run), "target": {"name": target.name, "aux_layer_ids": AUX},
                        "data": {"sources": [{"kind": "lines", "path": "unused"}]},
                        "capture": {"max_length": max_length, "batch_tokens": batch_tokens, "dtype": dtype,
                                    "teacher": teacher, "topk": topk, "shard_samples": 10_000},
                        "eval": {"datasets": [{"name": "x", "kind": "lines"}]}})
    sync(target)
    s = run_capture(cfg, target=target)
    return {"teacher": teacher, "dtype": dtype, "topk": topk if teacher == "topk" else None,
            "tokens": s.tokens, "tokens_per_s": s.captured_tokens_per_s, "bytes_per_token": s.bytes_per_token}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--convs", type=int, default=12)
    ap.add_argument("--max-length", type=int, default=192)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    target = load_target("smollm2-135m-instruct", dtype="float32", device=args.device)
    convs = sharegpt(args.convs)
    samples, _ = render_all(convs, target.tokenizer, args.max_length)
    seqs, masks = [s.input_ids for s in samples], [s.loss_mask for s in samples]
    plain_forward_tps(target, seqs[:2], args.batch_tokens)  # warm-up
    h, runs = target.hidden_size, []
    with tempfile.TemporaryDirectory() as tmp:
        for t in ("hidden", "topk"):
            for d in ("bfloat16", "float32"):
                # back to back, so that load from other processes hits both sides of the ratio alike
                plain = plain_forward_tps(target, seqs, args.batch_tokens)
                r = capture_run(target, convs, Path(tmp), t, d, args.topk, args.max_length, args.batch_tokens)
                runs.append(r | {"plain_forward_tokens_per_s": plain, "throughput_ratio": r["tokens_per_s"] / plain,
                                 "bytes_vs_specforge": r["bytes_per_token"] / (8 * h)})
    result = {"device": str(target.device), "target": target.name, "hidden_size": h, "samples": len(seqs),
              "tokens": sum(map(len, seqs)),
              "specforge_bytes_per_token": 8 * h, "capture": runs,
              "teacher_gap": teacher_gaps(target, seqs, masks, [16, args.topk])}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    print(f"\n| teacher | dtype | capture tok/s | plain tok/s | ratio | bytes/token | vs SpecForge 8·H={8 * h} |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        name = r["teacher"] + (f" (k={r['topk']})" if r["topk"] else "")
        print(f"| {name} | {r['dtype']} | {r['tokens_per_s']:.0f} | {r['plain_forward_tokens_per_s']:.0f} | "
              f"{r['throughput_ratio']:.2f} | "
              f"{r['bytes_per_token']:.0f} | {r['bytes_vs_specforge']:.2f}× |")
    g = result["teacher_gap"]
    print(f"\nTeacher gap over {g['positions']} loss positions (nats, mean):\n")
    print("| teacher | tail mass | KL(p_k ‖ p) | soft-CE bias at optimum |\n|---|---|---|---|")
    for k in (16, args.topk):
        d = g[f"top{k}"]
        print(f"| top-{k} | {d['tail_mass']:.4f} | {d['kl_topk_vs_full']:.4f} | {d['ce_bias']:+.4f} |")
    print(f"| hidden (bf16 stored) | 0 | KL(p ‖ p_bf16) = {g['hidden_bf16']['kl_full_vs_stored']:.2e} | 0 |")


if __name__ == "__main__":
    main()
