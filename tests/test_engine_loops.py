"""Tail loops of an answer (engine.loops) on hand-made token lists: where the copies start, what is too
short or not at the end to count, the windowed check the engine runs, and the measures the reports use."""

from __future__ import annotations

import random

import numpy as np

from engine.loops import (
    after_first_repeat_chars,
    after_first_repeat_share,
    check_window,
    first_repeat,
    loop_start,
    loop_tail_tokens,
    loop_token_share,
    may_loop,
    retokenized_loop_start,
    trailing_runs,
)

PROSE = list(range(1000, 1200))  # 200 distinct tokens: text that never repeats itself


def test_period_1_keeps_one_copy_of_the_repeated_token() -> None:
    tokens = PROSE[:40] + [7] * 100
    assert loop_start(tokens) == 41  # the prose, then one 7
    assert loop_tail_tokens(tokens) == 99
    assert loop_token_share(tokens) == 99 / 140


def test_period_7_keeps_the_first_copy_of_the_block() -> None:
    block = [11, 12, 13, 14, 15, 16, 17]
    tokens = PROSE[:30] + block * 20
    assert loop_start(tokens) == 37
    assert tokens[:37] == PROSE[:30] + block


def test_a_paragraph_of_150_tokens_repeated() -> None:
    paragraph = list(range(5000, 5150))
    tokens = PROSE[:20] + paragraph * 2 + paragraph[:50]  # two copies and a third begun: run 200 >= p = 150
    assert loop_start(tokens) == 170
    assert loop_start(PROSE[:20] + paragraph + paragraph[:149]) is None  # not one full extra copy yet
    assert loop_start(PROSE[:20] + paragraph * 2) == 170  # exactly one extra copy counts


def test_the_longest_run_wins_and_ties_take_the_smallest_period() -> None:
    # period 3 and its multiples all repeat; 3 has the longest run
    assert loop_start(PROSE[:10] + [1, 2, 3] * 40) == 13
    runs = trailing_runs(PROSE[:10] + [1, 2, 3] * 40, 12)
    assert [int(runs[p - 1]) for p in (3, 6, 9, 12)] == [117, 114, 111, 108]
    assert runs[0] == runs[1] == 0
    # a run of 1 then a run of 2 of the same token: period 1 and 2 both qualify; 1 is longer
    assert loop_start(PROSE[:5] + [9] * 80) == 6


def test_text_that_does_not_loop() -> None:
    rng = random.Random(0)
    words = [rng.randrange(32000) for _ in range(1024)]
    assert loop_start(words) is None
    assert loop_start(PROSE) is None
    assert loop_start([]) is None and loop_start([3]) is None
    assert loop_token_share([]) == 0.0
    # natural repetition: the same short phrase a few times with other words between is no loop
    phrase = [50, 51, 52, 53]
    tokens = []
    for i in range(40):
        tokens += phrase + PROSE[5 * i: 5 * i + 5]
    assert loop_start(tokens) is None


def test_a_loop_too_short_to_count() -> None:
    assert loop_start(PROSE[:50] + [4] * 64) is None  # 63 repeated tokens < 64
    assert loop_start(PROSE[:50] + [4] * 65) == 51
    assert loop_start(PROSE[:50] + [1, 2, 3, 4, 5] * 13) is None  # run of 60
    assert loop_start(PROSE[:50] + [1, 2, 3, 4, 5] * 13, min_repeat_tokens=32) == 55
    long_block = list(range(7000, 7300))  # period 300 > max_period
    assert loop_start(PROSE[:5] + long_block * 3) is None
    assert loop_start(PROSE[:5] + long_block * 3, max_period=300) == 305


def test_a_loop_that_does_not_reach_the_end_is_not_a_tail_loop() -> None:
    tokens = PROSE[:30] + [8, 9] * 60 + PROSE[100:140]
    assert loop_start(tokens) is None
    assert loop_start(tokens[:150]) == 32  # the same answer stopped inside the loop


def test_a_retokenized_answer_may_end_in_a_ragged_token() -> None:
    tokens = PROSE[:10] + [1, 2, 3] * 30 + [99]  # the text cut mid-block tokenizes its last piece otherwise
    assert loop_start(tokens) is None
    assert retokenized_loop_start(tokens) == 13
    assert retokenized_loop_start(tokens + [98]) is None and retokenized_loop_start(tokens + [98], ragged=2) == 13
    assert retokenized_loop_start(PROSE) is None and retokenized_loop_start([]) is None


def test_the_engines_window_gives_the_whole_answers_cut() -> None:
    """Checked every 16 tokens on the last ``check_window`` tokens, the first cut equals the cut of the whole
    answer at that length (what the engine relies on)."""
    rng = random.Random(1)
    m, p_max, every = 64, 256, 16
    window = check_window(m, p_max, every)
    for _ in range(40):
        prefix = [rng.randrange(100, 30000) for _ in range(rng.randrange(0, 700))]
        block = [rng.randrange(100, 30000) for _ in range(rng.randrange(1, 257))]
        tokens = prefix + block * (1 + 1200 // len(block))
        for n in range(m, len(tokens) + 1, every):
            off = max(0, n - window)
            got = loop_start(tokens[off:n], m, p_max)
            if got is not None:
                assert off + got == loop_start(tokens[:n], m, p_max) == len(prefix) + len(block)
                break
        else:
            raise AssertionError("the loop was never found")


def test_may_loop_says_exactly_whether_loop_start_finds_a_loop() -> None:
    """The engine asks ``may_loop`` before ``loop_start``: True exactly where ``loop_start`` finds a loop (any
    period, on the engine's windows and whole answers alike, small ``min_repeat_tokens`` too; loops still forming
    and too short to count among them), so it rules out both text that does not loop and loops not yet long
    enough, without ``loop_start``'s arrays."""
    rng = random.Random(3)
    found = forming = 0
    for _ in range(60):
        m, p_max = rng.choice([(64, 256), (16, 32), (4, 8), (1, 4)])
        prefix = [rng.randrange(100, 400) for _ in range(rng.randrange(0, 300))]
        block = [rng.randrange(100, 400) for _ in range(rng.randrange(1, p_max + 1))]
        tokens = prefix + block * (1 + 3 * max(m, len(block)) // len(block)) + [rng.randrange(100, 400)]
        for n in range(1, len(tokens) + 1):
            for off in (0, max(0, n - check_window(m, p_max, 16))):
                window = tokens[off:n]
                loops = loop_start(window, m, p_max) is not None
                assert may_loop(window, m, p_max) == loops, (window, m, p_max)
                found += loops
                forming += not loops and n > len(prefix) + len(block) + min(m, 8)  # a k-gram repeats, too short
    assert found > 1000 and forming > 1000
    assert not any(may_loop(PROSE[:n]) for n in range(len(PROSE) + 1))


def test_runs_are_vectorised_over_periods_and_match_a_plain_loop() -> None:
    rng = np.random.default_rng(2)
    for _ in range(30):
        tokens = list(rng.integers(0, 4, size=int(rng.integers(2, 200))))
        runs = trailing_runs(tokens, 64)
        for p in range(1, min(64, len(tokens) - 1) + 1):
            r = 0
            while r < len(tokens) - p and tokens[-1 - r] == tokens[-1 - r - p]:
                r += 1
            assert runs[p - 1] == r, (tokens, p)


def test_runs_of_looping_tails_and_their_multiples_match_a_plain_loop() -> None:
    """The runs a measured period gives its multiples (r + p - q) against the plain loop, on tails that loop
    (blocks with repeated tokens inside, cut anywhere, noise after) and as lists or arrays."""
    rng = random.Random(5)
    for _ in range(400):
        block = [rng.randrange(5) for _ in range(rng.randrange(1, 30))]
        tokens = ([rng.randrange(5) for _ in range(rng.randrange(0, 60))] + block * rng.randrange(1, 15)
                  + block[:rng.randrange(len(block) + 1)] + [rng.randrange(5) for _ in range(rng.randrange(0, 3))])
        max_period = rng.choice([4, 64, 256])
        for given in (tokens, np.array(tokens, dtype=np.int64)):
            runs = trailing_runs(given, max_period)
            for p in range(1, min(max_period, len(tokens) - 1) + 1):
                r = 0
                while r < len(tokens) - p and tokens[-1 - r] == tokens[-1 - r - p]:
                    r += 1
                assert runs[p - 1] == r, (tokens, p)
            floored = trailing_runs(given, max_period, floor=16)  # loop_start's: runs under 16 may read 0
            assert all(f == e if e >= 16 else f in (0, e) for f, e in zip(floored, runs, strict=True)), tokens


def test_the_character_measure_of_issue_18() -> None:
    intro = "".join(chr(65 + i % 26) + str(i) for i in range(40))  # no 64-char window twice
    loop = "I am a loop of more than sixty-four characters, said again and again. "
    text = intro + loop * 3
    assert first_repeat(intro) is None and after_first_repeat_share(intro) == 0.0
    assert first_repeat(text) == len(intro) + len(loop)
    assert after_first_repeat_chars(text) == 2 * len(loop)
    assert after_first_repeat_share(text) == 2 * len(loop) / len(text)
    assert after_first_repeat_share("") == 0.0 and first_repeat("short") is None
