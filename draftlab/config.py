"""Typed run configuration: defaults live here once; recipes pick options; `key=value` overrides the rest.

`load_config(["recipe=eagle_head", "train.lr=3e-4"])` composes, in order:
  1. the dataclass defaults below,
  2. `recipes/<recipe>.yaml` (which may name base recipes under `defaults: [...]`, merged first),
  3. the command-line overrides (`a.b=value`, values parsed as YAML).
Unknown recipes, unknown keys, wrong types and invalid choices raise `ConfigError` with one line that names
the offending key and the valid choices, before anything expensive happens.
"""
from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from draftlab.drafters import CONFIGS
from draftlab.drafters.options import DrafterConfig
from draftlab.errors import ConfigError


@dataclass
class TargetConfig:
    path: str = ""
    """The target LLM: local HF folder, Hub id, `.gguf` file, or `package:PKG/FILE` (a file inside a Python package)."""
    dtype: str = "auto"
    """Target weights dtype: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16."""
    device: str = "auto"
    """Device for the target (and drafter): auto, cpu, cuda, cuda:N. Under multi-process launch each rank uses its own."""


@dataclass
class DataConfig:
    train: str = ""
    """Training conversations: JSONL/JSON file (chat `messages`, ShareGPT `conversations`, prompt/response) or a datasets Hub id."""
    eval_prompts: str = ""
    """Prompt set (JSONL with `messages` or `prompt`) for in-loop evaluation."""
    max_length: int = 2048
    """Tokens per training conversation; longer ones are truncated."""
    limit: int = 0
    """Use at most this many training conversations (0 = all)."""
    strict: bool = False
    """Fail on the first malformed data row instead of counting and skipping it."""
    store: str = ""
    """Offline store for data.train (target features and/or top-k logits, sharded safetensors): the training step
    reads it instead of running the target. Built on first use when missing ('' = online: target in the loop)."""
    regenerate_from: str = ""
    """When `data.train` does not exist yet: prompts file the target answers first to create it (cached, resumable)."""
    regenerate_num: int = 0
    """How many prompts of `data.regenerate_from` to answer (0 = all)."""
    regenerate_max_new_tokens: int = 256
    """Answer length limit when regenerating."""
    regenerate_batch_size: int = 16
    """Prompts per generate batch when regenerating (transformers backend)."""
    regenerate_backend: str = "transformers"
    """Who answers when regenerating (draftlab/engines.py): transformers (the loaded target; the reference),
    llama_cpp (llama.cpp on target.path's .gguf; the `engine` extra) or openai (OpenAI-compatible servers)."""
    regenerate_server_urls: str = ""
    """openai backend: base URL(s) of the server(s), comma-separated, e.g. http://10.0.0.1:8000,http://10.0.0.2:8000."""
    regenerate_concurrency: int = 8
    """openai backend: requests in flight; llama_cpp backend: sequences decoded together."""
    regenerate_timeout: float = 300.0
    """openai backend: seconds per request before it is retried."""


@dataclass
class TrainConfig:
    max_steps: int = 1000
    """Optimizer steps (each = batch_size x grad_accum x processes conversations)."""
    max_minutes: float = 0.0
    """Wall-clock training budget: stop (and save) at the first step past it, summed over resumed runs (0 = off).
    The learning-rate schedule still follows max_steps: size max_steps to what fits in the budget."""
    lr: float = 1e-4
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    schedule: str = "cosine"
    """Learning-rate schedule after warm-up: constant, linear, cosine."""
    batch_size: int = 4
    """Conversations per micro-batch per process."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    grad_clip: float = 0.5
    """Gradient-norm clipping (0 = off)."""
    mixed_precision: str = "auto"
    """auto (bf16 on a GPU that supports it, else none), no, bf16, fp16."""
    log_every: int = 10
    """Write a metrics.jsonl row every N steps."""
    save_every: int = 0
    """Also save a checkpoint every N steps (0 = only at evaluations and the final step)."""
    keep_last: int = 0
    """Keep only the N newest step folders, never the best one (0 = keep all)."""
    resume: str = ""
    """Resume: '' (fresh run), 'auto' (latest step in out_dir, if any), or a step folder."""
    num_threads: int = 0
    """CPU threads for torch (0 = torch's default)."""
    bucketed: bool = False
    """Group conversations of similar length into batches (less padding, same data each epoch, resumable)."""
    bucket_batches: int = 64
    """Bucketing window: batches' worth of conversations sorted by length together."""
    gradient_checkpointing: bool = False
    """Recompute the drafter's activations in the backward pass (less memory, more compute)."""
    pack_tokens: int = 0
    """Pack whole conversations into rows of at most N tokens (document-masked attention, positions restart per
    conversation, no padding; `draftlab/packing.py`); batch_size then counts packed rows. 0 = off: batch_size
    conversations padded to the longest. Must be at least data.max_length."""
    cache_features: bool = False
    """Keep each conversation's target features in memory after its first forward (the target is frozen, so they
    never change) and skip the target forward in later epochs. Memory: training tokens x feature size."""


@dataclass
class EvalConfig:
    every: int = 500
    """Evaluate by real speculative decoding every N steps (0 = off); the final step is always evaluated when > 0."""
    at_start: bool = False
    """Also evaluate the untrained drafter before the first step (step_0)."""
    num_prompts: int = 16
    """Prompts of data.eval_prompts used in each evaluation."""
    max_new_tokens: int = 128
    """Tokens generated per prompt."""
    draft_length: int = 5
    """Chain draft length k (tau <= k+1)."""
    tree: str = "chain"
    """Draft structure: chain, static, dynamic."""
    depth: int = 5
    """Dynamic tree: expansion depth."""
    top_k: int = 8
    """Dynamic tree: branching per expansion."""
    total_tokens: int = 48
    """Dynamic tree: nodes kept after reranking."""
    temperature: float = 0.0
    """Sampling temperature for evaluation (0 = greedy, with the identity check)."""
    seed: int = 0
    """Sampling seed for evaluation."""
    repeats: int = 1
    """Target-only and speculative decoding timed interleaved prompt by prompt this many times (median speedup,
    with its min and max); 0 = time target-only decoding once, at the first evaluation, and reuse it (cheaper)."""
    auto_draft_length: bool = False
    """Chains: at each evaluation, measure the draft and verification costs on this machine and the drafter's
    acceptance on the first eval.calibration_prompts prompts, and draft the chain length (up to
    eval.max_draft_length) with the most expected tokens/s (draftlab eval --draft-length auto; draftlab/costs.py).
    The report carries chosen_draft_length and the measured costs; `best` is still the highest tau."""
    max_draft_length: int = 8
    """Longest chain eval.auto_draft_length considers."""
    calibration_prompts: int = 2
    """Eval prompts eval.auto_draft_length calibrates on (the first N)."""


@dataclass
class HubConfig:
    repo_id: str = ""
    """Hub repository ORG/NAME to push to ('' = no upload)."""
    push: str = "none"
    """When to push: none, best, final, every_eval."""
    private: bool = False
    """Create the Hub repository as private."""


@dataclass
class RunConfig:
    recipe: str = ""
    """Recipe name (recipes/NAME.yaml) or path to a YAML file."""
    out_dir: str = "checkpoints/run"
    """Run folder: config.yaml, metrics.jsonl, step_N/, best, plots."""
    seed: int = 0
    """Seed for data order, noise and initialisation."""
    tracking: str = "jsonl"
    """Comma-separated trackers: none, jsonl, tensorboard, wandb."""
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=CONFIGS["eagle"])
    """The drafter's keys: those of drafter.kind's config (EagleConfig in drafters/eagle.py, ...)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    hub: HubConfig = field(default_factory=HubConfig)


CHOICES = {
    "train.schedule": ("constant", "linear", "cosine"),
    "train.mixed_precision": ("auto", "no", "bf16", "fp16"),
    "eval.tree": ("chain", "static", "dynamic"),
    "data.regenerate_backend": ("transformers", "llama_cpp", "openai"),
    "hub.push": ("none", "best", "final", "every_eval"),
    "drafter.distill_mode": ("offline_blackbox", "offline_whitebox", "online_whitebox", "online_blackbox"),
    "drafter.distill_loss": ("fkl", "rkl", "jsd", "tvd"),
    "drafter.acceptance_label": ("sampled", "greedy"),
    "drafter.loss_position": ("drafted", "input"),
    "drafter.loss_tokens": ("assistant", "all"),
}
TRACKERS = ("none", "jsonl", "tensorboard", "wandb")
SEEDS = "[0, 4294967295]"  # numpy's seed range (accelerate's set_seed seeds numpy too)
# Every numeric key's valid range, as an interval: [a, b] inclusive, (a, b) exclusive, inf = unbounded.
RANGES = {
    "seed": SEEDS, "eval.seed": SEEDS,
    **dict.fromkeys(["train.max_steps", "train.batch_size", "train.grad_accum", "train.log_every",
                     "train.bucket_batches", "data.max_length", "data.regenerate_max_new_tokens",
                     "data.regenerate_batch_size", "data.regenerate_concurrency", "eval.num_prompts", "eval.max_new_tokens", "eval.draft_length",
                     "eval.depth", "eval.top_k", "eval.total_tokens",
                     "eval.max_draft_length", "eval.calibration_prompts", "drafter.num_layers", "drafter.ttt_steps",
                     "drafter.harmonized_steps", "drafter.medusa_heads", "drafter.medusa_tree_nodes", "drafter.rollout_tokens",
                     "drafter.teacher_topk", "drafter.min_draft", "drafter.serial_tokens", "drafter.serial_layers",
                     "drafter.mlp_heads"], "[1, inf)"),
    **dict.fromkeys(["train.lr", "train.max_minutes", "train.weight_decay", "train.warmup_steps", "train.grad_clip", "train.save_every",
                     "train.keep_last", "train.num_threads", "train.pack_tokens", "data.limit", "data.regenerate_num", "eval.every",
                     "eval.repeats", "eval.temperature", "drafter.feature_noise", "drafter.reg_weight",
                     "drafter.topk_weight", "drafter.cls_weight", "drafter.medusa_layers", "drafter.medusa_weight", "drafter.lora_r", "drafter.lora_alpha",
                     "drafter.kl_weight", "drafter.hidden_size", "drafter.num_attention_heads",
                     "drafter.num_key_value_heads", "drafter.intermediate_size", "drafter.acceptance_layers",
                     "drafter.reject_weight", "drafter.mlp_layers", "drafter.mlp_weight"], "[0, inf)"),
    **dict.fromkeys(["drafter.student_ratio", "drafter.jsd_beta", "drafter.mix_ratio", "drafter.adaptive_threshold"],
                    "[0, 1]"),
    **dict.fromkeys(["train.adam_beta1", "train.adam_beta2", "drafter.lora_dropout"], "[0, 1)"),
    **dict.fromkeys(["drafter.ttt_decay", "drafter.medusa_decay", "drafter.mlp_decay"], "(0, 1]"),
    "drafter.distill_temperature": "(0, inf)", "data.regenerate_timeout": "(0, inf)",
    "drafter.draft_vocab_size": "[-1, inf)", "drafter.mask_token_id": "[-1, inf)",
    "drafter.num_anchors": "[1, inf)", "drafter.block_size": "[2, inf)",
}


def range_problem(name: str, value, interval: str) -> str | None:
    """'NAME is V: it must ...' when value lies outside `interval` (e.g. "[1, inf)", "(0, 1]"), else None.
    NaN and infinities never pass."""
    low, high = (float(x) for x in interval[1:-1].split(","))
    if isinstance(value, float) and not math.isfinite(value):
        return f"{name} is {value}: it must be a finite number"
    above = low < value if interval[0] == "(" else low <= value
    below = value < high if interval[-1] == ")" else value <= high
    if above and below:
        return None
    def show(x: float) -> str:
        return str(int(x)) if x.is_integer() else str(x)
    if high == math.inf and interval[0] == "[":
        words = "not be negative" if low == 0 else f"be at least {show(low)}"
    elif high == math.inf:
        words = f"be > {show(low)}"
    else:
        words = f"lie in {interval[0]}{show(low)}, {show(high)}{interval[-1]}"
    return f"{name} is {value}: it must {words}"


# ORG/NAME as the Hub accepts it: each part 1-96 of A-Z a-z 0-9 _ . -, not starting or ending with '.' or '-'
_REPO_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
REPO_ID_RE = re.compile(rf"^{_REPO_PART}/{_REPO_PART}$")


def repo_id_problem(repo_id: str, option: str = "--repo-id") -> str | None:
    """Why the Hub would reject `repo_id` as a model repository id (one line), or None when it is valid."""
    kind = repo_id.split("/", 1)[0] if repo_id.count("/") == 2 else None
    if kind in ("datasets", "spaces"):
        return (f"{option} {repo_id} names a {kind[:-1]} repository: draftlab pushes model repositories, "
                f"pass ORG/NAME ({repo_id.split('/', 1)[1]})")
    if not REPO_ID_RE.match(repo_id or "") or "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        return (f"{option} {repo_id!r} is not a Hub model id: use ORG/NAME, each part 1-96 letters, digits, '-', "
                "'_' or '.', not starting or ending with '-' or '.', without '--', '..' or a '.git' ending")
    return None


def recipes_dir() -> Path:
    """The recipes folder: $DRAFTLAB_RECIPES, else the one beside the package (source checkout / editable install)."""
    env = os.environ.get("DRAFTLAB_RECIPES")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent.parent / "recipes"
    return here if here.is_dir() else Path.cwd() / "recipes"


def recipe_command(path: Path) -> str:
    """The command a recipe file is for: its top-level `command:` key (disco, serve-learn), else train."""
    raw = load_yaml(path, f"recipe {path}")
    command = raw.get("command") if isinstance(raw, DictConfig) else None
    return str(command) if command else "train"


def available_recipes(command: str = "train") -> list[str]:
    """Names of the shipped recipes for `command` (train: `draftlab train recipe=NAME`; disco, serve-learn:
    `draftlab COMMAND --recipe NAME`)."""
    return sorted(p.stem for p in recipes_dir().glob("*.yaml") if recipe_command(p) == command)


def parse_command_args(parser, argv: list[str], command: str, required: tuple[str, ...] = ()):
    """`parser.parse_args(argv)` for a command other than train, whose `--recipe NAME` sets option defaults from a
    recipe for that command (`command_recipe`); options given on the command line win. `required`: option names
    that the recipe or the command line must set."""
    args = parser.parse_args(argv)
    if args.recipe:
        options = {a.dest: None if a.nargs not in (None, 0) else bool if a.const is True else
                   a.type or (type(a.default) if a.default is not None else str)
                   for a in parser._actions if a.dest not in ("help", "recipe")}
        parser.set_defaults(**command_recipe(args.recipe, command, options))
        args = parser.parse_args(argv)
    missing = [name for name in required if getattr(args, name) in (None, [])]
    if missing:
        parser.error("give " + ", ".join("--" + name.replace("_", "-") for name in missing) +
                     (f" (on the command line or in --recipe {args.recipe})" if args.recipe else ""))
    return args


def command_recipe(name: str, command: str, options: dict) -> dict:
    """The option values a recipe for `command` (not train) sets: `{option: value}` from recipes/NAME.yaml or a
    YAML file, with its `command:` key checked and each key checked against `options` (the command's option
    names, with underscores, and their types)."""
    path = _recipe_file(name)
    raw = load_yaml(path, f"recipe {path}")
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"recipe {path} must be a mapping of option names to values")
    data = OmegaConf.to_container(raw)
    found = data.pop("command", None) or "train"
    if found != command:
        how = f"draftlab train recipe={name}" if found == "train" else f"draftlab {found} --recipe {name}"
        raise ConfigError(f"recipe {name} is for `{how}`, not for draftlab {command}: give a recipe with "
                          f"`command: {command}` ({', '.join(available_recipes(command)) or 'none shipped'})")
    for key, value in data.items():
        if key not in options:
            raise ConfigError(f"recipe {path}: unknown option '{key}' for draftlab {command}: use "
                              f"{', '.join(sorted(options))}")
        want = options[key]
        if want is not None and value is not None and not (isinstance(value, want) or want is float and
                                                              isinstance(value, int) and not isinstance(value, bool)):
            article = "an" if want.__name__[0] in "aeiou" else "a"
            raise ConfigError(f"recipe {path}: {key} is {value!r}: give {article} {want.__name__}")
    return data


def _recipe_file(name: str) -> Path:
    path = Path(name)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"recipe file {name} not found")
        return path
    path = recipes_dir() / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in recipes_dir().glob("*.yaml"))
        raise ConfigError(f"unknown recipe '{name}': choose one of {', '.join(names)} "
                          f"(files in {recipes_dir()}), or pass recipe=path/to/file.yaml")
    return path


def _load_recipe(name: str, seen: tuple[str, ...] = ()) -> DictConfig:
    """A recipe's YAML with its `defaults` (base recipes) merged underneath it."""
    if name in seen:
        raise ConfigError(f"recipe '{name}' includes itself through defaults: {' -> '.join(seen + (name,))}")
    path = _recipe_file(name)
    raw = load_yaml(path, f"recipe {path}")
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"recipe {path} must be a mapping of keys to values")
    if raw.get("command") not in (None, "train"):
        raise ConfigError(f"recipe {name} is for `draftlab {raw.command} --recipe {name}`, not for draftlab train "
                          f"(train recipes: {', '.join(available_recipes())})")
    bases = raw.pop("defaults", []) or []
    merged = OmegaConf.create({})
    for base in bases:
        merged = OmegaConf.merge(merged, _load_recipe(str(base), seen + (name,)))
    return OmegaConf.merge(merged, raw)


def load_yaml(path: str | Path, what: str):
    """OmegaConf.load with one-line errors that keep the YAML error's line and column."""
    try:
        return OmegaConf.load(path)
    except UnicodeDecodeError as e:
        data = Path(path).read_bytes()
        line, column = data[:e.start].count(b"\n") + 1, e.start - data.rfind(b"\n", 0, e.start)
        raise ConfigError(f"cannot parse {what}: {path}:{line}:{column}: not valid UTF-8 (byte "
                          f"0x{data[e.start]:02x}): save the file as UTF-8") from None
    except Exception as e:  # YAML syntax errors (yaml.MarkedYAMLError) and unreadable files
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        if mark is None:
            raise ConfigError(f"cannot parse {what}: {path}: {(str(e).splitlines() or [type(e).__name__])[0]}") \
                from None
        raise ConfigError(f"cannot parse {what}: {path}:{mark.line + 1}:{mark.column + 1}: "
                          f"{getattr(e, 'problem', None) or str(e).splitlines()[0]} (fix the YAML there)") from None


def _check_sections(layer: DictConfig, origin: str, section: str = "") -> None:
    """A section (target, data, train, ...) must be given keys, not a value: `train=3` or an empty `train:`
    in a recipe would otherwise replace the whole section."""
    for f in fields(_section_class(section)):
        if not (is_dataclass(f.default_factory) and f.name in layer):
            continue
        key = ".".join(filter(None, [section, f.name]))
        node = layer._get_node(f.name)
        if not isinstance(node, DictConfig):
            first = fields(f.default_factory)[0].name
            raise ConfigError(f"{origin}: '{key}' is a section, not a value: set its keys, e.g. {key}.{first}=... "
                              f"(in a recipe, indent them under '{key}:')")
        _check_sections(node, origin, key)


def _section_class(section: str, kind: str | None = None):
    """The dataclass behind a dotted section name ('' = RunConfig; drafter = drafter.kind's config, or the keys
    every kind has when no kind is given)."""
    if section == "drafter":
        return CONFIGS[kind] if kind else DrafterConfig
    node: Any = RunConfig
    for part in [p for p in section.split(".") if p]:
        node = {f.name: f for f in fields(node)}[part].default_factory
    return node


def _describe_key_error(key: str, kind: str) -> str:
    """One line naming the bad key, a close match and the valid keys of its section (of drafter.kind's config
    for a drafter key, and which kinds the key belongs to)."""
    parts, section = key.split("."), ""
    for i, part in enumerate(parts):
        schema = {f.name: f for f in fields(_section_class(section, kind))}
        if part not in schema and section == "drafter":
            owners = [k for k, c in CONFIGS.items() if part in {f.name for f in fields(c)}]
            if owners:
                return (f"config key '{key}' does not belong to drafter.kind={kind} (it is a key of "
                        f"{', '.join(owners)}): the keys of {kind} are {', '.join(schema)}")
        if part not in schema:
            where = f"drafter (drafter.kind={kind})" if section == "drafter" else section or "the top level"
            close = difflib.get_close_matches(part, list(schema), n=1)
            hint = f" (did you mean {'.'.join(filter(None, [section, close[0]]))}?)" if close else ""
            return f"unknown config key '{key}'{hint}: valid keys under {where} are {', '.join(schema)}"
        is_section = schema[part].default_factory is not None and is_dataclass(schema[part].default_factory)
        if not is_section and i < len(parts) - 1:
            return f"config key '{'.'.join(parts[: i + 1])}' is a value, not a section: '{key}' is not valid"
        section = ".".join(filter(None, [section, part]))
    return f"invalid config key '{key}'"


def _field_type_name(key: str, drafter_kind: str) -> str:
    section, _, name = key.rpartition(".")
    try:
        kind = {f.name: f for f in fields(_section_class(section, drafter_kind))}[name].type
    except (KeyError, TypeError):
        return "another type"
    return kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))


def _merge(base: DictConfig, layer: DictConfig, origin: str) -> DictConfig:
    _check_sections(layer, origin)
    kind = base.drafter.kind
    try:
        return OmegaConf.merge(base, layer)
    except ConfigKeyError as e:
        raise ConfigError(f"{origin}: {_describe_key_error(e.full_key, kind)}") from None
    except ValidationError as e:
        expected = _field_type_name(e.full_key, kind)
        raise ConfigError(f"{origin}: config key '{e.full_key}' got {e.value!r}, expected {expected}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{origin}: {str(e).splitlines()[0]}") from None


def parse_overrides(args: list[str]) -> tuple[str, list[str]]:
    """Split `recipe=NAME` from the other `key=value` arguments; anything else is an error."""
    recipe, rest = "", []
    for arg in args:
        if "=" not in arg or arg.startswith("="):
            raise ConfigError(f"argument '{arg}' is not key=value: use recipe=NAME and overrides like train.lr=1e-4")
        key, value = arg.split("=", 1)
        if key.lstrip("+") == "recipe":
            recipe = value
        else:
            rest.append(arg)
    return recipe, rest


def load_config(args: list[str]) -> RunConfig:
    """Compose defaults, recipe and overrides into a validated RunConfig (an OmegaConf-backed object)."""
    cfg = compose(args)
    validate(cfg)
    return cfg


def compose(args: list[str]) -> RunConfig:
    """Defaults, recipe and overrides merged, keys and types checked, but not yet validated as a runnable
    config (`draftlab recipes --show` prints this). The drafter section is the config of the drafter.kind that
    the recipe and overrides end with, so a key of another kind is an error."""
    recipe, overrides = parse_overrides(args)
    layers = [(_load_recipe(recipe), f"recipe {recipe}")] if recipe else []
    for item in overrides:
        try:
            layers.append((OmegaConf.from_dotlist([item]), f"override {item}"))
        except Exception as e:
            raise ConfigError(f"cannot parse override '{item}': {str(e).splitlines()[0]}") from None
    cfg = structured(_chosen_kind(layers))
    for layer, origin in layers:
        cfg = _merge(cfg, layer, origin)
    if recipe:
        cfg.recipe = recipe
    return cfg


def structured(kind: str) -> RunConfig:
    """The defaults, with drafter.kind's config as the drafter section."""
    cfg = OmegaConf.structured(RunConfig)
    cfg.drafter = CONFIGS[kind]()
    return cfg


def _chosen_kind(layers: list[tuple[DictConfig, str]]) -> str:
    """drafter.kind as the last layer that sets it says (default eagle), checked against the registry."""
    kind, origin = "eagle", "the default"
    for layer, where in layers:
        node = layer.get("drafter") if isinstance(layer, DictConfig) else None
        if isinstance(node, DictConfig) and node.get("kind") is not None:
            kind, origin = node.get("kind"), where
    if kind not in CONFIGS:
        raise ConfigError(f"{origin}: config key 'drafter.kind' is '{kind}': choose one of {', '.join(CONFIGS)}")
    return kind


def validate(cfg) -> None:
    """Choices and ranges that types alone do not catch (drafter keys: those drafter.kind has)."""
    for key, options in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value is None and key.startswith("drafter."):
            continue
        if value in (False, "False", "false") and "no" in options:   # YAML reads a bare `no` as false
            OmegaConf.update(cfg, key, "no")
            value = "no"
        if value not in options:
            raise ConfigError(f"config key '{key}' is '{value}': choose one of {', '.join(options)}")
    for tracker in tracking_list(cfg):
        if tracker not in TRACKERS:
            raise ConfigError(f"config key 'tracking' names '{tracker}': choose from {', '.join(TRACKERS)} "
                              "(comma-separated for several)")
    check_ranges(cfg)
    problem = CONFIGS[cfg.drafter.kind].run_problem(cfg)
    if problem:
        raise ConfigError(problem)
    if cfg.train.pack_tokens:
        problem = packing_problem(cfg)
        if problem:
            raise ConfigError(problem)
    if cfg.hub.repo_id:
        problem = repo_id_problem(cfg.hub.repo_id, "config key hub.repo_id")
        if problem:
            raise ConfigError(problem)
    if cfg.hub.push != "none" and not cfg.hub.repo_id:
        raise ConfigError(f"hub.push={cfg.hub.push} needs hub.repo_id=ORG/NAME (or hub.push=none)")
    if not cfg.target.path:
        raise ConfigError("config key 'target.path' is empty: set target.path=FOLDER|HUB_ID|FILE.gguf")
    if not cfg.data.train:
        raise ConfigError("config key 'data.train' is empty: set data.train=FILE.jsonl or a datasets Hub id")
    if cfg.eval.every > 0 and not cfg.data.eval_prompts:
        raise ConfigError("in-loop evaluation needs prompts: set data.eval_prompts=FILE.jsonl (or eval.every=0)")
    if cfg.eval.auto_draft_length and cfg.eval.tree != "chain":
        raise ConfigError(f"eval.auto_draft_length=true chooses a chain's length, but eval.tree={cfg.eval.tree}: set "
                          "eval.tree=chain (or eval.auto_draft_length=false)")


def check_ranges(cfg) -> None:
    """Every numeric key in its range (RANGES): what `draftlab recipes --show` checks of the config it prints (the
    rest of validate() needs the run's paths)."""
    for key, interval in RANGES.items():
        value = OmegaConf.select(cfg, key)
        if value is None and key.startswith("drafter."):
            continue
        problem = range_problem(f"config key '{key}'", value, interval)
        if problem:
            raise ConfigError(problem)


def check_device(option: str, device: str) -> None:
    """A CUDA or MPS device asked for on a machine without one: one line, before anything loads."""
    import torch

    name = str(device or "auto").lower()
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{option} {device}: this machine has no CUDA device (torch.cuda.is_available() is false): "
                          "use cpu or auto")
    if name.startswith("cuda:") and name[5:].isdigit() and int(name[5:]) >= torch.cuda.device_count():
        raise ConfigError(f"{option} {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                          f"0..{torch.cuda.device_count() - 1}")
    if name.startswith("mps") and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError(f"{option} {device}: this machine has no MPS device: use cpu or auto")


def packing_problem(cfg) -> str | None:
    """Why train.pack_tokens cannot be used with this run (None: it can)."""
    n = cfg.train.pack_tokens
    if n < cfg.data.max_length:
        return (f"train.pack_tokens={n} is below data.max_length={cfg.data.max_length}: a conversation must fit a "
                f"packed row; set train.pack_tokens to at least {cfg.data.max_length} (or lower data.max_length)")
    if cfg.train.bucketed:
        return "train.pack_tokens and train.bucketed=true both shape the batches: choose one (packing has no padding)"
    if not CONFIGS[cfg.drafter.kind].packs(cfg.drafter):
        return (f"train.pack_tokens: drafter.kind={cfg.drafter.kind} does not train on packed rows (it generates "
                "or trains the target on its own batches): set train.pack_tokens=0")
    return None


def tracking_list(cfg) -> list[str]:
    return [t.strip() for t in str(cfg.tracking).split(",") if t.strip() and t.strip() != "none"]


def to_yaml(cfg) -> str:
    return OmegaConf.to_yaml(cfg)


def load_saved(path: str | Path) -> RunConfig:
    """A run's saved config.yaml, checked against the current schema. Runs saved before the drafter section was
    per kind hold every kind's keys there: those not of its kind are dropped."""
    saved = load_yaml(path, "saved config")
    kind = _chosen_kind([(saved, str(path))])
    drafter = saved.get("drafter") if isinstance(saved, DictConfig) else None
    if isinstance(drafter, DictConfig):
        own = {f.name for f in fields(CONFIGS[kind])}
        for key in [k for k in drafter if k not in own]:
            drafter.pop(key)
    return _merge(structured(kind), saved, str(path))


# --- the resume contract (train.resume) ----------------------------------------------------------------------------
# A resumed run continues the run recorded in its config.yaml. Keys that shape the drafter (every drafter.* key, the
# kind included), its target or the data it trains on, and in which order (the layout the saved data position
# counts in), cannot change: a resume that changes one is refused, naming each. Any other key (train.lr,
# train.max_steps, eval.*, hub.*, ...) may change: the new value is applied and recorded in config.yaml.
RESUME_FIXED = ("drafter.", "target.path", "seed", "data.train", "data.limit", "data.max_length", "data.store",
                "data.regenerate_from", "data.regenerate_num", "data.regenerate_max_new_tokens",
                "data.regenerate_backend", "train.pack_tokens", "train.bucketed", "train.bucket_batches",
                "train.cache_features")
RESUME_IGNORED = ("recipe", "out_dir", "train.resume")  # where a run is, and how it was composed, not what it is


def flat_config(cfg) -> dict:
    """{dotted key: value} of a config (lists as lists)."""
    out: dict = {}

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = value

    walk(OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else cfg, "")
    return out


def resume_changes(saved, cfg) -> tuple[list[tuple[str, object, object]], list[tuple[str, object, object]]]:
    """(fixed, applied): the keys whose value differs between a run's saved config and the resumed one, as
    (key, saved, now), split into those a resume may not change and those it applies. A changed drafter.kind is the
    one drafter key named (the other kind's keys differ by construction)."""
    old, new = flat_config(saved), flat_config(cfg)
    fixed, applied = [], []
    kind_changed = old.get("drafter.kind") != new.get("drafter.kind")
    for key in sorted(set(old) | set(new)):
        if key in RESUME_IGNORED or old.get(key) == new.get(key):
            continue
        if kind_changed and key.startswith("drafter.") and key != "drafter.kind":
            continue
        is_fixed = any(key == f or (f.endswith(".") and key.startswith(f)) for f in RESUME_FIXED)
        (fixed if is_fixed else applied).append((key, old.get(key), new.get(key)))
    return fixed, applied


def changes_text(changes) -> str:
    """'drafter.block_size 8 (now 4), target.path A (now B)'."""
    return ", ".join(f"{key} {old!r} (now {new!r})" if isinstance(old, str) or isinstance(new, str) else
                     f"{key} {old} (now {new})" for key, old, new in changes)
