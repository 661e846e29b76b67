"""The command line the benchmarks that compare drafters on the real target share (``loop_split``, ``run_copy``):
one config, the drafters (each after the first paired against the first), overrides and the results object's name."""

from __future__ import annotations

import argparse


def drafters_parser(doc: str | None, name: str) -> argparse.ArgumentParser:
    """A parser with --config, --checkpoint, --set and --name (default ``name``); a benchmark adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--checkpoint", nargs="+", required=True,
                    help="drafters to measure; each after the first is also paired against the first")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--name", default=name, help="the results.json object to write")
    return ap
