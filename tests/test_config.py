"""The run config: every shipped YAML loads; bad input is one line per problem naming file and key;
dotted overrides apply and are validated like the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from common.config import (
    ConfigError,
    PromptSource,
    RunConfig,
    dump_config,
    load_config,
    parse_config,
    read_yaml,
    write_config,
)

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))
SMOL = REPO / "configs" / "smollm2-135m.yaml"


def test_there_are_shipped_configs() -> None:
    assert {p.name for p in SHIPPED} >= {"smollm2-135m.yaml", "kimi-k25-from-k2.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert cfg.store_dir == Path(cfg.run_dir) / "store"
    assert parse_config(dump_config(cfg), str(path)) == cfg  # the dumped form (run_config.json) reads back


def test_a_written_config_reads_back_equal_and_leaves_no_temporary(tmp_path: Path) -> None:
    cfg = load_config(SMOL, ["train.lr=0.002", f"run_dir={tmp_path / 'run'}"])
    out = write_config(cfg, tmp_path / "config.yaml")
    assert load_config(out) == cfg and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_shipped_values() -> None:
    smol = load_config(SMOL)
    assert smol.target.aux_layer_ids == [2, 15, 27] and smol.drafter.init_from == "drafters/smollm2-135m-eagle3"
    k2 = load_config(REPO / "configs" / "kimi-k25-from-k2.yaml")
    assert k2.target.aux_layer_ids == [2, 30, 58] and k2.target.trust_remote_code
    # the 1T target is captured by SpecForge under tp/ep 8 and imported: no HF model load, the exact teacher
    assert (k2.capture.backend, k2.capture.teacher) == ("specforge", "hidden")
    assert (k2.capture.tensor_parallel_size, k2.capture.expert_parallel_size) == (8, 8)
    assert k2.target.chat_template_kwargs == {"thinking": False} and k2.eval.acceptance == "sglang"
    assert k2.eval.timings is not None and k2.eval.timings.cycle_ms == {3: 29.8}
    assert k2.eval.sglang is not None and k2.eval.sglang.incumbent_url and k2.eval.sglang.baseline_url


@pytest.mark.parametrize(("edit", "words"), [
    ({"capture": {"backend": "sglang", "teacher": "hidden"}, "drafter": {"init_from": "d"}},
     ["capture.backend 'sglang'", "capture.teacher 'hidden'"]),
    ({"capture": {"backend": "specforge"}}, ["capture.backend 'specforge'", "capture.specforge_dir"]),
    ({"capture": {"backend": "specforge", "specforge_dir": "x"}, "target": {"aux_layer_ids": None},
      "drafter": {"init_from": None}},
     ["capture.backend 'specforge'", "target.aux_layer_ids", "drafter.init_from"]),
    ({"eval": {"timings": {"decode_ms": 12.1, "cycle_ms": {5: 35.0}}}}, ["eval.timings.cycle_ms", "eval.num_steps 3"]),
])
def test_pairs_that_cannot_work_fail_at_load_in_one_line(tmp_path: Path, base_tree: dict, edit: dict,
                                                        words: list[str]) -> None:
    for section, values in edit.items():
        base_tree[section] = {**(base_tree.get(section) or {}), **values}
    path = write(tmp_path, base_tree)
    (line,) = error_lines(path)
    assert line.startswith(f"{path}: ") and all(w in line for w in words), line


def test_parallel_sizes_must_nest(tmp_path: Path, base_tree: dict) -> None:
    base_tree["capture"].update(tensor_parallel_size=8, expert_parallel_size=3)
    (line,) = error_lines(write(tmp_path, base_tree))
    assert line.startswith(f"{tmp_path / 'run.yaml'}: capture: ") and "expert_parallel_size 3" in line


def write(tmp_path: Path, tree: dict, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.fixture
def base_tree() -> dict:
    return yaml.safe_load(SMOL.read_text())


def error_lines(path: Path, overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value).splitlines()


@pytest.mark.parametrize(("edit", "key", "words"), [
    (lambda t: t["train"].update(lrr=1e-3), "train.lrr", "unknown key"),
    (lambda t: t.update(extra_section={}), "extra_section", "unknown key"),
    (lambda t: t["train"].update(lr="fast"), "train.lr", "valid number"),
    (lambda t: t["train"].update(epochs=1.5), "train.epochs", "integer"),
    (lambda t: t["train"].update(epochs=True), "train.epochs", "must be a number, not true"),
    (lambda t: t["train"].update(lr=True), "train.lr", "must be a number, not true"),
    (lambda t: t["regenerate"].update(max_failure_share=1.5), "regenerate.max_failure_share", "less than or equal"),
    (lambda t: t["train"].update(lr=0), "train.lr", "greater than 0"),
    (lambda t: t["regenerate"].update(top_p=1.5), "regenerate.top_p", "less than or equal to 1"),
    (lambda t: t["capture"].update(teacher="soft"), "capture.teacher", "'hidden' or 'topk'"),
    (lambda t: t["target"].update(aux_layer_ids=[2, 2, 27]), "target.aux_layer_ids", "distinct"),
    # SGLang concatenates the captures in layer order: fc would read [30, 2, 58] permuted
    (lambda t: t["target"].update(aux_layer_ids=[30, 2, 58]), "target.aux_layer_ids",
     "must be ascending: write [2, 30, 58]"),
    (lambda t: t["data"]["sources"][0].update(kind="csv"), "data.sources.0.kind", "sharegpt"),
    (lambda t: t["eval"].update(datasets=[]), "eval.datasets", "at least 1"),
    (lambda t: t["gate"].update(datasets=["nope"]), "gate.datasets", "not among eval.datasets"),
    (lambda t: t.pop("target"), "target", "required"),
    (lambda t: t["tracking"].update(report_to=["tensorbored"]), "tracking.report_to", "unknown tracker"),
    (lambda t: t["tracking"].update(init_kwargs={"mlflow": {}}), "tracking.init_kwargs", "not in tracking.report_to"),
    (lambda t: t["train"].update(report_to="wandb"), "train.report_to", "moved to tracking.report_to"),
    (lambda t: t["regenerate"].update(max_tokens=64), "regenerate.max_tokens", "moved to regenerate.max_new_tokens"),
])
def test_bad_values_are_one_line_naming_file_and_key(tmp_path: Path, base_tree: dict, edit, key: str,
                                                     words: str) -> None:
    edit(base_tree)
    path = write(tmp_path, base_tree)
    lines = error_lines(path)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{path}: {key}: "), lines
    assert words in lines[0], lines


def test_all_problems_reported_at_once(tmp_path: Path, base_tree: dict) -> None:
    base_tree["train"].update(lr=-1, bogus=True)
    base_tree["capture"]["max_length"] = 0
    lines = error_lines(write(tmp_path, base_tree))
    assert sorted(line.split(": ")[1] for line in lines) == ["capture.max_length", "train.bogus", "train.lr"]


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("run_dir: x\ntarget:\n  name: [unclosed\n")
    (line,) = error_lines(path)
    assert line.startswith(f"{path}:") and "not valid YAML" in line


def test_missing_file_and_non_mapping(tmp_path: Path) -> None:
    assert error_lines(tmp_path / "nope.yaml")[0].startswith(f"{tmp_path / 'nope.yaml'}: no such config file")
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    assert error_lines(path) == [f"{path}: top level must be a mapping of sections"]


def test_dotted_overrides_apply(tmp_path: Path, base_tree: dict) -> None:
    base_tree["eval"]["timings"] = None
    path = write(tmp_path, base_tree)
    cfg = load_config(path, ["train.lr=5e-4", "target.aux_layer_ids=[3, 14, 26]", "drafter.init_from=ckpt/a",
                             "run_dir=elsewhere", "eval.timings.decode_ms=10", "eval.timings.cycle_ms={3: 25}"])
    assert cfg.train.lr == 5e-4 and cfg.target.aux_layer_ids == [3, 14, 26]
    assert cfg.drafter.init_from == "ckpt/a" and cfg.checkpoints_dir == Path("elsewhere/checkpoints")
    assert cfg.eval.timings is not None and (cfg.eval.timings.decode_ms, cfg.eval.timings.cycle_ms) == (10.0, {3: 25.0})
    assert load_config(path, ["drafter.init_from=null"]).drafter.init_from is None
    assert load_config(path).train.lr == base_tree["train"]["lr"]  # the file itself is untouched


def test_a_bare_no_is_the_no_precision_it_means(tmp_path: Path, base_tree: dict) -> None:
    """YAML reads ``mixed_precision: no`` (file or --set) as false; the benches' fp32 runs write it so."""
    base_tree["train"]["mixed_precision"] = False
    path = write(tmp_path, base_tree)
    assert load_config(path).train.mixed_precision == "no"
    assert load_config(path, ["train.mixed_precision=bf16"]).train.mixed_precision == "bf16"
    assert load_config(SMOL, ["train.mixed_precision=no"]).train.mixed_precision == "no"
    (line,) = error_lines(SMOL, ("train.mixed_precision=yes",))
    assert line.startswith(f"{SMOL}: train.mixed_precision: ")


@pytest.mark.parametrize(("override", "key", "words"), [
    ("train.lr=-1", "train.lr", "greater than 0"),
    ("train.lrr=1", "train.lrr", "unknown key"),
    ("regenerate.backend=openai", "regenerate", "server_urls"),
    ("target.aux_layer_ids=[1, 2]", "target.aux_layer_ids", "3 distinct"),
])
def test_overrides_are_validated(override: str, key: str, words: str) -> None:
    lines = error_lines(SMOL, (override,))
    assert len(lines) == 1 and lines[0].startswith(f"{SMOL}: {key}: ") and words in lines[0], lines


@pytest.mark.parametrize(("override", "words"), [
    ("train.lr", "expected key.sub=value"),
    ("train.lr.x=1", "lr is not a section"),
])
def test_malformed_overrides(override: str, words: str) -> None:
    (line,) = error_lines(SMOL, (override,))
    assert line.startswith(f"{SMOL}: override") and words in line


@pytest.mark.parametrize(("value", "problem"), [
    ("[1", "expected ',' or ']', but got '<stream end>'"),
    ("{lr: 1, lr: 2}", "duplicate key 'lr' (first at line 1)"),
])
def test_an_override_that_is_not_yaml_is_one_line_naming_it(value: str, problem: str) -> None:
    assert error_lines(SMOL, (f"train.lr={value}",)) == [f"{SMOL}: override train.lr: not valid YAML ({problem})"]


def test_a_config_that_is_not_utf8_names_file_line_and_byte(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    text = SMOL.read_bytes()
    path.write_bytes(text + b"# r\xe9sum\xe9\n")
    line = text.count(b"\n") + 1
    assert error_lines(path) == [f"{path}:{line}: not UTF-8 text (byte 0xe9 at offset {len(text) + 3}); "
                                 "save it as UTF-8"]


def test_a_key_given_twice_at_any_depth_is_one_line_naming_both_lines(tmp_path: Path) -> None:
    text = SMOL.read_text()
    train, end = text.splitlines().index("train:") + 1, text.count("\n")  # `end`: the file's last line
    path = tmp_path / "dup.yaml"
    path.write_text(text + "train:\n  epochs: 1\n")  # a second section: PyYAML alone would drop the first
    assert error_lines(path) == [f"{path}:{end + 1}: duplicate key 'train' (first at line {train}); keep one"]
    path.write_text(text + "x:\n  - a: 1\n    b: 2\n    a: 3\n")  # inside a list item
    assert error_lines(path) == [f"{path}:{end + 4}: duplicate key 'a' (first at line {end + 2}); keep one"]


def test_merge_keys_override_without_counting_as_duplicates() -> None:
    assert read_yaml("a: &a {k: 1, j: 2}\nb: {<<: *a, k: 3}\n") == {"a": {"k": 1, "j": 2}, "b": {"k": 3, "j": 2}}


def test_limit_is_described_as_the_records_kept() -> None:
    """Ingest and the eval reader stop at ``limit`` records kept and read on past the skipped ones."""
    assert PromptSource.model_fields["limit"].description == ("Keep at most this many records of the source "
                                                              "(skipped records do not count).")


def test_the_demo_starts_from_a_shipped_drafter_sglang_serves() -> None:
    """The embedded default's incumbent: at most 32 MB, passes the strict checker, has the demo's aux ids."""
    from drafter.sglang_checkpoint import check_checkpoint, read_config

    shipped = REPO / load_config(SMOL).drafter.init_from
    assert check_checkpoint(shipped) == []
    assert sum(f.stat().st_size for f in shipped.iterdir()) <= 32 * 2**20
    aux = read_config(shipped)["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert aux == load_config(SMOL).target.aux_layer_ids
