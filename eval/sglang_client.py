"""Measure a drafter where it will run: an SGLang server with speculative decoding (live mode).

Sends each prompt to ``POST /generate`` and reads SGLang's ``meta_info``: ``completion_tokens`` and
``spec_verify_ct`` give tau exactly as SGLang reports it (completion_tokens / spec_verify_ct, the
prefill token included), ``spec_accept_histogram`` (verify steps that accepted exactly n drafts), when
the server sends it, gives alpha_k. A baseline server without speculation gives t_decode from
``e2e_latency`` (or the client's wall time) per completion token.

UNVERIFIED against a live SGLang server here (none can run on this machine): it is tested on
recorded response bodies shaped like SGLang's, served by a local http.server.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

from eval import metrics


class ServerError(RuntimeError):
    pass


def generate(url: str, input_ids: Sequence[int], temperature: float, max_new_tokens: int,
             timeout: float = 600.0) -> tuple[dict, float]:
    """One /generate call; returns the body and the client-side wall time in seconds."""
    payload = {"input_ids": list(input_ids),
               "sampling_params": {"temperature": temperature, "max_new_tokens": max_new_tokens}}
    req = urllib.request.Request(url.rstrip("/") + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = json.loads(resp.read())
    except (urllib.error.URLError, TimeoutError, json.JSONDecodeError) as e:
        raise ServerError(f"{url}/generate: {e}") from None
    elapsed = time.perf_counter() - t0
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ServerError(f"{url}/generate: response has no meta_info object")
    return body, elapsed


def _int(meta: dict, key: str, url: str) -> int:
    if not isinstance(meta.get(key), int):
        raise ServerError(f"{url}/generate: meta_info.{key} missing (is speculative decoding on?)")
    return meta[key]


def _add(total: list[int], hist: Sequence[int]) -> None:
    total.extend([0] * (len(hist) - len(total)))
    for i, n in enumerate(hist):
        total[i] += int(n)


def speculative_stats(url: str, prompts: Sequence[Sequence[int]], temperature: float, max_new_tokens: int) -> dict:
    completion = verify = 0
    hist: list[int] = []
    missing_hist = 0
    for ids in prompts:
        body, _ = generate(url, ids, temperature, max_new_tokens)
        meta = body["meta_info"]
        completion += _int(meta, "completion_tokens", url)
        verify += _int(meta, "spec_verify_ct", url)
        if isinstance(meta.get("spec_accept_histogram"), list):
            _add(hist, meta["spec_accept_histogram"])
        else:
            missing_hist += 1
    out = {"requests": len(prompts), "completion_tokens": completion, "spec_verify_ct": verify,
           "tau": completion / verify if verify else float("nan"), "histogram": hist or None,
           "requests_without_histogram": missing_hist}
    if hist and not missing_hist:
        out["tau_histogram"] = metrics.tau_from_histogram(hist)  # per cycle, without the prefill token
        out["alpha_conditional"] = metrics.conditional_rates(hist)
        out["alpha_unconditional"] = metrics.unconditional_rates(hist)
    return out


def decode_ms(url: str, prompts: Sequence[Sequence[int]], temperature: float, max_new_tokens: int) -> dict:
    """Milliseconds per completion token on a server without speculation (prefill included: at
    max_new_tokens in the hundreds it is a small share; say so when reporting)."""
    tokens, seconds, source = 0, 0.0, set()
    for ids in prompts:
        body, elapsed = generate(url, ids, temperature, max_new_tokens)
        meta = body["meta_info"]
        tokens += _int(meta, "completion_tokens", url)
        lat = meta.get("e2e_latency")
        seconds += float(lat) if isinstance(lat, int | float) else elapsed
        source.add("meta_info.e2e_latency" if isinstance(lat, int | float) else "client wall time")
    return {"requests": len(prompts), "completion_tokens": tokens,
            "decode_ms": 1000 * seconds / tokens if tokens else float("nan"), "source": sorted(source)}


def live_eval(server_url: str, baseline_url: str | None, datasets: Mapping[str, Sequence[Sequence[int]]],
              temperature: float, max_new_tokens: int) -> dict:
    out: dict = {"server_url": server_url, "datasets": {name: speculative_stats(server_url, p, temperature,
                                                                                max_new_tokens)
                                                        for name, p in datasets.items()}}
    if baseline_url:
        out["baseline"] = decode_ms(baseline_url, [p for ps in datasets.values() for p in ps], temperature,
                                    max_new_tokens)
    return out
