"""DISCO's stop classifier: the decision rule against brute force on toy cost tables, training, save/load, lossless
decoding with `--draft-length disco`, and bad input as one line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from draftlab import disco
from draftlab.errors import CheckpointError, DataError
from draftlab.evaluator import evaluate, speculative_generate, target_generate
from draftlab.proposers import CausalLMProposer
from draftlab.rounds import RoundLog, drafter_identity, read_rounds
from draftlab.trees import TreeSpec
from draftlab.verify import Sampling


# draft[k], verify[n] in ms: a CPU (verification grows with n), a GPU (flat, then a step), and an uneven table
COST_TABLES = {
    "cpu": ({k: 4.0 * k for k in range(1, 9)}, {n: 60 + 9 * (n - 1) for n in range(1, 10)}),
    "gpu": ({k: 1.0 * k for k in range(1, 9)}, {n: 20 if n <= 5 else 31 for n in range(1, 10)}),
    "uneven": ({k: 2.0 * k + (3 if k % 3 == 0 else 0) for k in range(1, 9)},
               {n: 30 + (12 if n in (4, 7) else 0) + 2 * n for n in range(1, 10)}),
}


@pytest.mark.parametrize("table", list(COST_TABLES))
@pytest.mark.parametrize("overhead", [0.0, 15.0])
def test_the_rule_picks_the_brute_force_best_length(table, overhead):
    draft, verify = COST_TABLES[table]
    costs = disco.RoundCosts(draft, verify, overhead)
    chosen = set()
    for max_length in (1, 4, 8):
        rule = disco.StopRule(costs, max_length)
        for p in [i / 40 for i in range(1, 40)]:
            best = disco.best_fixed_length(p, costs, max_length)
            assert rule.length([p] * max_length) == best, (table, max_length, p)
            chosen.add(best)
    assert len(chosen) >= 3          # the grid covers short and long chains, not one answer everywhere


def test_brute_force_on_a_hand_checked_table():
    # verify costs 10 for any n, drafting free: every extra token adds p^i tokens at no cost, so draft to the end;
    # drafting costing 10 a token with p = 0.5: k=1 gives 1.5/20, k=2 1.75/30: stop at one
    flat = disco.RoundCosts({k: 0.0 for k in range(1, 6)}, {n: 10.0 for n in range(1, 7)})
    assert disco.best_fixed_length(0.3, flat, 5) == 5 == disco.StopRule(flat, 5).length([0.3] * 5)
    dear = disco.RoundCosts({k: 10.0 * k for k in range(1, 6)}, {n: 10.0 for n in range(1, 7)})
    assert disco.best_fixed_length(0.5, dear, 5) == 1 == disco.StopRule(dear, 5).length([0.5] * 5)


def test_a_confident_then_doubtful_chain_stops_at_the_doubt():
    costs = disco.RoundCosts({k: 3.0 * k for k in range(1, 9)}, {n: 40.0 + 4 * n for n in range(1, 10)})
    rule = disco.StopRule(costs, 8)
    assert rule.length([0.95, 0.95, 0.95, 0.05, 0.95, 0.95, 0.95, 0.95]) == 3
    assert rule.length([0.95] * 8) == 8


def test_the_classifier_learns_a_separable_toy_set():
    g = torch.Generator().manual_seed(0)
    n = 400
    top1 = torch.rand(n, generator=g)
    x = torch.stack([top1, top1 * torch.rand(n, generator=g) * 0.5, 3 * (1 - top1),
                     torch.randint(1, 6, (n,), generator=g).float()], 1)
    y = (top1 > 0.5).float()
    model, history = disco.train_classifier(x, y, steps=200)
    losses = history["train_loss"]
    assert losses[-1] < 0.5 * losses[0]
    assert history["val_accuracy"] >= 0.9
    assert ((model.prob(x) > 0.5).float() == y).float().mean() > 0.95


def test_save_and_load_give_the_same_predictions(tmp_path):
    x = torch.rand(50, 4)
    y = (x[:, 0] > 0.5).float()
    model, _ = disco.train_classifier(x, y, steps=20)
    disco.save_classifier(model, tmp_path / "c", {"rounds": ["toy"]})
    back = disco.load_classifier(tmp_path / "c")
    assert torch.equal(model.prob(x), back.prob(x)) and back.info["rounds"] == ["toy"]
    config = json.loads((tmp_path / "c" / disco.CONFIG_NAME).read_text())
    (tmp_path / "c" / disco.CONFIG_NAME).write_text(json.dumps({**config, "version": 99}))
    with pytest.raises(CheckpointError, match="version 99"):
        disco.load_classifier(tmp_path / "c")
    with pytest.raises(CheckpointError, match="no disco.json"):
        disco.load_classifier(tmp_path / "nothing")


@pytest.fixture(scope="module")
def prompts(tiny_chat_prompts):
    return tiny_chat_prompts


@pytest.fixture(scope="module")
def trained(tiny_target, prompts, noisy_copy, tmp_path_factory):
    """A round log of the noisy copy's chains of 6 and the classifier trained from it."""
    model, _ = tiny_target
    folder = tmp_path_factory.mktemp("disco")
    with RoundLog(folder / "rounds.jsonl", drafter=drafter_identity("noisy_copy", "causal_lm", model)) as log:
        evaluate(model, CausalLMProposer(noisy_copy), prompts, spec=TreeSpec("chain", draft_length=6),
                 sampling=Sampling(), max_new_tokens=24, progress=False, log_rounds=log)
    x, y = disco.examples_from_rounds(read_rounds(folder / "rounds.jsonl"))
    model_c, _ = disco.train_classifier(x, y, steps=100)
    disco.save_classifier(model_c, folder / "classifier", {"rounds": [str(folder / "rounds.jsonl")]})
    from draftlab.checkpoint import save_drafter
    from draftlab.drafters.eagle import EagleHead

    save_drafter(EagleHead.from_target(model, None), folder / "step_0")      # an untrained head to stop
    return folder, model_c


COSTS = disco.RoundCosts({k: 2.0 * k for k in range(1, 7)}, {n: 20.0 + 3 * n for n in range(1, 8)})


def test_disco_decoding_is_lossless_under_greedy(tiny_target, prompts, noisy_copy, trained):
    model, _ = tiny_target
    proposer = disco.wrap(CausalLMProposer(noisy_copy), trained[1], COSTS, 6)
    lengths = set()
    for p in prompts:
        res = speculative_generate(model, proposer, p, TreeSpec("chain", draft_length=6), Sampling(), 24)
        assert res.tokens == target_generate(model, p, 24).tokens
        lengths |= set(res.draft_nodes)
        assert len(res.predicted) == len(res.outcome) > 0 and all(0 <= q <= 1 for q in res.predicted)
    assert lengths <= set(range(1, 7))


def test_disco_only_cuts_the_sampled_chain_short(tiny_target, prompts, noisy_copy, trained):
    """Under sampling, a DISCO chain is a prefix of the fixed chain drawn with the same random stream (same tokens,
    same q), and the stop depends on the drafter alone: verification is the usual lossless rule over it."""
    model, _ = tiny_target
    sampling = Sampling(temperature=1.0)
    fixed, stopped = CausalLMProposer(noisy_copy), disco.wrap(CausalLMProposer(noisy_copy), trained[1], COSTS, 6)
    cut = 0
    for p in prompts:
        for proposer in (fixed, stopped):
            proposer.reset(p)
            proposer.commit(torch.tensor([int(p[-1])]), None)
        a = fixed.propose(TreeSpec("chain", draft_length=6), sampling, torch.Generator().manual_seed(1))
        b = stopped.propose(TreeSpec("chain", draft_length=6), sampling, torch.Generator().manual_seed(1))
        n = len(b)
        assert 1 <= n <= 6 and torch.equal(a.tokens[:n], b.tokens) and torch.allclose(a.q[:n], b.q)
        assert b.proposal == "with_replacement"
        cut += n < 6
    res = speculative_generate(model, stopped, prompts[0], TreeSpec("chain", draft_length=6), sampling, 16,
                               generator=torch.Generator().manual_seed(0))
    assert 1 <= res.new_tokens / res.rounds <= 7


def test_rounds_without_draft_stats_or_outcomes_are_refused(tmp_path):
    with pytest.raises(DataError, match="no draft_stats"):
        disco.examples_from_rounds([])
    with pytest.raises(DataError, match="both outcomes"):
        disco.train_classifier(torch.rand(5, 4), torch.zeros(5))


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "draftlab.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_trains_and_evaluates_disco(tiny_target, tiny_target_dir, tiny_prompt_file, trained, tmp_path):
    folder, _ = trained
    proc = run_cli("disco", "--rounds", str(folder / "rounds.jsonl"), "--out", str(tmp_path / "c"), "--steps", "50")
    assert proc.returncode == 0, proc.stderr
    assert "judged draft tokens" in proc.stdout and (tmp_path / "c" / disco.WEIGHTS_NAME).is_file()
    logged = json.loads((tmp_path / "c" / disco.CONFIG_NAME).read_text())["drafter"]
    assert logged["checkpoint"] == "noisy_copy" and logged["target"]["hidden_size"] == 64
    ckpt = folder / "step_0"
    out = tmp_path / "report.json"
    proc = run_cli("eval", "--checkpoint", str(ckpt), "--target", tiny_target_dir, "--prompts", tiny_prompt_file,
                   "--out", str(out), "--max-new-tokens", "12", "--num-prompts", "2", "--draft-length", "disco",
                   "--disco", str(tmp_path / "c"), "--max-draft-length", "4", "--calibration-prompts", "1")
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]   # another drafter's rounds
    assert len(warnings) == 1 and "noisy_copy" in warnings[0] and str(ckpt.resolve()) in warnings[0]
    report = json.loads(out.read_text())
    assert report["lossless"] is True and report["adaptive"]["rule"] == "disco"
    assert report["draft_length"] == 4 and 1 <= report["mean_draft_length"] <= 4
    assert "verify_cost" in report["draft_shape"] and report["disco"]["classifier"] == str(tmp_path / "c")


@pytest.mark.parametrize("case", ["no_log", "bad_version", "no_classifier", "disco_without_path", "path_without_disco",
                                  "disco_with_tree", "disco_with_lookup", "other_target"])
def test_bad_disco_input_is_one_line(case, trained, tiny_target, tiny_target_dir, tiny_prompt_file, tmp_path):
    folder, classifier = trained
    if case in ("no_log", "bad_version"):
        log = tmp_path / "r.jsonl"
        if case == "bad_version":
            row = json.loads((folder / "rounds.jsonl").read_text().splitlines()[0])
            log.write_text(json.dumps({**row, "version": 7}) + "\n")
        proc = run_cli("disco", "--rounds", str(log), "--out", str(tmp_path / "c"))
        assert not (tmp_path / "c").exists()
    else:
        if case == "other_target":    # trained from rounds of this drafter, against a target of another width
            identity = drafter_identity(str((folder / "step_0").resolve()), "eagle", tiny_target[0])
            identity["target"]["hidden_size"] = 96
            disco.save_classifier(classifier, tmp_path / "other", {"drafter": identity})
        extra = {"no_classifier": ["--draft-length", "disco", "--disco", str(tmp_path / "nope")],
                 "disco_without_path": ["--draft-length", "disco"],
                 "path_without_disco": ["--disco", str(folder / "classifier")],
                 "disco_with_tree": ["--draft-length", "disco", "--disco", str(folder / "classifier"),
                                     "--tree", "dynamic"],
                 "disco_with_lookup": ["--draft-length", "disco", "--disco", str(folder / "classifier"),
                                       "--lookup-first", "3"],
                 "other_target": ["--draft-length", "disco", "--disco", str(tmp_path / "other")]}[case]
        proc = run_cli("eval", "--checkpoint", str(folder / "step_0"), "--target", tiny_target_dir, "--prompts",
                       tiny_prompt_file, "--out", str(tmp_path / "r.json"), *extra)
        assert not (tmp_path / "r.json").exists()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr     # one line (the target's loading bar aside, once it loads):
    assert len([line for line in proc.stderr.strip().splitlines() if not line.startswith("Loading weights")]) == 1
    if case == "bad_version":
        assert "version 7" in proc.stderr
    if case == "other_target":
        assert "another target (hidden_size=96" in proc.stderr


@pytest.fixture(scope="module")
def layer_skip(tiny_target, tmp_path_factory):
    """A small_lm drafter made of the tiny target's two layers plus a little noise, saved as a checkpoint: it agrees
    with the target often, not always, so its rounds hold both outcomes."""
    from draftlab.checkpoint import save_drafter
    from draftlab.config import load_config
    from draftlab.drafters.small_lm import SmallLM

    model, _ = tiny_target
    cfg = load_config(["drafter.kind=small_lm", "drafter.target_layers=[0,1]", "target.path=/x", "data.train=/x",
                       "data.eval_prompts=/p"]).drafter
    drafter = SmallLM.from_target(model, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(0.006 * torch.randn(p.shape, generator=g))
    return save_drafter(drafter, tmp_path_factory.mktemp("layer_skip") / "step_0")


def disco_from_checkpoint(ckpt, target_dir, prompt_file, out, *extra):
    return run_cli("disco", "--recipe", "disco_stop", "--checkpoint", str(ckpt), "--target", target_dir, "--prompts",
                   prompt_file, "--max-new-tokens", "12", "--max-length", "4", "--steps", "30", "--out", str(out),
                   *extra)


@pytest.fixture(scope="module")
def from_recipe(layer_skip, tiny_target_dir, tiny_prompt_file, tmp_path_factory):
    """`draftlab disco --recipe disco_stop --checkpoint` on 3 prompts, in one go: its output folder."""
    out = tmp_path_factory.mktemp("from_recipe") / "c"
    proc = disco_from_checkpoint(layer_skip, tiny_target_dir, tiny_prompt_file, out, "--num-prompts", "3")
    assert proc.returncode == 0, proc.stderr
    assert "judged draft tokens" in proc.stdout
    return out


def test_the_recipe_logs_rounds_then_trains_and_a_rerun_continues(layer_skip, from_recipe, tiny_target_dir,
                                                                  tiny_prompt_file, tmp_path):
    """`draftlab disco --recipe disco_stop --checkpoint`: rounds are logged first; a rerun with more prompts keeps
    the rows already logged and drops those of a prompt a stop cut off; the log equals one uninterrupted run's."""
    info = json.loads((from_recipe / disco.CONFIG_NAME).read_text())
    assert info["recipe"] == "disco_stop" and info["drafter"]["kind"] == "small_lm"
    assert info["drafter"]["checkpoint"] == str(layer_skip.resolve())
    rows = (from_recipe / disco.ROUNDS_NAME).read_text().splitlines()

    part = tmp_path / "part"
    first = disco_from_checkpoint(layer_skip, tiny_target_dir, tiny_prompt_file, part, "--num-prompts", "2")
    assert first.returncode == 0, first.stderr
    done = (part / disco.ROUNDS_NAME).read_text().splitlines()
    with open(part / disco.ROUNDS_NAME, "a") as f:    # a third prompt's first round, cut off by a stop
        f.write(rows[len(done)] + "\n")
    again = disco_from_checkpoint(layer_skip, tiny_target_dir, tiny_prompt_file, part, "--num-prompts", "3")
    assert again.returncode == 0, again.stderr
    assert (part / disco.ROUNDS_NAME).read_text().splitlines() == rows
    assert json.loads((part / disco.PROGRESS_NAME).read_text())["done"] == 3

    other = disco_from_checkpoint(layer_skip, tiny_target_dir, tiny_prompt_file, part, "--num-prompts", "3",
                                  "--max-length", "5")
    assert other.returncode == 2 and "max_length" in other.stderr and "Traceback" not in other.stderr
    assert (part / disco.ROUNDS_NAME).read_text().splitlines() == rows          # nothing written over


def test_the_export_ships_the_classifier_and_eval_reads_it_there(layer_skip, from_recipe, tiny_target,
                                                                 tiny_target_dir, tiny_prompt_file, tmp_path):
    """`draftlab push --disco`: the classifier goes in the export's disco/ folder, named against the export's own
    checkpoint (no warning when eval stops that drafter with it), the card describes it, and decoding stays
    lossless; one trained against another target is refused before anything is written."""
    export = tmp_path / "export"
    proc = run_cli("push", str(layer_skip), "--target", tiny_target_dir, "--to", str(export), "--disco",
                   str(from_recipe))
    assert proc.returncode == 0, proc.stderr
    assert (export / "disco" / disco.WEIGHTS_NAME).is_file()
    assert json.loads((export / "export.json").read_text())["disco"]["folder"] == "disco"
    assert "## Stopping rule (DISCO)" in (export / "README.md").read_text()
    assert disco.load_classifier(export / "disco").info["shipped_from"] == str(layer_skip.resolve())
    out = tmp_path / "report.json"
    proc = run_cli("eval", "--checkpoint", str(export), "--target", tiny_target_dir, "--prompts", tiny_prompt_file,
                   "--out", str(out), "--max-new-tokens", "12", "--num-prompts", "2", "--draft-length", "disco",
                   "--disco", str(export / "disco"), "--max-draft-length", "4", "--calibration-prompts", "1")
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr
    report = json.loads(out.read_text())
    assert report["lossless"] is True and report["adaptive"]["rule"] == "disco"

    classifier = disco.load_classifier(from_recipe)
    identity = drafter_identity(str(layer_skip.resolve()), "small_lm", tiny_target[0])
    identity["target"]["hidden_size"] = 96
    disco.save_classifier(classifier, tmp_path / "other", {"drafter": identity})
    bad = run_cli("push", str(layer_skip), "--target", tiny_target_dir, "--to", str(tmp_path / "e2"), "--disco",
                  str(tmp_path / "other"))
    assert bad.returncode == 2 and "another target (hidden_size=96" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "e2").exists()


@pytest.mark.parametrize("args, says", [
    (["--recipe", "serve_learn", "--out", "X"], "draftlab serve-learn --recipe serve_learn"),
    (["--recipe", "disco_stop"], "give --out"),
    (["--recipe", "disco_stop", "--out", "X"], "give --rounds"),
    (["--recipe", "disco_stop", "--out", "X", "--checkpoint", "C"], "needs --prompts"),
    (["--recipe", "eagle_head", "--out", "X"], "draftlab train recipe=eagle_head"),
])
def test_bad_recipe_use_is_one_line(args, says, tmp_path):
    proc = run_cli("disco", *[str(tmp_path / a) if a in ("X", "C") else a for a in args])
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "X").exists()
