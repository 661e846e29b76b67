"""eval/oracle_cache.py: the oracle is measured once per target, prompts and setting, read back equal by the next
eval, measured again for another setting, and a damaged entry is said and replaced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import eval.oracle_cache as oracle_cache
from eval.oracle_cache import oracle_acceptance


@pytest.mark.real
def test_the_oracle_is_measured_once_then_read(smollm2, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    tok = smollm2.tokenizer
    prompts = {"a": [tok.encode("Name a colour.")], "b": [tok.encode("Count to three."), tok.encode("Say hi.")]}
    cache = tmp_path / "oracle"
    first = oracle_acceptance(smollm2, [2, 15, 27], prompts, 2, 1.0, 6, cache_dir=cache)
    assert set(first) == {"a", "b"} and first["b"]["prompts"] == 2 and first["a"]["tau"] >= 1.0
    assert len(list(cache.glob("*.json"))) == 2

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again though every entry was stored")

    monkeypatch.setattr(oracle_cache, "acceptance", no_measuring)
    again = oracle_acceptance(smollm2, [2, 15, 27], prompts, 2, 1.0, 6, cache_dir=cache)
    assert again == json.loads(json.dumps(first))
    assert "oracle k=2 T=1: a, b read from" in capsys.readouterr().out
    monkeypatch.undo()

    # another k is another entry; a damaged entry is said and measured again, only that dataset
    damaged = sorted(cache.glob("*.json"))[0]
    damaged.write_text("{not json")
    calls: list[list[str]] = []
    real = oracle_cache.acceptance

    def counted(target, drafter, aux, ps, *args, **kwargs):
        calls.append(sorted(ps))
        return real(target, drafter, aux, ps, *args, **kwargs)

    monkeypatch.setattr(oracle_cache, "acceptance", counted)
    healed = oracle_acceptance(smollm2, [2, 15, 27], prompts, 2, 1.0, 6, cache_dir=cache)
    assert healed == json.loads(json.dumps(first)) and len(calls) == 1 and len(calls[0]) == 1
    assert f"acceptance store: {damaged} unreadable" in capsys.readouterr().out
    oracle_acceptance(smollm2, [2, 15, 27], {"a": prompts["a"]}, 3, 1.0, 6, cache_dir=cache)
    assert calls[-1] == ["a"] and len(list(cache.glob("*.json"))) == 3
