"""Training-time-test fine-tuning of the EAGLE-3 drafter, on the capture store or online (train/data.py).

    accelerate launch -m train --config FILE      # or: python -m train --config FILE [--set key=value ...]

Reads top to bottom: ``train`` is ``setup`` (config → accelerator → data → drafter (resume > warm start >
from scratch) → optimizer → resume state) then ``train_steps`` (accumulate, backward, clip, step, log, held-out
eval, save) then end_training.
"""

from __future__ import annotations

import gc
import math
import os
import signal
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from tqdm import tqdm

from common.cli import StopRequest, one_line_errors, stop_on_sigterm
from common.config import RunConfig, TrainConfig, dump_config, load_config
from common.files import cut_torn_tail, json_text, named_errors, remove_temps, write_text_atomic
from common.locking import run_lock
from common.queued_copy import queued_to_device, queued_to_host
from common.step_clock import StepClock
from common.tracking import flat_config, make_trackers
from common.wheels import MissingWheelError
from data_prep.dataset import LeftOutBatches, TokenBudgetSampler
from train import run_checkpoints
from train.build import build_drafter, scale_aux_inputs, teacher_rows
from train.data import TrainingData, to_device, training_data
from train.holdout_curve import LOG_NAME, plot_holdout_curve, read_train_log
from train.module import TTTModel
from train.optim import clip_into_step, make_optimizer, make_scheduler, trainable
from train.target_ahead import TargetAhead
from train.ttt import Objective
from train.ttt_metrics import Counts


class TrainingAborted(RuntimeError):
    pass


def mixed_precision(setting: str) -> str | None:
    """auto: bf16 on CUDA, fp32 on CPU, unless `accelerate launch` already chose (its config wins)."""
    if setting != "auto":
        return setting
    if "ACCELERATE_MIXED_PRECISION" in os.environ:
        return None
    return "bf16" if torch.cuda.is_available() else "no"


def configure_deepspeed(accelerator: Accelerator, train_cfg: TrainConfig) -> None:
    """DeepSpeed clips and accumulates inside its engine, and wants a micro-batch size even though our
    batches are token budgets (the number only labels its throughput logs)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        plugin.deepspeed_config.update(gradient_clipping=train_cfg.max_grad_norm, train_micro_batch_size_per_gpu=1,
                                       gradient_accumulation_steps=train_cfg.grad_accum)


class JsonlLog:
    """Per-step records for machines (run_dir/train_log.jsonl), after a step-0 record of the run's setup. On resume,
    records past the resumed step are dropped so that the file reads as one uninterrupted run, and so is the half
    line a kill can leave; a fresh start (``resume_step`` 0) starts the file over."""

    def __init__(self, path: Path, enabled: bool, resume_step: int):
        self.path, self.enabled = path, enabled
        if enabled and path.is_file():
            cut_torn_tail(path)
            keep = [rec for rec in read_train_log(path.parent) if 0 < resume_step and rec.get("step", 0) <= resume_step]
            write_text_atomic(path, "".join(json_text(rec) + "\n" for rec in keep))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with named_errors(self.path), open(self.path, "a") as f:
                f.write(json_text(record) + "\n")


def pad_multiple(device: torch.device) -> int:
    """On CUDA batch lengths round up to a multiple of 16 (tensor-core friendly; the compiled kernels take every
    length in a few graphs: ``train.attention._flex``). Rounding to 128, one flex block, padded a loop's batch to
    1.12x its real tokens against 1.05x (2,000 ShareGPT conversations, 16,384-token budget). CPU needs none."""
    return 16 if device.type == "cuda" else 1


def holdout_metrics(accelerator: Accelerator, model: torch.nn.Module, data: TrainingData,
                    sampler: TokenBudgetSampler, n: int) -> dict[str, float]:
    """Held-out loss, acc_i and simulated accept length (train/ttt_metrics.py has the formula)."""
    counts = Counts.zeros(n, accelerator.device)
    model.eval()
    dev = accelerator.device
    with torch.no_grad():
        for raw in data.loader(data.holdout, sampler.batches(), dev, pad_multiple(dev)):
            res = model(**data.complete(to_device(raw, dev)))
            counts.add(res.step_losses, res.correct, res.scored)
    model.train()
    total = accelerator.reduce(counts.flat(), reduction="sum")
    return Counts.from_flat(total, n).summary("holdout/")


@one_line_errors(TrainingAborted, MissingWheelError)
def run(config: str | Path, overrides: Sequence[str] = (), resume: str = "auto") -> int:
    """Load the run config and train under the run dir's lock (rank 0 holds it for every process of one
    launch); a problem the user can fix (a bad config, a damaged store or checkpoint, a full disk) is one
    line on stderr and exit code 2."""
    cfg = load_config(config, list(overrides))
    with run_lock(cfg.root, "train", main_process=int(os.environ.get("RANK", "0")) == 0):
        return train(cfg, resume)


# A run stopped on SIGTERM exits as the signal would have (128 + 15): not done, but nothing lost.
EXIT_STOPPED = 128 + signal.SIGTERM


def train(cfg: RunConfig, resume: str) -> int:
    """``resume``: "auto" continues from the newest complete checkpoint in run_dir/checkpoints, "never"
    starts over. SIGTERM ends the run after its current step, with a checkpoint of that step."""
    run = setup(cfg, resume)
    with stop_on_sigterm() as stop:
        stopped = train_steps(run, cfg.train, stop)
    accelerator = run.accelerator
    if stopped:
        accelerator.print(f"stopped on SIGTERM at step {run.state['step']} of {int(run.total_steps)}: saved "
                          f"{run_checkpoints.step_dir(run.ckpt_root, run.state['step'])}; the same "
                          "command resumes from it")
    else:
        accelerator.print(f"done: {run.state['step']} steps, {run.state['nonfinite_total']} skipped as non-finite; "
                          f"checkpoints in {run.ckpt_root} ({best_line(run.ckpt_root)})")
        if accelerator.is_main_process:
            accelerator.print(held_out_curve(cfg.root))
    del run  # the last references to the prepared model and optimizer: end_processes frees them
    end_processes(accelerator)
    return EXIT_STOPPED if stopped else 0


def end_processes(accelerator: Accelerator) -> None:
    """Free the prepared model and optimizer on every process, wait for the others, then destroy the process group.
    The DDP wrapper's reducer holds the group: freed later, with the caller's frame, it is torn down after the
    group's shutdown and possibly after a peer has exited, and a rank can block in that native destructor."""
    accelerator.free_memory()  # accelerate's own references to them (it collects before dropping them)
    gc.collect()  # now nothing holds them, cycles included
    accelerator.wait_for_everyone()
    accelerator.end_training()


def best_line(ckpt_root: Path) -> str:
    """Where ``best`` is, only when it is there: the next stage (eval gate) takes that path."""
    best = ckpt_root / "best"
    return f"best: {best}" if best.exists() else "no best checkpoint: none was saved after a held-out pass"


def held_out_curve(run_dir: Path) -> str:
    """Draw the run's held-out curve; a run without one (no held-out eval) says so instead of failing, its
    checkpoints being what it was for."""
    try:
        return f"held-out curve: {plot_holdout_curve(run_dir)}"
    except ValueError as e:
        return f"no held-out curve: {e}"


@dataclass
class Run:
    """What the step loop works on, built by ``setup``."""

    accelerator: Accelerator
    data: TrainingData
    sampler: TokenBudgetSampler  # this process's training batches
    holdout_sampler: TokenBudgetSampler
    windows_per_epoch: int  # optimizer steps per epoch
    total_steps: int
    milestones: list[int]  # steps always saved (train.save_at)
    model: torch.nn.Module  # the TTT unroll around the drafter, prepared by accelerate
    optimizer: torch.optim.Optimizer
    scheduler: Any
    state: dict[str, int]  # the position and counters a checkpoint saves (restored on resume)
    log: JsonlLog
    ckpt_root: Path
    run_config: dict[str, Any]  # the resolved config each checkpoint carries
    serve_dtype: str  # the dtype checkpoints are saved in


def setup(cfg: RunConfig, resume: str) -> Run:
    """Accelerator, data, drafter (resume > warm start > from scratch), optimizer and schedule, and the state
    of a resumed run, in this order (the seeded RNG is drawn from in it)."""
    train_cfg = cfg.train
    # -- accelerator -----------------------------------------------------------------------------
    accelerator = Accelerator(mixed_precision=mixed_precision(train_cfg.mixed_precision),
                              gradient_accumulation_steps=train_cfg.grad_accum,
                              log_with=make_trackers(cfg.tracking, cfg.tracking_dir, "train") or None,
                              project_dir=cfg.run_dir)
    set_seed(train_cfg.seed)
    ckpt_root = cfg.checkpoints_dir
    if accelerator.is_main_process:
        remove_temps(ckpt_root)  # half-built saves of a killed run (we hold the run dir's lock)
    resume_from = run_checkpoints.latest(ckpt_root) if resume == "auto" else None

    # -- data ------------------------------------------------------------------------------------
    # Rank 0 verifies the store's sha256 first and the others find it cached; online reads no shards.
    with accelerator.main_process_first() if train_cfg.source == "store" else nullcontext():
        data = training_data(cfg, accelerator.device)
    train_ds, holdout_ds = data.train, data.holdout
    ranks = {"num_replicas": accelerator.num_processes, "rank": accelerator.process_index}
    sampler = TokenBudgetSampler(train_ds.lengths, train_cfg.batch_tokens, shuffle=True, seed=train_cfg.seed, **ranks)
    holdout_sampler = TokenBudgetSampler(holdout_ds.lengths, train_cfg.batch_tokens, shuffle=False, **ranks)
    windows_per_epoch = len(sampler) // train_cfg.grad_accum
    if windows_per_epoch == 0:
        raise TrainingAborted(f"{data.source}: {len(train_ds)} training samples make {len(sampler)} batches per "
                              f"process, fewer than train.grad_accum={train_cfg.grad_accum}; capture more data")
    total_steps = min(train_cfg.max_steps or math.inf, train_cfg.epochs * windows_per_epoch)
    # the batches of an epoch no process reads: training ones after each process's whole accumulation windows
    left_out = {"train": sampler.left_out(windows_per_epoch * train_cfg.grad_accum),
                "holdout": holdout_sampler.left_out()}
    setup_facts = {"train_samples": len(train_ds), "holdout_samples": len(holdout_ds), **data.left_out.to_dict(),
                   "left_out_per_epoch": {k: asdict(v) for k, v in left_out.items()}}
    milestones = sorted({max(1, round(f * total_steps)) for f in train_cfg.save_at})

    # -- drafter ---------------------------------------------------------------------------------
    if resume_from is not None:
        if cfg.drafter.init_from:
            accelerator.print(f"resuming from {resume_from}: drafter.init_from {cfg.drafter.init_from} is "
                              "ignored (a resume continues the run)")
        cfg = cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update={"init_from": str(resume_from)})})
    drafter, how = build_drafter(cfg, data)
    how = f"resume from {resume_from}" if resume_from else how
    if cfg.drafter.aux_scale == "per_state":  # before DDP wraps it: every process computes the same scale
        how += "; " + scale_aux_inputs(drafter, data, accelerator.device)
    compute_dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
    rows = teacher_rows(data, drafter) if data.teacher == "hidden" else None
    objective = Objective(train_cfg.loss, train_cfg.lk_kl_scale, train_cfg.lk_kl_decay)
    if objective.needs_mass and data.teacher != "hidden":
        raise TrainingAborted(f"{data.source}: train.loss {train_cfg.loss} needs the target's last hidden state, and "
                              "this store holds top-k log-probs (capture.teacher topk); capture with teacher hidden, "
                              "train online, or use train.loss kl")
    model = TTTModel(drafter, rows, train_cfg.ttt_length, train_cfg.loss_decay, train_cfg.teacher_temperature,
                     objective, data.head["lm_head.weight"] if objective.needs_mass else None
                     ).to_device(accelerator.device, compute_dtype)
    n_train = sum(p.numel() for p in trainable(model))
    accelerator.print(f"drafter: {how}; {n_train / 1e6:.1f}M trainable parameters; {accelerator.num_processes} "
                      f"process{'es' if accelerator.num_processes > 1 else ''}; "
                      f"{len(train_ds)} train / {len(holdout_ds)} held-out samples ({data.source}; {data.left_out}); "
                      f"{total_steps} steps")
    accelerator.print(left_out_line(left_out, train_cfg.grad_accum, accelerator.num_processes))

    # -- optimizer, schedule, state ----------------------------------------------------------------
    optimizer = make_optimizer(model, train_cfg.lr, train_cfg.weight_decay, fused=accelerator.device.type == "cuda")
    scheduler = make_scheduler(optimizer, train_cfg.warmup_ratio, int(total_steps))
    accelerator.init_trackers(cfg.tracking.project, config=flat_config({**dump_config(cfg), "setup": setup_facts}))
    configure_deepspeed(accelerator, train_cfg)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # stepped once per update, not once per process
    state = {"step": 0, "epoch": 0, "batch": 0, "nonfinite_total": 0, "nonfinite_in_row": 0, "tokens_seen": 0}
    if resume_from is not None:
        run_checkpoints.verify_state(resume_from)
        accelerator.load_state(str(resume_from / run_checkpoints.STATE_DIR))
        state.update(run_checkpoints.read_trainer_state(resume_from)["position"])
        if accelerator.is_main_process:  # the best update and pruning a kill may have cut from its save
            run_checkpoints.finish_save(ckpt_root, resume_from, train_cfg.keep_last, milestones)
    log = JsonlLog(cfg.root / LOG_NAME, accelerator.is_main_process, state["step"])
    if resume_from is None:  # a resumed log keeps this record from the run's start
        log.write({"step": 0, "setup": setup_facts})
    run_config = dump_config(cfg)
    serve_dtype = "bfloat16" if compute_dtype == torch.bfloat16 else "float32"
    return Run(accelerator, data, sampler, holdout_sampler, windows_per_epoch, total_steps, milestones, model,
               optimizer, scheduler, state, log, ckpt_root, run_config, serve_dtype)


def left_out_line(left_out: dict[str, LeftOutBatches], grad_accum: int, processes: int) -> str:
    """The set-up line on the batches each epoch forms that no process reads (``left_out``: "train", "holdout"):
    the training order is reshuffled each epoch, so only their count stays the same."""
    share = f"past an even share over {processes} processes" if processes > 1 else ""
    return (f"left out of each epoch: training {left_out['train']} (after each process's last whole window of "
            f"train.grad_accum={grad_accum}{'; ' + share if share else ''}; reshuffled each epoch: epoch 0's samples "
            f"and tokens); held-out {left_out['holdout']}" + (f" ({share})" if share else ""))


def save_step(run: Run, train_cfg: TrainConfig, last_eval: dict[str, float] | None) -> None:
    """A checkpoint of the current step (every process takes part), then, on rank 0, best and pruning.
    ``last_eval`` None: a stop's save, made without a held-out pass, so it is no candidate for best."""
    accelerator, state, ckpt_root = run.accelerator, run.state, run.ckpt_root
    claim = run_checkpoints.candidate(last_eval)
    trainer = {"position": dict(state), "metrics": last_eval or {}, "candidate": claim,
               "store": run.data.target["fingerprint"]}
    ckpt = run_checkpoints.save(accelerator, accelerator.unwrap_model(run.model).drafter, ckpt_root, state["step"],
                                trainer, run.run_config, run.serve_dtype)
    if accelerator.is_main_process:  # run_checkpoints.finish_save redoes this when a kill cuts it short
        if claim is not None:
            run_checkpoints.update_best(ckpt_root, ckpt, state["step"], claim["metric"], claim["value"])
        run_checkpoints.prune(ckpt_root, train_cfg.keep_last, run.milestones)
    accelerator.wait_for_everyone()


@dataclass
class Window:
    """What the step loop carries between micro-batches: the current accumulation window's figures (this process),
    the per-position counts since the last train/ summary, and the last held-out metrics (what a save records).

    The clock takes four marks a micro-batch (around the target's forward, around the drafter's forward and
    backward), read at the step's one wait, so the log splits each step without a wait of its own. The window's
    loss and non-finite losses stay on the device: the step reads them with everything else it needs from the GPU
    in that one wait (a wait drains the queue the host would otherwise keep ahead of)."""

    counts: Counts
    clock: StepClock
    loss: torch.Tensor
    nonfinite: torch.Tensor
    tokens: int = 0  # padded tokens
    real: int = 0  # real tokens
    t0: float = field(default_factory=time.perf_counter)
    last_eval: dict[str, float] = field(default_factory=dict)

    @classmethod
    def start(cls, device: torch.device, n: int) -> Window:
        zero = torch.zeros((), device=device, dtype=torch.float64)
        return cls(Counts.zeros(n, device), StepClock(device.type == "cuda"), zero, zero.clone())

    def reset(self) -> None:
        """A new accumulation window (the counts and the clock go on)."""
        self.loss.zero_()
        self.nonfinite.zero_()
        self.tokens, self.real, self.t0 = 0, 0, time.perf_counter()


def accumulate(run: Run, train_cfg: TrainConfig, w: Window, raw: dict[str, torch.Tensor],
               batch: dict[str, torch.Tensor], steps_in_backward: bool) -> None:
    """One micro-batch's forward and backward into the window. DeepSpeed steps its optimizer inside backward: a
    non-finite loss must be kept from it there, which costs a wait per micro-batch. Elsewhere the loss's gradients
    are non-finite too, and the step skips the window."""
    accelerator, model = run.accelerator, run.model
    w.clock.mark()  # (the previous step's optimizer may run between the target's forward and here)
    with accelerator.accumulate(model):
        res = model(**batch)
        w.nonfinite += (~torch.isfinite(res.loss.detach())).double()
        w.loss += res.loss.detach().double() / train_cfg.grad_accum
        # every process must agree to skip, or DDP would wait for a backward that never comes
        if not (steps_in_backward and accelerator.reduce(w.nonfinite, reduction="sum") > 0):
            accelerator.backward(res.loss)
        w.counts.add(res.step_losses, res.correct, res.scored)
        w.tokens += int(batch["loss_mask"].numel())
        w.real += int(raw["attention_mask"].sum())
    w.clock.mark()


def optimizer_step(run: Run, train_cfg: TrainConfig, w: Window, k: int, micro_batches: TargetAhead,
                   stop: StopRequest | None) -> tuple[dict[str, Any], bool]:
    """The window's optimizer step (skipped when its loss or gradient norm is not finite) and the state after it;
    returns the step's log record and whether any process was asked to stop. The one wait of the step: the window's
    figures summed over processes, and the gradient norm (the same in every process after the all-reduce; None
    where DeepSpeed clips inside its own step). The clip itself runs inside the fused AdamW step where it can
    (train/optim.py says where)."""
    accelerator, optimizer, scheduler, state = run.accelerator, run.optimizer, run.scheduler, run.state
    grad_norm = clip_into_step(optimizer, trainable(run.model), train_cfg.max_grad_norm, accelerator.clip_grad_norm_)
    host = torch.tensor([w.tokens, w.real, float(bool(stop))], dtype=torch.float64)
    summed = accelerator.reduce(torch.cat([torch.stack([w.nonfinite, w.loss]),
                                           queued_to_device(host, accelerator.device)]), reduction="sum")
    if grad_norm is not None:
        summed = torch.cat([summed, torch.as_tensor(grad_norm, dtype=torch.float64,
                                                    device=accelerator.device).reshape(1)])
    figures = queued_to_host(summed)
    landed = torch.cuda.Event() if w.clock.cuda else None
    if landed is not None:
        landed.record()
    next_clock = StepClock(w.clock.cuda)
    if state["step"] + 1 < run.total_steps:  # the next micro-batch's target runs while the host waits and steps
        micro_batches.queue(next_clock)
    if landed is not None:
        landed.synchronize()
    nonfinite, loss_sum, padded, real, stopping, *rest = figures.tolist()
    spans = w.clock.spans_ms()  # (the wait above has run every marked span)
    w.clock = next_clock
    norm = rest[0] if rest else None  # (a bad window's may be NaN: the log writes None, strict JSON)
    window_bad = nonfinite > 0 or (norm is not None and not math.isfinite(norm))
    if not window_bad:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    state["step"] += 1
    state["batch"] = k + 1
    state["nonfinite_total"] += int(window_bad)
    state["nonfinite_in_row"] = state["nonfinite_in_row"] + 1 if window_bad else 0
    state["tokens_seen"] += int(real)
    elapsed = time.perf_counter() - w.t0
    record = {"step": state["step"], "epoch": state["epoch"],
              "loss": loss_sum / accelerator.num_processes if not window_bad else None,
              "lr": scheduler.get_last_lr()[0], "grad_norm": None if window_bad else norm,
              "skipped_nonfinite": window_bad, "nonfinite_total": state["nonfinite_total"],
              "tokens_per_s": padded / elapsed, "real_tokens_per_s": real / elapsed,
              "tokens_seen": state["tokens_seen"],
              "target_ms": round(sum(spans[0::4]), 2), "drafter_ms": round(sum(spans[2::4]), 2)}
    return record, stopping > 0


def log_step(run: Run, train_cfg: TrainConfig, w: Window, record: dict[str, Any], bar: tqdm) -> None:
    """The step's record (train_log.jsonl, the bar), the abort after too many non-finite steps in a row, and every
    train.log_every steps the train/ summary since the last one (to the trackers too)."""
    accelerator, state, n = run.accelerator, run.state, train_cfg.ttt_length
    run.log.write(record)
    bar.update(1)
    if state["nonfinite_in_row"] >= train_cfg.max_nonfinite_in_row:
        raise TrainingAborted(
            f"{state['nonfinite_in_row']} non-finite losses/gradients in a row (train.max_nonfinite_in_row="
            f"{train_cfg.max_nonfinite_in_row}) at step {state['step']}; the last good checkpoint in "
            f"{run.ckpt_root} is intact; lower train.lr or check the store for non-finite values")
    if state["step"] % train_cfg.log_every == 0 or state["step"] == run.total_steps:
        summary = Counts.from_flat(accelerator.reduce(w.counts.flat(), reduction="sum"), n).summary("train/")
        accelerator.log({**{k: v for k, v in record.items() if v is not None and k != "step"}, **summary},
                        step=state["step"])
        run.log.write({"step": state["step"], **summary})
        bar.set_postfix(loss=record["loss"], acc0=round(summary["train/acc_0"], 3))
        w.counts = Counts.zeros(n, accelerator.device)


def evaluate_and_save(run: Run, train_cfg: TrainConfig, w: Window, stopping: bool) -> tuple[bool, bool]:
    """The held-out pass (every train.eval_every steps and before each save) and the save (every
    train.save_every steps, at train.save_at and at the end; a stop's save at once, without a held-out pass: done
    well before timeout's SIGKILL). Returns (at the end, stopped early)."""
    accelerator, state = run.accelerator, run.state
    at_end = state["step"] >= run.total_steps
    stopped = stopping and not at_end
    due = state["step"] % train_cfg.save_every == 0 or state["step"] in run.milestones or at_end
    if len(run.data.holdout) and (state["step"] % train_cfg.eval_every == 0 or due):
        w.last_eval = holdout_metrics(accelerator, run.model, run.data, run.holdout_sampler, train_cfg.ttt_length)
        accelerator.log(w.last_eval, step=state["step"])
        run.log.write({"step": state["step"], **w.last_eval})
        accelerator.print(f"step {state['step']}: " + ", ".join(
            f"{k.split('/')[1]} {v:.3f}" for k, v in w.last_eval.items() if "loss_" not in k))
    if due:
        save_step(run, train_cfg, w.last_eval)
    elif stopped:
        save_step(run, train_cfg, None)
    return at_end, stopped


def train_steps(run: Run, train_cfg: TrainConfig, stop: StopRequest | None = None) -> bool:
    """The step loop: accumulate, step, log, held-out eval, save; from ``run.state`` to ``run.total_steps``, or to
    the first step that ends after ``stop`` was set in any process (all of them learn it in the step's token count
    reduction, so they stop at the same step, and save it). Returns whether it stopped early: every process gets
    the same answer, the one that was signalled or not."""
    accelerator, data, state = run.accelerator, run.data, run.state
    w = Window.start(accelerator.device, train_cfg.ttt_length)
    steps_in_backward = accelerator.distributed_type == DistributedType.DEEPSPEED
    bar = tqdm(total=int(run.total_steps), initial=state["step"], desc="train", unit="step",
               disable=not accelerator.is_local_main_process)
    run.model.train()
    stopped = False
    while state["step"] < run.total_steps and not stopped:
        run.sampler.set_epoch(state["epoch"])
        batches = run.sampler.batches()[: run.windows_per_epoch * train_cfg.grad_accum]
        loader = data.loader(data.train, batches[state["batch"]:], accelerator.device, pad_multiple(accelerator.device))
        micro_batches = TargetAhead(loader, data.complete, accelerator.device, start=state["batch"])
        while (item := micro_batches.take(w.clock)) is not None:
            k, raw, batch = item
            accumulate(run, train_cfg, w, raw, batch, steps_in_backward)
            if not accelerator.sync_gradients:
                continue
            record, stopping = optimizer_step(run, train_cfg, w, k, micro_batches, stop)
            log_step(run, train_cfg, w, record, bar)
            at_end, stopped = evaluate_and_save(run, train_cfg, w, stopping)
            w.reset()
            if at_end or stopped:
                break
        else:
            state["epoch"] += 1
            state["batch"] = 0
    bar.close()
    return stopped
