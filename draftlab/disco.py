"""DISCO: a stop classifier that decides, token by token, whether a chain drafter keeps drafting.

Paper: Mamou, Pereg, Korat, Berchansky, Timor, Wasserblat, Schwartz, "Dynamic Speculation Lookahead Accelerates
Speculative Decoding of Large Language Models" (arXiv 2405.04304; first titled "Accelerating Speculative Decoding
using Dynamic Speculation Length").

Specification, as read:
* [ABS] The speculation lookahead (SL, draft tokens per round) is usually static; the SL an *oracle* would choose
  (draft until the first token the target rejects) varies widely from round to round, so a static SL is
  suboptimal. DISCO "uses a classifier to dynamically adjust the SL at each iteration, while provably preserving
  the decoding quality"; reported: about 10% average speedup over the best static SL on four datasets, the same
  text as static SL.
* [RECALLED, UNVERIFIED] After each draft token the classifier reads features the drafter has at that moment (the
  probabilities of its top-ranked tokens, the entropy of its distribution, the index of the token in the round)
  and predicts whether the token will be accepted; drafting stops when the predicted probability falls below a
  threshold tuned for speed on held-out data. Labels come from the oracle: a draft token is positive when the
  target accepts it. The classifier is a small feed-forward network.
* [DERIVED, section 1.2 of method_specs] The stop decision changes only how many tokens go to verification, never
  the verification rule, so the output stays exactly the target's (greedy identity, and the target's distribution
  under sampling: each drafted token is still drawn from q and verified by rejection sampling).

What draftlab builds (and where it departs from the paper):
* Features per draft position, all available before the token is drafted: top-1 and top-2 probability and entropy
  of the drafter's temperature-1 distribution at that position (`drafting.draft_stats`), and the position in the
  round (1-based). They are standardised with the training set's mean and spread, stored with the classifier.
* Labels from a round log (`rounds.py`, written by `draftlab eval --log-rounds`): every node the target judged
  (a child of the root or of an accepted node) is one example, positive when it was accepted; so the classifier
  estimates p_i = P(token i accepted | tokens 1..i-1 accepted). Trained with binary cross-entropy
  (`losses.acceptance_bce` with reject weight 1), full batch, Adam.
* The decision rule uses this machine's measured costs instead of a tuned threshold (`StopRule`): with i tokens
  drafted, reach R_i = p_1 ... p_i, E_i = 1 + R_1 + ... + R_i expected tokens of stopping now and
  T(k) = draft(k) + verify(k + 1) + overhead seconds a round of k (costs.py), keep drafting when some longer
  chain m <= max_length, its later tokens accepted with the next token's predicted p_{i+1}, reaches more
  expected tokens per second than stopping now: max_m E'_m / T(m) > E_i / T(i). With one p for every token this
  is exactly the best fixed length over the cost table (tests/test_disco.py checks it against brute force); with
  varying p it is a one-step-informed look-ahead. The first token is always drafted, as in SpecDec++'s rule.
* Any chain drafter whose proposer drafts through `drafting` (eagle, eagle3, medusa, small_lm, ...) can be wrapped
  (`DiscoProposer`); trees are drafted by the drafter itself, unchanged.
* disco.json records the drafter the round log names (`rounds.drafter_identity`: checkpoint, kind, target
  fingerprint). `eval --draft-length disco` refuses a classifier trained against another target and warns when it
  stops another drafter checkpoint than the one whose rounds taught it (`check_drafter`).
* Training from a recipe (`recipes/disco_stop.yaml`, `draftlab disco --recipe disco_stop --checkpoint DIR --prompts
  FILE --out OUT`): the rounds are logged first (`log_rounds`: greedy chains of max_length on training prompts,
  OUT/rounds.jsonl, resumable prompt by prompt), then the classifier is fitted; `--rounds LOG` takes rounds an engine
  served instead. `draftlab push DIR --disco OUT` ships the classifier in the export's disco/ folder, its drafter
  named relative to the export's own checkpoint.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from draftlab import drafting
from draftlab.errors import CheckpointError, DataError

FORMAT_VERSION = 1
FEATURES = ("top1", "top2", "entropy", "position")
CONFIG_NAME, WEIGHTS_NAME = "disco.json", "disco.safetensors"


# --- features and examples --------------------------------------------------------------------------------------
def features(stats: Tensor, positions: Tensor) -> Tensor:
    """stats [N, 3] (drafting.draft_stats: top-1, top-2 probability, entropy), positions [N] (1 = first draft token
    of the round) -> [N, 4] raw features in FEATURES order."""
    return torch.cat([stats.float(), positions.float()[:, None]], -1)


def examples_from_rounds(rows) -> tuple[Tensor, Tensor]:
    """Round-log rows -> (features [N, 4], labels [N] in {0, 1}): one example per judged draft node."""
    xs, ys = [], []
    for row in rows:
        if row.draft_stats is None:
            continue
        depths = [0] * len(row.parents)
        for i, p in enumerate(row.parents):
            depths[i] = 1 if p < 0 else depths[p] + 1
        accepted = set(row.accepted)
        for i in row.judged():
            xs.append(row.draft_stats[i] + [depths[i]])
            ys.append(float(i in accepted))
    if not xs:
        raise DataError("the round log has no draft_stats on any judged draft token: log rounds of a model-based "
                        "drafter (draftlab eval --checkpoint ... --log-rounds FILE), not prompt lookup")
    return torch.tensor(xs, dtype=torch.float32), torch.tensor(ys, dtype=torch.float32)


def logged_drafter(rows) -> dict | None:
    """The drafter identity the round-0 rows name (None when the log predates the key); rows of several drafters
    are a DataError."""
    named = {json.dumps(row.drafter, sort_keys=True) for row in rows if row.drafter is not None}
    if len(named) > 1:
        raise DataError(f"the round logs come from {len(named)} different drafters or targets: train one classifier "
                        "per drafter")
    return json.loads(named.pop()) if named else None


def check_drafter(info: dict, identity: dict, where: str) -> str | None:
    """info: a classifier's disco.json; identity: the drafter it is about to stop (`rounds.drafter_identity`).
    Another target is a CheckpointError; another drafter checkpoint gives a warning line to print (None when it is
    the same, or when the classifier records no drafter)."""
    from draftlab.target import check_fingerprint

    logged = info.get("drafter")
    if not logged:
        return None
    check_fingerprint(logged.get("target") or {}, identity["target"], f"--disco {where} (trained from rounds of "
                      f"{logged.get('checkpoint')})", "train a classifier from rounds logged with this target",
                      CheckpointError)
    checkpoint = logged.get("checkpoint")
    if isinstance(checkpoint, str) and checkpoint.startswith("../"):   # shipped in an export beside its drafter
        folder = Path(where).parent if Path(where).name == CONFIG_NAME else Path(where)
        checkpoint = str((folder / checkpoint).resolve())
    if (checkpoint, logged.get("kind")) == (identity["checkpoint"], identity["kind"]):
        return None
    return (f"draftlab: warning: --disco {where} was trained from rounds of {logged.get('kind')} drafter "
            f"{logged.get('checkpoint')}, not of {identity['checkpoint']}: its stops may suit this drafter less well")


# --- the classifier -----------------------------------------------------------------------------------------------
class StopClassifier(nn.Module):
    """A small feed-forward network: standardised features [N, 4] -> logit of "the target accepts this token" [N]."""

    def __init__(self, hidden: int = 32, layers: int = 2):
        super().__init__()
        dims = [len(FEATURES)] + [hidden] * layers
        blocks = []
        for a, b in zip(dims, dims[1:]):
            blocks += [nn.Linear(a, b), nn.SiLU()]
        self.net = nn.Sequential(*blocks, nn.Linear(dims[-1], 1))
        self.register_buffer("mean", torch.zeros(len(FEATURES)))
        self.register_buffer("std", torch.ones(len(FEATURES)))
        self.hidden, self.layers = hidden, layers
        self.info: dict = {}

    def forward(self, x: Tensor) -> Tensor:
        return self.net((x.float() - self.mean) / self.std).squeeze(-1)

    @torch.no_grad()
    def prob(self, x: Tensor) -> Tensor:
        """Raw features [N, 4] -> P(accepted) [N]."""
        return torch.sigmoid(self(x))


def train_classifier(x: Tensor, y: Tensor, *, hidden: int = 32, layers: int = 2, steps: int = 300,
                     lr: float = 1e-2, val_share: float = 0.1, seed: int = 0) -> tuple[StopClassifier, dict]:
    """Fit a StopClassifier on (x [N, 4], y [N]) with full-batch Adam on binary cross-entropy.

    A `val_share` of the examples (at random, at least one when N >= 10) is held out for the validation loss.
    Returns (the classifier, history: {train_loss: [per step], val_loss, val_accuracy, val_brier, examples,
    positive_rate})."""
    from draftlab.losses import acceptance_bce

    if len(x) < 2 or len(torch.unique(y)) < 2:
        raise DataError(f"the round log gives {len(x)} judged draft tokens, all "
                        f"{'accepted' if len(y) and y[0] == 1 else 'rejected'}: log more rounds (more prompts or "
                        "longer chains) so that both outcomes occur")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=g)
    n_val = max(1, int(len(x) * val_share)) if len(x) >= 10 else 0
    val, train = order[:n_val], order[n_val:]
    torch.manual_seed(seed)
    model = StopClassifier(hidden, layers)
    model.mean.copy_(x[train].mean(0))
    model.std.copy_(x[train].std(0).clamp(min=1e-3) if len(train) > 1 else torch.ones(x.shape[1]))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    ones = torch.ones(1, len(train))
    losses = []
    for _ in range(steps):
        loss = acceptance_bce(model(x[train])[None], y[train][None], ones, reject_weight=1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    history = {"train_loss": losses, "examples": len(x), "positive_rate": float(y.mean())}
    if n_val:
        with torch.no_grad():
            z = model(x[val])
            p = torch.sigmoid(z)
            history.update(val_loss=float(acceptance_bce(z[None], y[val][None], torch.ones(1, n_val), 1.0)),
                           val_accuracy=float(((p > 0.5).float() == y[val]).float().mean()),
                           val_brier=float(((p - y[val]) ** 2).mean()), val_examples=n_val)
    model.eval()
    return model, history


def save_classifier(model: StopClassifier, folder: str | Path, info: dict) -> Path:
    """Write disco.safetensors + disco.json into `folder` (created)."""
    from draftlab.runlock import atomic_path, write_atomic

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / WEIGHTS_NAME) as tmp:      # each file whole or not at all; disco.json last
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
    write_atomic(folder / CONFIG_NAME, json.dumps({"format": "draftlab.disco", "version": FORMAT_VERSION,
                                                   "features": list(FEATURES), "hidden": model.hidden,
                                                   "layers": model.layers, **info}, indent=2))
    return folder


def load_classifier(path: str | Path) -> StopClassifier:
    """A saved classifier (its folder, or the disco.json in it); a missing or foreign file is a CheckpointError."""
    path = Path(path)
    folder = path.parent if path.name == CONFIG_NAME else path
    config_file = folder / CONFIG_NAME
    if not config_file.is_file() or not (folder / WEIGHTS_NAME).is_file():
        raise CheckpointError(f"--disco {path}: no {CONFIG_NAME} and {WEIGHTS_NAME} there: train one with "
                              f"draftlab disco --rounds LOG --out {path}")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"--disco {path}: {config_file} is not JSON ({e.msg})") from None
    if config.get("format") != "draftlab.disco" or config.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"--disco {path}: {config_file} is format {config.get('format')!r} version "
                              f"{config.get('version')!r}; this draftlab reads draftlab.disco version {FORMAT_VERSION}: "
                              "train it again with draftlab disco")
    if config.get("features") != list(FEATURES):
        raise CheckpointError(f"--disco {path}: trained on features {config.get('features')}, this draftlab computes "
                              f"{list(FEATURES)}: train it again with draftlab disco")
    try:
        model = StopClassifier(int(config["hidden"]), int(config["layers"]))
        model.load_state_dict(load_file(str(folder / WEIGHTS_NAME)))
    except Exception as e:  # noqa: BLE001 (a damaged or cut-off file, or one of other shapes: whatever it trips on)
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise CheckpointError(f"--disco {path}: {folder / WEIGHTS_NAME} cannot be loaded as this classifier "
                              f"({reason}): train it again with draftlab disco") from None
    model.info, model.folder = config, folder
    return model.eval()


# --- the decision rule --------------------------------------------------------------------------------------------
@dataclass
class RoundCosts:
    """Seconds of a round of k draft tokens: draft[k] + verify[k + 1] + overhead (costs.auto_draft_length measures
    them on this machine)."""

    draft: dict[int, float]
    verify: dict[int, float]
    overhead: float = 0.0

    def seconds(self, k: int) -> float:
        return self.draft[k] + self.verify[k + 1] + self.overhead

    @property
    def max_length(self) -> int:
        return max(k for k in self.draft if k + 1 in self.verify)


@dataclass
class StopRule:
    """Keep drafting while a longer chain is expected to give more tokens per second (module docstring)."""

    costs: RoundCosts
    max_length: int
    decisions: list[int] = field(default_factory=list)

    def keep_drafting(self, p: list[float]) -> bool:
        """p: predicted conditional acceptance of tokens 1..i+1, where i = len(p) - 1 tokens are drafted and token
        i+1 is the candidate. True = draft it."""
        drafted = len(p) - 1
        if drafted >= self.max_length:
            return False
        reach, expected = 1.0, 1.0
        for value in p[:drafted]:
            reach *= value
            expected += reach
        now = expected / self.costs.seconds(drafted)
        for k in range(drafted + 1, self.max_length + 1):
            reach *= p[-1]
            expected += reach
            if expected / self.costs.seconds(k) > now:
                return True
        return False

    def length(self, p: list[float]) -> int:
        """The chain length the rule reaches when token i's predicted acceptance is p[i-1] (p as long as
        max_length): what DiscoProposer does in a round, without a drafter (for tests and tables)."""
        drafted = 1
        while drafted < self.max_length and self.keep_drafting(p[:drafted + 1]):
            drafted += 1
        return drafted


def best_fixed_length(p: float, costs: RoundCosts, max_length: int) -> int:
    """Brute force: the chain length k in 1..max_length with the most expected tokens per second when every draft
    token is accepted with probability p (given the ones before it); ties go to the shorter chain."""
    rates = [(1 + sum(p ** i for i in range(1, k + 1))) / costs.seconds(k) for k in range(1, max_length + 1)]
    return max(range(1, max_length + 1), key=lambda k: (rates[k - 1], -k))


# --- the proposer -------------------------------------------------------------------------------------------------
class DiscoProposer:
    """A chain drafter's proposer (`inner`: root / step / to_target / expand, as `drafting` needs) whose chains stop
    when the StopRule says another token no longer pays. Trees go to the inner proposer unchanged.

    After a propose(), `predicted_acceptance` lists the classifier's p per draft node (the evaluator pairs them
    with the verdicts: the report's calibration); `adaptive` describes the rule for the report."""

    def __init__(self, inner, classifier: StopClassifier, rule: StopRule, label: str = ""):
        self.inner, self.classifier, self.rule, self.label = inner, classifier, rule, label
        self.feature_layers = tuple(inner.feature_layers)
        self.max_depth = getattr(inner, "max_depth", None)
        self.predicted_acceptance: list[float] | None = None
        self._seen: list[Tensor] = []          # this round's draft logits: the root's, then one per fed node
        self._p: list[float] = []              # the classifier's p for the first len(_p) of them

    @property
    def adaptive(self) -> dict:
        return {"rule": "disco", "max_length": self.rule.max_length, "classifier": self.label,
                "description": f"DISCO classifier, measured costs, <= {self.rule.max_length}"}

    def reset(self, prompt_ids: Tensor) -> None:
        self.inner.reset(prompt_ids)

    def commit(self, tokens: Tensor, features: Tensor | None) -> None:
        self.inner.commit(tokens, features)

    # the Steps protocol, passed through; every distribution a chain token is drafted from is kept for the classifier
    def root(self) -> Tensor:
        logits = self.inner.root()
        self._seen, self._p = [logits], []
        return logits

    def step(self, nodes: list[int], tree) -> Tensor:
        logits = self.inner.step(nodes, tree)
        self._seen.append(logits[-1])
        return logits

    def to_target(self, index: Tensor) -> Tensor:
        return self.inner.to_target(index)

    def expand(self, logits: Tensor) -> Tensor:
        return self.inner.expand(logits)

    def _predict(self, upto: int) -> list[float]:
        """The classifier's p for draft tokens 1..upto (from the distributions seen so far)."""
        done = len(self._p)
        if upto > done:
            stats = drafting.draft_stats(torch.stack(self._seen[done:upto]))
            self._p += self.classifier.prob(features(stats.cpu(), torch.arange(done + 1, upto + 1))).tolist()
        return self._p[:upto]

    @torch.inference_mode()
    def propose(self, spec, sampling, generator: torch.Generator | None = None):
        self.predicted_acceptance = None
        if spec.kind != "chain":
            return self.inner.propose(spec, sampling, generator)
        length = min(spec.draft_length, self.rule.max_length)
        tree = drafting.chain(self, length, sampling, generator,
                              lambda i: not self.rule.keep_drafting(self._predict(i + 1)))
        self.predicted_acceptance = self._predict(len(tree)) if len(tree) else []
        return tree


def wrap(proposer, classifier: StopClassifier, costs: RoundCosts, max_length: int, label: str = "") -> DiscoProposer:
    """DISCO stopping around a drafter's proposer; one that does not draft through `drafting` is a CheckpointError."""
    if not all(hasattr(proposer, name) for name in ("root", "step", "to_target", "expand")):
        raise CheckpointError(f"--draft-length disco needs a drafter that drafts token by token (eagle, eagle3, "
                              f"medusa, small_lm); {type(proposer).__name__} does not")
    return DiscoProposer(proposer, classifier, StopRule(costs, min(max_length, costs.max_length)), label)


ROUNDS_NAME, PROGRESS_NAME = "rounds.jsonl", "rounds.progress.json"


def log_rounds(args, out: Path) -> Path:
    """`draftlab disco --checkpoint`: greedy chains of --max-length drafted on the first --num-prompts of --prompts,
    logged to OUT/rounds.jsonl. OUT/rounds.progress.json records the settings and the prompts whose rounds are
    whole; a rerun drops a cut-off prompt's rows and continues after the last whole one (more --num-prompts
    extends the log)."""
    from tqdm import tqdm

    from draftlab.checkpoint import checkpoint_target, resolve_checkpoint, write_text_atomic
    from draftlab.data import encode_prompt, load_prompts
    from draftlab.drafters import load_drafter
    from draftlab.errors import ConfigError
    from draftlab.evaluator import prompt_generator, speculative_generate
    from draftlab.rounds import RoundLog, drafter_identity
    from draftlab.target import eos_ids, load_target
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    folder = resolve_checkpoint(args.checkpoint)
    log_file, progress_file = out / ROUNDS_NAME, out / PROGRESS_NAME
    settings = {"checkpoint": str(folder.resolve()), "prompts": str(Path(args.prompts).resolve()),
                "max_length": args.max_length, "max_new_tokens": args.max_new_tokens, "target": args.target}
    done, rows = 0, 0
    if progress_file.is_file():
        progress = json.loads(progress_file.read_text())
        logged = progress["settings"]
        changed = [k for k, v in settings.items() if logged.get(k) != v]
        if changed:
            was = ", ".join(f"{k}={logged.get(k)}" for k in changed)
            raise ConfigError(f"--out {out} holds rounds logged with another {', '.join(changed)} ({was}): give a "
                              "new --out")
        done, rows = progress["done"], progress["rows"]
        lines = log_file.read_text().splitlines(keepends=True) if log_file.is_file() else []
        if len(lines) < rows:
            raise DataError(f"{log_file} holds {len(lines)} rows, {progress_file} says {rows}: give a new --out")
        if len(lines) > rows:                 # rows of a prompt cut off by a stop: logged again below
            write_text_atomic(log_file, "".join(lines[:rows]))
    elif out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty and holds no DISCO rounds ({PROGRESS_NAME}): give a new folder")
    prompts = load_prompts(args.prompts, limit=args.num_prompts)
    if done >= len(prompts):
        print(f"rounds: {rows} rows of {done} prompts already in {log_file}", flush=True)
        return log_file
    target, tokenizer = load_target(args.target or checkpoint_target(folder), "auto", "auto")
    drafter = load_drafter(folder, target).eval()
    proposer = drafter.proposer(target)
    spec, eos = TreeSpec(kind="chain", draft_length=args.max_length), eos_ids(tokenizer, target)
    out.mkdir(parents=True, exist_ok=True)
    with RoundLog(log_file, append=done > 0, drafter=drafter_identity(str(folder.resolve()), drafter.kind,
                                                                      target)) as log:
        log.rows = rows
        for i in tqdm(range(done, len(prompts)), initial=done, total=len(prompts), desc="logging rounds",
                      dynamic_ncols=True):
            ids = encode_prompt(tokenizer, prompts[i].messages)
            speculative_generate(target, proposer, ids, spec, Sampling(), args.max_new_tokens, eos,
                                 prompt_generator(target.device, 0, i), log.for_prompt(i, ids))
            write_text_atomic(progress_file, json.dumps({"settings": settings, "done": i + 1, "rows": log.rows}))
    print(f"rounds: {log.rows} rows of {len(prompts)} prompts in {log_file}", flush=True)
    return log_file


def cmd_disco(argv: list[str]) -> None:
    """`draftlab disco --rounds LOG --out DIR` (or `--checkpoint DIR --prompts FILE`): train the stop classifier."""
    from draftlab.config import parse_command_args
    from draftlab.errors import OneLineParser

    p = OneLineParser(prog="draftlab disco", description="Train DISCO's stop classifier from a round log "
                      "(draftlab eval --log-rounds), or log one first from a checkpoint; use it with draftlab eval "
                      "--draft-length disco --disco DIR.")
    p.add_argument("--recipe", help="recipes/NAME.yaml with `command: disco` (e.g. disco_stop) or a YAML file: "
                   "option values; options given here win")
    p.add_argument("--rounds", nargs="+", help="round log(s) of the drafter DISCO will stop")
    p.add_argument("--checkpoint", help="instead of --rounds: the drafter DISCO will stop; its greedy chains on "
                   f"--prompts are logged to OUT/{ROUNDS_NAME} first (a rerun continues them)")
    p.add_argument("--prompts", help="with --checkpoint: JSONL prompts to draft on (training prompts, none you score)")
    p.add_argument("--num-prompts", type=int, default=32, help="with --checkpoint: how many of --prompts (default 32)")
    p.add_argument("--max-length", type=int, default=8, help="with --checkpoint: chain length drafted (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="with --checkpoint: tokens per answer (default 64)")
    p.add_argument("--target", help="with --checkpoint: target model (default: the checkpoint's)")
    p.add_argument("--out", help="folder for disco.json + disco.safetensors (and the logged rounds)")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    args = parse_command_args(p, argv, "disco", required=("out",))
    if bool(args.rounds) == bool(args.checkpoint):
        p.error("give --rounds LOG [LOG ...], or --checkpoint DIR with --prompts FILE to log the rounds first")
    if args.checkpoint and not args.prompts:
        p.error("--checkpoint needs --prompts FILE (training prompts to draft on)")
    for name in ("hidden", "layers", "steps", "num_prompts", "max_length", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise DataError(f"--{name.replace('_', '-')} {getattr(args, name)}: give at least 1")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise DataError(f"--lr {args.lr}: give a learning rate above 0, e.g. --lr 0.01")
    if not 0 <= args.seed <= 2**32 - 1:
        raise DataError(f"--seed {args.seed}: give a seed in [0, 4294967295]")
    from draftlab.runlock import check_output, claim_outputs

    inputs = [("--rounds", r) for r in args.rounds or []] + [
        (option, getattr(args, name)) for option, name in (("--checkpoint", "checkpoint"), ("--prompts", "prompts"),
                                                           ("--target", "target"), ("--recipe", "recipe"))]
    check_output("--out", args.out, folder=True, inputs=inputs, example="disco_out")
    for path in args.rounds or []:
        if Path(path).is_dir():
            raise DataError(f"--rounds {path} is a folder: pass a round log (draftlab eval --log-rounds FILE)")
    with claim_outputs([("--out", args.out)]):
        train_and_save(args)


def train_and_save(args) -> None:
    """`draftlab disco` once its options and --out are checked and --out is locked."""
    from draftlab.rounds import read_rounds

    rounds = args.rounds or [str(log_rounds(args, Path(args.out)))]
    rows = [row for path in rounds for row in read_rounds(path)]
    x, y = examples_from_rounds(rows)
    drafter = logged_drafter(rows)
    model, history = train_classifier(x, y, hidden=args.hidden, layers=args.layers, steps=args.steps, lr=args.lr,
                                      seed=args.seed)
    losses = history.pop("train_loss")
    info = {"rounds": [str(r) for r in rounds], "round_rows": len(rows), "drafter": drafter,
            "recipe": args.recipe, "train_loss_first": losses[0], "train_loss_last": losses[-1], **history}
    save_classifier(model, args.out, info)
    val = f", validation loss {history['val_loss']:.3f}, accuracy {history['val_accuracy']:.3f}" \
        if "val_loss" in history else ""
    print(f"DISCO classifier: {history['examples']} judged draft tokens from {len(rows)} rounds (accepted "
          f"{history['positive_rate']:.3f}); loss {losses[0]:.3f} -> {losses[-1]:.3f}{val}; saved to {args.out}")
    if not math.isfinite(losses[-1]):
        raise DataError("the classifier's loss is not finite: lower --lr")
