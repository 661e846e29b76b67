"""Capture without the HF model: SpecForge's offline hidden-state files imported into our store, and the
target's tokenizer, config and head read from its safetensors index (``target_model.hf_index``).

The files are written the way SpecForge 0.2.0's ``scripts/prepare_hidden_states.py`` writes them
(``HiddenStatesGenerator``: ``rows_<g>-<g+G>/data_<i>.ckpt[.gz]``, ``torch.save`` of ``input_ids`` and
``loss_mask`` (int64, batch rows right-padded with zeros), ``aux_hidden_state`` (1, L, 3H) and
``hidden_state`` (1, L, H)), from a tiny random Llama whose states SGLang would capture as HF
``hidden_states[id + 1]`` and the final-normed ``hidden_states[-1]``.
"""

from __future__ import annotations

import gzip
import io
import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from common.config import parse_config
from common.wheels import builtin_gguf, converted_gguf_dir
from data_prep.capture import run_capture
from data_prep.capture_sample import CaptureError
from data_prep.dataset import ShardDataset
from data_prep.loss_mask import render_with_mask
from data_prep.specforge_import import ServerRendering, export_for_specforge, list_files
from data_prep.store import load_target_head, read_manifest
from target_model.hf_index import load_indexed_target
from target_model.hf_model import TargetModel

AUX = [1, 2, 3]


def conversations(n: int) -> list[dict]:
    words = "a cat sat on the warm mat and looked at birds".split()
    return [{"id": f"c{i}", "source": "t",
             "messages": [{"role": "user", "content": " ".join(words[: 2 + i])},
                          {"role": "assistant", "content": " ".join(reversed(words[: 3 + 2 * i]))}]}
            for i in range(n)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama saved in shards with an index, and SmolLM2's tokenizer (49152 tokens)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("ckpt")
    tok = AutoTokenizer.from_pretrained(converted_gguf_dir(builtin_gguf()))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out, max_shard_size="2MB")
    tok.save_pretrained(out)
    assert (out / "model.safetensors.index.json").is_file()
    return out


def specforge_order(n: int) -> list[int]:
    """Row of --data-path that SpecForge writes as data_<i>: ``build_eagle3_dataset`` shuffles the dataset
    (``dataset.shuffle(seed=shuffle_seed)``, default 42) before the dataloader (shuffle=False) numbers it."""
    from datasets import Dataset

    return Dataset.from_dict({"row": list(range(n))}).shuffle(seed=42)["row"]


def write_specforge(root: Path, model: TargetModel, samples: list[tuple[list[int], list[int]]],
                    batch_size: int = 2, group: int = 2, compress_every: int = 3) -> None:
    """SpecForge's writer: ``samples`` in its (shuffled) order, batches right-padded with zeros, the padded row
    forwarded and saved whole."""
    for b in range(0, len(samples), batch_size):
        rows = samples[b: b + batch_size]
        width = max(len(ids) for ids, _ in rows)
        for j, (ids, mask) in enumerate(rows):
            i = b + j
            pad = width - len(ids)
            input_ids = torch.tensor(ids + [0] * pad, dtype=torch.long)
            out = model.forward(input_ids[None], AUX, logits=False)  # SGLang's capture (LlamaForCausalLM)
            record = {"input_ids": input_ids, "loss_mask": torch.tensor(mask + [0] * pad, dtype=torch.long),
                      "aux_hidden_state": out.aux.clone(), "hidden_state": out.last_hidden.clone()}
            g = (i // group) * group
            path = root / f"rows_{g}-{g + group}" / f"data_{i}.ckpt"
            path.parent.mkdir(parents=True, exist_ok=True)
            if i % compress_every == compress_every - 1:  # --compress: gzip around the same torch.save bytes
                buf = io.BytesIO()
                torch.save(record, buf)
                with gzip.open(str(path) + ".gz", "wb") as f:
                    f.write(buf.getvalue())
            else:
                torch.save(record, path)


def tree(run: Path, checkpoint: Path, backend: str, **capture) -> dict:
    return {"run_dir": str(run),
            "target": {"name": str(checkpoint), "dtype": "float32", "device": "cpu", "aux_layer_ids": AUX},
            "data": {"sources": [{"kind": "lines", "path": "unused"}]},
            "capture": {"backend": backend, "max_length": 64, "dtype": "float32", "teacher": "hidden",
                        "shard_samples": 2, **capture},
            "eval": {"datasets": [{"name": "x", "kind": "lines"}]}}


@pytest.fixture
def no_hf_model(monkeypatch):
    """Fails the test if any HF model is instantiated (from_pretrained, from_config or directly)."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("an HF model was instantiated during a capture that must not build one")

    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", refuse)


def test_specforge_import_equals_hf_capture_without_building_the_model(tmp_path, checkpoint, monkeypatch):
    from target_model.hf_model import load_target

    convs = conversations(5)
    hf_run = tmp_path / "hf"
    hf_run.mkdir()
    (hf_run / "conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    model = load_target(str(checkpoint), dtype="float32", device="cpu")
    run_capture(parse_config(tree(hf_run, checkpoint, "hf")), target=model)

    # SpecForge read our export, shuffled it, tokenized the same chats (our render stands in for its parser) and
    # captured them in SGLang.
    sf_run = tmp_path / "sf"
    sf_run.mkdir()
    export_for_specforge(convs, sf_run / "specforge_input.jsonl")
    order = specforge_order(5)
    assert order != list(range(5))
    rendered = [render_with_mask(model.tokenizer, convs[j]["messages"], 64) for j in order]
    sf_dir = tmp_path / "specforge"
    write_specforge(sf_dir, model, [(r.input_ids, r.loss_mask) for r in rendered])
    assert sorted(p.relative_to(sf_dir).as_posix() for p in sf_dir.rglob("data_*"))[:3] == [
        "rows_0-2/data_0.ckpt", "rows_0-2/data_1.ckpt", "rows_2-4/data_2.ckpt.gz"]
    assert list(list_files(sf_dir)) == [0, 1, 2, 3, 4]

    def refuse(self, *args, **kwargs):
        raise AssertionError("an HF model was instantiated during a specforge capture")

    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", refuse)
    summary = run_capture(parse_config(tree(sf_run, checkpoint, "specforge", specforge_dir=str(sf_dir))))

    ref, got = ShardDataset(hf_run / "store"), ShardDataset(sf_run / "store")
    assert len(got) == len(ref) == 5 and [got[i]["id"] for i in range(5)] == [f"specforge-{i:08d}" for i in range(5)]
    for i in range(5):
        a, b = ref[order[i]], got[i]
        n = len(b["input_ids"])
        last_loss = int(a["loss_mask"].nonzero()[-1])
        assert n == last_loss + 1  # cut after the last loss token: the padding and the template's "\n" go
        for key in ("input_ids", "loss_mask", "target_argmax"):
            assert torch.equal(b[key], a[key][:n]), (i, key)
        for key in ("aux", "last_hidden"):  # padded batch vs alone: equal up to fp32 summation order
            torch.testing.assert_close(b[key], a[key][:n], rtol=1e-5, atol=1e-5)
    ref_head, got_head = load_target_head(hf_run / "store"), load_target_head(sf_run / "store")
    assert all(torch.equal(ref_head[k], got_head[k]) for k in ref_head)
    m = read_manifest(sf_run / "store")
    assert m["aux_layer_ids"] == AUX and m["target"]["num_layers"] == 5 and m["target"]["hidden_size"] == 32
    widths = [max(len(r.input_ids) for r in rendered[b: b + 2]) for b in (0, 0, 2, 2, 4)]  # batch padding
    last = [int(torch.tensor(r.loss_mask).nonzero()[-1]) for r in rendered]
    assert summary.tail_tokens_dropped == sum(w - k - 1 for w, k in zip(widths, last, strict=True))
    assert summary.samples == 5 and not summary.skipped


def test_the_index_reader_loads_only_the_two_head_tensors(checkpoint, no_hf_model, monkeypatch):
    loaded: list[str] = []
    real = safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            loaded.append(name)
            return self.inner.get_tensor(name)

        def keys(self):
            return self.inner.keys()

    monkeypatch.setattr("target_model.hf_index.safe_open", Spy)
    target = load_indexed_target(str(checkpoint), dtype="float32")
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (5, 32, 49152)
    assert target.embed_weight().shape == target.lm_head_weight().shape == (49152, 32)
    assert sorted(loaded) == ["lm_head.weight", "model.embed_tokens.weight"]
    with open(checkpoint / "model.safetensors.index.json") as f:
        shard = json.load(f)["weight_map"]["lm_head.weight"]
    with real(str(checkpoint / shard), framework="pt") as f:
        assert torch.equal(target.lm_head_weight(), f.get_tensor("lm_head.weight"))


def test_head_names_for_k25_layouts(tmp_path, checkpoint):
    """K2.5 nests the LM (text_config, language_model.* names) and DeepSeek-V3's MTP layer has its own
    embed_tokens; a tied model has no lm_head tensor."""
    from target_model.hf_index import head_tensor_names

    names = ["language_model.model.layers.61.embed_tokens.weight", "language_model.model.embed_tokens.weight",
             "language_model.lm_head.weight", "vision_tower.patch_embed.proj.weight"]
    assert head_tensor_names(names, False, "k25") == ("language_model.model.embed_tokens.weight",
                                                      "language_model.lm_head.weight")
    assert head_tensor_names(["model.embed_tokens.weight"], True, "x") == ("model.embed_tokens.weight",) * 2
    with pytest.raises(Exception, match="lm_head.weight"):
        head_tensor_names(["model.embed_tokens.weight"], False, "x")


def test_missing_or_malformed_specforge_files_are_clear(tmp_path, checkpoint, no_hf_model):
    run = tmp_path / "run"
    run.mkdir()
    (run / "conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(2)))
    sf_dir = tmp_path / "sf"
    cfg = parse_config(tree(run, checkpoint, "specforge", specforge_dir=str(sf_dir), tensor_parallel_size=8,
                            expert_parallel_size=8))
    with pytest.raises(CaptureError) as e:
        run_capture(cfg)
    msg = str(e.value)
    assert "holds no SpecForge hidden states" in msg and "--tp-size 8" in msg and "--sglang-ep-size 8" in msg
    exported = [json.loads(line) for line in (run / "specforge_input.jsonl").read_text().splitlines()]
    assert [r["conversations"] for r in exported] == [c["messages"] for c in conversations(2)]

    bad = sf_dir / "rows_0-2000" / "data_0.ckpt"
    bad.parent.mkdir(parents=True)
    torch.save({"input_ids": torch.arange(4), "loss_mask": torch.ones(4, dtype=torch.long),
                "hidden_state": torch.zeros(1, 4, 32), "aux_hidden_state": torch.zeros(1, 4, 64)}, bad)
    with pytest.raises(CaptureError, match=r"data_0.ckpt: aux_hidden_state is \(1, 4, 64\), expected \(1, 4, 96\)"):
        run_capture(cfg)


@pytest.mark.parametrize(("lines", "error"), [
    (['{"id": "c0", "conversations": []}', '{"id": "c1", "conv'], ":2: not JSON"),
    (['{"id": "c0", "conversations": []}', "", '{"id": "c1", "messages": []}'], ":3: no 'conversations' list; "),
    (["[1, 2]"], ":1: a JSON list, not an object; "),
], ids=["torn-line", "no-conversations", "not-an-object"])
def test_a_damaged_data_path_is_one_line_naming_its_line(tmp_path, lines: list[str], error: str):
    """SpecForge's --data-path as the import reads it back: a bad row names the file and line, and how to have the file
    again."""
    path = tmp_path / "specforge_input.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CaptureError) as e:
        ServerRendering(path, None, {}, 64)
    assert str(e.value).startswith(f"{path}{error}") and "capture writes it again" in str(e.value), e.value


def test_the_specforge_command_always_passes_the_drafters_config(tmp_path, checkpoint, tiny_drafter, no_hf_model):
    """SpecForge's prepare_hidden_states.py reads the capture layers and draft_vocab_size from
    --draft-model-config (without it, it fails: the option is read as a path). A fresh drafter's config.json is
    written to the run dir and passed; a warm start's config is written there with its ids spelled out."""
    from drafter.sglang_checkpoint import check_checkpoint, save_checkpoint, shape_from_config

    run = tmp_path / "fresh"
    run.mkdir()
    (run / "conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(2)))
    tree_ = tree(run, checkpoint, "specforge", specforge_dir=str(tmp_path / "sf"))
    tree_["drafter"] = {"draft_vocab_size": 1000}
    tree_["target"]["chat_template_kwargs"] = {"thinking": False}
    with pytest.raises(CaptureError) as e:
        run_capture(parse_config(tree_))
    written = run / "specforge_draft_config.json"
    assert f"--draft-model-config {written}" in str(e.value)
    assert "no option of SpecForge's takes target.chat_template_kwargs {'thinking': False}" in str(e.value)
    cfg = json.loads(written.read_text())
    shape = shape_from_config(cfg, str(written))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == AUX
    assert (shape.hidden_size, shape.vocab_size, shape.draft_vocab_size, shape.num_attention_heads) == (
        32, 49152, 1000, 4)

    warm = save_checkpoint(tiny_drafter, tmp_path / "warm-drafter", dtype="float32")
    assert check_checkpoint(warm) == []
    run = tmp_path / "warm"
    run.mkdir()
    (run / "conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(2)))
    tree_ = tree(run, checkpoint, "specforge", specforge_dir=str(tmp_path / "sf"))
    tree_["target"]["aux_layer_ids"] = None
    tree_["drafter"] = {"init_from": str(warm)}
    with pytest.raises(CaptureError) as e:
        run_capture(parse_config(tree_))
    written = run / "specforge_draft_config.json"
    assert f"--draft-model-config {written}" in str(e.value)
    assert json.loads(written.read_text()) == json.loads((warm / "config.json").read_text())


def _import_specforge_rendered(tmp_path: Path, checkpoint: Path, convs: list[dict], chats: list[list[dict]],
                               kwargs: dict | None = None, template_kwargs: dict | None = None,
                               max_length: int = 64) -> dict:
    """SpecForge's files for ``chats`` (one per conversation, rendered with ``kwargs`` and cut at ``max_length``
    as SpecForge would), then the import of ``convs`` with target.chat_template_kwargs ``template_kwargs``;
    returns the config tree."""
    from target_model.hf_model import load_target

    model = load_target(str(checkpoint), dtype="float32", device="cpu")
    run = tmp_path / "run"
    run.mkdir(parents=True)
    export_for_specforge(convs, run / "specforge_input.jsonl")
    order = specforge_order(len(convs))
    rendered = [render_with_mask(model.tokenizer, chats[j], max_length, kwargs) for j in order]
    write_specforge(tmp_path / "sf", model, [(r.input_ids, r.loss_mask) for r in rendered])
    t = tree(run, checkpoint, "specforge", specforge_dir=str(tmp_path / "sf"))
    t["target"]["chat_template_kwargs"] = template_kwargs or {}
    return t


def test_specforge_tokens_that_differ_from_the_servers_rendering_are_one_line(tmp_path, checkpoint, monkeypatch):
    """SpecForge's GeneralParser puts its template registry's system prompt ("You are a helpful assistant.") in
    front of a conversation that has none; the server renders SmolLM2's own default. The import compares every
    sample with the server's rendering of the same conversation and names the first differing token."""
    convs = conversations(3)
    system = [{"role": "system", "content": "You are a helpful assistant."}]
    t = _import_specforge_rendered(tmp_path, checkpoint, convs, [system + c["messages"] for c in convs])
    with pytest.raises(CaptureError) as e:
        run_capture(parse_config(t))
    msg = str(e.value)
    assert "\n" not in msg, msg
    first = specforge_order(3)[0]
    assert f"data_0.ckpt: SpecForge sample 0 (conversation {convs[first]['id']}) differs from the server's " \
           "rendering at token " in msg, msg
    assert re.search(r"at token \d+: SpecForge has \d+ \('.*'\), the server's rendering \d+ \('.*'\)", msg), msg


def test_chat_template_kwargs_that_never_reach_specforge_are_caught(tmp_path, checkpoint):
    """target.chat_template_kwargs (thinking off) reach every render of ours and the server, but no flag of
    SpecForge's prepare_hidden_states.py carries them: its tokens lack the empty think block."""
    import shutil

    ckpt = tmp_path / "thinking-ckpt"
    shutil.copytree(checkpoint, ckpt)
    (ckpt / "chat_template.jinja").write_text(
        "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
        "{%- if m.role == 'assistant' and thinking is defined and not thinking -%}<think></think>{%- endif -%}"
        "{{ m.content }}<|im_end|>\n{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
        "{%- if thinking is defined and not thinking -%}<think></think>{%- endif -%}{%- endif -%}")
    convs = conversations(2)
    t = _import_specforge_rendered(tmp_path, ckpt, convs, [c["messages"] for c in convs],
                                   template_kwargs={"thinking": False})
    with pytest.raises(CaptureError, match=r"SpecForge sample 0 \(conversation c\d\) differs from the server's "
                       r"rendering at token \d+: SpecForge has .*target.chat_template_kwargs \{'thinking': False\}"):
        run_capture(parse_config(t))
    # rendered with the same kwargs (a template whose thinking default is off), the tokens agree
    t = _import_specforge_rendered(tmp_path / "same", ckpt, convs, [c["messages"] for c in convs],
                                   kwargs={"thinking": False}, template_kwargs={"thinking": False})
    assert run_capture(parse_config(t)).samples == 2


def test_what_specforges_max_length_cut_is_counted_and_a_different_cut_is_named(tmp_path, checkpoint):
    """SpecForge cuts each rendering at its --max-length (the command capture prints passes capture.max_length):
    the import counts the samples cut and the rendering's tokens they lost; files cut at another length are a
    one-line error saying which option to change."""
    from transformers import AutoTokenizer

    convs = conversations(4)
    convs[1]["messages"][1]["content"] = " ".join(["the cat sat on the mat"] * 20)  # past 64 tokens
    convs[3]["messages"][0]["content"] = " ".join(["a warm mat"] * 30)  # its answer lies wholly past the cut
    chats = [c["messages"] for c in convs]
    tok = AutoTokenizer.from_pretrained(checkpoint)
    lengths = [len(render_with_mask(tok, m, 10_000).input_ids) for m in chats]
    assert sum(n > 64 for n in lengths) == 2
    summary = run_capture(parse_config(_import_specforge_rendered(tmp_path / "same", checkpoint, convs, chats)))
    cut = {"samples": 2, "tokens": sum(n - 64 for n in lengths if n > 64)}
    assert summary.samples == 3 and summary.skipped == {"no_loss_tokens": 1} and summary.specforge_cut == cut
    assert "SpecForge's --max-length cut 2 samples" in str(summary)

    longer = _import_specforge_rendered(tmp_path / "longer", checkpoint, convs, chats, max_length=96)
    with pytest.raises(CaptureError, match=r"^[^\n]*runs past capture.max_length 64: SpecForge ran with a larger "
                       r"--max-length; rerun it with --max-length 64 or set capture.max_length to its value$"):
        run_capture(parse_config(longer))
    shorter = _import_specforge_rendered(tmp_path / "shorter", checkpoint, convs, chats, max_length=48)
    with pytest.raises(CaptureError, match=r"^[^\n]*ends after 48 tokens, where the server's rendering cut at "
                       r"capture.max_length 64 goes on: SpecForge ran with --max-length 48; set capture.max_length 48 "
                       r"or rerun it with --max-length 64$"):
        run_capture(parse_config(shorter))
