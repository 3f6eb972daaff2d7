"""Config composition and its errors: every shipped recipe loads; bad input gives one clear line, exit 2."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from draftlab.config import ConfigError, available_recipes, load_config, load_saved
from draftlab.drafters import CONFIGS
from draftlab.drafters.options import settings

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = ["target.path=/x", "data.train=/x.jsonl", "data.eval_prompts=/p.jsonl"]


@pytest.mark.parametrize("recipe", available_recipes())
def test_every_shipped_recipe_composes(recipe):
    base = ["drafter.base=/b"] if recipe == "acceptance_head" else []
    cfg = load_config([f"recipe={recipe}", *REQUIRED, *base])
    assert cfg.recipe == recipe
    assert cfg.train.max_steps >= 1


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_the_drafter_section_is_the_kinds_own_config(kind):
    """drafter.kind selects its dataclass: the section holds that kind's keys, with its defaults, and nothing else;
    the drafter reads the same defaults from it as from no config at all (defaults live once)."""
    cfg = load_config([f"drafter.kind={kind}", *REQUIRED, *(["drafter.base=/b"] if kind == "acceptance" else [])])
    assert OmegaConf.get_type(cfg.drafter) is CONFIGS[kind]
    assert list(cfg.drafter) == [f.name for f in fields(CONFIGS[kind])]
    assert settings(CONFIGS[kind], None) == settings(CONFIGS[kind], CONFIGS[kind]())


@pytest.mark.parametrize("args, kind, owner", [
    (["recipe=eagle_head", "drafter.ttt_steps=3"], "eagle", "eagle3"),
    (["recipe=eagle3_head", "drafter.harmonized_steps=2"], "eagle3", "eagle"),
    (["recipe=medusa_heads", "drafter.distill_mode=online_whitebox"], "medusa", "small_lm"),
    (["recipe=distill_offline_blackbox", "drafter.medusa_heads=3"], "small_lm", "medusa"),
    (["recipe=eagle_head", "drafter.base=/b"], "eagle", "acceptance"),
])
def test_a_key_of_another_kind_is_refused_with_the_kinds_keys(args, kind, owner):
    with pytest.raises(ConfigError) as err:
        load_config([*args, *REQUIRED])
    message = str(err.value)
    assert "\n" not in message and f"drafter.kind={kind}" in message and f"a key of {owner}" in message
    assert ", ".join(f.name for f in fields(CONFIGS[kind])) in message  # the kind's valid keys


def test_a_key_of_another_kind_stops_the_cli_before_any_model_loads(tmp_path):
    """The target path does not exist: had the run got that far, the error would be about the target."""
    proc = subprocess.run([sys.executable, str(ROOT / "draftlab" / "train.py"), "recipe=eagle_head",
                           "drafter.ttt_steps=3", f"target.path={tmp_path / 'no_target'}", f"data.train={tmp_path}/x",
                           f"out_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "drafter.ttt_steps" in lines[0] and "drafter.kind=eagle" in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()


def test_recipes_show_prints_the_resolved_config():
    proc = subprocess.run([sys.executable, "-m", "draftlab.cli", "recipes", "--show", "eagle3_head",
                           "drafter.ttt_steps=2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    shown = OmegaConf.create(proc.stdout)
    assert shown.recipe == "eagle3_head" and shown.drafter.kind == "eagle3" and shown.drafter.ttt_steps == 2
    assert shown.train.max_steps == load_config(["recipe=eagle3_head", *REQUIRED]).train.max_steps
    bad = subprocess.run([sys.executable, "-m", "draftlab.cli", "recipes", "--show", "eagle_head",
                          "drafter.ttt_steps=2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "drafter.ttt_steps" in bad.stderr


def test_a_run_saved_with_every_kinds_keys_still_loads(tmp_path):
    """Runs saved before the per-kind sections hold all kinds' keys under drafter: the other kinds' are dropped."""
    cfg = load_config(["recipe=eagle_head", *REQUIRED, "drafter.num_layers=2"])
    old = OmegaConf.to_container(cfg)
    old["drafter"].update(ttt_steps=7, medusa_heads=4, base="", distill_mode="offline_blackbox")
    path = tmp_path / "config.yaml"
    path.write_text(OmegaConf.to_yaml(old))
    again = load_saved(path)
    assert OmegaConf.get_type(again.drafter) is CONFIGS["eagle"] and again.drafter.num_layers == 2
    assert "ttt_steps" not in again.drafter


def test_overrides_are_typed_and_win_over_the_recipe():
    cfg = load_config(["recipe=eagle_head", *REQUIRED, "train.lr=3e-4", "eval.draft_length=7", "train.batch_size=2"])
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.eval.draft_length == 7 and cfg.train.batch_size == 2



def test_a_bare_no_is_the_choice_no_not_a_yaml_boolean():
    for text in ("no", "false"):   # YAML 1.1 reads both as false
        cfg = load_config(["recipe=eagle_head", *REQUIRED, f"train.mixed_precision={text}"])
        assert cfg.train.mixed_precision == "no"


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


def test_recipes_of_other_commands_are_refused_by_train_and_checked_by_their_command(tmp_path):
    """disco_stop and serve_learn are recipes of `draftlab disco` / `serve-learn`: train refuses them in one line;
    a command recipe's unknown option or wrong type is one line naming the file."""
    from draftlab.config import command_recipe

    assert "disco_stop" in available_recipes("disco") and "serve_learn" in available_recipes("serve-learn")
    assert not {"disco_stop", "serve_learn"} & set(available_recipes())
    with pytest.raises(ConfigError, match="draftlab disco --recipe disco_stop"):
        load_config(["recipe=disco_stop", *REQUIRED])
    options = {"steps": int, "lr": float, "follow": bool}
    assert command_recipe(str(ROOT / "recipes" / "disco_stop.yaml"), "disco", {**options, **dict.fromkeys(
        ["num_prompts", "max_length", "max_new_tokens", "hidden", "layers", "seed"], int)})["steps"] == 300
    bad = tmp_path / "bad.yaml"
    for text, says in (("command: disco\nsteps: many\n", "steps is 'many': give an int"),
                       ("command: disco\nstepz: 3\n", "unknown option 'stepz'"),
                       ("command: serve-learn\nlr: 1\n", "draftlab serve-learn --recipe")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=says) as err:
            command_recipe(str(bad), "disco", options)
        assert "\n" not in str(err.value)
    bad.write_text("command: disco\nlr: 1\n")
    assert command_recipe(str(bad), "disco", options) == {"lr": 1}     # an int where a float goes is fine
