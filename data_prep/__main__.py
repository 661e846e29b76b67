"""``python -m data_prep {ingest,regenerate,capture,all} --config FILE [--set key=value ...]``.

Each step resumes where a killed run stopped; the closing summary is printed and merged into
``run_dir/data_prep_summary.json`` (one key per step).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

STEPS = {
    "ingest": "reads data.sources (ShareGPT / OpenAI messages / MT-Bench / HumanEval / lines); "
              "writes run_dir/prompts.jsonl (deduplicated, stable ids)",
    "regenerate": "reads run_dir/prompts.jsonl and the target (regenerate.backend hf|openai); "
                  "writes run_dir/conversations.jsonl (every assistant turn rewritten by the target)",
    "capture": "reads run_dir/conversations.jsonl and the target; writes run_dir/store/ (safetensors shards of "
               "input ids, loss mask, aux states, teacher signal + manifest.json + target_head.safetensors)",
    "all": "ingest, regenerate, capture in order",
}


def _runner(step: str) -> Callable[[Any], Any]:
    # Imported per step: ingest needs neither torch nor the target.
    if step == "ingest":
        from data_prep.ingest import run_ingest

        return run_ingest
    if step == "regenerate":
        from data_prep.regenerate import run_regenerate

        return run_regenerate
    from data_prep.capture import run_capture

    return run_capture


def _save_summary(cfg: Any, step: str, summary: Any) -> None:
    from common.files import write_json_atomic

    path = cfg.root / "data_prep_summary.json"
    cfg.root.mkdir(parents=True, exist_ok=True)
    merged = json.loads(path.read_text()) if path.is_file() else {}
    merged[step] = summary.to_dict()
    write_json_atomic(path, merged)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Prepare training data for the drafter.\n\n" + "\n".join(f"  {k:<11}{v}" for k, v in STEPS.items()),
        epilog="A summary of each step is written to run_dir/data_prep_summary.json.")
    parser.add_argument("step", choices=list(STEPS))
    parser.add_argument("--config", required=True, help="run config YAML (see configs/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set capture.dtype=bfloat16 (repeatable)")
    args = parser.parse_args(argv)

    from common.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    for step in ["ingest", "regenerate", "capture"] if args.step == "all" else [args.step]:
        try:
            summary = _runner(step)(cfg)
        except (ValueError, OSError) as e:  # our errors are ValueErrors with a ready message
            print(f"data_prep {step}: error: {e}", file=sys.stderr)
            return 1
        print(summary)
        _save_summary(cfg, step, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
