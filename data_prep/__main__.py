"""``python -m data_prep {synthesize,ingest,regenerate,symbol-runs,capture,all} --config FILE [--set key=value ...]``.

Each step resumes where a killed run stopped; the closing summary is printed and merged into
``run_dir/data_prep_summary.json`` (one key per step). The steps run in data_prep/steps.py.
"""

from __future__ import annotations

import argparse
import sys

from data_prep.steps import run_steps

STEPS = {
    "synthesize": "the target writes prompts itself (data.synthesize, Magpie) into run_dir/self_prompts.jsonl "
                  "(list it in data.sources, kind openai)",
    "ingest": "reads data.sources (ShareGPT / OpenAI messages / MT-Bench / HumanEval / lines: JSON(L), parquet, "
              "arrow, save_to_disk dirs, hub ids); writes run_dir/prompts.jsonl (deduplicated, stable ids)",
    "regenerate": "reads run_dir/prompts.jsonl and the target (regenerate.backend hf|openai); "
                  "writes run_dir/conversations.jsonl (every assistant turn rewritten by the target)",
    "symbol-runs": "reads data.symbol_runs.conversations and the target (hf); writes run_dir/symbol_runs.jsonl "
                   "(conversations: the target continuing a run of one symbol token inside its answers)",
    "capture": "reads run_dir/conversations.jsonl and the target (capture.backend hf), or SpecForge's hidden-state "
               "files (specforge); writes run_dir/store/ (safetensors shards of input ids, loss mask, aux states, "
               "teacher signal + manifest.json + target_head.safetensors)",
    "all": "synthesize (when data.synthesize is set), ingest, regenerate, capture in order",
}


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
    return run_steps(args.step, args.config, args.set)


if __name__ == "__main__":
    sys.exit(main())
