"""bench/device_out.py: what a device call returns keeps the transfer's limits, groups whole, in priority order."""

from __future__ import annotations

from pathlib import Path

from bench.device_out import choose, main


def files(folder: Path, sizes: dict[str, int]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, size in sizes.items():
        (folder / name).write_bytes(b"x" * size)
        out.append(folder / name)
    return out


def test_groups_go_in_order_while_they_fit_and_a_split_checkpoint_goes_whole_or_not_at_all(tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    results, logs = files(stage, {"results.json": 10, "logs.tar.gz": 12})
    convs = files(stage, {"conversations.jsonl.gz.part-aa": 15, "conversations.jsonl.gz.part-ab": 5})
    model = files(stage, {"best-config.json": 1, "best-model.part-aa": 15, "best-model.part-ab": 15})
    png = files(stage, {"learning_curve.png": 3})
    big = files(stage, {"timeline.png": 17})

    kept, left = choose([[results], [logs], convs, model, png, big], max_files=8, max_total=70, max_file=16)

    assert kept == [[results], [logs], convs, png]  # the drafter would pass 70 bytes: it stays, the plot fits
    assert [g for g, _ in left] == [model, big]
    assert "would pass the" in left[0][1] and "timeline.png over" in left[1][1]


def test_what_passes_the_file_count_stays_behind_and_is_named(tmp_path: Path, capsys) -> None:
    stage, out = tmp_path / "stage", tmp_path / "out"
    names = {f"part-{i}": 1 for i in range(9)}
    parts = files(stage, names)

    assert main(["--out", str(out), "--group", *map(str, parts[:7]), "--group", *map(str, parts[7:]),
                 "--group", str(stage / "absent.json")]) == 0

    assert sorted(p.name for p in out.iterdir()) == [f"part-{i}" for i in range(7)]
    said = capsys.readouterr().out
    assert "left behind part-7 part-8: 9 files would pass the 8 a call returns" in said
    assert "returning 7 files" in said
