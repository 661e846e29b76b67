"""Wall time of the MT-Bench gate on CPU: SmolLM2-135M-Instruct + a random drafter, first turns.

The full gate is 80 questions x 256 new tokens, decoded once plainly (t_decode and the greedy
reference) and once speculatively. On a shared CPU run a subset and read the clearly labelled linear
extrapolation (it ignores attention growing with length and answers that stop early at EOS):

    python bench/eval_speed.py --limit 4 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from common.config import DatasetConfig
from drafter.factory import fresh_drafter, shape_for_target
from drafter.vocab_map import build_vocab_map
from eval.measure import Settings, measure
from eval.prompts import load_eval_prompts, render
from eval.speculative import Eagle3Proposer, Engine
from target_model.aux_layers import default_aux_layer_ids
from target_model.hf_model import load_target, stop_token_ids

FULL_QUESTIONS, FULL_TOKENS = 80, 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=FULL_QUESTIONS, help="MT-Bench questions (of 80)")
    ap.add_argument("--max-new-tokens", type=int, default=FULL_TOKENS)
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    target = load_target("smollm2-135m-instruct", device="cpu")
    ids = default_aux_layer_ids(target.num_layers)
    d2t, t2d = build_vocab_map(torch.zeros(target.vocab_size), 8192)
    drafter = fresh_drafter(shape_for_target(target.hf_config, 8192, ids), target.embed_weight().detach(), d2t, t2d)
    mtbench = DatasetConfig(name="mtbench", kind="mtbench")
    prompts = {"mtbench": [render(target.tokenizer, p) for p in load_eval_prompts(mtbench, args.limit)]}
    load_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    engine = Engine(target, ids, stop_token_ids(target.tokenizer))
    r = measure(engine, prompts, {"random": Eagle3Proposer(drafter, ids)}, Settings(args.num_steps, 0.0,
                                                                                    args.max_new_tokens))
    wall = time.perf_counter() - t1
    d = r["drafters"]["random"]
    cycles = d["datasets"]["mtbench"]["cycles"]
    verify_s = d["phases_ms_per_cycle"]["verify"] * cycles / 1000
    n = len(prompts["mtbench"])
    scale = (FULL_QUESTIONS / n) * (FULL_TOKENS / args.max_new_tokens)
    out = {"questions": n, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
           "load_s": round(load_s, 2), "decode_wall_s": round(wall, 2),
           "plain_decode_ms_per_token": round(r["plain"]["decode_ms"], 2),
           "phases": d["phase_lines"], "tau": d["datasets"]["mtbench"]["tau"],
           "verify_share_of_wall": round(verify_s / wall, 3),
           "plain_decode_share_of_wall": round(r["plain"]["decode_ms_with_stalls"] * r["plain"]["decode_steps"] / 1000
                                               / wall, 3),
           "lossless_ok": d["lossless"]["ok"],
           "EXTRAPOLATED_full_gate_s (linear: x questions x tokens)": round(wall * scale, 1)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
