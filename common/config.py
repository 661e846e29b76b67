"""The run config: one YAML file per run, validated by pydantic.

Every stage reads the same file; this module is the only place that knows its shape. Unknown keys,
wrong types and impossible values are all reported at once, one line each, naming the file and the
dotted key to change (``configs/x.yaml: train.lr: must be > 0``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from common.dtypes import DTypeName

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]


class ConfigError(ValueError):
    """A config problem; the message is ready to show the user as is."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TargetConfig(Section):
    """The target LLM whose distribution the drafter must match."""

    name: str = Field(description="Local dir, hub id, path to a .gguf, or a builtin name.")
    gguf_file: str | None = Field(None, description="GGUF file inside `name` (a dir or hub repo).")
    dtype: DTypeName = "float32"
    device: str = Field("auto", description="'auto' picks cuda when present, else cpu.")
    trust_remote_code: bool = False
    aux_layer_ids: list[int] | None = Field(
        None, description="The drafter's eagle_aux_hidden_state_layer_ids; default: the drafter's own, else ours "
        "for a new drafter, the outputs of [2, N//2, N-3] (SGLang's own default, for a drafter config without "
        "ids, is the outputs of [1, N//2-1, N-4]; drafter.target explains both).")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the chat template wherever a chat is rendered (regenerate, "
        "capture, eval prompts) and sent to servers as chat_template_kwargs, e.g. {thinking: false} for "
        "Kimi-K2.5: the drafter must see the text the server renders.")

    @field_validator("aux_layer_ids")
    @classmethod
    def _ids_distinct(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and (len(ids) != 3 or len(set(ids)) != 3 or min(ids) < 0):
            raise ValueError(f"must be 3 distinct non-negative layer ids, got {ids}")
        return ids


class DrafterConfig(Section):
    """Where the drafter starts: a checkpoint (warm start) or a shape derived from the target."""

    init_from: str | None = Field(None, description="SGLang-layout drafter dir to warm-start from.")
    draft_vocab_size: PositiveInt = 32000
    intermediate_size: PositiveInt | None = None
    num_attention_heads: PositiveInt | None = None
    num_key_value_heads: PositiveInt | None = None
    head_dim: PositiveInt | None = None


class SourceConfig(Section):
    kind: Literal["sharegpt", "openai", "mtbench", "humaneval", "lines"]
    path: str = Field(description="File path, or 'builtin' for the copy shipped in a PyPI wheel.")
    limit: PositiveInt | None = None


class DataConfig(Section):
    sources: list[SourceConfig] = Field(min_length=1)
    max_prompt_chars: PositiveInt = 16000
    max_turns: PositiveInt = 4
    seed: int = 0


class RegenerateConfig(Section):
    """How the target rewrites every assistant turn (the drafter must learn the target's own text)."""

    backend: Literal["hf", "openai"] = "hf"
    num_prompts: PositiveInt | None = None
    server_urls: list[str] = Field(default_factory=list)
    model: str = "default"
    api_key_env: str | None = Field(None, description="Name of the env var holding the API key.")
    concurrency: PositiveInt = 8
    timeout_s: PositiveFloat = 600.0
    max_retries: Annotated[int, Field(ge=0)] = 5
    retry_backoff_s: PositiveFloat = Field(1.0, description="First retry delay; doubles per retry (capped at 60 s).")
    batch_size: PositiveInt = 16
    batch_tokens: PositiveInt = Field(
        16384, description="hf: most padded tokens (prompt + max_tokens per row) in one generate call; "
        "long prompts go in smaller batches.")
    temperature: Annotated[float, Field(ge=0.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: int | None = None
    max_tokens: PositiveInt = 512
    seed: int = 0

    @model_validator(mode="after")
    def _urls_for_openai(self) -> RegenerateConfig:
        if self.backend == "openai" and not self.server_urls:
            raise ValueError("backend 'openai' needs regenerate.server_urls")
        return self


class CaptureConfig(Section):
    """Where the target's states come from: ``hf`` runs the HF model in-process (targets that fit one device);
    ``specforge`` imports the hidden-state files of SpecForge's ``scripts/prepare_hidden_states.py`` (an SGLang
    target under tensor/expert parallelism, the path that trained the AQ-MedAI drafters); ``sglang`` asks a stock
    ``sgl.Engine`` (teacher 'topk' only, unverified). Only ``hf`` loads the HF model."""

    backend: Literal["hf", "specforge", "sglang"] = "hf"
    specforge_dir: str | None = Field(
        None, description="specforge: SpecForge's --output-path (rows_*/data_<i>.ckpt[.gz] files).")
    tensor_parallel_size: PositiveInt = Field(
        1, description="specforge/sglang: GPUs the target is sharded over (SpecForge --tp-size, SGLang tp_size).")
    expert_parallel_size: PositiveInt = Field(
        1, description="specforge/sglang: expert-parallel size of a MoE target (SpecForge --sglang-ep-size, "
        "SGLang ep_size); divides tensor_parallel_size.")
    max_length: PositiveInt = 2048
    batch_tokens: PositiveInt = 16384
    dtype: DTypeName = "bfloat16"
    teacher: Literal["hidden", "topk"] = Field(
        "hidden", description="'hidden': final normed hidden state (exact teacher via lm_head at "
        "train time); 'topk': top-k ids and log-probs (compact, approximate).")
    topk: PositiveInt = 64
    shard_samples: PositiveInt = 256

    @model_validator(mode="after")
    def _parallel_sizes(self) -> CaptureConfig:
        if self.tensor_parallel_size % self.expert_parallel_size:
            raise ValueError(f"expert_parallel_size {self.expert_parallel_size} must divide tensor_parallel_size "
                             f"{self.tensor_parallel_size} (SGLang runs experts within the tensor-parallel group)")
        return self


class TrainConfig(Section):
    epochs: PositiveInt = 1
    max_steps: PositiveInt | None = None
    batch_tokens: PositiveInt = 8192
    grad_accum: PositiveInt = 1
    lr: PositiveFloat = 1e-4
    warmup_ratio: Probability = 0.03
    weight_decay: Annotated[float, Field(ge=0.0)] = 0.0
    max_grad_norm: PositiveFloat = 0.5
    ttt_length: PositiveInt = 7
    loss_decay: Annotated[float, Field(gt=0.0, le=1.0)] = 0.8
    holdout_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.05
    eval_every: PositiveInt = 200
    save_every: PositiveInt = 200
    keep_last: PositiveInt = 2
    log_every: PositiveInt = 10
    max_nonfinite_in_row: PositiveInt = 5
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    report_to: Literal["none", "wandb"] = "none"
    wandb_project: str = "eagle3-drafter"
    seed: int = 0


class DatasetConfig(Section):
    name: str
    kind: Literal["sharegpt", "openai", "mtbench", "humaneval", "lines"]
    path: str = "builtin"
    limit: PositiveInt | None = None


class TimingsConfig(Section):
    """Production timings at batch size 1 (e.g. from an SGLang deployment) that replace the measured ones.
    A verify cycle with k drafts costs another time at every k, so ``cycle_ms`` is keyed by k (eval.num_steps):
    ``{decode_ms: 12.1, cycle_ms: {3: 29.8}}``."""

    decode_ms: PositiveFloat
    cycle_ms: dict[PositiveInt, PositiveFloat] = Field(min_length=1)

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
    api_key_env: str | None = Field(None, description="Env var holding the servers' --api-key.")
    timeout_s: PositiveFloat = 1800.0


class EvalConfig(Section):
    datasets: list[DatasetConfig] = Field(min_length=1)
    num_steps: PositiveInt = 3
    temperature: Annotated[float, Field(ge=0.0)] = 0.0
    max_new_tokens: PositiveInt = 256
    timings: TimingsConfig | None = None
    target_tps: PositiveFloat | None = None
    acceptance: Literal["sglang", "speculative_sampling"] = Field(
        "sglang", description="T > 0 rule: 'sglang' drafts greedily and keeps draft d with probability p(d), as "
        "SGLang's EAGLE worker does; 'speculative_sampling' samples drafts from q and keeps them with "
        "min(1, p/q). At T = 0 both are greedy verification.")
    tie_epsilon: Annotated[float, Field(ge=0.0)] = Field(
        1e-4, description="T = 0 lossless check: a divergence where the target's top-1/top-2 logit margin is "
        "below this is a near-tie (a bf16 verify and decode may round it either way), reported apart, not a "
        "failure.")
    sglang: SGLangEvalConfig | None = None
    seed: int = 0


class GateConfig(Section):
    margin: Annotated[float, Field(ge=0.0)] = 0.0
    min_delta: Annotated[float, Field(ge=0.0)] = 0.0
    datasets: list[str] | None = Field(None, description="Gate datasets; default: all eval ones.")
    promoted_dir: str = "promoted"
    history_file: str = "promotions.jsonl"


class RunConfig(Section):
    run_dir: str = Field(description="Where every stage writes; relative paths are to the CWD.")
    target: TargetConfig
    drafter: DrafterConfig = DrafterConfig()
    data: DataConfig
    regenerate: RegenerateConfig = RegenerateConfig()
    capture: CaptureConfig = CaptureConfig()
    train: TrainConfig = TrainConfig()
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
        if cap.backend == "sglang" and self.drafter.init_from is None:
            raise ValueError("capture.backend 'sglang' needs drafter.init_from: SGLang captures the aux layers of "
                             "the EAGLE-3 drafter it serves")
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


def _format_errors(source: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling against configs/smollm2-135m.yaml)"
        # Whole-config checks have no location; their message starts with the dotted key.
        lines.append(f"{source}: {key}: {msg}" if key else f"{source}: {msg}")
    return "\n".join(lines)


def parse_config(tree: dict[str, Any], source: str = "<config>") -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(source, e)) from None


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a YAML run config and apply ``key.sub=value`` overrides (values parsed as YAML)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file (the shipped ones are in configs/)")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"{path}: override {item!r}: expected key.sub=value")
        _set_dotted(tree, key.strip(), yaml.safe_load(raw), str(path))
    return parse_config(tree, str(path))


def dump_config(cfg: RunConfig) -> dict[str, Any]:
    return cfg.model_dump(mode="json")
