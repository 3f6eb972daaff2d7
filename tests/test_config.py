"""Config composition and its errors: every shipped recipe loads; bad input gives one clear line, exit 2."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from draftlab.config import ConfigError, available_recipes, load_config

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = ["target.path=/x", "data.train=/x.jsonl", "data.eval_prompts=/p.jsonl", "drafter.base=/b"]


@pytest.mark.parametrize("recipe", available_recipes())
def test_every_shipped_recipe_composes(recipe):
    cfg = load_config([f"recipe={recipe}", *REQUIRED])
    assert cfg.recipe == recipe
    assert cfg.train.max_steps >= 1


def test_overrides_are_typed_and_win_over_the_recipe():
    cfg = load_config(["recipe=eagle_head", *REQUIRED, "train.lr=3e-4", "eval.draft_length=7", "train.batch_size=2"])
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.eval.draft_length == 7 and cfg.train.batch_size == 2


def test_recipe_defaults_are_merged_under_the_recipe():
    cfg = load_config(["recipe=quickstart"])
    base = load_config(["recipe=eagle_head", *REQUIRED])
    assert cfg.drafter.kind == base.drafter.kind == "eagle"
    assert cfg.train.max_steps != base.train.max_steps  # the quickstart overrides its base


@pytest.mark.parametrize("args, words", [
    (["recipe=nope"], ["unknown recipe 'nope'", "eagle_head"]),
    (["recipe=eagle_head", *REQUIRED, "train.lrr=1"], ["train.lrr", "did you mean train.lr", "valid keys"]),
    (["recipe=eagle_head", *REQUIRED, "bogus=1"], ["bogus", "valid keys under the top level"]),
    (["recipe=eagle_head", *REQUIRED, "train.max_steps=ten"], ["train.max_steps", "'ten'", "int"]),
    (["recipe=eagle_head", *REQUIRED, "eval.tree=forest"], ["eval.tree", "chain, static, dynamic"]),
    (["recipe=eagle_head", *REQUIRED, "drafter.kind=nope"], ["drafter.kind", "eagle"]),
    (["recipe=eagle_head", *REQUIRED, "tracking=mlflow"], ["tracking", "wandb"]),
    (["recipe=eagle_head", *REQUIRED, "eval.draft_length=0"], ["eval.draft_length", "at least 1"]),
    (["recipe=eagle_head", "data.train=/x", "data.eval_prompts=/p"], ["target.path"]),
    (["recipe=eagle_head", *REQUIRED, "train.lr"], ["not key=value"]),
])
def test_config_errors_name_the_problem(args, words):
    with pytest.raises(ConfigError) as err:
        load_config(args)
    message = str(err.value)
    assert "\n" not in message
    for w in words:
        assert w in message, (w, message)


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(["recipe=eagle_head", *REQUIRED, "train.lr=0.01"])
    path = tmp_path / "config.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    again = load_config([f"recipe={path}"])
    assert OmegaConf.to_container(again) == {**OmegaConf.to_container(cfg), "recipe": str(path)}


@pytest.mark.parametrize("entry", [["-m", "draftlab.cli", "train"], [str(ROOT / "draftlab" / "train.py")]])
def test_cli_reports_bad_keys_without_traceback(entry):
    """`draftlab train` and `python draftlab/train.py` both exit 2 with one line naming the key, before loading."""
    proc = subprocess.run([sys.executable, *entry, "recipe=eagle_head", "train.lrr=1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "train.lrr" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
