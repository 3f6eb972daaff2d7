"""The family matrix: every drafter kind on tiny random targets of the model families users serve (tests/families.py).

Each cell (family x kind, ids like `gemma3-eagle3`) trains the kind's shipped recipe for a few steps on that family's
target (`train.main`, in-loop evaluation off), once, and the cell's tests share that run:
  - resume: 2 steps, stop, `train.resume=auto` to 4 ends with exactly the weights of the 4 steps straight;
  - greedy: speculative decoding with the trained drafter (a chain, and the recipe's tree) emits exactly the
    target-only greedy tokens, with 1 <= tau <= depth + 1;
  - sampled: seeded sampling emits valid tokens, the same twice; with top_k=1 the target's distribution is a point
    mass, so lossless rejection sampling must emit exactly the greedy tokens;
  - export: the kind's serving format (what `draftlab push RUN --to DIR` writes) loads back in that format's own
    reader where this environment has it (eagle-llm, speculators, medusa-llm, transformers; draftlab's foreign
    importer otherwise) and its tensors / logits are the checkpoint's.
The hybrid family (recurrent linear-attention layers) must be refused by `draftlab train` before training: a
recurrent state cannot be rolled back to the accepted prefix after a rejected draft.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import chat_prompt
from draftlab.checkpoint import WEIGHTS_NAME, load_trainer_state, trainable_state_dict
from draftlab.config import load_config
from draftlab.drafters import DRAFTERS, load_drafter
from families import DENSE_OR_MOE, HYBRID, save_family

# kind -> (shipped recipe, overrides that shrink it to a few CPU seconds); common settings in `train_args`
RECIPES = {
    "eagle": ("eagle_head", []),
    "eagle3": ("eagle3_head", ["drafter.ttt_steps=2", "train.pack_tokens=256"]),   # packed rows, as shipped
    "gumiho": ("gumiho_heads", ["drafter.serial_layers=1", "drafter.mlp_heads=2", "drafter.mlp_layers=1"]),
    "medusa": ("medusa_heads", ["drafter.medusa_heads=3", "drafter.medusa_tree_nodes=16"]),
    "medusa2": ("medusa2_lora", ["drafter.medusa_heads=3", "drafter.medusa_tree_nodes=16", "drafter.lora_r=4"]),
    "small_lm": ("distill_offline_blackbox", ["data.regenerate_from=''", "drafter.num_layers=1"]),
    "acceptance": ("acceptance_head", ["drafter.acceptance_layers=1"]),     # drafter.base: the family's small_lm run
    "dflash": ("dflash_head", ["drafter.num_layers=1", "drafter.block_size=4", "drafter.num_anchors=16",
                               "train.pack_tokens=0"]),
}
KINDS = list(RECIPES)
STEPS = 4
DRAFT_LENGTH = 3
MAX_NEW_TOKENS = 10
PROMPTS = ["The quick brown fox", "def add(a, b):"]
CELLS = [pytest.param(family, kind, id=f"{family}-{kind}") for family in DENSE_OR_MOE for kind in KINDS]


def train_args(target_dir: str, data: str, prompts: str, out: Path, kind: str, steps: int, *extra: str) -> list[str]:
    recipe, own = RECIPES[kind]
    return [f"recipe={recipe}", f"target.path={target_dir}", f"data.train={data}", f"data.eval_prompts={prompts}",
            f"out_dir={out}", f"train.max_steps={steps}", "train.save_every=2", "train.batch_size=2",
            "train.grad_accum=1", "train.warmup_steps=0", "train.schedule=constant", "train.lr=1e-3",
            "train.keep_last=0", "train.num_threads=1", "data.max_length=96", "tracking=none", "eval.every=0",
            "eval.num_prompts=2", "eval.max_new_tokens=8", f"eval.draft_length={DRAFT_LENGTH}", "eval.depth=3",
            "eval.top_k=3", "eval.total_tokens=8", *own, *extra]


@pytest.fixture(autouse=True)
def keep_thread_count():
    """train.num_threads=1 (deterministic CPU kernels in every run) must not leak into other tests."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@dataclass
class Cell:
    family: str
    kind: str
    target_dir: str
    out: Path             # the run folder: STEPS steps straight, step_2 and step_4 saved
    args: list[str]       # its train arguments (without out_dir / max_steps changes)

    def specs(self):
        """The chain and, when the recipe evaluates another shape, the recipe's tree (as train.py builds it)."""
        from draftlab.trees import TreeSpec

        e = load_config(self.args).eval
        specs = [TreeSpec(kind="chain", draft_length=DRAFT_LENGTH)]
        if e.tree != "chain":
            specs.append(TreeSpec(kind=e.tree, draft_length=e.draft_length, depth=e.depth, top_k=e.top_k,
                                  total_tokens=e.total_tokens))
        return specs


class Matrix:
    """Family folders and trained runs, each made once per session; a failure is kept and raised again for every
    test of that cell, so one broken training does not cost its four tests four trainings."""

    def __init__(self, tokenizer, data: str, prompts: str, root: Path):
        self.tokenizer, self.data, self.prompts, self.root = tokenizer, data, prompts, root
        self.dirs: dict[str, str] = {}
        self.cells: dict[tuple[str, str], Cell | BaseException] = {}

    def target_dir(self, family: str) -> str:
        if family not in self.dirs:
            save_family(family, self.tokenizer, self.root / "targets" / family)
            self.dirs[family] = str(self.root / "targets" / family)
        return self.dirs[family]

    def args(self, family: str, kind: str, out: Path, steps: int, *extra: str) -> list[str]:
        if kind == "acceptance":
            extra = (f"drafter.base={self.cell(family, 'small_lm').out}", *extra)
        return train_args(self.target_dir(family), self.data, self.prompts, out, kind, steps, *extra)

    def cell(self, family: str, kind: str) -> Cell:
        from draftlab.train import main

        key = (family, kind)
        if key not in self.cells:
            try:
                out = self.root / "runs" / f"{family}-{kind}"
                args = self.args(family, kind, out, STEPS)
                main(load_config(args))
                self.cells[key] = Cell(family, kind, self.target_dir(family), out, args)
            except BaseException as e:        # noqa: BLE001 - kept, raised again for each test of the cell
                if kind == "acceptance" and (family, "small_lm") in self.cells and isinstance(
                        self.cells[(family, "small_lm")], BaseException):
                    e = RuntimeError(f"the acceptance head's base, the {family} small_lm run, failed: {e!r}")
                self.cells[key] = e
        found = self.cells[key]
        if isinstance(found, BaseException):
            raise found
        return found


@pytest.fixture(scope="session")
def matrix(tiny_tokenizer, tiny_chat_file, tiny_prompt_file, tmp_path_factory):
    return Matrix(tiny_tokenizer, tiny_chat_file, tiny_prompt_file, tmp_path_factory.mktemp("families"))


def fresh_target(cell: Cell):
    """The family's target loaded as draftlab loads it (a new copy: Medusa-2 adapts the target it is loaded on)."""
    from draftlab.target import load_target

    return load_target(cell.target_dir)


def same_tensors(ours: dict, theirs: dict, what: str) -> None:
    assert ours.keys() == theirs.keys(), f"{what}: {sorted(ours.keys() ^ theirs.keys())}"
    for k in ours:
        assert ours[k].shape == theirs[k].shape and torch.equal(ours[k], theirs[k]), f"{what}: {k} differs"


def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def client(module: str, why: str):
    return pytest.importorskip(module, reason=f"{why} is not installed (`bash .ci/run` installs it)",
                               exc_type=ImportError)


# ----------------------------------------------------------------------------------------------------------
# the matrix


def test_every_kind_is_in_the_matrix():
    assert set(RECIPES) == set(DRAFTERS), "a drafter kind without a recipe here is not covered by the matrix"


@pytest.mark.parametrize("family, kind", CELLS)
def test_resume_is_bit_identical(matrix, family, kind, tmp_path):
    from draftlab.train import main

    cell = matrix.cell(family, kind)
    split = tmp_path / "split"
    main(load_config(matrix.args(family, kind, split, STEPS // 2)))
    main(load_config(matrix.args(family, kind, split, STEPS, "train.resume=auto")))
    final = f"step_{STEPS}"
    same_tensors(load_file(str(split / final / WEIGHTS_NAME)), load_file(str(cell.out / final / WEIGHTS_NAME)),
                 "resumed vs straight weights")
    a, b = load_trainer_state(split / final), load_trainer_state(cell.out / final)
    assert a["micro_step"] == b["micro_step"]
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


def reference_greedy(target, prompt: torch.Tensor, eos) -> list[int]:
    """Target-only greedy tokens recomputed from scratch at every step (no KV cache): transformers' own masks,
    sliding windows included, independent of the caches draftlab decodes with."""
    ids, out = prompt[None], []
    with torch.no_grad():
        for _ in range(MAX_NEW_TOKENS):
            token = int(target(ids).logits[0, -1].argmax())
            out.append(token)
            if token in eos:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], 1)
    return out


@pytest.mark.parametrize("family, kind", CELLS)
def test_greedy_speculation_is_lossless(matrix, family, kind):
    from draftlab.evaluator import speculative_generate, target_generate
    from draftlab.target import eos_ids
    from draftlab.verify import Sampling

    cell = matrix.cell(family, kind)
    target, tok = fresh_target(cell)
    drafter = load_drafter(cell.out, target).eval()       # Medusa-2: the target is now the adapted one it serves
    eos = eos_ids(tok, target)
    prompts = [chat_prompt(tok, text) for text in PROMPTS]
    plain = [reference_greedy(target, p, set(eos)) for p in prompts]
    for i, prompt in enumerate(prompts):
        assert target_generate(target, prompt, MAX_NEW_TOKENS, eos).tokens == plain[i], \
            f"prompt {i}: draftlab's target-only decoding is not the target's greedy output"
    for spec in cell.specs():
        proposer = drafter.proposer(target)
        for i, prompt in enumerate(prompts):
            result = speculative_generate(target, proposer, prompt, spec, Sampling(), MAX_NEW_TOKENS, eos)
            assert result.tokens == plain[i], f"{spec.kind} tree, prompt {i}: not the target's greedy output"
            if result.rounds:
                assert 1 <= result.new_tokens / result.rounds <= spec.max_depth + 1, spec.kind


@pytest.mark.parametrize("family, kind", CELLS)
def test_sampled_speculation_emits_valid_tokens_and_is_lossless_at_top_k_1(matrix, family, kind):
    from draftlab.evaluator import speculative_generate
    from draftlab.target import eos_ids
    from draftlab.verify import Sampling

    cell = matrix.cell(family, kind)
    target, tok = fresh_target(cell)
    drafter = load_drafter(cell.out, target).eval()
    eos = set(eos_ids(tok, target))
    vocab = target.get_output_embeddings().weight.shape[0]
    prompts = [chat_prompt(tok, text) for text in PROMPTS]
    greedy = [reference_greedy(target, p, eos) for p in prompts]
    for spec in cell.specs():
        proposer = drafter.proposer(target)
        for i, prompt in enumerate(prompts):
            def run(sampling, seed=i):
                return speculative_generate(target, proposer, prompt, spec, sampling, MAX_NEW_TOKENS, list(eos),
                                            generator=torch.Generator().manual_seed(seed))

            first, again = run(Sampling(temperature=1.0, top_p=0.9)), run(Sampling(temperature=1.0, top_p=0.9))
            assert first.tokens == again.tokens, f"{spec.kind}: the same seed drew different tokens"
            assert all(0 <= t < vocab for t in first.tokens), spec.kind
            assert len(first.tokens) == MAX_NEW_TOKENS or first.tokens[-1] in eos, spec.kind
            assert all(0 <= a <= spec.max_depth for a in first.accepted), spec.kind
            # top_k=1: the target's processed distribution is a point mass on its argmax, so exact rejection
            # sampling emits the greedy tokens whatever the draft proposes
            point = run(Sampling(temperature=1.0, top_k=1))
            assert point.tokens == greedy[i], f"{spec.kind} tree, prompt {i}: sampling at top_k=1 is not greedy"


@pytest.mark.parametrize("family, kind", CELLS)
def test_export_loads_in_its_serving_format(matrix, family, kind, tmp_path):
    from draftlab import hub

    cell = matrix.cell(family, kind)
    export = hub.export_checkpoint(cell.out, tmp_path / "export")       # what `draftlab push RUN --to DIR` does
    meta = json.loads((export / hub.MARKER).read_text())
    assert meta["kind"] == kind and meta["format"] == DRAFTERS[kind].export_format
    assert (export / "README.md").is_file()
    # the export is a draftlab checkpoint too (through `best`): the same trained tensors
    target, _ = fresh_target(cell)
    reference = trainable_state_dict(load_drafter(cell.out, target))
    again, _ = fresh_target(cell)
    same_tensors(trainable_state_dict(load_drafter(export, again)), reference, "export's draftlab checkpoint")
    READERS[kind](cell, export, tmp_path)


# ----------------------------------------------------------------------------------------------------------
# the serving formats' own readers


def native_copy(export: Path, dest: Path, names: tuple[str, ...]) -> Path:
    """Only the serving-format files of an export (no draftlab/ checkpoint, no `best`): a foreign folder."""
    dest.mkdir()
    for name in names:
        shutil.copy2(export / name, dest / name)
    return dest


def foreign_round_trip(cell: Cell, export: Path, tmp_path: Path, names: tuple[str, ...], fmt: str) -> None:
    """draftlab's importer of the format reads the serving files alone back into the checkpoint's tensors."""
    from draftlab.foreign import find_foreign

    found = find_foreign(str(native_copy(export, tmp_path / "foreign", names)))
    assert found is not None and found.kind == fmt
    target, _ = fresh_target(cell)
    reference = trainable_state_dict(load_drafter(cell.out, target))
    loaded = trainable_state_dict(found.load(fresh_target(cell)[0]))
    same_tensors({k: loaded[k] for k in reference if k in loaded}, reference, f"{fmt} import")


def every_trained_tensor_is_exported(cell: Cell, weights: dict) -> None:
    """Each tensor the checkpoint trained appears unchanged in the export's weights (under the format's names)."""
    exported = list(weights.values())
    for name, tensor in load_file(str(cell.out / f"step_{STEPS}" / WEIGHTS_NAME)).items():
        assert any(t.shape == tensor.shape and torch.equal(t, tensor) for t in exported), f"{name} is not exported"


def read_eagle(cell: Cell, export: Path, tmp_path: Path) -> None:
    """The official EAGLE-1/2 layout in the reference head (eagle-llm), every tensor by name."""
    client("eagle.model.cnets", "eagle-llm 1.2.1")
    from types import SimpleNamespace

    from eagle.model.cnets import Model

    config = json.loads((export / "config.json").read_text())
    weights = load_file(str(export / "model.safetensors"))
    theirs = Model(SimpleNamespace(**config), bias=config["bias"])
    theirs.load_state_dict(weights, strict=True)
    every_trained_tensor_is_exported(cell, weights)
    foreign_round_trip(cell, export, tmp_path, ("config.json", "model.safetensors"), "eagle")


def read_eagle3(cell: Cell, export: Path, tmp_path: Path) -> None:
    """speculators' Eagle3DraftModel.from_pretrained (which reads the verifier too) holds the exported tensors."""
    client("speculators.models.eagle3", "speculators 0.9.0")
    from speculators.models.eagle3 import Eagle3DraftModel

    theirs = Eagle3DraftModel.from_pretrained(str(export)).state_dict()
    weights = load_file(str(export / "model.safetensors"))
    assert set(weights) <= set(theirs), sorted(set(weights) - set(theirs))
    for name, tensor in weights.items():
        assert torch.equal(theirs[name].to(tensor.dtype), tensor), name
    foreign_round_trip(cell, export, tmp_path, ("config.json", "model.safetensors"), "speculators")


def read_gumiho(cell: Cell, export: Path, tmp_path: Path) -> None:
    """No Gumiho reader is packaged: the official layout's config and weights hold the trained tensors."""
    config = json.loads((export / "config.json").read_text())
    assert config["hidden_size"] == fresh_target(cell)[0].config.get_text_config().hidden_size
    weights = load_file(str(export / "model.safetensors"))
    assert set(torch.load(export / "pytorch_model.bin", weights_only=True)) == set(weights)
    every_trained_tensor_is_exported(cell, weights)


def medusa_heads_in_medusa_code(export: Path, base_model) -> torch.nn.ModuleList:
    """Medusa's own MedusaModel over `base_model`, with its heads loaded from medusa_lm_head.pt (strictly: Medusa's
    strict=False load would leave a misnamed head at its initial value)."""
    medusa_model = client("medusa.model.medusa_model", "medusa-llm 0.1")
    config = medusa_model.MedusaConfig.from_pretrained(str(export))
    model = medusa_model.MedusaModel(base_model, config.medusa_num_heads, config.medusa_num_layers,
                                     config.base_model_name_or_path)
    model.medusa_head.load_state_dict(torch.load(export / "medusa_lm_head.pt", weights_only=True), strict=True)
    return model.medusa_head.eval()


def head_logits_agree(drafter, heads: torch.nn.ModuleList, target, tok) -> None:
    ids = chat_prompt(tok, PROMPTS[0])[None]
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]
        close(drafter.head_logits(hidden), torch.stack([head(hidden) for head in heads]))


def read_medusa(cell: Cell, export: Path, tmp_path: Path) -> None:
    target, tok = fresh_target(cell)
    drafter = load_drafter(cell.out, target).eval()
    head_logits_agree(drafter, medusa_heads_in_medusa_code(export, target), target, tok)
    foreign_round_trip(cell, export, tmp_path, ("config.json", "medusa_lm_head.pt", "medusa_choices.json"), "medusa")


def read_medusa2(cell: Cell, export: Path, tmp_path: Path) -> None:
    """The merged (adapted) target in transformers computes what draftlab's adapted target computes; its heads load
    in Medusa's code."""
    from transformers import AutoModelForCausalLM

    adapted, tok = fresh_target(cell)
    drafter = load_drafter(cell.out, adapted).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(export)).eval()
    ids = chat_prompt(tok, PROMPTS[0])[None]
    with torch.no_grad():
        close(merged(ids).logits, adapted(ids).logits)
    if (export / "medusa_lm_head.pt").is_file():
        rope = (merged.config.get_text_config().rope_parameters or {}).get("rope_type", "default")
        if rope not in ("default", "linear", "dynamic"):
            # medusa-llm 0.1 serves Llama and Mistral bases only; its MedusaConfig cannot even read a config.json
            # with another rope scaling under transformers 5 (gpt-oss: yarn). The merged target was checked above.
            pytest.skip(f"medusa-llm 0.1 cannot read a {rope}-rope base config ({merged.config.model_type})")
        head_logits_agree(drafter, medusa_heads_in_medusa_code(export, merged), adapted, tok)


def read_small_lm(cell: Cell, export: Path, tmp_path: Path) -> None:
    """A transformers folder (`assistant_model`): the same tokenizer, the drafter's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target, tok = fresh_target(cell)
    drafter = load_drafter(cell.out, target).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(export)).eval()
    theirs = AutoTokenizer.from_pretrained(str(export))
    assert [theirs(t)["input_ids"] for t in PROMPTS] == [tok(t)["input_ids"] for t in PROMPTS]
    ids = chat_prompt(tok, PROMPTS[0])[None]
    with torch.no_grad():
        close(draft(ids).logits, drafter(ids))


def read_acceptance(cell: Cell, export: Path, tmp_path: Path) -> None:
    """The base drafter as a transformers folder (its logits), the head's tensors in acceptance_head/."""
    from transformers import AutoModelForCausalLM

    target, tok = fresh_target(cell)
    head = load_drafter(cell.out, target).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(export)).eval()
    ids = chat_prompt(tok, PROMPTS[0])[None]
    with torch.no_grad():
        close(draft(ids).logits, head.base(ids))
    same_tensors(load_file(str(export / "acceptance_head" / "model.safetensors")),
                 load_file(str(cell.out / f"step_{STEPS}" / WEIGHTS_NAME)), "acceptance_head/")


def read_dflash(cell: Cell, export: Path, tmp_path: Path) -> None:
    """The DFlashDraftModel folder (no reference reader is packaged): draftlab's importer of it."""
    weights = load_file(str(export / "model.safetensors"))
    every_trained_tensor_is_exported(cell, weights)
    foreign_round_trip(cell, export, tmp_path, ("config.json", "model.safetensors"), "dflash")


READERS = {"eagle": read_eagle, "eagle3": read_eagle3, "gumiho": read_gumiho, "medusa": read_medusa,
           "medusa2": read_medusa2, "small_lm": read_small_lm, "acceptance": read_acceptance, "dflash": read_dflash}


# ----------------------------------------------------------------------------------------------------------
# the hybrid family: refused


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "acceptance"])   # acceptance needs a small_lm base run
def test_hybrid_linear_attention_target_is_refused_before_training(matrix, kind, tmp_path, capsys):
    """A target with recurrent (linear-attention) layers cannot have its state rolled back to the accepted prefix
    after a rejected draft: `draftlab train` says so in one line, exit code 2, before any step is trained."""
    from draftlab.cli import main

    capsys.readouterr()
    out = tmp_path / "run"
    code = main(["train", *matrix.args(HYBRID, kind, out, 1)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("draftlab: error")]
    assert code == 2 and len(lines) == 1, f"exit {code}, stderr: {err[-2000:]}"
    target_dir = matrix.target_dir(HYBRID)
    model_type = json.loads((Path(target_dir) / "config.json").read_text())["model_type"]
    assert target_dir in lines[0] or model_type in lines[0], f"the refusal does not name the target: {lines[0]}"
    assert not list(out.glob("step_*")), "refused after training had started"
