"""`draftlab eval --checkpoint` on drafters in other projects' formats (draftlab/foreign.py), its errors, and the
report's acceptance length counted both ways. The round trips against the real clients are in test_interop.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftlab import hub
from draftlab.checkpoint import CheckpointError
from draftlab.cli import main
from draftlab.foreign import find_foreign
from test_hub import make_run
from test_interop import eagle3_case, native_copy  # noqa: F401 (a fixture)


@pytest.fixture
def speculators_folder(eagle3_case, tmp_path):
    """A speculators-format EAGLE-3 head (config.json + model.safetensors only) naming a local target."""
    x = eagle3_case
    out = hub.export_checkpoint(make_run(tmp_path / "run", x.head, target_path=x.target_dir), tmp_path / "export",
                                target=x.model)
    return native_copy(out, tmp_path / "speculators", ("config.json", "model.safetensors")), x.model, x.head


def run_eval(args: list[str], capsys) -> tuple[int, str]:
    code = main(["eval", *args])
    return code, capsys.readouterr().err


def test_eval_scores_a_speculators_folder(speculators_folder, tiny_prompt_file, tmp_path, capsys):
    folder, model, head = speculators_folder
    loaded = find_foreign(str(folder)).load(model)
    g, ids, pos = torch.randn(1, 9, 3 * 64), torch.randint(0, 300, (1, 9)), torch.arange(9)[None]
    with torch.no_grad():
        ours, theirs = loaded(g, ids, pos, None), head(g, ids, pos, None)
        torch.testing.assert_close(loaded.draft_logits(ours), head.draft_logits(theirs))
    code, err = run_eval(["--checkpoint", str(folder), "--prompts", tiny_prompt_file, "--out", str(tmp_path / "r.json"),
                          "--num-prompts", "2", "--max-new-tokens", "8", "--draft-length", "3"], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["lossless"] is True and "speculators format" in report["drafter"]
    n = report["num_prompts"]
    assert report["acceptance_length"] == report["new_tokens"] / report["target_forwards"]
    assert report["acceptance_length_incl_prefill"] == pytest.approx(
        (report["new_tokens"] + n) / (report["target_forwards"] + n))
    assert "prefill" in (tmp_path / "r.md").read_text()


def test_foreign_folders_fail_with_one_line(speculators_folder, tiny_prompt_file, tmp_path, capsys):
    folder, model, _ = speculators_folder
    common = ["--prompts", tiny_prompt_file, "--out", str(tmp_path / "r.json")]
    config = json.loads((folder / "config.json").read_text())

    # no target named and none given
    config["speculators_config"]["verifier"]["name_or_path"] = None
    (folder / "config.json").write_text(json.dumps(config))
    code, err = run_eval(["--checkpoint", str(folder), *common], capsys)
    assert code == 2 and "does not name its target: pass --target" in err and len(err.strip().splitlines()) == 1

    # a weight missing
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "fc.weight"}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing \\['fc.weight'\\]"):
        find_foreign(str(folder)).load(model)

    # an embedding that is not the target's
    weights["embed_tokens.weight"] = weights["embed_tokens.weight"] + 1
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="not the target's embedding"):
        find_foreign(str(folder)).load(model)

    # an unknown format, and another speculators algorithm
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="neither speculators EAGLE-3, official EAGLE-1/2/3 nor Medusa"):
        find_foreign(str(folder))
    (folder / "config.json").write_text(json.dumps({"speculators_model_type": "mlp"}))
    code, err = run_eval(["--checkpoint", str(folder), "--target", str(folder), *common], capsys)
    assert code == 2 and "EAGLE-3 heads only" in err


def test_native_checkpoints_and_exports_are_not_foreign(speculators_folder, tmp_path):
    folder, _, _ = speculators_folder
    assert find_foreign(str(folder.parent / "export")) is None        # an export: `best` points at draftlab/
    assert find_foreign(str(folder.parent / "run")) is None            # a run folder
    assert find_foreign(str(tmp_path / "nowhere")) is None             # a missing local path stays native's error
    with pytest.raises(CheckpointError, match="does not exist locally"):
        find_foreign("org/not-downloaded")                             # HF_HUB_OFFLINE in tests


def test_medusa_heads_without_projection_use_the_target_head(tiny_target, tiny_target_dir, tmp_path):
    """Heads saved in Medusa's legacy layout (ResBlocks only) project with the target's LM head."""
    from draftlab.drafters.medusa import MedusaHeads

    model, _ = tiny_target
    folder = tmp_path / "legacy"
    folder.mkdir()
    torch.manual_seed(0)
    blocks = {f"{k}.0.linear.{p}": torch.randn(64, 64) * 0.05 if p == "weight" else torch.randn(64) * 0.05
              for k in range(2) for p in ("weight", "bias")}
    torch.save(blocks, folder / "medusa_lm_head.pt")
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                    "base_model_name_or_path": tiny_target_dir}))
    heads = find_foreign(str(folder)).load(model)
    assert isinstance(heads, MedusaHeads) and heads.medusa_heads == 2
    h = torch.randn(3, 64)
    block = blocks["1.0.linear.weight"], blocks["1.0.linear.bias"]
    expect = model.lm_head(h + torch.nn.functional.silu(h @ block[0].T + block[1]))
    with torch.no_grad():
        torch.testing.assert_close(heads.head_logits(h)[1], expect)


def test_push_names_a_target_other_tools_resolve(tiny_target, tiny_target_dir, tmp_path, monkeypatch):
    """A package:/.gguf target is exported under its dequantised folder or --base-model, never as given."""
    from draftlab.drafters.eagle import EagleHead

    model, tok = tiny_target
    run = make_run(tmp_path / "run", EagleHead.from_target(model, None), target_path="package:nopkg/model.gguf")
    with pytest.raises(hub.HubError, match="pass --base-model"):
        hub.export_checkpoint(run, tmp_path / "e1", target=model, tokenizer=tok)
    assert not (tmp_path / "e1").exists()
    out = hub.export_checkpoint(run, tmp_path / "e2", target=model, tokenizer=tok, base_model=tiny_target_dir)
    meta = json.loads((out / hub.MARKER).read_text())
    assert meta["verifier"] == str(Path(tiny_target_dir).resolve()) and meta["base_model"] is None
    assert "package:" not in (out / "README.md").read_text().split("## Usage")[1].split("### draftlab")[0]
    with pytest.raises(hub.HubError, match="neither a Hub model id"):
        hub.export_checkpoint(run, tmp_path / "e3", target=model, base_model="./missing-folder")
    assert main(["push", str(run), "--to", str(tmp_path / "e4"), "--base-model", "./missing-folder"]) == 2
    assert not (tmp_path / "e4").exists()
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    converted = tmp_path / "converted"
    shutil.copytree(tiny_target_dir, converted)
    monkeypatch.setattr("draftlab.target.convert_gguf", lambda path, *a, **k: str(converted))
    assert hub.verifier_name(None, str(gguf)) == str(converted)
