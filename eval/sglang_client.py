"""Measure a drafter where it will run: an SGLang server with speculative decoding (live mode).

Sends each prompt to ``POST /generate`` (``{"input_ids", "sampling_params"}``) and reads SGLang's
``meta_info`` (sglang srt/managers/tokenizer_manager.py, ``_calculate_spec_decoding_metrics``; 0.5.23):
``completion_tokens`` and ``spec_verify_ct`` (verify passes; the first token comes from prefill) give tau as
SGLang reports it (completion_tokens / spec_verify_ct, the prefill token included);
``spec_correct_drafts_histogram`` (``spec_accept_histogram`` before 0.5.2x: the same list under its old name;
index = drafts accepted in one verify step, grown as needed, so it may be shorter than k + 1) gives alpha_k.
``e2e_latency`` is always there; ``first_token_latency`` only with ``--enable-metrics``
(srt/observability/req_time_stats.py), and without it a decode time includes prefill and queueing.
``GET /server_info`` (``/get_server_info`` on older servers; srt/entrypoints/http_server.py) returns the
resolved server args: ``speculative_algorithm``, ``speculative_num_steps``, ``speculative_eagle_topk``,
``speculative_num_draft_tokens``, ``speculative_draft_model_path``, ``model_path``.

UNVERIFIED against a live SGLang server here (none can run on this machine): it is tested on
recorded response bodies shaped like SGLang's, served by a local http.server.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

from eval import metrics


class ServerError(RuntimeError):
    pass


HISTOGRAM_KEYS = ("spec_correct_drafts_histogram", "spec_accept_histogram")  # current name, then the old one


def auth_headers(api_key_env: str | None) -> dict[str, str]:
    """The servers' --api-key as a bearer token, read from the named environment variable (never printed)."""
    if not api_key_env:
        return {}
    key = os.environ.get(api_key_env)
    if not key:
        raise ServerError(f"eval.sglang.api_key_env: environment variable {api_key_env} is not set")
    return {"Authorization": f"Bearer {key}"}


def generate(url: str, input_ids: Sequence[int], temperature: float, max_new_tokens: int,
             timeout: float = 600.0, headers: Mapping[str, str] | None = None) -> tuple[dict, float]:
    """One /generate call; returns the body and the client-side wall time in seconds."""
    payload = {"input_ids": list(input_ids),
               "sampling_params": {"temperature": temperature, "max_new_tokens": max_new_tokens}}
    req = urllib.request.Request(url.rstrip("/") + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
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


def server_info(url: str, timeout: float = 60.0, headers: Mapping[str, str] | None = None) -> dict:
    """``GET /server_info`` (``/get_server_info`` for servers that predate the rename)."""
    last: Exception | None = None
    for path in ("/server_info", "/get_server_info"):
        req = urllib.request.Request(url.rstrip("/") + path, headers=dict(headers or {}))
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                info = json.loads(resp.read())
            if isinstance(info, dict):
                return info
            last = ValueError("not a JSON object")
        except urllib.error.HTTPError as e:
            last = e
            if e.code != 404:
                break
        except (urllib.error.URLError, TimeoutError, json.JSONDecodeError) as e:
            last = e
            break
    raise ServerError(f"{url}/server_info: {last}")


def histogram_of(meta: Mapping) -> list[int] | None:
    for key in HISTOGRAM_KEYS:
        if isinstance(meta.get(key), list):
            return [int(n) for n in meta[key]]
    return None


def _int(meta: dict, key: str, url: str) -> int:
    if not isinstance(meta.get(key), int):
        raise ServerError(f"{url}/generate: meta_info.{key} missing (is speculative decoding on?)")
    return meta[key]


def add_histogram(total: list[int], hist: Sequence[int]) -> None:
    total.extend([0] * (len(hist) - len(total)))
    for i, n in enumerate(hist):
        total[i] += int(n)


def speculative_stats(url: str, prompts: Sequence[Sequence[int]], temperature: float, max_new_tokens: int) -> dict:
    completion = verify = no_cycles = 0
    hist: list[int] = []
    missing_hist = 0
    for ids in prompts:
        body, _ = generate(url, ids, temperature, max_new_tokens)
        meta = body["meta_info"]
        if "spec_verify_ct" not in meta and _int(meta, "completion_tokens", url) <= 1:
            no_cycles += 1  # ended at its prefill token: no verify cycle, and SGLang sends no spec_* field
            continue
        completion += _int(meta, "completion_tokens", url)
        verify += _int(meta, "spec_verify_ct", url)
        h = histogram_of(meta)
        if h is not None:
            add_histogram(hist, h)
        else:
            missing_hist += 1
    out = {"requests": len(prompts), "completion_tokens": completion, "spec_verify_ct": verify,
           "tau": completion / verify if verify else float("nan"), "histogram": hist or None,
           "requests_without_histogram": missing_hist, "requests_without_cycles": no_cycles}
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
