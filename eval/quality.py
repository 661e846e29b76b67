"""How good a drafter is on whole eval sets (``python -m eval quality``): tau and alpha_k on every prompt.

    python -m eval quality --config configs/smollm2-135m-h200.yaml --checkpoint runs/smollm2-h200/checkpoints/best

Every prompt of the config's eval datasets (their limits lifted; ``limit`` for smoke runs), chat-templated (a
later ``turn`` after the target's own answers, ``eval.turns``), at each k:T setting, with the batched engine
(``eval.batched_eval``): tau with its bootstrap interval (``ci``, over ``prompts``), alpha_k, and at T = 0 the
prompts whose output differs from the target's greedy output. Then tau* per k from the batch-1 engine's timings on
the first ``timing_prompts`` prompts (one process, nothing else on the device) with its interval over them, or from
the deployment's ``eval.timings`` when given (acceptance measured anywhere, gated where it will serve); tau by
history length on the run's held-out conversations (``tau_by_context``, ``eval.context_buckets``); and what the
gate would decide at the first setting: against break-even, and with an ``incumbent`` against it too (the incumbent
measured on the same prompts at that setting, the difference read through paired intervals: what a promotion
needs, since a new drafter must beat what serves, not only break-even). The target runs in float32 unless
overridden, so that the lossless check is exact (``eval.lossless``). ``eval run`` measures the batch-1 engine on
the datasets as configured (timings and acceptance together); this measures acceptance on all of them in a few
batched passes. ``bench/drafter_quality.py`` records the same figures in ``bench/results.json``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from common.config import RunConfig, TimingsConfig, load_config
from drafter.factory import load_for_target
from drafter.model import Eagle3Drafter
from drafter.sglang_checkpoint import fingerprint
from drafter.vocab_map import draft_vocab_mask, outside_draft_vocab
from eval import breakeven
from eval.acceptance_store import drafter_key, kept_acceptance, target_key
from eval.batched_eval import GreedyReferences, acceptance
from eval.context_buckets import holdout_buckets
from eval.gate import decide
from eval.gate_stats import bootstrap, evidence, evidence_record, per_prompt, tau_ci, timed_tau_star
from eval.intervals import Bootstrap, Estimate, constant
from eval.measure import Settings, measure
from eval.oracle_cache import oracle_acceptance
from eval.speculative import Eagle3Proposer, Engine
from eval.turns import EvalPrompts, eval_prompts, records_skipped_short
from target_model.hf_model import TargetModel, load_target_from_config, stop_token_ids

DEFAULT_SETTINGS = ("3:0", "3:1", "5:0")  # k:T; the first one is the one the gate's decision reads
STORE_VERSION = 1  # in the key of kept figures (keep_dir): changes when the measurement does


def figures_store(cfg: RunConfig) -> Path:
    """Where ``eval quality`` keeps each drafter's figures per dataset and setting (its keep_dir): one store for every
    report of the run, since the key names all a figure depends on (target, drafter, prompts, setting)."""
    return cfg.eval_dir / "measured"


class QualityError(ValueError):
    pass


def parse_settings(settings: Sequence[str]) -> list[tuple[int, float]]:
    """``["3:0", "5:0.7"]`` -> ``[(3, 0.0), (5, 0.7)]``."""
    out = []
    for s in settings:
        k, sep, t = s.partition(":")
        try:
            out.append((int(k), float(t)))
        except ValueError:
            raise QualityError(f"--settings {s}: expected k:T, e.g. 3:0 (k drafts per cycle, temperature T)") from None
        if not sep or out[-1][0] < 1 or not 0 <= out[-1][1] < math.inf:  # float() takes nan and inf
            raise QualityError(f"--settings {s}: expected k:T with k >= 1 and T a finite number >= 0, e.g. 3:0")
    if not out:
        raise QualityError("--settings: give at least one k:T pair")
    return out


def setup(config: str | Path, limit: int | None = None, dtype: str = "float32", overrides: Sequence[str] = (),
          ) -> tuple[RunConfig, TargetModel, EvalPrompts]:
    """The config (``target.dtype`` set to ``dtype`` before ``overrides``), the target and every eval prompt
    (``limit`` per dataset: smoke runs only), with the records each dataset skipped as short."""
    cfg = quality_config(config, dtype, overrides)
    return (cfg, *target_and_prompts(cfg, limit))


def quality_config(config: str | Path, dtype: str = "float32", overrides: Sequence[str] = ()) -> RunConfig:
    """The run config with ``target.dtype`` set to ``dtype`` first, so that ``overrides`` may set it otherwise."""
    return load_config(config, [f"target.dtype={dtype}", *overrides])


def target_and_prompts(cfg: RunConfig, limit: int | None = None) -> tuple[TargetModel, EvalPrompts]:
    """The target and every prompt of the eval datasets, their limits lifted (``limit``: smoke runs only), with the
    records each dataset skipped for too few user turns (``quality`` reports them)."""
    target = load_target_from_config(cfg.target)
    datasets = [ds.model_copy(update={"limit": limit}) for ds in cfg.eval.datasets]
    return target, eval_prompts(target, datasets, cfg.eval.max_new_tokens, cfg.target.chat_template_kwargs)


def load_drafter(target: TargetModel, cfg: RunConfig, checkpoint: str | Path) -> tuple[Eagle3Drafter, tuple]:
    """A saved drafter on the target's device and dtype, and its aux layer ids."""
    return load_for_target(checkpoint, target.embed_weight(), target.num_layers, cfg.target.aux_layer_ids,
                           device=target.device, dtype=target.dtype)


def summary(stats: dict, k: int, temperature: float, boot: Bootstrap, skipped: Mapping[str, int]) -> dict:
    """Per dataset: tau with its interval and prompts, the records skipped for too few user turns (``skipped``:
    prompts never measured), alpha, histogram and, at T = 0, how many prompts differ from greedy."""
    out = {name: {"tau": s["tau"], "ci": tau_ci(s, boot), "prompts": s["prompts"],
                  "records_skipped_short": skipped.get(name, 0),
                  "prompts_without_cycles": s["prompts_without_cycles"], "k": k,
                  "temperature": temperature, "alpha": s["alpha_conditional"], "histogram": s["histogram"]}
           for name, s in stats.items()}
    for name, s in stats.items():
        if "lossless_mismatches" in s:
            out[name]["lossless_mismatches"] = len(s["lossless_mismatches"])
    return out


def add_oracle(per_dataset: dict, oracle_stats: dict, boot: Bootstrap) -> None:
    """Beside each dataset's tau at T > 0: the oracle's (a drafter proposing the target's own greedy tokens, same
    prompts, same rule), the most any greedy drafter could keep at that temperature."""
    for name, s in oracle_stats.items():
        per_dataset[name] |= {"oracle_tau": s["tau"], "oracle_ci": tau_ci(s, boot),
                              "oracle_alpha": s["alpha_conditional"]}


def given_timings(given: TimingsConfig, ks: list[int], boot: Bootstrap) -> tuple[dict, dict[str, Estimate]]:
    """tau* per k from the deployment's timings (``eval.timings``): what the gate must clear where the drafter
    will serve, not on the machine that measures acceptance (a CPU's tau* says nothing about an H200's). A
    constant: no timing prompts behind it, so no interval."""
    missing = [k for k in ks if k not in given.cycle_ms]
    if missing:
        raise QualityError(f"eval.timings.cycle_ms has no entry for k = {', '.join(map(str, missing))} (--settings): "
                           "give the verify cycle's ms at every k measured, e.g. {3: 29.8}")
    out, estimates = {}, {}
    for k in ks:
        figures = breakeven.breakeven(given.decode_ms, given.cycle_ms[k], k)
        estimates[str(k)] = constant(figures["tau_star"], boot)
        out[str(k)] = figures | {"ci": [figures["tau_star"], figures["tau_star"]]}
    return out, estimates


def timings(target: TargetModel, drafter: Eagle3Drafter, aux_ids: Sequence[int], prompts: list[list[int]],
            ks: list[int], max_new: int, boot: Bootstrap) -> tuple[dict, dict[str, Estimate]]:
    """Batch-1 plain decode and speculative cycle times: tau* per k with its interval over the timing prompts (one
    process, one stream); and tau*'s bootstrap per k, for the gate."""
    engine = Engine(target, aux_ids, stop_token_ids(target.tokenizer))
    out, estimates = {}, {}
    for k in ks:
        rep = measure(engine, {"timing": prompts}, {"d": Eagle3Proposer(drafter, aux_ids)}, Settings(k, 0.0, max_new))
        cycle = rep["drafters"]["d"]["cycle_ms"]
        estimates[str(k)] = est = timed_tau_star(rep["plain"], rep["drafters"]["d"]["per_prompt_timing"], boot)
        iv = est.interval(boot.level)
        out[str(k)] = breakeven.breakeven(rep["plain"]["decode_ms"], cycle, k) | {"ci": [iv.low, iv.high]}
    return out, estimates


def tau_by_context(cfg: RunConfig, target: TargetModel, drafter: Eagle3Drafter, aux_ids: Sequence[int], k: int,
                   temperature: float, per_bucket: int | None, boot: Bootstrap) -> dict:
    """tau per history-length bucket (``eval.context_buckets``) on the run's held-out conversations, at one setting;
    each bucket's interval resamples conversations. Without conversations.jsonl, the reason instead."""
    held = holdout_buckets(cfg.conversations_path, cfg.train.holdout_fraction, per_bucket, lambda: target.tokenizer,
                           cfg.target.chat_template_kwargs)
    if held.skipped:
        return held.header()
    prompts = held.ids()
    stats = acceptance(target, drafter, aux_ids, prompts, k, temperature, cfg.eval.max_new_tokens,
                       seed=cfg.eval.seed, rule=cfg.eval.acceptance) if prompts else {}
    return {**held.header(), "k": k, "temperature": temperature,
            "buckets": held.figures({name: per_prompt(st) for name, st in stats.items()}, boot)}


@torch.no_grad()
def quality(cfg: RunConfig, target: TargetModel, prompts: Mapping[str, list[list[int]]], checkpoint: str | Path,
            settings: Sequence[tuple[int, float]], timing_prompts: int = 8, context_prompts: int | None = 80,
            per_prompt_columns: bool = False, incumbent: str | Path | None = None, keep_dir: Path | None = None,
            ) -> dict:
    """The figures: the first setting's per-dataset summary at the top level, every setting under ``settings``
    (every tau with its interval), tau* and the timings per k with tau*'s interval, tau by history length on the
    held-out conversations (at most ``context_prompts`` per bucket; 0: none), at every T > 0 setting the oracle's
    tau and alpha beside the drafter's (``add_oracle``; measured once per target, prompts and setting:
    ``eval.oracle_cache``), at every T = 0 setting the share of the target's greedy tokens outside the drafter's
    draft vocab (``drafter.vocab_map``: each ends a cycle whatever the weights), and the gate's decision at the first
    setting against break-even (and the ``incumbent``'s tau on the same prompts, when given), read through the
    intervals. ``prompts``: as ``eval_prompts`` gives them, whose records skipped as short each dataset's summary
    counts.
    ``per_prompt_columns``: the first setting's datasets keep their (tokens, cycles) per prompt too, for a paired
    comparison with another drafter on the same prompts. ``keep_dir``: where each drafter's figures per dataset and
    setting are kept as they land, so that a run cut by a kill or a deadline resumes (``eval.acceptance_store``)."""
    boot, ks = bootstrap(cfg.gate), sorted({k for k, _ in settings})
    given = given_timings(cfg.eval.timings, ks, boot) if cfg.eval.timings else None  # a k they lack: before measuring
    drafter, aux_ids = load_drafter(target, cfg, checkpoint)
    max_new = cfg.eval.max_new_tokens
    refs = GreedyReferences(target, prompts, max_new)
    kept = Kept.under(keep_dir, target)
    mine = kept(checkpoint)  # hashed once for every setting
    stats = {f"k{k}_T{t:g}": setting_acceptance(cfg, target, drafter, aux_ids, prompts, k, t, refs, mine)
             for k, t in settings}
    skipped = records_skipped_short(prompts)
    results = {name: summary(st, k, t, boot, skipped)
               for (name, st), (k, t) in zip(stats.items(), settings, strict=True)}
    vocab = draft_vocab_mask(drafter)
    for (k, t), per_dataset in zip(settings, results.values(), strict=True):
        if t > 0:
            add_oracle(per_dataset, oracle_acceptance(target, aux_ids, prompts, k, t, max_new, cfg.eval.acceptance,
                                                      cfg.eval.seed), boot)
        else:  # the greedy output is the same at every k: its tokens outside the draft vocab too
            for name, figures in per_dataset.items():
                figures["outside_draft_vocab"] = outside_draft_vocab(
                    [g.tokens for g in refs[name]], vocab, target.tokenizer)
    first, first_stats = next(iter(results.values())), next(iter(stats.values()))
    if per_prompt_columns:
        for name, s in first_stats.items():
            first[name]["per_prompt"] = dict(zip(("tokens", "cycles"), per_prompt(s), strict=True))
    first_name = list(prompts)[0]
    times, tau_stars = given or timings(target, drafter, aux_ids, prompts[first_name][:timing_prompts], ks, max_new,
                                        boot)
    k0, t0 = settings[0]
    mismatches = [f"{name}: {s['lossless_mismatches']} prompts differ from greedy" for name, s in first.items()
                  if s.get("lossless_mismatches")]
    held = (incumbent_stats(cfg, target, prompts, incumbent, k0, t0, refs, kept(incumbent)) if incumbent is not None
            else None)
    ev = {name: evidence(per_prompt(s), tau_stars[str(k0)], cfg.gate.margin, boot,
                         per_prompt(held[name]) if held is not None else None) for name, s in first_stats.items()}
    d = decide(ev, cfg.gate.margin, cfg.gate.min_delta, lossless_mismatches=mismatches)
    return {**first, "checkpoint": str(checkpoint), "fingerprint": fingerprint(checkpoint), "max_new_tokens": max_new,
            "seed": cfg.eval.seed, "settings": results, "tau_star": {k: v["tau_star"] for k, v in times.items()},
            "tau_star_ci": {k: v["ci"] for k, v in times.items()}, "confidence": boot.level,
            "timings_ms": {k: {"decode": v["decode_ms"], "cycle": v["cycle_ms"]} for k, v in times.items()},
            "timing_prompts": 0 if cfg.eval.timings else len(prompts[first_name][:timing_prompts]),
            "timings_source": "config (eval.timings)" if cfg.eval.timings else "measured",
            "tau_by_context": tau_by_context(cfg, target, drafter, aux_ids, k0, t0, context_prompts, boot),
            "gate": {"verdict": d.verdict, "promote": d.promote, "reasons": d.reasons,
                     "intervals": evidence_record(ev, d), **incumbent_named(incumbent)}}


@dataclass(frozen=True)
class Kept:
    """Where one drafter's figures are kept (``eval.acceptance_store``) and the key they are kept under: the
    target's and the drafter's parts, each hashed once per eval (a drafter's weights may be gigabytes)."""

    folder: Path
    key: dict
    what: str

    @staticmethod
    def under(keep_dir: Path | None, target: TargetModel) -> Callable[[str | Path], Kept | None]:
        """Per checkpoint, where its figures are kept in ``keep_dir`` (None: nothing is kept)."""
        if keep_dir is None:
            return lambda checkpoint: None
        target_part = {"version": STORE_VERSION, **target_key(target)}
        return lambda checkpoint: Kept(keep_dir, {**target_part, "drafter": drafter_key(checkpoint)}, str(checkpoint))


def setting_acceptance(cfg: RunConfig, target: TargetModel, drafter: Eagle3Drafter, aux_ids: Sequence[int],
                       prompts: Mapping[str, list[list[int]]], k: int, temperature: float, refs: GreedyReferences,
                       kept: Kept | None = None) -> dict:
    """One drafter's acceptance at one k:T on every prompt, under the config's rule: what the candidate gets at
    each setting and the incumbent at the gate's, so that the two are measured alike. With ``kept`` each
    dataset's figures are kept as they land, and read back by a rerun."""
    e = cfg.eval

    def one_dataset(name: str, ps: Sequence[Sequence[int]]) -> dict:
        references = {name: refs[name]} if temperature == 0 else None  # the lossless check, at T = 0 only
        return acceptance(target, drafter, aux_ids, {name: ps}, k, temperature, e.max_new_tokens, references,
                          seed=e.seed, rule=e.acceptance, tie_epsilon=e.tie_epsilon)[name]

    if kept is None:
        return {name: one_dataset(name, ps) for name, ps in prompts.items()}
    key = {**kept.key, "k": k, "temperature": temperature, "max_new": e.max_new_tokens, "rule": e.acceptance,
           "seed": e.seed, "tie_epsilon": e.tie_epsilon}
    return kept_acceptance(kept.folder, key, prompts, one_dataset, f"{kept.what} k={k} T={temperature:g}")


def incumbent_named(incumbent: str | Path | None) -> dict:
    """The incumbent the gate compared against, by path and by its weights' fingerprint (none: nothing)."""
    return {} if incumbent is None else {"incumbent": str(incumbent), "incumbent_fingerprint": fingerprint(incumbent)}


def incumbent_stats(cfg: RunConfig, target: TargetModel, prompts: Mapping[str, list[list[int]]],
                    incumbent: str | Path, k: int, temperature: float, refs: GreedyReferences,
                    kept: Kept | None = None) -> dict:
    """The incumbent's acceptance at the gate's setting on the same prompts (its per-prompt columns pair with the
    candidate's), its weights freed afterwards."""
    drafter, aux_ids = load_drafter(target, cfg, incumbent)
    try:
        return setting_acceptance(cfg, target, drafter, aux_ids, prompts, k, temperature, refs, kept)
    finally:
        del drafter
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
