"""Does SGLang's T > 0 acceptance rule keep the target's output distribution? Measured, not assumed.

SGLang's EAGLE worker drafts greedily and verifies with sgl-kernel's ``tree_speculative_sampling_target_only``
and zero draft probabilities: keep draft d with probability p(d); after a rejection sample p with d removed;
after k kept, the bonus from p (``eval.speculative.accept_sglang`` follows the kernel line by line). On a
hand-made 6-token case (T = 0.8, the first draft is not p's argmax) this draws many cycles and compares, by
chi-square and total variation, the first emitted token with p0, the resample after a rejection with p0
without d, and the second token (first draft kept) with p1; it also reports the acceptance rate against
p(d), and the rate of min(1, p/q) with drafts sampled from a hand-made q.

    python bench/sglang_acceptance.py --draws 100000      # writes its figures into bench/results.json
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.results import record
from eval.speculative import Draft, accept_sampled, accept_sglang

LOGITS = torch.tensor([[1.5, 0.2, -0.3, 0.9, -1.0, 0.0],
                       [0.1, 1.2, 0.4, -0.5, 0.8, -0.2],
                       [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
DRAFT, T = [3, 1], 0.8
Q = torch.tensor([0.05, 0.05, 0.05, 0.7, 0.05, 0.1])


def compare(counts: torch.Tensor, p: torch.Tensor) -> dict:
    n = float(counts.sum())
    keep = p > 0
    chi2 = float(((counts[keep] - n * p[keep]) ** 2 / (n * p[keep])).sum())
    return {"n": int(n), "chi2": round(chi2, 3), "dof": int(keep.sum()) - 1,
            "total_variation": round(float(0.5 * (counts / n - p).abs().sum()), 5),
            "empirical": [round(float(x), 4) for x in counts / n], "target": [round(float(x), 4) for x in p]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    p = torch.softmax(LOGITS / T, -1)
    first, after_reject, second = torch.zeros(6), torch.zeros(6), torch.zeros(6)
    kept1 = kept2 = 0
    t0 = time.perf_counter()
    for _ in range(args.draws):
        a, nxt = accept_sglang(LOGITS, Draft(DRAFT, None), T, g)
        first[DRAFT[0] if a >= 1 else nxt] += 1
        if a == 0:
            after_reject[nxt] += 1
        else:
            kept1 += 1
            kept2 += a == 2
            second[DRAFT[1] if a == 2 else nxt] += 1
    residual = p[0].clone()
    residual[DRAFT[0]] = 0
    ours = sum(accept_sampled(LOGITS[[0, 2]], Draft([int(torch.multinomial(Q, 1, generator=g))], Q[None]), T, g)[0]
               for _ in range(args.draws // 4))
    figures = {
        "first_token_vs_p0": compare(first, p[0]),
        "after_rejection_vs_p0_without_d": compare(after_reject, residual / residual.sum()),
        "second_token_given_first_kept_vs_p1": compare(second, p[1]),
        "accept_rate_first": {"measured": kept1 / args.draws, "p0(d)": round(float(p[0, DRAFT[0]]), 5)},
        "accept_rate_both": {"measured": kept2 / args.draws,
                             "p0(d1)*p1(d2)": round(float(p[0, DRAFT[0]] * p[1, DRAFT[1]]), 5)},
        "min(1,p/q)_sampled_drafts_accept_rate": {"measured": ours / (args.draws // 4),
                                                  "sum(min(p,q))": round(float(torch.minimum(p[0], Q).sum()), 5)},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    record("sglang_acceptance", figures)


if __name__ == "__main__":
    main()
