"""tau*'s timings without a shared machine's stalls: a stall added to a few steps of one run leaves the run's time,
and tau* with its interval, where they were, and is counted."""

from __future__ import annotations

import pytest
import torch

from drafter.factory import fresh_drafter, shape_for_target
from drafter.vocab_map import build_vocab_map
from eval.gate_stats import timed_tau_star
from eval.intervals import Bootstrap
from eval.measure import Settings, measure
from eval.prompts import render
from eval.report import stalls_note
from eval.speculative import Eagle3Proposer, Engine
from eval.stall_free import stall_free_s, stalled
from target_model.aux_layers import default_aux_layer_ids
from target_model.hf_model import stop_token_ids

BOOT = Bootstrap(0.95, 2000, 0)


def test_a_stall_of_a_few_steps_leaves_the_runs_time_where_it_was() -> None:
    quiet = [0.010, 0.0102, 0.0099, 0.0101, 0.0100, 0.0103, 0.0098, 0.0100] * 4  # 32 steps, within 3 %
    assert stall_free_s(quiet) == pytest.approx(sum(quiet), rel=0.02) and stalled(quiet) == 0
    stall = list(quiet)
    stall[5:10] = [0.2] * 5  # another process held the cores for five steps
    assert stall_free_s(stall) == pytest.approx(stall_free_s(quiet), rel=0.01)
    assert stalled(stall) == 5 and sum(stall) > 3 * sum(quiet)
    assert stall_free_s([]) == 0.0 and stalled([]) == 0


class SteadyClock:
    """Each reading 1 ms after the last, and ``stall_s`` more at reading ``stall_at``: a machine that does every
    step in the same time but once made one wait."""

    def __init__(self, stall_at: int | None = None, stall_s: float = 0.5):
        self.now, self.reads, self.stall_at, self.stall_s = 0.0, 0, stall_at, stall_s

    def __call__(self) -> float:
        self.reads += 1
        self.now += 0.001 + (self.stall_s if self.reads == self.stall_at else 0.0)
        return self.now


@pytest.mark.real
def test_a_stalled_plain_step_moves_neither_tau_star_nor_its_interval(smollm2) -> None:
    ids = default_aux_layer_ids(smollm2.num_layers)
    engine = Engine(smollm2, ids, stop_token_ids(smollm2.tokenizer))
    d2t, t2d = build_vocab_map(torch.zeros(smollm2.vocab_size), 1024)
    drafter = fresh_drafter(shape_for_target(smollm2.hf_config, 1024, ids), smollm2.embed_weight().detach(), d2t, t2d)
    prompts = {"p": [render(smollm2.tokenizer, text) for text in (
        "Explain in detail how a bicycle works, step by step.", "Write a long poem about the sea.",
        "List every planet of the solar system and describe each one.")]}
    reports = {}
    for name, clock in (("steady", SteadyClock()), ("stalled", SteadyClock(stall_at=6))):  # prompt 0's 4th step
        engine.clock = clock
        reports[name] = measure(engine, prompts, {"d": Eagle3Proposer(drafter, ids)}, Settings(3, 0.0, 16))
    # every plain step reads the clock once (1 ms), every cycle from its draft to its extend over four readings
    for rep in reports.values():
        assert rep["plain"]["decode_ms"] == pytest.approx(1.0)
        assert rep["drafters"]["d"]["cycle_ms"] == pytest.approx(4.0)
        iv = timed_tau_star(rep["plain"], rep["drafters"]["d"]["per_prompt_timing"], BOOT).interval(0.95)
        assert iv.point == pytest.approx(4.0) and iv.low == pytest.approx(4.0) and iv.high == pytest.approx(4.0)
    stalled_plain = reports["stalled"]["plain"]
    assert stalled_plain["stalled_steps"] == 1 and reports["steady"]["plain"]["stalled_steps"] == 0
    assert stalled_plain["decode_ms_with_stalls"] == pytest.approx(1.0 + 500 / stalled_plain["decode_steps"])
    note = stalls_note(reports["stalled"])
    assert f"1 of {stalled_plain['decode_steps']} plain, 0 d cycles" in note and stalls_note(reports["steady"]) == ""
