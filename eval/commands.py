"""The ``python -m eval`` commands as functions of their arguments (the entry point only parses them).

Each returns the exit code: 0 pass, 1 rejected by the gate, 2 a problem the user can fix, printed as
one line on stderr (our errors carry ready messages that name the file or key).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ParamSpec

from common.config import ConfigError, load_config
from common.wheels import MissingWheelError
from drafter.checkpoint import CheckpointError
from drafter.target import TargetError
from eval import breakeven
from eval.evaluate import evaluate, evaluate_live, save_report
from eval.gate_flow import gate
from eval.prompts import PromptError
from eval.serving_sweep import SweepError, markdown, measure_table, read_table, recommend, write_sweep
from eval.sglang_client import ServerError

EXIT_PASS, EXIT_REJECT, EXIT_ERROR = 0, 1, 2
USER_ERRORS = (ConfigError, CheckpointError, TargetError, PromptError, MissingWheelError, ServerError, SweepError,
               FileNotFoundError, ValueError)
P = ParamSpec("P")


def _one_line_errors(command: Callable[P, int]) -> Callable[P, int]:
    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> int:
        try:
            return command(*args, **kwargs)
        except USER_ERRORS as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_ERROR
    return run


def _report_name(checkpoint: str, name: str | None) -> str:
    if not Path(checkpoint).is_dir():
        raise CheckpointError(f"{checkpoint}: no such checkpoint directory")
    return name or Path(checkpoint).resolve().name


@_one_line_errors
def run_command(config: str | Path, checkpoint: str | Path, overrides: Sequence[str] = (),
                name: str | None = None, live: bool = False) -> int:
    """Speculative decoding on the eval datasets, against the HF target or (``live``) the eval.sglang servers;
    the report only."""
    cfg = load_config(config, list(overrides))
    checkpoint = str(checkpoint)
    if live:
        from eval.live_gate import run_live

        run_live(cfg, checkpoint, _report_name(checkpoint, name))
        return EXIT_PASS
    save_report(cfg, evaluate(cfg, {"candidate": checkpoint}, _report_name(checkpoint, name)))
    return EXIT_PASS


@_one_line_errors
def gate_command(config: str | Path, checkpoint: str | Path, overrides: Sequence[str] = (), name: str | None = None,
                 incumbent: str | None = None, promote: bool = False, live: bool = False) -> int:
    """Measure, then the ship decision; ``promote`` copies a passing checkpoint to gate.promoted_dir. ``live``:
    tau, alpha_k and the timings from the eval.sglang servers (eval/live_gate.py)."""
    cfg = load_config(config, list(overrides))
    checkpoint = str(checkpoint)
    if live:
        from eval.live_gate import live_gate

        decision = live_gate(cfg, checkpoint, incumbent, promote, _report_name(checkpoint, name))
    else:
        decision = gate(cfg, checkpoint, incumbent, promote, _report_name(checkpoint, name))
    return EXIT_REJECT if decision == "rejected" else EXIT_PASS


@_one_line_errors
def sweep_command(config: str | Path | None = None, table: str | Path | None = None,
                  overrides: Sequence[str] = (), out: str | Path | None = None) -> int:
    """The serving flags with the best tokens/s under the measured cost model: from a cost table file, or
    measured on the eval.sglang servers. Writes sweep.{json,md} (run_dir/eval/sweep, or ``out``)."""
    if table is None and config is None:
        raise SweepError("eval sweep: give --table FILE or --config FILE")
    cfg = load_config(config, list(overrides)) if config is not None else None
    if table is not None:
        costs, decode, alpha = read_table(Path(table))
    else:
        from eval.live_gate import live_prompts

        costs, decode, alpha = measure_table(cfg, live_prompts(cfg))
    result = recommend(costs, decode, alpha)
    where = Path(out) if out else (cfg.eval_dir / "sweep" if cfg else Path(table).with_suffix(""))
    write_sweep(where, result)
    print(markdown(result))
    print(f"sweep: {where}/sweep.{{json,md}}")
    return EXIT_PASS


@_one_line_errors
def breakeven_command(decode_ms: float, cycle_ms: float, steps: int = 3, target_tps: float | None = None) -> int:
    """τ* and the α a tok/s goal needs, from given timings, as JSON on stdout."""
    print(json.dumps(breakeven.breakeven(decode_ms, cycle_ms, steps, target_tps), indent=2))
    return EXIT_PASS


@_one_line_errors
def sglang_command(config: str | Path, overrides: Sequence[str] = ()) -> int:
    """τ and α_k from a live SGLang server, as JSON on stdout."""
    print(json.dumps(evaluate_live(load_config(config, list(overrides))), indent=2))
    return EXIT_PASS
