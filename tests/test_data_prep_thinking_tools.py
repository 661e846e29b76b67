"""Thinking and tools kept end to end: a K2.5-style agentic chat (reasoning, a tool call, its result) goes
through ingest -> regenerate (an OpenAI-compatible server replaying bodies shaped like SGLang's, with
reasoning_content and tool_calls) -> capture, whose stored tokens are the chat template's rendering of it,
with thinking on and off (target.chat_template_kwargs reaches the server and every render).

The tokenizer is SmolLM2's with a K2.5-style Jinja chat template written here (reasoning in <think>, tool
calls by id with JSON arguments, tool results as "## Return of <id>", thinking off = an empty think block).
"""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from loss_mask_spans import masked_spans

from common.config import parse_config
from common.wheels import builtin_gguf, converted_gguf_dir
from data_prep.capture import run_capture
from data_prep.dataset import ShardDataset
from data_prep.ingest import run_ingest
from data_prep.loss_mask import as_server_renders
from data_prep.regenerate import run_regenerate

TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}\n"
    "{{ m.content }}<|im_end|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>"
    "{%- else -%}<think>\n{{ m.reasoning_content or '' }}\n</think>{%- endif -%}{{ m.content }}"
    "{%- if m.tool_calls -%}<|tool_calls_section_begin|>{%- for tc in m.tool_calls -%}"
    "<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>{{ tc.function.arguments | tojson }}"
    "<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- endif -%}{%- endif -%}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
SOURCE = {"tools": TOOLS, "messages": [
    {"role": "system", "content": "You are Kimi."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "another model's thought",
     "tool_calls": [{"id": "call_abc", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "{\"temp_c\": 18, \"sky\": \"sunny\"}"},
    {"role": "assistant", "content": "another model's answer"},
]}
CALL = {"id": "functions.get_weather:0", "index": 0, "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}


def sglang_chat(thinking: bool, name: str = "get_weather") -> list[dict]:
    """The target's two answers as SGLang's /v1/chat/completions returns them (ChatMessage: content,
    reasoning_content with --reasoning-parser, tool_calls with --tool-call-parser)."""
    call = {**CALL, "function": {**CALL["function"], "name": name}}
    first = {"role": "assistant", "content": "", "tool_calls": [call]}
    second = {"role": "assistant", "content": "It is 18 C and sunny in Paris."}
    if thinking:
        first["reasoning_content"] = "The user wants the weather; I should call get_weather."
        second["reasoning_content"] = "The tool says 18 C, sunny."
    return [{"id": "c1", "object": "chat.completion", "model": "kimi",
             "choices": [{"index": 0, "message": m, "finish_reason": f}],
             "usage": {"prompt_tokens": 30, "completion_tokens": 9, "total_tokens": 39}}
            for m, f in ((first, "tool_calls"), (second, "stop"))]


class Replay(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        srv: Any = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv.requests.append(body)
        reply = json.dumps(srv.bodies[len(srv.requests) - 1]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def k25_style_target(tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and the K2.5-style chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("k25-style")
    src = converted_gguf_dir(builtin_gguf())
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(out)
    return out


@pytest.mark.parametrize("thinking", [True, False])
def test_reasoning_and_tool_calls_survive_ingest_regenerate_capture(tmp_path, k25_style_target, thinking):
    srv: Any = ThreadingHTTPServer(("127.0.0.1", 0), Replay)
    srv.bodies, srv.requests = sglang_chat(thinking), []
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    source = tmp_path / "agentic.jsonl"
    source.write_text(json.dumps(SOURCE) + "\n")
    cfg = parse_config({
        "run_dir": str(tmp_path / "run"),
        "target": {"name": str(k25_style_target), "device": "cpu", "aux_layer_ids": [0, 1, 2],
                   "chat_template_kwargs": {"thinking": thinking}},
        "data": {"sources": [{"kind": "openai", "path": str(source)}]},
        "regenerate": {"backend": "openai", "server_urls": [f"http://127.0.0.1:{srv.server_address[1]}"],
                       "concurrency": 1, "batch_size": 1, "timeout_s": 10},
        "capture": {"backend": "hf", "max_length": 512, "dtype": "float32"},
        "eval": {"datasets": [{"name": "mtbench", "kind": "mtbench"}]}})
    try:
        # ingest keeps the tools, the assistant's reasoning and tool call, and the tool result
        run_ingest(cfg)
        (prompt,) = [json.loads(line) for line in cfg.prompts_path.read_text().splitlines()]
        assert prompt["tools"] == TOOLS and [m["role"] for m in prompt["messages"]] == [
            "system", "user", "assistant", "tool", "assistant"]
        assert prompt["messages"][2]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert prompt["messages"][2]["reasoning_content"] == "another model's thought"

        # regenerate: the target answers twice; its tool call is fed back with the recorded result
        summary = run_regenerate(cfg)
    finally:
        srv.shutdown()
        srv.server_close()
    assert summary.written == 1 and summary.tool_calls_diverged == 0 and summary.empty_answers == 0
    first, second = srv.requests
    assert first["tools"] == TOOLS and first["chat_template_kwargs"] == {"thinking": thinking}
    assert [m["role"] for m in first["messages"]] == ["system", "user"]
    answer1 = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}
    if thinking:
        answer1["reasoning_content"] = "The user wants the weather; I should call get_weather."
    result = {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": SOURCE["messages"][3]["content"]}
    assert second["messages"][2:] == [answer1, result]  # the target's own call; the result re-addressed to it
    (conv,) = [json.loads(line) for line in cfg.conversations_path.read_text().splitlines()]
    assert conv["tools"] == TOOLS and conv["finish_reasons"] == ["tool_calls", "stop"]
    assert conv["messages"][2:4] == [answer1, result]
    assert conv["messages"][4]["content"] == "It is 18 C and sunny in Paris."
    assert ("reasoning_content" in conv["messages"][4]) is thinking

    # capture: the stored tokens are the template's rendering, tools, reasoning and the call included
    run_capture(cfg)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(k25_style_target)
    item = ShardDataset(cfg.store_dir)[0]
    text = tok.decode(item["input_ids"].tolist())
    trained = tok.decode(item["input_ids"][item["loss_mask"].bool()].tolist())
    # as SGLang renders: the call's arguments parsed to an object first (serving_chat.py), so they print as JSON
    assert text == tok.apply_chat_template(as_server_renders(conv["messages"]), tools=TOOLS, tokenize=False,
                                           thinking=thinking)
    assert text.startswith('<|im_system|>tool_declare<|im_middle|>[{"type": "function"')
    assert '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}' in trained
    assert "## Return of functions.get_weather:0\n{\"temp_c\": 18" in text
    assert "## Return of" not in trained and "Weather in Paris?" not in trained  # only the target's turns
    assert "It is 18 C and sunny in Paris.<|im_end|>" in trained
    if thinking:
        assert "<think>\nThe user wants the weather; I should call get_weather.\n</think>" in trained
        assert "<think>\nThe tool says 18 C, sunny.\n</think>" in trained
    else:  # thinking off reached the template (unset, it would render "<think>\n\n</think>")
        assert text.count("<think></think>") == 2 and "<think>\n" not in text and "The user wants" not in text


PLAIN = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Sunny."},
         {"role": "user", "content": "And tomorrow?"}, {"role": "assistant", "content": "Rain."}]


@pytest.mark.parametrize(("messages", "called"), [
    (SOURCE["messages"], "search_web"),  # the source called get_weather: its result answers no call made here
    (PLAIN, "get_weather"),  # the source made no call: SGLang refuses a chat with an unanswered call
])
def test_other_tool_calls_end_the_conversation_there(tmp_path, messages, called):
    """No result exists for the target's call, so the conversation is kept up to its answer and counted."""
    srv: Any = ThreadingHTTPServer(("127.0.0.1", 0), Replay)
    srv.bodies, srv.requests = sglang_chat(True, name=called), []
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    cfg = parse_config({"run_dir": str(tmp_path / "run"), "target": {"name": "smollm2-135m-instruct"},
                        "data": {"sources": [{"kind": "lines", "path": "unused"}]},
                        "regenerate": {"backend": "openai", "server_urls": [f"http://127.0.0.1:{srv.server_address[1]}"],
                                       "concurrency": 1, "batch_size": 1, "timeout_s": 10},
                        "eval": {"datasets": [{"name": "mtbench", "kind": "mtbench"}]}})
    cfg.root.mkdir(parents=True)
    cfg.prompts_path.write_text(json.dumps({"id": "p", "source": "openai", "tools": TOOLS,
                                            "messages": messages}) + "\n")
    try:
        summary = run_regenerate(cfg)
    finally:
        srv.shutdown()
        srv.server_close()
    (conv,) = [json.loads(line) for line in cfg.conversations_path.read_text().splitlines()]
    assert len(srv.requests) == 1 and summary.tool_calls_diverged == 1 and summary.written == 1
    assert [m["role"] for m in conv["messages"]][-2:] == ["user", "assistant"]
    assert conv["messages"][-1]["tool_calls"][0]["function"]["name"] == called


def k25_cfg(tmp_path: Path, target: Path, thinking: bool, **sections: Any):
    return parse_config({"run_dir": str(tmp_path / "run"),
                         "target": {"name": str(target), "device": "cpu", "dtype": "float32",
                                    "aux_layer_ids": [0, 1, 2], "chat_template_kwargs": {"thinking": thinking}},
                         "data": {"sources": [{"kind": "lines", "path": "unused"}]},
                         "eval": {"datasets": [{"name": "mtbench", "kind": "mtbench"}]}, **sections})


@pytest.mark.parametrize("thinking", [True, False])
def test_hf_backend_renders_tools_and_template_kwargs_and_its_plain_text_ends_a_tool_chat(
        tmp_path, k25_style_target, thinking, monkeypatch):
    """The in-process engine is fed the chat as the server renders it (tools, thinking on/off). Its answer is
    plain text (no tool-call parser): where the source's next turns are tool results, the conversation ends
    after that answer, counted, as with a server whose target made no call."""
    from transformers import AutoTokenizer

    import engine.continuous_batching as cb

    fed: list[list[int]] = []
    real = cb.Stream.submit

    def spy(stream, key, prompt, max_new, continue_from=None):  # what the engine is asked to answer
        fed.append(list(prompt))
        return real(stream, key, prompt, max_new, continue_from)

    monkeypatch.setattr(cb.Stream, "submit", spy)
    cfg = k25_cfg(tmp_path, k25_style_target, thinking,
                  regenerate={"backend": "hf", "batch_size": 2, "max_new_tokens": 6, "devices": ["cpu"]})
    cfg.root.mkdir(parents=True)
    cfg.prompts_path.write_text(json.dumps({"id": "p", "source": "openai", "tools": TOOLS,
                                            "messages": SOURCE["messages"]}) + "\n")
    summary = run_regenerate(cfg)
    tok = AutoTokenizer.from_pretrained(k25_style_target)
    chat = [m for m in SOURCE["messages"][:2]]
    expected = tok.apply_chat_template(as_server_renders(chat), tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                       thinking=thinking)
    assert fed == [tok(expected, add_special_tokens=False)["input_ids"]]
    assert expected.startswith("<|im_system|>tool_declare") and expected.endswith(
        "<think></think>" if not thinking else "<|im_middle|>")
    (conv,) = [json.loads(line) for line in cfg.conversations_path.read_text().splitlines()]
    assert summary.tool_calls_diverged == 1 and conv["tools"] == TOOLS
    assert [m["role"] for m in conv["messages"]] == ["system", "user", "assistant"]
    assert set(conv["messages"][2]) == {"role", "content"}  # plain text: no reasoning or calls invented


class ToolThenFull:
    """Calls get_weather first (as the source did); the chat with the tool result no longer fits the context."""

    name, batch_size = "scripted", 1

    def complete(self, batch: list[list[dict]], tools: list | None = None) -> list[Any]:
        from data_prep.backends import CONTEXT_FULL, Completion

        (chat,) = batch
        if chat[-1]["role"] == "tool":
            return [Completion(finish_reason=CONTEXT_FULL)]
        return [Completion(text="", finish_reason="tool_calls", tool_calls=[
            {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}])]


def test_a_full_context_after_a_tool_call_ends_the_conversation_at_the_call(tmp_path):
    from data_prep.regenerate_files import load_prompt_records
    from data_prep.regenerate_loop import regenerate

    cfg = k25_cfg(tmp_path, Path("unused"), True)
    cfg.root.mkdir(parents=True)
    messages = [*SOURCE["messages"], {"role": "user", "content": "And tomorrow?"}]
    prompt = {"id": "p", "source": "openai", "tools": TOOLS, "messages": messages}
    cfg.prompts_path.write_text(json.dumps(prompt) + "\n")
    summary = regenerate(cfg, load_prompt_records(cfg.prompts_path, None), ToolThenFull())
    (conv,) = [json.loads(line) for line in cfg.conversations_path.read_text().splitlines()]
    assert [m["role"] for m in conv["messages"]] == ["system", "user", "assistant"]  # the unsent results dropped
    assert conv["messages"][2]["tool_calls"][0]["id"] == "call_x" and conv["finish_reasons"] == ["tool_calls"]
    assert summary.turns_dropped_context_full == 2 and summary.tool_calls_diverged == 0  # tool results + "tomorrow"


AGENTIC_CONVS = [
    {"id": "agent", "tools": TOOLS, "messages": [
        *SOURCE["messages"][:2],
        {"role": "assistant", "content": "", "reasoning_content": "I should call get_weather.",
         "tool_calls": [{"id": "c0", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "18 C"},
        {"role": "assistant", "content": "18 C in Paris.", "reasoning_content": "The tool says 18 C."}],
     "finish_reasons": ["tool_calls", "length"]},
    {"id": "plain", "messages": PLAIN, "finish_reasons": ["loop", "stop"]},
]


@pytest.mark.parametrize("thinking", [True, False])
def test_render_all_pool_and_online_training_render_as_capture_does(tmp_path, k25_style_target, thinking,
                                                                    monkeypatch):
    """The forked render pool passes each chat's tools and the template kwargs to its workers, and online
    training (train.source: online) trains on the tokens and masks capture stores."""
    from transformers import AutoTokenizer

    import data_prep.capture as capture
    from data_prep.loss_mask import render_with_mask
    from train.data import online_data

    tok = AutoTokenizer.from_pretrained(k25_style_target)
    kwargs = {"thinking": thinking}
    direct = [render_with_mask(tok, c["messages"], 512, {**kwargs, "tools": c.get("tools")},
                               finish_reasons=c["finish_reasons"]) for c in AGENTIC_CONVS]
    assert ("<think></think>" in tok.decode(direct[0].input_ids)) is not thinking
    alone, _ = capture.render_all(AGENTIC_CONVS, tok, 512, kwargs, workers=1)
    monkeypatch.setattr(capture, "RENDER_POOL_MIN", 1)
    pooled, _ = capture.render_all(AGENTIC_CONVS * 3, tok, 512, kwargs, workers=2)  # duplicates skipped
    assert [(s.input_ids, s.loss_mask) for s in alone] == [(s.input_ids, s.loss_mask) for s in pooled] == [
        (r.input_ids, r.loss_mask) for r in direct]

    cfg = k25_cfg(tmp_path, k25_style_target, thinking, capture={"max_length": 512, "dtype": "float32"},
                  train={"source": "online", "holdout_fraction": 0.0})
    cfg.root.mkdir(parents=True)
    cfg.conversations_path.write_text("".join(json.dumps(c | {"source": "t", "backend": "t"})
                                              + "\n" for c in AGENTIC_CONVS))
    run_capture(cfg)
    stored = ShardDataset(cfg.store_dir)
    online = online_data(cfg, torch.device("cpu")).train
    assert len(stored) == len(online) == 2
    for i in range(2):
        assert torch.equal(stored[i]["input_ids"], online[i]["input_ids"])
        assert torch.equal(stored[i]["loss_mask"], online[i]["loss_mask"])


@pytest.mark.parametrize("thinking", [True, False])
def test_a_cut_answer_of_a_reasoning_template_ends_where_its_text_does(k25_style_target, thinking):
    """The template renders reasoning before the content: a cut answer's loss ends with
    its content, or with its reasoning when it has none (where regenerate cuts a loop); an answer that stopped
    keeps its end-of-turn marker. Each answer goes by its own finish reason."""
    from transformers import AutoTokenizer

    from data_prep.loss_mask import render_with_mask

    tok = AutoTokenizer.from_pretrained(k25_style_target)
    chat = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "Let me think. Let me think."},
            {"role": "user", "content": "Well?"},
            {"role": "assistant", "content": "Sunny. Sunny.", "reasoning_content": "Easy."},
            {"role": "user", "content": "Thanks."},
            {"role": "assistant", "content": "You are welcome."}]
    r = render_with_mask(tok, chat, 512, {"thinking": thinking}, finish_reasons=["loop", "length", "stop"])
    spans = masked_spans(tok, r)
    # a span may start inside the token before it ("|><think>"); what matters here is where each one ends
    if thinking:
        tails = ["\nLet me think. Let me think.", "</think>Sunny. Sunny.", "</think>You are welcome.<|im_end|>"]
        unlocated = 0
    else:  # the template renders no reasoning: the first answer's text is not there to end its span, counted
        tails, unlocated = ["<|im_end|>", "Sunny. Sunny.", "You are welcome.<|im_end|>"], 1
    assert len(spans) == 3 and all(sp.endswith(t) for sp, t in zip(spans, tails, strict=True)), spans
    assert "</think>" not in spans[0] and r.unlocated_ends == unlocated
