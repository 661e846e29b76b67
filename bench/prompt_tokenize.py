"""Follow-up prompts tokenized whole against tokenized from the previous prompt's ids (data_prep/prompt_ids.py).

    python bench/prompt_tokenize.py --config configs/smollm2-135m-h200.yaml \
        --conversations runs/smollm2-h200/conversations.jsonl          # (or its .gz) -> "prompt_tokenize"

For each of the first --limit regenerated conversations: its previous prompt is the chat before its last answer
(rendered and tokenized as regeneration does), its follow-up the whole chat plus a user turn. Each follow-up is
tokenized one at a time, as the regeneration's caller does between decode steps: whole (the tokenizer), then by
``PromptTokenizer.encode`` with the previous prompt's text and ids. Figures: ms per follow-up each way (medians
of --repeats passes), their ratio, and how many shortcut ids equal the whole text's (all of them must). CPU only:
the tokenizer is the cost.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import record  # noqa: E402
from common.config import load_config  # noqa: E402
from data_prep.loss_mask import prompt_text  # noqa: E402
from data_prep.prompt_ids import PromptTokenizer  # noqa: E402
from target_model.hf_model import load_tokenizer, resolve_source  # noqa: E402

FOLLOW_UP = "Please go on, and explain it in more detail."


def read_chats(path: Path, limit: int) -> list[list[dict[str, Any]]]:
    """The first ``limit`` conversations' messages (.jsonl or .jsonl.gz) that hold an answer."""
    chats = []
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        for n, line in enumerate(f, 1):
            if len(chats) >= limit:
                break
            try:
                msgs = json.loads(line)["messages"]
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"prompt_tokenize: {path}:{n}: not a conversation record ({e})") from None
            if any(m.get("role") == "assistant" for m in msgs):
                chats.append(msgs)
    return chats


def measure(tok: Any, chats: list[list[dict[str, Any]]], repeats: int) -> dict[str, Any]:
    pairs = []
    for msgs in chats:
        last = max(i for i, m in enumerate(msgs) if m.get("role") == "assistant")
        before = prompt_text(tok, msgs[:last])
        pairs.append(((before, tok(before, add_special_tokens=False)["input_ids"]),
                      prompt_text(tok, msgs + [{"role": "user", "content": FOLLOW_UP}])))
    whole_s, short_s = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        whole = [tok(text, add_special_tokens=False)["input_ids"] for _, text in pairs]
        whole_s.append(time.perf_counter() - t)
        pt = PromptTokenizer(tok)
        t = time.perf_counter()
        short = [pt.encode([text], [prev])[0] for prev, text in pairs]
        short_s.append(time.perf_counter() - t)
    n = len(pairs)
    whole_ms, short_ms = 1e3 * statistics.median(whole_s) / n, 1e3 * statistics.median(short_s) / n
    return {"follow_ups": n, "mean_prompt_tokens": round(sum(map(len, whole)) / n, 1),
            "whole_ms": round(whole_ms, 3), "shortcut_ms": round(short_ms, 3), "speedup": round(whole_ms / short_ms, 2),
            "equal_ids": sum(a == b for a, b in zip(whole, short, strict=True)), "repeats": repeats, **pt.stats()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the run config (its target's tokenizer and chat template)")
    ap.add_argument("--conversations", required=True, type=Path, help="regenerated conversations (.jsonl[.gz])")
    ap.add_argument("--limit", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if not args.conversations.is_file():
        print(f"prompt_tokenize: {args.conversations}: not found", file=sys.stderr)
        return 2
    cfg = load_config(args.config)
    tok = load_tokenizer(resolve_source(cfg.target.name, cfg.target.gguf_file), cfg.target.trust_remote_code)
    chats = read_chats(args.conversations, args.limit)
    if not chats:
        print(f"prompt_tokenize: {args.conversations}: no conversation with an answer", file=sys.stderr)
        return 2
    record("prompt_tokenize", measure(tok, chats, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
