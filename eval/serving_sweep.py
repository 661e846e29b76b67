"""Which ``--speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens`` to serve with.

A cost table holds, per serving setting and concurrency, the verify-cycle time and tau (measured on a server
running that setting; or, for a chain (topk 1), predicted from the alpha_k measured at a longer chain: a greedy
chain's first j drafts are the same whatever k, so tau(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j). With t_decode
per concurrency (a server without speculation) each setting yields, per request,

    tokens/s = 1000 * tau / t_cycle      speed-up = tau / tau* = tau * t_decode / t_cycle

and the recommendation at each concurrency is the setting with the most tokens/s, or no speculation when even
the best one is slower than plain decoding. ``python -m eval sweep --table FILE`` runs the model on a table;
``python -m eval sweep --config C`` measures one (``eval.sglang.server_url`` + ``sweep_urls``, one setting each).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common.config import RunConfig
from common.files import write_json_atomic, write_text_atomic
from eval.live_gate import decode_summary, run_prompts, served_settings, spec_summary
from eval.sglang_client import auth_headers, server_info


class SweepError(ValueError):
    """A cost table that cannot be used; the message names the entry."""


@dataclass(frozen=True)
class ServingSetting:
    num_steps: int
    topk: int
    draft_tokens: int

    def flags(self) -> str:
        return (f"--speculative-num-steps {self.num_steps} --speculative-eagle-topk {self.topk} "
                f"--speculative-num-draft-tokens {self.draft_tokens}")


@dataclass(frozen=True)
class Cost:
    """One measured setting at one concurrency; ``tau`` None means "predict it from alpha" (chains only)."""

    setting: ServingSetting
    concurrency: int
    cycle_ms: float
    tau: float | None = None


def chain_tau(alpha_conditional: Sequence[float], steps: int) -> float:
    """Tokens per cycle of a greedy chain of ``steps`` drafts with conditional acceptances alpha_1..alpha_k."""
    if steps > len(alpha_conditional):
        raise SweepError(f"alpha is measured for {len(alpha_conditional)} draft positions; cannot predict k = {steps}")
    tau, reach = 1.0, 1.0
    for a in alpha_conditional[:steps]:
        reach *= a if math.isfinite(a) else 0.0
        tau += reach
    return tau


def recommend(costs: Sequence[Cost], decode_ms: Mapping[int, float],
              alpha_conditional: Sequence[float] | None = None) -> dict[int, dict[str, Any]]:
    """Per concurrency: every setting ranked by tokens/s per request under the cost model, and the pick."""
    out: dict[int, dict[str, Any]] = {}
    for c in sorted({x.concurrency for x in costs}):
        if c not in decode_ms:
            raise SweepError(f"no t_decode at concurrency {c} (decode_ms has {sorted(decode_ms)})")
        rows = []
        for x in (x for x in costs if x.concurrency == c):
            if x.tau is not None:
                tau, source = x.tau, "measured"
            elif x.setting.topk == 1 and alpha_conditional is not None:
                tau, source = chain_tau(alpha_conditional, x.setting.num_steps), "predicted from alpha"
            else:
                raise SweepError(f"setting {x.setting.flags()} at concurrency {c}: no tau, and only a chain (topk 1) "
                                 "can be predicted from alpha")
            if x.cycle_ms <= 0:
                raise SweepError(f"setting {x.setting.flags()} at concurrency {c}: cycle_ms must be > 0")
            rows.append({**asdict(x.setting), "flags": x.setting.flags(), "tau": tau, "tau_source": source,
                         "cycle_ms": x.cycle_ms, "tau_star": x.cycle_ms / decode_ms[c],
                         "tokens_per_s": 1000 * tau / x.cycle_ms, "speedup": tau * decode_ms[c] / x.cycle_ms})
        rows.sort(key=lambda r: -r["tokens_per_s"])
        plain = 1000 / decode_ms[c]
        best = rows[0]
        out[c] = {"decode_ms": decode_ms[c], "plain_tokens_per_s": plain, "settings": rows,
                  "recommended": best["flags"] if best["speedup"] > 1 else None,
                  "why": (f"{best['tokens_per_s']:.1f} tok/s per request, x{best['speedup']:.2f} plain decoding"
                          if best["speedup"] > 1 else f"no setting beats plain decoding ({plain:.1f} tok/s; best "
                          f"{best['flags']} gives x{best['speedup']:.2f}): serve without speculation")}
    return out


def read_table(path: Path) -> tuple[list[Cost], dict[int, float], list[float] | None]:
    """A cost table file: ``{"decode_ms": {"1": 12.1}, "alpha_conditional": [..] (optional), "settings":
    [{"num_steps", "topk", "draft_tokens", "concurrency", "cycle_ms", "tau" (optional)}]}``. Every count and time
    is checked here: a zero time divides by zero in ``recommend``, and a negative or NaN one ranks nonsense."""
    try:
        t = json.loads(path.read_text())
        decode = {_count(path, "decode_ms key (a concurrency)", c):
                  _number(path, f'decode_ms["{c}"]', ms, 0, strict=True) for c, ms in t["decode_ms"].items()}
        costs = [_cost(path, f"settings[{i}]", e) for i, e in enumerate(t["settings"])]
        alpha = [float(a) for a in t["alpha_conditional"]] if t.get("alpha_conditional") else None
    except FileNotFoundError:
        raise SweepError(f"{path}: no such cost table") from None
    except SweepError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SweepError(f"{path}: not a cost table ({type(e).__name__}: {e}); see eval/serving_sweep.py") from None
    if not costs:
        raise SweepError(f"{path}: settings: empty; give at least one serving setting to rank")
    return costs, decode, alpha


def _cost(path: Path, where: str, e: Mapping[str, Any]) -> Cost:
    """One ``settings`` entry; tau counts the target's own token too, so a measured one is at least 1."""
    setting = ServingSetting(*(_count(path, f"{where}.{k}", e[k]) for k in ("num_steps", "topk", "draft_tokens")))
    tau = _number(path, f"{where}.tau", e["tau"], 1) if e.get("tau") is not None else None
    return Cost(setting, _count(path, f"{where}.concurrency", e.get("concurrency", 1)),
                _number(path, f"{where}.cycle_ms", e["cycle_ms"], 0, strict=True), tau)


def _number(path: Path, field: str, value: Any, low: float, strict: bool = False) -> float:
    """A finite float >= ``low`` (> with ``strict``): float() also takes NaN and infinities."""
    x = float(value)
    if not math.isfinite(x) or x < low or (strict and x == low):
        raise SweepError(f"{path}: {field} must be a finite number {'>' if strict else '>='} {low:g}, got {value!r}")
    return x


def _count(path: Path, field: str, value: Any) -> int:
    """A count of steps, drafts or requests in flight: 0 or fewer is no setting."""
    n = int(value)
    if n < 1:
        raise SweepError(f"{path}: {field} must be >= 1, got {value!r}")
    return n


def measure_table(cfg: RunConfig, prompts: Mapping[str, Sequence[Sequence[int]]]) -> tuple[list[Cost], dict[int, float],
                                                                                     list[float] | None]:
    """A cost table from live servers: each of eval.sglang.server_url + sweep_urls runs one setting (read from
    its /server_info); t_decode from baseline_url; alpha from the longest chain measured."""
    live = cfg.eval.sglang
    if live is None or not live.baseline_url:
        raise SweepError("eval.sglang.baseline_url: eval sweep needs a server without speculation for t_decode")
    headers = auth_headers(live.api_key_env)
    everything = [p for ps in prompts.values() for p in ps]
    T, n = cfg.eval.temperature, cfg.eval.max_new_tokens
    costs, decode, alpha, longest = [], {}, None, -1
    for url in [live.server_url, *live.sweep_urls]:
        s = served_settings(server_info(url, live.timeout_s, headers))
        setting = ServingSetting(int(s["num_steps"]), int(s["topk"]), int(s["draft_tokens"]))
        for c in live.concurrency:
            m = spec_summary(run_prompts(url, everything, c, T, n, live.timeout_s, headers, speculative=True))
            costs.append(Cost(setting, c, m["cycle_ms"], m["tau"]))
            if setting.topk == 1 and m.get("alpha_conditional") and setting.num_steps > longest:
                alpha, longest = m["alpha_conditional"], setting.num_steps
    for c in live.concurrency:
        decode[c] = decode_summary(run_prompts(live.baseline_url, everything, c, T, n, live.timeout_s, headers,
                                               speculative=False))["decode_ms"]
    return costs, decode, alpha


def markdown(result: Mapping[int, Mapping[str, Any]]) -> str:
    lines = ["# Serving sweep", ""]
    for c, r in result.items():
        lines += [f"## Concurrency {c}: {r['recommended'] or 'no speculation'}", "", f"{r['why']}.", "",
                  "| flags | tau | source | cycle ms | tau* | tok/s per request | speed-up |", "|---" * 7 + "|"]
        lines += [f"| `{s['flags']}` | {s['tau']:.3f} | {s['tau_source']} | {s['cycle_ms']:.2f} | "
                  f"{s['tau_star']:.3f} | {s['tokens_per_s']:.1f} | x{s['speedup']:.2f} |" for s in r["settings"]]
        lines.append("")
    return "\n".join(lines)


def write_sweep(out_dir: Path, result: Mapping[int, Mapping[str, Any]]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / "sweep.json", {str(c): r for c, r in result.items()})
    write_text_atomic(out_dir / "sweep.md", markdown(result))
    return out_dir
