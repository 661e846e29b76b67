"""Break-even arithmetic for speculative decoding (pure).

A cycle costs ``t_cycle = verify + k * draft_step + overhead`` and yields tau tokens; plain decoding
yields one token per ``t_decode``. Speculation pays iff tau > tau* = t_cycle / t_decode. With a
constant per-draft acceptance alpha, a chain of k drafts yields E(alpha) = (1 - alpha^(k+1)) / (1 - alpha)
tokens per cycle (1 / (1 - alpha) as k -> infinity), so a tok/s goal R needs E = R * t_cycle / 1000.
"""

from __future__ import annotations


def cycle_ms(verify_ms: float, draft_step_ms: float, overhead_ms: float, k: int) -> float:
    return verify_ms + k * draft_step_ms + overhead_ms


def tau_star(cycle: float, decode: float) -> float:
    """Tokens per cycle needed to match plain decoding."""
    if cycle <= 0 or decode <= 0:
        raise ValueError(f"timings must be > 0 (cycle {cycle} ms, decode {decode} ms)")
    return cycle / decode


def expected_tokens(alpha: float, k: int | None) -> float:
    """Tokens per cycle for acceptance alpha with k drafts (k=None: the k -> infinity limit)."""
    if k is None:
        return float("inf") if alpha >= 1 else 1.0 / (1.0 - alpha)
    if alpha >= 1:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def alpha_for_tokens(tokens: float, k: int | None, tol: float = 1e-10) -> float | None:
    """The constant alpha giving ``tokens`` per cycle; None when k drafts cannot reach it (> k+1)."""
    if tokens <= 1.0:
        return 0.0
    if k is None:
        return 1.0 - 1.0 / tokens
    if tokens > k + 1:
        return None
    lo, hi = 0.0, 1.0  # expected_tokens is increasing in alpha
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < tokens else (lo, mid)
    return (lo + hi) / 2


def breakeven(decode: float, cycle: float, k: int, target_tps: float | None = None) -> dict:
    """tau*, the alpha that breaks even, and (given a goal) the alpha the goal needs. A time of 0 is one nothing
    was measured for (a drafter that ran no verify cycle): tau* is NaN and no alpha follows, which the gate reads
    as not measured, a failure, rather than an error."""
    measured = decode > 0 and cycle > 0

    def alphas(tokens: float) -> dict:
        return {"finite_k": alpha_for_tokens(tokens, k) if measured else None,
                "k_infinity": alpha_for_tokens(tokens, None) if measured else None}

    ts = tau_star(cycle, decode) if measured else float("nan")
    out: dict = {"decode_ms": decode, "cycle_ms": cycle, "num_steps": k, "tau_star": ts, "alpha_breakeven": alphas(ts)}
    if target_tps is not None:
        need = target_tps * cycle / 1000.0
        out["target_tps"] = target_tps
        out["tokens_per_cycle_required"] = need
        out["alpha_required"] = alphas(need)
    return out
