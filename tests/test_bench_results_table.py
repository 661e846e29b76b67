"""bench/results_table.py: the table at the top of bench/RESULTS.md is generated from bench/results.json, so it must
be what the file gives today; a figure the file no longer holds is an error naming it."""

from __future__ import annotations

import json

import pytest

from bench import results_table as rt


def test_the_committed_table_is_what_results_json_gives() -> None:
    results = json.loads(rt.RESULTS_JSON.read_text())
    assert rt.current_block(rt.RESULTS_MD.read_text()) == rt.block(results), (
        "bench/RESULTS.md's results table is stale: run `python bench/results_table.py` and commit it")


def _results() -> dict:
    return {"quality": {"command": "python bench/x.py", "device": "NVIDIA H200", "date": "2030-01-02",
                        "mtbench": {"tau": 2.30316}, "rows": [{"name": "a", "tau": 1.5}, {"name": "b", "tau": 1.25}],
                        "inner": {"command": "python bench/y.py", "device": "cpu (2 cores)", "date": "2030-01-01",
                                  "share": 0.17134}}}


def test_a_figure_is_found_by_key_index_and_selector_with_the_innermost_provenance() -> None:
    results = _results()
    value, source, key = rt.lookup(results, "quality", ("mtbench", "tau"))
    assert (value, source["command"], key) == (2.30316, "python bench/x.py", "quality.mtbench.tau")
    assert rt.lookup(results, "quality", ("rows", {"name": "b"}, "tau"))[0] == 1.25
    assert rt.lookup(results, "quality", ("rows", -1, "name"))[0] == "b"
    value, source, _ = rt.lookup(results, "quality", ("inner", "share"))
    assert (value, source["device"], source["date"]) == (0.17134, "cpu (2 cores)", "2030-01-01")
    assert [rt.number(v) for v in (2.30316, 55738.4, 16256, 0.00116, 0.0)] == ["2.303", "55,738", "16,256",
                                                                                "0.00116", "0"]


@pytest.mark.parametrize("path", [("mtbench", "alpha"), ("rows", {"name": "c"}, "tau"), ("rows", 5), ("mtbench", 0)])
def test_a_figure_results_json_no_longer_holds_is_an_error_naming_it(path) -> None:
    with pytest.raises(rt.TableError, match="quality.*no such figure.*update FIGURES"):
        rt.lookup(_results(), "quality", path)
    with pytest.raises(rt.TableError, match="no 'gone' object"):
        rt.lookup(_results(), "gone", ("x",))


def test_rewrite_replaces_only_the_marked_block_and_needs_the_markers(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(rt, "FIGURES", (("τ on MT-Bench", "quality", ("mtbench", "tau")),))
    results, md = tmp_path / "results.json", tmp_path / "RESULTS.md"
    results.write_text(json.dumps(_results()))
    md.write_text(f"# Results\n\n{rt.BEGIN}\nold\n{rt.END}\n\n## Reasoning\n")
    assert rt.rewrite(results, md) is True
    text = md.read_text()
    assert text.startswith("# Results\n\n") and text.endswith("\n\n## Reasoning\n")
    assert "| τ on MT-Bench (`quality.mtbench.tau`) | 2.303 | `python bench/x.py` | NVIDIA H200 | 2030-01-02 |" in text
    assert rt.rewrite(results, md) is False
    md.write_text("# Results\n")
    with pytest.raises(rt.TableError, match="marker lines are missing"):
        rt.rewrite(results, md)


def _gated(fingerprint: str, date: str, mt: float, with_turn2: bool = True) -> dict:
    iv = {"mtbench": {"tau": {"point": 2.6}, "vs_incumbent": {"point": mt, "ci": [mt - 0.02, mt + 0.02]}},
          "humaneval": {"vs_incumbent": {"point": -0.01, "ci": [-0.05, 0.03]}}}
    if with_turn2:
        iv["mtbench_turn2"] = {"vs_incumbent": {"point": 0.004, "ci": [-0.01, 0.02]}}
    return {"command": "python bench/drafter_quality.py eval", "device": "cpu (2 cores)", "date": date,
            "checkpoint": "runs/c", "confidence": 0.95,
            "gate": {"incumbent_fingerprint": fingerprint, "verdict": "unresolved", "intervals": iv}}


def test_the_candidates_table_lists_every_try_against_the_shipped_drafter_and_the_level_they_ask() -> None:
    shipped = {"command": "python bench/x.py", "device": "cpu", "date": "2030-01-01", "fingerprint": "f" * 64}
    results = {"quality": shipped,
               "stage10_vs_shipped": _gated("f" * 64, "2030-01-02", 0.025),
               "stage9_vs_shipped": _gated("f" * 64, "2030-01-02", 0.006, with_turn2=False),
               "stage2_vs_older": _gated("e" * 64, "2030-01-01", 0.1)}
    text = rt.candidates_table(results)
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == ["stage9_vs_shipped", "stage10_vs_shipped"]  # numbers read as numbers
    assert "+0.025 [+0.005, +0.045]" in rows[1] and "| — |" in rows[0]  # no second turns measured: a dash
    assert text.endswith("2 candidates tried on the same prompts: gating each at 1 − 5 %/2 asks 97.5 %.")
    assert rt.candidates_table({"stage9_vs_shipped": results["stage9_vs_shipped"]}) == ""  # no shipped drafter yet
