"""The batched engine behind hf regeneration: at T=0 every answer is what plain greedy ``generate`` gives
for that prompt, whatever the row count, refills, compaction, requests submitted mid-run, a pool that grows or
preempts, or the attention kernel (flex over pages, or gathered pages); sampling is seeded; budgets and stop
tokens end answers; with ``loops`` an answer that falls into a loop ends there, the same answer up to the
loop's first copy; an architecture it cannot run is refused in one line."""

from __future__ import annotations

import time

import pytest
import torch
from torch._dynamo.utils import compilation_time_metrics
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from engine import batched as bt
from engine import continuous_batching as cb
from engine import layer_pieces, stream_admission, stream_decoding
from engine.batched import BatchedTarget, UnsupportedTargetError
from engine.continuous_batching import Stream, generate
from engine.kv_cache import PAGE
from engine.loops import LoopStop, loop_start
from engine.profile import EngineProfile
from engine.requests import Generated
from engine.sampling import Sampling, counter_uniform, request_seed
from engine.sizing import CPU_START_POSITIONS, decode_rows, plan_rows

STOPS = [1, 2]
V = 101


def tiny(kind: str = "llama") -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=V, num_hidden_layers=3, rope_theta=10000.0, max_position_embeddings=2048)
    model = LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama" else Qwen3ForCausalLM(Qwen3Config(**common))
    return model.eval()


def plain_greedy(model: torch.nn.Module, prompt: list[int], max_new: int) -> tuple[list[int], str]:
    """HF greedy ``generate`` on one prompt. The mask is explicit: without it ``generate`` masks every token equal
    to ``pad_token_id``, and a prompt that feeds an answer back may hold token 0."""
    dev = model.device
    out = model.generate(torch.tensor([prompt], device=dev),
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=dev),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=STOPS,
                         pad_token_id=0)[0, len(prompt):].tolist()
    end = next((i for i, t in enumerate(out) if t in STOPS), None)
    return (out, "length") if end is None else (out[:end], "stop")


def prompts(n: int, lo: int, hi: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_equals_plain_generate_with_refills_and_compaction(kind: str, monkeypatch) -> None:
    model = tiny(kind)
    calls = {"compact": 0}
    original = cb.Stream.compact

    def counting(self: cb.Stream) -> None:
        calls["compact"] += 1
        original(self)

    monkeypatch.setattr(cb.Stream, "compact", counting)
    # Equal prompt lengths: requests are admitted in budget order, so the longest answers sit in the highest
    # slots and the last steps run with a few live rows far from the front (the compaction case).
    ps = prompts(30, 10, 11)
    budgets = [1 + (7 * i) % 24 for i in range(30)]
    outs = generate(BatchedTarget(model), ps, budgets, STOPS, cpu_slots=12)
    assert calls["compact"] > 0, "the tail of the run never compacted its rows"
    for p, budget, o in zip(ps, budgets, outs, strict=True):
        assert (o.tokens, o.finish_reason) == plain_greedy(model, p, budget)


def test_short_and_long_prompts_share_a_pool_that_grows_and_stay_exact() -> None:
    """A row holds pages for the positions it uses: short and long prompts run side by side, and the CPU pool
    starts at CPU_START_POSITIONS per row and grows when the long ones come in."""
    model = tiny()
    ps = prompts(6, 2, 12) + prompts(3, 600, 700, seed=2)
    stream = Stream(BatchedTarget(model), STOPS, max_len=720, cpu_rows=4)
    start = stream.cache.pages
    assert start == 1 + 4 * CPU_START_POSITIONS // PAGE
    for i, p in enumerate(ps):
        stream.submit(i, p, 8)
    outs = dict(stream.run())
    assert stream.cache.pages > start and stream.preempted == 0
    for i, p in enumerate(ps):
        assert (outs[i].tokens, outs[i].finish_reason) == plain_greedy(model, p, 8)
    assert len(stream.cache.free) == stream.cache.pages - 1  # every page back, scratch aside


def test_a_full_pool_preempts_the_last_admitted_and_answers_stay_exact() -> None:
    """Five pages (one scratch) for three rows whose answers each need two: a row that needs a page when none is
    free takes one from the request admitted last, which starts again later; every answer is still greedy's."""
    model = tiny()
    ps = prompts(6, 100, 120, seed=3)
    stream = Stream(BatchedTarget(model), STOPS, max_len=256, cpu_rows=3, pages=5)
    for i, p in enumerate(ps):
        stream.submit(i, p, 40)
    outs = dict(stream.run())
    assert stream.preempted > 0 and stream.discarded > 0
    for i, p in enumerate(ps):
        assert (outs[i].tokens, outs[i].finish_reason) == plain_greedy(model, p, 40)


def test_requests_submitted_while_the_stream_runs_join_it_and_stay_exact() -> None:
    """A conversation's next turn enters the running batch when its previous answer ends: here each answer,
    with two more tokens, is the next prompt, three turns deep, beside first turns still decoding."""
    model = tiny()
    engine = BatchedTarget(model)
    ps = prompts(8, 3, 30, seed=4)
    stream = Stream(engine, STOPS, max_len=200, cpu_rows=5)
    for i, p in enumerate(ps):
        stream.submit((i, 0), p, 5 + 3 * i)
    seen: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    prompt_of = {(i, 0): p for i, p in enumerate(ps)}
    for key, answer in stream.run():
        seen[key] = (prompt_of[key], answer.tokens)
        i, turn = key
        if turn < 2:
            nxt = (i, turn + 1)
            prompt_of[nxt] = list(prompt_of[key]) + answer.tokens + [7, 9]
            stream.submit(nxt, prompt_of[nxt], 5 + 3 * i)
    assert len(seen) == 24
    for (i, _), (prompt, tokens) in seen.items():
        assert tokens == plain_greedy(model, prompt, 5 + 3 * i)[0]


def test_flex_attention_over_pages_equals_greedy_on_cpu(monkeypatch, cpu_flex) -> None:
    """CUDA's kernel: flex attention compiled over a block mask of each row's pages (one decode shape: the CPU
    compile takes tens of seconds). Inductor's CPU kernel skips the blocks the mask leaves out as the GPU's
    does, so a wrong block list would show here. Two turns each: the second decodes over a row whose pages were
    cut to the reused prefix and extended, its suffix prefilled by flex's suffix kernel (dynamic shapes: every
    group of suffixes has its own rows and width), then read by the decode kernel. First turns are prefilled by
    the suffix kernel too, after an empty prefix (never ``fresh_layer``)."""
    monkeypatch.setattr(cb, "DECODE_ROW_BUCKETS", 1)

    def fresh_layer(*args: object) -> None:
        raise AssertionError("a fresh prefill over flex pages runs the suffix kernel (one prefill graph on CUDA)")

    monkeypatch.setattr(layer_pieces, "fresh_layer", fresh_layer)
    model = tiny()
    ps = prompts(10, 3, 150, seed=5)
    stream = Stream(BatchedTarget(model), STOPS, max_len=260, cpu_rows=4, attention="flex")
    assert stream.cache.attention == "flex" and stream.buckets == 1
    seen = converse(stream, ps, 2, lambda i: 30)
    s = stream.stats()
    assert (s["attention"], s["suffix_attention"], s["continued"]) == ("flex", "flex", 10) and all_free(stream)
    # both flex kernels ran; several groups of suffixes: more than one suffix shape
    assert stream.cache.flex_ran == {"decode", "suffix"} and s["continue_forwards"] >= 2
    assert s["compile_s"]["_compile.compile_inner"] > 0  # the decode kernel's compile, in the stats
    for prompt, answer in seen.values():
        assert (answer.tokens, answer.finish_reason) == plain_greedy(model, prompt, 30)


def test_a_profiled_stream_splits_the_seconds_and_counts_steps_by_live_rows() -> None:
    """Given a profile, ``stats`` says where a run's seconds went: prefill and decode forwards, the engine's host
    work and the caller's time between polls, which add up to its seconds; and how many decode steps ran how many
    live rows (and their forwards' seconds), which add up to its steps. Unprofiled, it measures none of it."""
    profile = EngineProfile()
    stream = Stream(BatchedTarget(tiny()), STOPS, max_len=80, cpu_rows=12, profile=profile)
    time.sleep(0.05)  # the caller's work before its first requests: before the first poll
    for i, p in enumerate(prompts(12, 3, 30, seed=12)):
        stream.submit(i, p, 2 + 3 * i)
    for _ in stream.run():
        time.sleep(0.01)  # the caller's work between polls
    s = stream.stats()
    parts = s["prefill_s"] + s["decode_s"] + s["engine_host_s"] + s["caller_s"]
    assert abs(parts - s["seconds"]) < 0.05 and s["caller_s"] >= 0.1
    assert profile.times.prefill_s > 0 and profile.times.decode_s > 0  # (the stats round to 10 ms)
    phases = profile.times.host_phases  # the engine's host work by phase: within it, and each one ran
    assert set(s["engine_host_s_by_phase"]) == set(phases) and sum(phases.values()) <= s["engine_host_s"] + 0.01
    assert all(phases[p] > 0 for p in ("release", "continue", "admit", "pages", "tokens")), phases
    assert s["prefill_forwards"] >= 1 and s["continue_forwards"] == 0 and s["continue_prefill_s"] == 0  # all fresh
    assert 0 < s["decode_launch_s"] <= s["decode_s"] and s["decode_first_shape_s"] == 0  # gather: nothing compiles
    assert (s["graph_steps"], s["graph_captures"], s["graph_fallback"]) == (0, 0, None)  # CUDA graphs: CUDA only
    steps, seconds = s["steps_by_live_rows"], s["decode_s_by_live_rows"]
    assert list(steps) == list(seconds) == ["<=8", "<=64", "<=512", ">512"]
    assert sum(steps.values()) == s["steps"] and steps["<=8"] > 0 and steps["<=64"] > 0  # 12 rows, then fewer
    assert steps["<=512"] == steps[">512"] == 0 and abs(sum(seconds.values()) - s["decode_s"]) < 0.05
    line = s["timeline"]  # the run second by second: every token and prefill second in one bin, rows at most 12
    assert len(line["tokens"]) == len(line["live_rows"]) == len(line["prefill_s"]) >= int(s["seconds"] / line["bin_s"])
    assert sum(line["tokens"]) == s["decoded_tokens"] and abs(sum(line["prefill_s"]) - s["prefill_s"]) < 0.05
    assert max(line["live_rows"]) == 12 and s["compiled_pieces"] == "compiled"  # (compiled on CUDA only)
    # when the first poll began (after the caller's first submits) and the first decode step (after the first prefill):
    # ordered on the profile's own clock; the stats round both to 10 ms, so there they may tie
    assert 0.05 <= profile.first_poll_s < profile.first_step_s < s["seconds"]
    assert (s["first_poll_s"], s["first_step_s"]) == (round(profile.first_poll_s, 2), round(profile.first_step_s, 2))
    plain = Stream(BatchedTarget(tiny()), STOPS, max_len=80, cpu_rows=12)
    plain.submit(0, prompts(1, 3, 30, seed=12)[0], 4)
    assert len(list(plain.run())) == 1
    unmeasured = {"prefill_s", "decode_s", "caller_s", "timeline", "first_poll_s", "steps_by_live_rows"}
    assert not unmeasured & set(plain.stats()) and plain.stats()["steps"] > 0


def test_an_unknown_paged_attention_is_refused() -> None:
    with pytest.raises(ValueError, match="paged attention 'dense': use one of"):
        Stream(BatchedTarget(tiny()), STOPS, max_len=64, cpu_rows=2, attention="dense")


def test_per_prompt_budgets_and_stop_tokens() -> None:
    model = tiny()
    with torch.no_grad():  # make token 2 (a stop) the greedy choice after token 7
        model.lm_head.weight[2] = model.model.embed_tokens.weight[7] * 50
    ps = [[5, 9, 7], [5, 9, 11], [4, 4, 4, 4]]
    outs = generate(BatchedTarget(model), ps, [3, 5, 0 + 1], STOPS, cpu_slots=2)
    for p, budget, o in zip(ps, [3, 5, 1], outs, strict=True):
        assert (o.tokens, o.finish_reason) == plain_greedy(model, p, budget)
        assert len(o.tokens) <= budget
    assert outs[0] == Generated([], "stop", 2)


def test_sampling_is_seeded_and_top_k_1_is_greedy() -> None:
    model = tiny()
    ps = prompts(8, 2, 20)
    engine = BatchedTarget(model)
    a = generate(engine, ps, 12, STOPS, Sampling(temperature=1.0, seed=3), cpu_slots=8)
    b = generate(engine, ps, 12, STOPS, Sampling(temperature=1.0, seed=3), cpu_slots=8)
    assert a == b
    assert a != generate(engine, ps, 12, STOPS, Sampling(temperature=1.0, seed=4), cpu_slots=8)
    greedy = generate(engine, ps, 12, STOPS, cpu_slots=8)
    assert generate(engine, ps, 12, STOPS, Sampling(temperature=0.7, top_k=1, seed=5), cpu_slots=8) == greedy
    assert generate(engine, ps, 12, STOPS, Sampling(temperature=0.7, top_p=1e-6, seed=5), cpu_slots=8) == greedy


def test_a_sampled_answer_is_its_requests_own_whatever_the_batch() -> None:
    """Each token is drawn with a number from its request's seed (the run's seed and the request's key) and its
    position: the same answers with 8 rows at once or 2 (other batches, other rows, rows compacted), and with
    the requests submitted in another order; a request alone gets the answer it gets among others."""
    model = tiny()
    ps = prompts(8, 2, 20)
    engine = BatchedTarget(model)
    sampling = Sampling(temperature=1.0, seed=3)
    wide = generate(engine, ps, 12, STOPS, sampling, cpu_slots=8)
    assert generate(engine, ps, 12, STOPS, sampling, slots=2) == wide

    def by_key(order: list[int], rows: int) -> dict[int, Generated]:
        stream = cb.Stream(engine, STOPS, sampling, max_len=40, rows=rows)
        for i in order:
            stream.submit(i, ps[i], 12)
        return dict(stream.run())

    assert by_key(list(range(8))[::-1], 3) == dict(enumerate(wide))
    assert by_key([5], 1)[5] == wide[5]
    # the numbers themselves: a function of (seed, counter) alone, uniform enough to sample with
    u = counter_uniform(torch.full((20000,), request_seed(3, 5)), torch.arange(20000))
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0 and abs(float(u.mean()) - 0.5) < 0.01
    assert torch.equal(u[:7], counter_uniform(torch.full((7,), request_seed(3, 5)), torch.arange(7)))
    assert request_seed(3, 5) != request_seed(3, 6) != request_seed(4, 5)


def test_a_looping_answer_ends_at_its_loop_and_the_rest_are_unchanged() -> None:
    """A random tiny model decoding greedily loops within a few dozen tokens: with ``loops`` those answers end
    as "loop", cut to the prefix before the copies of the answer generated without it; answers that never
    loop are the same token for token. Without margins most tokens are appended without ``_take`` (``Stream.due``
    says when a loop check falls); with them every token goes through it: the same answers."""
    engine = BatchedTarget(tiny())
    ps = prompts(12, 3, 20)
    lp = LoopStop(min_repeat_tokens=16, max_period=32, every=8)
    plain = generate(engine, ps, 160, STOPS, cpu_slots=6)
    cut = generate(engine, ps, 160, STOPS, cpu_slots=6, loops=lp)
    taken = generate(engine, ps, 160, STOPS, cpu_slots=6, loops=lp, margins=True)
    for o, t in zip(cut, taken, strict=True):
        assert (o.tokens, o.finish_reason, o.generated) == (t.tokens, t.finish_reason, t.generated)
        assert len(t.margins) == len(t.tokens) + (t.finish_reason == "stop")
    looped = 0
    for p, o in zip(plain, cut, strict=True):
        if o.finish_reason != "loop":
            assert (o.tokens, o.finish_reason, o.generated) == (p.tokens, p.finish_reason, 0)
            continue
        looped += 1
        assert lp.min_repeat_tokens <= o.generated <= len(p.tokens) and o.generated % lp.every == 0
        assert len(o.tokens) < o.generated and o.tokens == p.tokens[:len(o.tokens)]
        # the cut is where loop_start puts it on the answer as it was when checked, and no earlier check found one
        assert len(o.tokens) == loop_start(p.tokens[:o.generated], lp.min_repeat_tokens, lp.max_period)
        assert all(loop_start(p.tokens[:n], lp.min_repeat_tokens, lp.max_period) is None
                   for n in range(lp.min_repeat_tokens, o.generated, lp.every))
        assert o.stop_token is None
    assert looped >= 6, "the tiny model did not loop: the test checks nothing"
    assert sum(len(o.tokens) for o in cut) < sum(len(p.tokens) for p in plain) / 2


def test_a_looping_answer_keeps_the_asked_tokens_of_its_copies() -> None:
    """``LoopStop.keep``: the same cut point as without it, then exactly ``keep`` tokens of the copies, which are
    the plain answer's next tokens (a bounded loop tail for the drafter to learn copying from)."""
    engine = BatchedTarget(tiny())
    ps = prompts(12, 3, 20)
    plain = generate(engine, ps, 160, STOPS, cpu_slots=6)
    lp, keep = LoopStop(min_repeat_tokens=16, max_period=32, every=8), LoopStop(16, 32, 8, keep=16)
    cut = generate(engine, ps, 160, STOPS, cpu_slots=6, loops=lp)
    kept = generate(engine, ps, 160, STOPS, cpu_slots=6, loops=keep)
    looped = 0
    for p, c, k in zip(plain, cut, kept, strict=True):
        assert (k.finish_reason, k.generated) == (c.finish_reason, c.generated)
        if c.finish_reason == "loop":
            looped += 1
            assert k.tokens == p.tokens[:len(c.tokens) + 16]
        else:
            assert k.tokens == c.tokens
    assert looped >= 6, "the tiny model did not loop: the test checks nothing"
    with pytest.raises(ValueError, match="keep 17"):
        LoopStop(16, 32, 8, keep=17)


def test_a_flex_kernel_that_fails_to_build_falls_back_to_gather(monkeypatch) -> None:

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this torch")

    monkeypatch.setattr(bt, "flex_decode", broken)
    model = tiny()
    ps = prompts(5, 3, 40, seed=6)
    stream = Stream(BatchedTarget(model), STOPS, max_len=80, cpu_rows=3, attention="flex")
    for i, p in enumerate(ps):
        stream.submit(i, p, 12)
    outs = dict(stream.run())
    assert stream.stats()["attention"] == "gather (flex failed: RuntimeError: no kernel for this torch)"
    for i, p in enumerate(ps):
        assert (outs[i].tokens, outs[i].finish_reason) == plain_greedy(model, p, 12)


@pytest.mark.parametrize("failure", ["build", "recompile limit"])
def test_a_suffix_kernel_that_fails_gathers_suffixes_and_decode_keeps_flex(failure: str, monkeypatch, capsys,
                                                                         cpu_flex) -> None:
    """A flex suffix kernel that does not build, or that meets dynamo's recompile limit after it ran (then dynamo
    would run flex uncompiled, whose dense scores do not fit on a GPU): suffixes gather from then on (one
    warning), the decode step keeps flex, and every turn is still greedy's. The kernel called on its own, as it is
    on a CPU and on CUDA once the compiled layers are off (on CUDA it is otherwise traced into the compiled
    ``suffix_layer``, where a failure turns the layers off first: test_engine_decode_graphs)."""
    from torch._dynamo.exc import FailOnRecompileLimitHit


    layers = tiny().config.num_hidden_layers
    real, calls = layer_pieces.flex_suffix, {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if failure == "build":
            raise RuntimeError("no suffix kernel for this torch")
        if calls["n"] > layers:  # the first suffix forward ran flex in every layer; the next one meets the limit
            raise FailOnRecompileLimitHit("recompile_limit reached")
        return real(*args, **kwargs)

    monkeypatch.setattr(layer_pieces, "flex_suffix", failing)
    monkeypatch.setattr(cb, "DECODE_ROW_BUCKETS", 1)
    model = tiny()
    stream = Stream(BatchedTarget(model), STOPS, max_len=200, cpu_rows=3, attention="flex")
    stream.t.pieces.state = "off: the test drives the suffix kernel called on its own"
    seen = converse(stream, prompts(5, 3, 40, seed=8), 2, lambda i: 12)
    s = stream.stats()
    assert s["attention"] == "flex" and s["continued"] == 5 and all_free(stream)
    assert s["suffix_attention"] == ("gather (flex failed: RuntimeError: no suffix kernel for this torch)"
                                     if failure == "build" else
                                     "gather (flex failed: FailOnRecompileLimitHit: recompile_limit reached)")
    assert calls["n"] > (layers if failure == "recompile limit" else 0)
    assert sum("of suffixes falls back" in line for line in capsys.readouterr().err.splitlines()) == 1
    for prompt, answer in seen.values():
        assert (answer.tokens, answer.finish_reason) == plain_greedy(model, prompt, 12)


def test_rows_come_from_the_setting_or_the_cpu_default_and_decode_in_a_few_shapes() -> None:
    engine = BatchedTarget(tiny())
    assert plan_rows(engine, wanted=100, cpu_rows=16) == 16
    assert plan_rows(engine, wanted=10, cpu_rows=16) == 10
    assert plan_rows(engine, wanted=100, cpu_rows=16, rows=40) == 40
    sizes = {decode_rows(hi, 4096, 4) for hi in range(1, 4097)}
    assert sizes == {512, 1024, 2048, 4096}
    assert all(decode_rows(hi, 4096, 4) >= hi for hi in range(1, 4097)) and decode_rows(7, 4096, 0) == 7
    assert {decode_rows(hi, 3, 4) for hi in range(1, 4)} == {1, 2, 3}


def test_an_unsupported_architecture_is_one_line() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(UnsupportedTargetError, match=r"model_type 'gpt2' is not one of .*regenerate.backend: openai"):
        BatchedTarget(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)))


@pytest.mark.real
def test_real_smollm2_64_prompts_equal_plain_generate(smollm2) -> None:
    """The Must-show check: 64 chat-templated MT-Bench prompts, fp32, every answer token for token equal to
    HF ``generate``'s greedy answer (run in left-padded batches of 16, prompts of like length together: batch 1
    would take minutes here, and unsorted batches pad to half again the tokens)."""
    from common.config import DatasetConfig
    from eval.prompts import load_eval_prompts, render
    from target_model.hf_model import stop_token_ids

    tok = smollm2.tokenizer
    ps = [render(tok, p) for p in load_eval_prompts(DatasetConfig(name="mtbench", kind="mtbench"), 80)[16:80]]
    assert len(ps) == 64
    stops = stop_token_ids(tok)
    outs = generate(BatchedTarget(smollm2.model), ps, 24, stops, cpu_slots=16)
    by_length = sorted(range(64), key=lambda i: len(ps[i]))
    tok.padding_side = "left"
    try:
        for i in range(0, 64, 16):
            batch = by_length[i:i + 16]
            enc = tok.pad({"input_ids": [ps[j] for j in batch]}, return_tensors="pt")
            ref = smollm2.model.generate(**enc, max_new_tokens=24, do_sample=False, eos_token_id=stops,
                                         pad_token_id=tok.pad_token_id)[:, enc["input_ids"].shape[1]:]
            for row, o in zip(ref.tolist(), [outs[j] for j in batch], strict=True):
                end = next((j for j, t in enumerate(row) if t in stops), None)
                assert o.tokens == (row if end is None else row[:end])
    finally:
        tok.padding_side = "right"


# Multi-turn: a follow-up continues in the row of the answer it follows (prefix reuse).

END = 2  # the end-of-turn marker a chat template writes after an answer: a stop token, as the real ones are


def next_turn(prompt: list[int], answer: Generated, user: list[int]) -> list[int]:
    """The next turn's prompt as a chat template renders it: the history, the answer, its end-of-turn marker
    (written whether or not the target produced it) and the new user turn."""
    return list(prompt) + answer.tokens + [END] + user


def pages_accounted(stream: Stream) -> None:
    """Every page is free or held by a row, every row is free, live or held (parked or continuing), and
    ``last_live`` is the highest live row."""
    c = stream.cache
    assert sum(map(len, c.row_pages)) + len(c.free) == c.pages - 1
    held = [row for row, _ in stream.parked.values()] + [x.row for x in stream.continuing]
    live = [s for s, r in enumerate(stream.request) if r is not None]
    assert sorted(stream.free + held + live) == list(range(stream.rows))
    assert all(not c.row_pages[s] for s in stream.free)
    assert not live or stream.last_live() == max(live)


def converse(stream: Stream, openers: list[list[int]], turns: int, budget, follow=next_turn, reuse: bool = True,
             late: frozenset[int] = frozenset()) -> dict[tuple[int, int], tuple[list[int], Generated]]:
    """Conversation i opens with ``openers[i]``; each answer's follow-up (``follow``) is submitted as the answer
    comes out, continuing in its row when ``reuse``, except for the conversations in ``late``, which submit
    theirs after the next poll (by then their rows are freed). Returns {(i, turn): (prompt, answer)}."""
    users = prompts(len(openers) * turns, 2, 9, seed=11)
    prompt_of = {(i, 0): p for i, p in enumerate(openers)}
    for i, p in enumerate(openers):
        stream.submit((i, 0), p, budget(i))
    seen: dict[tuple[int, int], tuple[list[int], Generated]] = {}
    deferred: list[tuple[int, int]] = []
    while stream.busy or deferred:
        done = stream.poll()
        pages_accounted(stream)
        for i, turn in deferred:
            stream.submit((i, turn), prompt_of[(i, turn)], budget(i), continue_from=(i, turn - 1))
        deferred = []
        for (i, turn), answer in done:
            seen[(i, turn)] = (prompt_of[(i, turn)], answer)
            if turn + 1 == turns:
                continue
            prompt_of[(i, turn + 1)] = follow(prompt_of[(i, turn)], answer, users[i * turns + turn])
            if i in late:
                deferred.append((i, turn + 1))
            else:
                stream.submit((i, turn + 1), prompt_of[(i, turn + 1)], budget(i),
                              continue_from=(i, turn) if reuse else None)
    assert len(seen) == len(openers) * turns
    return seen


def all_free(stream: Stream) -> bool:
    return (len(stream.cache.free) == stream.cache.pages - 1 and sorted(stream.free) == list(range(stream.rows))
            and not stream.parked and not stream.continuing and stream.live == 0)


def test_a_follow_up_continues_in_its_rows_cache_and_every_turn_stays_greedy() -> None:
    """Eight conversations of three turns through five rows: each follow-up prefills only what its row does not
    hold (the end-of-turn marker and the new user turn, and for an answer cut at its budget the last token,
    which was never fed back), so prefill_tokens drops by exactly that, and every answer is plain greedy
    ``generate``'s for the turn's whole prompt, and the same as with no reuse. Afterwards every page and row is
    free."""
    model = tiny()
    with torch.no_grad():  # token 2 (a stop) likelier after token 7: answers end by a stop as well as by budget
        model.lm_head.weight[2] = model.model.embed_tokens.weight[7] * 5
    engine = BatchedTarget(model)
    openers = prompts(8, 3, 40, seed=7)

    def budget(i: int) -> int:
        return 4 + 3 * i

    runs = {}
    for reuse in (True, False):
        stream = Stream(engine, STOPS, max_len=400, cpu_rows=5, margins=True)
        runs[reuse] = converse(stream, openers, 3, budget, reuse=reuse), stream.stats()
        assert all_free(stream)
    (seen, stats), (plain, plain_stats) = runs[True], runs[False]
    assert {k: (p, a.tokens, a.finish_reason) for k, (p, a) in seen.items()} == \
        {k: (p, a.tokens, a.finish_reason) for k, (p, a) in plain.items()}
    for key, (_, answer) in seen.items():  # the same logits, up to the attention kernels' summation order
        assert answer.margins == pytest.approx(plain[key][1].margins, abs=1e-4)
    assert {a.finish_reason for _, a in seen.values()} == {"stop", "length"}
    for (i, _), (prompt, answer) in seen.items():
        assert (answer.tokens, answer.finish_reason) == plain_greedy(model, prompt, budget(i))
        assert len(answer.margins) == len(answer.tokens) + (answer.finish_reason == "stop")  # the stop token's too
    # what each row held when its follow-up came: the prompt and the answer, less a budget-cut answer's last token
    held = sum(len(p) + len(a.tokens) - (a.finish_reason == "length") for (_, t), (p, a) in seen.items() if t < 2)
    assert stats["reused_prefix_tokens"] == held and stats["continued"] == 16 and stats["preempted"] == 0
    prompted = sum(len(p) for p, _ in seen.values())
    assert stats["prefill_tokens"] == plain_stats["prefill_tokens"] - held == prompted - held
    assert plain_stats["reused_prefix_tokens"] == plain_stats["continued"] == 0
    assert 1 <= stats["continue_forwards"] <= 16 and plain_stats["continue_forwards"] == 0  # forwards, split by kind
    assert stats["continue_forwards"] < stats["prefill_forwards"] and plain_stats["prefill_forwards"] >= 1


def test_a_follow_up_that_diverges_inside_the_answer_reuses_only_the_common_prefix() -> None:
    """The text of an answer tokenized again need not give the ids generated, and a loop-cut answer keeps fewer
    tokens than its row holds: a follow-up whose ids differ from the row's at some position inside the previous
    answer reuses exactly the positions before it, and every answer is still greedy's (up to its loop's first
    copy, for an answer stopped at a loop)."""
    model = tiny()
    engine = BatchedTarget(model)
    openers = prompts(8, 3, 30, seed=8)
    loops = LoopStop(min_repeat_tokens=16, max_period=32, every=8)

    def retokenized(prompt: list[int], answer: Generated, user: list[int]) -> list[int]:
        """Even turns' answers come back with their middle token changed (another id, never a stop token)."""
        k = len(answer.tokens) // 2
        if answer.tokens and len(prompt) % 2 == 0:
            return list(prompt) + answer.tokens[:k] + [3 + (answer.tokens[k] - 2) % (V - 3)] + answer.tokens[k + 1:] \
                + [END] + user
        return next_turn(prompt, answer, user)

    stream = Stream(engine, STOPS, max_len=400, cpu_rows=4, loops=loops)
    seen = converse(stream, openers, 3, lambda i: 90, follow=retokenized)
    assert all_free(stream)
    reasons = {a.finish_reason for _, a in seen.values()}
    assert "loop" in reasons, "no answer looped: the loop-cut case goes untested"
    expected = 0
    for (i, turn), (prompt, answer) in seen.items():
        ref, reason = plain_greedy(model, prompt, 90)
        if answer.finish_reason == "loop":
            assert answer.tokens == ref[: len(answer.tokens)] and len(answer.tokens) < answer.generated
        else:
            assert (answer.tokens, answer.finish_reason) == (ref, reason)
        if turn < 2:  # the row holds the answer's tokens fed back: all but the last one generated (not a stop)
            fed = {"stop": len(answer.tokens), "length": len(answer.tokens) - 1, "loop": answer.generated - 1}
            expected += cb.common_prefix(prompt + ref[: fed[answer.finish_reason]], seen[(i, turn + 1)][0])
    assert stream.stats()["reused_prefix_tokens"] == expected
    assert any(len(p) % 2 == 0 for (_, t), (p, _) in seen.items() if t < 2), "no follow-up diverged"


def test_follow_ups_that_come_late_or_never_leave_no_page_held() -> None:
    """A finished row waits for its follow-up until the next poll only: conversations that submit theirs a poll
    late start again from scratch (still greedy), the last turns' rows are freed, and every page comes back."""
    model = tiny()
    openers = prompts(6, 3, 30, seed=9)
    stream = Stream(BatchedTarget(model), STOPS, max_len=300, cpu_rows=4)
    seen = converse(stream, openers, 3, lambda i: 6 + i, late=frozenset({1, 4}))
    assert all_free(stream)
    for (i, _), (prompt, answer) in seen.items():
        assert (answer.tokens, answer.finish_reason) == plain_greedy(model, prompt, 6 + i)
    assert stream.stats()["continued"] == 2 * 4  # second and third turns of the four conversations on time


@pytest.mark.parametrize("waiting", [False, True])
def test_a_full_pool_preempts_continuations_and_answers_stay_exact(waiting: bool, monkeypatch) -> None:
    """Five pages (one scratch) for three rows whose turns need one to three pages each: continuations that find
    no pages start again from scratch, continued rows are preempted, and (with continuations waiting to be
    prefilled together) a waiting one gives its pages up to a live row; yet every turn's answer is greedy's,
    turns still reuse their rows, and every page comes back."""
    dropped = {"held": 0}
    original = cb.Stream._drop_held

    def counting(self: cb.Stream) -> bool:
        freed = original(self)
        dropped["held"] += freed
        return freed

    monkeypatch.setattr(cb.Stream, "_drop_held", counting)
    if waiting:
        monkeypatch.setattr(stream_admission, "CONTINUE_SHARE", 0)
        monkeypatch.setattr(stream_admission, "CONTINUE_WAIT", 10)
    model = tiny()
    lo, budget = (100, 40) if waiting else (60, 60)
    openers = prompts(5, lo, 120, seed=10)
    stream = Stream(BatchedTarget(model), STOPS, max_len=400, cpu_rows=3, pages=5)
    seen = converse(stream, openers, 3, lambda i: budget)
    assert all_free(stream)
    stats = stream.stats()
    assert stats["preempted"] > 0 and stats["reused_prefix_tokens"] > 0
    assert dropped["held"] > 0 if waiting else stats["continued"] < 10  # some continuations started again
    for prompt, answer in seen.values():
        assert (answer.tokens, answer.finish_reason) == plain_greedy(model, prompt, budget)


@pytest.mark.parametrize("attention", ["gather", "flex"])
def test_a_row_that_used_every_position_can_wait_for_its_follow_up_while_steps_run(attention: str,
                                                                                    monkeypatch) -> None:
    """A row of exactly ``max_len`` positions whose answer is cut at a loop found on its last budgeted token: the
    step launched before that token was read wrote the row's last position and moved its position to ``max_len``,
    one past its table. The cut answer is shorter than what the row holds, so its follow-up fits and continues in
    that row, waiting to be prefilled with others while decode steps still run the row (a live row above it).
    Those steps write at position ``max_len``: scratch's, not an index past the page table (where a device assert,
    "scatter gather kernel index out of bounds", would kill the run). Every answer stays greedy's."""
    # one waiting continuation is not due while two rows are live
    monkeypatch.setattr(stream_admission, "CONTINUE_SHARE", 1)
    monkeypatch.setattr(cb, "DECODE_ROW_BUCKETS", 1)
    model = tiny()
    page, budget = PAGE, 24
    first = prompts(1, 2 * page - budget, 2 * page - budget + 1, seed=12)[0]  # prompt + budget = two whole pages
    others = prompts(2, 5, 20, seed=13)
    stream = Stream(BatchedTarget(model), STOPS, max_len=2 * page, cpu_rows=4, attention=attention,
                    loops=LoopStop(min_repeat_tokens=16, max_period=32, every=8))
    cut = []

    def loop_start(window: list[int], min_repeat: int, max_period: int) -> int | None:
        """A loop at the first conversation's last budgeted token only (row 0: submitted first)."""
        r = stream.request[0]
        if r is not None and r.key == ("first", 0) and len(window) == budget and window == stream.tokens[0]:
            cut.append(len(window))
            return 0
        return None

    monkeypatch.setattr(stream_decoding, "may_loop", lambda *args: True)
    monkeypatch.setattr(stream_decoding, "loop_start", loop_start)
    stream.submit(("first", 0), first, budget)
    for i, p in enumerate(others):
        stream.submit(("other", i), p, 60)
    user = [5, 6, 7]
    seen, waited = {}, 0
    while stream.busy:
        for key, answer in stream.poll():
            seen[key] = answer
            if key == ("first", 0):
                assert answer.finish_reason == "loop" and answer.generated == budget
                follow = first + answer.tokens + [END] + user
                stream.submit(("first", 1), follow, 2 * page - len(follow), continue_from=key)
        waited += any(c.row == 0 for c in stream.continuing) and stream.last_live() > 0
    assert cut == [budget] and waited > 0, "the follow-up never waited in its row while steps ran"
    assert seen[("first", 1)].tokens == plain_greedy(model, follow, 2 * page - len(follow))[0]
    assert stream.stats()["continued"] == 1 and all_free(stream)
    for i, p in enumerate(others):
        assert (seen[("other", i)].tokens, seen[("other", i)].finish_reason) == plain_greedy(model, p, 60)


@pytest.mark.parametrize("full_blocks", [True, False])
def test_a_decode_block_mask_reads_every_visible_key_and_skips_the_mask_only_where_all_are(full_blocks) -> None:
    """Eager flex attention (the CPU tests' kernel) ignores a block mask's sparsity, so the blocks are checked here
    against the mask itself: every key the mask shows a row lies in one of its blocks, and every key of a full
    block (read without the mask) is visible. Rows at a page's first and last position, across page ends."""
    from engine.kv_cache import PagedKVCache

    cache = PagedKVCache(1, 1, 4, rows=4, pages=16, max_len=64, dtype=torch.float32, device=torch.device("cpu"),
                         attention="flex", page=8)
    cache.full_blocks = full_blocks
    for r, pos in enumerate([0, 7, 8, 21]):
        assert cache.ensure(r, pos + 1)
        cache.query_pos[r] = pos
    cache.release(1), cache.ensure(1, 8)  # row 1's page comes back: tables are not in row order
    cache.flush()
    mask = cache.block_mask(4, 1)
    keys = torch.arange(cache.k.shape[2])
    for b in range(4):
        visible = cache.mask_mod(torch.tensor(b), torch.tensor(0), torch.tensor(0), keys)
        partial = set(mask.kv_indices[b, 0, 0, : int(mask.kv_num_blocks[b, 0, 0])].tolist())
        full = set() if mask.full_kv_num_blocks is None else set(
            mask.full_kv_indices[b, 0, 0, : int(mask.full_kv_num_blocks[b, 0, 0])].tolist())
        assert not partial & full
        assert set((keys[visible] // cache.page).tolist()) <= partial | full
        for p in full:
            assert visible[p * cache.page:(p + 1) * cache.page].all()
        assert int(visible.sum()) == int(cache.query_pos[b]) + 1
        assert len(full) == (int(cache.query_pos[b]) // cache.page if full_blocks else 0)


@pytest.mark.parametrize("with_lengths", [False, True])
def test_a_suffix_block_mask_lists_exactly_the_pages_each_query_block_sees(with_lengths: bool) -> None:
    """A suffix prefill's blocks, checked against the mask itself (eager flex ignores a block mask's sparsity): each
    query block lists its row's pages up to its last query's, which are exactly the pages holding a key one of its
    queries sees; those wholly at or before its first query's position as full blocks (every key visible to every
    query, so the kernel may skip the mask), none twice. With the rows' lengths, a block of padding only lists none
    and the others are as without. A fresh prefill (empty prefix), suffixes after a prefix mid-page and at a page's
    end, one padded past what its row holds; queries over three blocks, tables not in row order."""
    from engine.kv_cache import FLEX_Q_BLOCK, PagedKVCache

    cache = PagedKVCache(1, 1, 4, rows=4, pages=200, max_len=512, dtype=torch.float32, device=torch.device("cpu"),
                         attention="flex", page=8)
    t = 2 * FLEX_Q_BLOCK + 30
    starts, lengths = [0, 13, 7, 40], [t, t, t, 50]  # row 3's suffix is 50 tokens, padded to t
    for r, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        assert cache.ensure(r, s + n)
    cache.release(0), cache.ensure(0, t)  # row 0's pages come back in another order
    cache.flush()
    rows = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    positions = torch.tensor([starts[r] for r in rows.tolist()])[:, None] + torch.arange(t)
    real = torch.tensor([lengths[r] for r in rows.tolist()])
    mask = cache.suffix_block_mask(rows, positions, real if with_lengths else None)
    keys = torch.arange(cache.k.shape[2])
    padding_only = 0
    for b in range(len(rows)):
        visible = cache.suffix_mask_mod(torch.tensor(b), torch.tensor(0), torch.arange(t)[:, None], keys[None, :])
        for j in range(-(-t // FLEX_Q_BLOCK)):
            partial = mask.kv_indices[b, 0, j, : int(mask.kv_num_blocks[b, 0, j])].tolist()
            full = mask.full_kv_indices[b, 0, j, : int(mask.full_kv_num_blocks[b, 0, j])].tolist()
            if with_lengths and j * FLEX_Q_BLOCK >= int(real[b]):
                assert partial == [] and full == [], (b, j)
                padding_only += 1
                continue
            queries = visible[j * FLEX_Q_BLOCK:(j + 1) * FLEX_Q_BLOCK]
            needed = set((keys[queries.any(0)] // cache.page).tolist())
            assert set(partial) | set(full) == needed and len(partial) + len(full) == len(needed), (b, j)
            for p in full:
                assert queries[:, p * cache.page:(p + 1) * cache.page].all(), (b, j, p)
            whole = {p for p in needed if queries[:, p * cache.page:(p + 1) * cache.page].all()}
            assert set(full) == whole, (b, j)  # every page it may skip the mask on, and no other
    assert padding_only == (2 if with_lengths else 0)  # row 3's second and third blocks


def test_a_block_sparse_flex_kernel_reads_the_suffix_mask_as_the_dense_mask_does(cpu_flex) -> None:
    """What the mask test above cannot see (eager flex ignores the blocks): flex compiled by inductor (on a CPU, its
    C++ template at static shapes) reads only the listed blocks, and skips the mask on full ones. Over a suffix
    mask with full blocks and, with the rows' lengths, query blocks of padding only, every real query's output is
    the eager (dense) kernel's, and a padding-only block's output is zeros (nothing read; not NaN, which would reach
    the keys and values its padding writes)."""
    from torch.nn.attention.flex_attention import flex_attention

    from engine.kv_cache import FLEX_Q_BLOCK, PagedKVCache

    torch.manual_seed(0)
    kv, d, heads = 1, 16, 2
    cache = PagedKVCache(1, kv, d, rows=4, pages=16, max_len=1024, dtype=torch.float32, device=torch.device("cpu"),
                         attention="flex", page=FLEX_Q_BLOCK)
    t = 2 * FLEX_Q_BLOCK + 30
    starts, lengths = [0, 130, 7, 300], [t, 100, t, 50]  # rows 1 and 3 end in their first query block
    for r, s in enumerate(starts):
        assert cache.ensure(r, s + t)
    cache.flush()
    cache.k.normal_(), cache.v.normal_()
    rows = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    positions = torch.tensor([starts[r] for r in rows.tolist()])[:, None] + torch.arange(t)
    real = torch.tensor([lengths[r] for r in rows.tolist()])
    q = torch.randn(len(rows), heads, t, d)
    k, v = cache.k[0][None], cache.v[0][None]
    mask = cache.suffix_block_mask(rows, positions, real)
    empty = mask.kv_num_blocks + mask.full_kv_num_blocks == 0
    assert int(mask.full_kv_num_blocks.sum()) > 0 and int(empty.sum()) == 4  # rows 1 and 3: their last two blocks
    dense = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    sparse = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=mask, enable_gqa=True)
    for b, n in enumerate(real.tolist()):
        torch.testing.assert_close(sparse[b, :, :n], dense[b, :, :n], rtol=1e-5, atol=1e-5)
        padding_only = -(-n // FLEX_Q_BLOCK) * FLEX_Q_BLOCK
        assert torch.equal(sparse[b, :, padding_only:], torch.zeros_like(sparse[b, :, padding_only:]))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_each_layer_piece_traces_once_for_every_prefill_shape(kind: str) -> None:
    """The pieces ``BatchedTarget`` compiles on CUDA, traced by dynamo with dynamic shapes as ``_piece`` traces them
    (a counting backend in front of AOT autograd, whose graphs run eagerly: all but inductor, as on CUDA): one graph
    each, traced once (no restart), for two prefills of other rows, widths and prefixes; the same outputs as
    uncompiled. The head counts as arguments (symbolic sizes, and a symbolic bool that split the fresh layer's
    graph) or a float traced as a symbol (a second trace) make the prefill graph's compile several times longer."""
    from torch._dynamo.backends.registry import lookup_backend

    aot_eager = lookup_backend("aot_eager")
    torch.manual_seed(0)
    t = BatchedTarget(tiny(kind))
    names = ("inputs", "after", "fresh", "suffix")  # LayerPieces' methods
    graphs = dict.fromkeys(names, 0)

    def compiled(name: str):
        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
            graphs[name] += 1
            return aot_eager(gm, example_inputs)

        return torch.compile(getattr(t.layer_pieces, name), dynamic=True, backend=backend)

    pieces = {name: compiled(name) for name in names}
    torch._dynamo.reset()
    retraced = len(compilation_time_metrics.get("compile_attempt_1", []))  # dynamo's restarts of a trace so far
    with torch.no_grad():
        for rows, width, prefix in ((3, 129, 0), (5, 200, 130)):
            cache = t.new_paged_cache(rows, 1 + rows * 3, max_len=3 * PAGE, attention="flex")
            for r in range(rows):
                assert cache.ensure(r, prefix + width + 1)
            cache.flush()
            ids = torch.randint(0, V, (rows, width))
            positions = (prefix + torch.arange(width))[None].expand(rows, width).contiguous()
            h = t.embed(ids)
            cos, sin = t.rotary(h, positions)
            mask = cache.suffix_block_mask(torch.arange(rows, dtype=torch.int32), positions)
            q, k, v = t.layer_pieces.inputs(t.layers[0], h, cos, sin)
            calls = {"inputs": (t.layers[0], h, cos, sin), "after": (t.layers[0], h, q),
                     "fresh": (t.layers[0], t.layers[1], h, q, k, v, cos, sin),
                     "suffix": (t.layers[0], t.layers[1], h, q, cache.k[0], cache.v[0], mask, cos, sin)}
            for name, args in calls.items():
                got = t.pieces.run(lambda name=name, args=args: pieces[name](*args), lambda: None)
                # exact: aot_eager runs the traced graph's own ATen ops, eagerly, on the same data
                torch.testing.assert_close(got, getattr(t.layer_pieces, name)(*args), rtol=0, atol=0)
    assert graphs == {"inputs": 1, "after": 1, "fresh": 1, "suffix": 1}
    assert len(compilation_time_metrics.get("compile_attempt_1", [])) == retraced
