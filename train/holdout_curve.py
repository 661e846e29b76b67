"""A training run's held-out curve as a PNG: the simulated accept length and acc_0 at each held-out eval, read from
run_dir/train_log.jsonl. Whether more steps would still help is the question a user asks of every run; the
trainer draws this when it finishes, and this module draws it for a log from elsewhere.

    python -m train.holdout_curve RUN_DIR [--out PNG]        # default RUN_DIR/holdout_curve.png
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import Any

from common.cli import EXIT_OK, one_line_errors
from common.files import iter_jsonl, write_bytes_atomic

LOG_NAME = "train_log.jsonl"
PNG_NAME = "holdout_curve.png"


def read_train_log(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of run_dir/train_log.jsonl, in order; a line that is not a JSON object is an error naming
    the file and line."""
    path = run_dir / LOG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no training log (is {run_dir} a run directory that trained?)")
    return [rec for _, rec in iter_jsonl(path, fix="the file is damaged")]


def holdout_points(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The held-out evals (step, accept length, acc_0, tokens seen by then), in step order."""
    seen, points = 0, []
    for r in records:
        seen = r.get("tokens_seen", seen)
        if "holdout/accept_length" in r:
            points.append({"step": r["step"], "tokens_seen": seen, "accept_length": r["holdout/accept_length"],
                           "acc_0": r["holdout/acc_0"]})
    return points


def plot_holdout_curve(run_dir: Path, png: Path | None = None) -> Path:
    """Draw the curve into ``png`` (default run_dir/holdout_curve.png); a log with no held-out eval is an error
    saying why (train.eval_every larger than the run)."""
    points = holdout_points(read_train_log(run_dir))
    if not points:
        raise ValueError(f"{run_dir / LOG_NAME}: no held-out eval in the log (train.eval_every is larger than "
                         "the run, or train.holdout_fraction is 0)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png = png or run_dir / PNG_NAME
    steps = [p["step"] for p in points]
    fig, left = plt.subplots(figsize=(7, 4))
    left.plot(steps, [p["accept_length"] for p in points], "o-", color="tab:blue")
    left.set_xlabel("optimizer step")
    left.set_ylabel("held-out accept length (simulated)", color="tab:blue")
    right = left.twinx()
    right.plot(steps, [p["acc_0"] for p in points], "s--", color="tab:orange")
    right.set_ylabel("held-out acc_0", color="tab:orange")
    left.set_title(f"{run_dir.name}: held-out curve ({points[-1]['tokens_seen'] / 1e6:.1f} M tokens seen)")
    left.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    png.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(png, buf.getvalue())
    return png


@one_line_errors(ValueError, FileNotFoundError)
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.holdout_curve", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, help=f"the PNG (default RUN_DIR/{PNG_NAME})")
    args = ap.parse_args(argv)
    print(plot_holdout_curve(args.run_dir, args.out))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
