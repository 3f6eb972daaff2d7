"""Round trips with the libraries users load exports with (CI installs them, see .ci/run; pinned in README.md).

Each test exports a drafter trained on a tiny random target, loads it with the real client the model card names,
and compares the client's draft logits with draftlab's (within 1e-4, top-1 agreement 100%). The card's Python
usage snippets are executed as written, with the repository id replaced by the local export folder.

Clients (versions pinned in .ci/run): transformers (the project's own 5.23, and 4.53.3, which the official EAGLE
and Medusa code run under, in a separate folder, DRAFTLAB_TRANSFORMERS4, run in a subprocess), speculators 0.9.0,
medusa-llm 0.1 (FasterDecoding/Medusa) and eagle-llm 1.2.1 (SafeAILab/EAGLE's EAGLE-1 head). Where a client's own
*target* model class cannot be built under transformers 5.23 (Medusa's KV-cache Llama, written for 4.x), the test
swaps in transformers' Llama for the target only and says so; the head classes, configs and weight loaders are
always the client's own. Under 4.53.3 (the last test) their card snippets run with their own target classes.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import build_tiny_llama
from draftlab import hub
from draftlab.drafters import DRAFTERS
from draftlab.drafters.eagle import EagleHead
from draftlab.trees import additive
from draftlab.drafters.eagle3 import EagleHead3
from draftlab.drafters.medusa import MedusaHeads
from draftlab.foreign import find_foreign
from draftlab.model_card import usage
from test_hub import make_run

TRANSFORMERS4_VERSION = "4.53.3"      # what the official EAGLE and Medusa code run under; .ci/run installs it
TRANSFORMERS4 = os.environ.get("DRAFTLAB_TRANSFORMERS4") or str(Path(__file__).parents[1] / ".ci/clients/transformers4")


def client(module: str, why: str):
    """Import a client library or skip, naming what CI installs."""
    return pytest.importorskip(module, reason=f"{why} is not installed (`bash .ci/run` installs it; see README.md, "
                                              "'Checked with')", exc_type=ImportError)


def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Draft logits agree within 1e-4 and pick the same top-1 token everywhere."""
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def perturb(module: torch.nn.Module, seed: int = 1, scale: float = 0.05) -> None:
    """Move every trainable weight off its initial value, so a dropped or zeroed tensor cannot go unseen."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * scale)


def snippet(export: Path, engine: str) -> str:
    """The Python code of the card's usage section for `engine`, for this export kept at `export`."""
    meta = json.loads((export / hub.MARKER).read_text())
    text = usage({**meta, "repo_id": str(export)}, [])[engine]
    return re.search(r"```python\n(.*?)\n```", text, re.S).group(1)


def saved_target(tokenizer, folder: Path, **kw) -> tuple[torch.nn.Module, str]:
    model = build_tiny_llama(tokenizer, **kw).requires_grad_(False)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, str(folder)


def native_copy(export: Path, dest: Path, names: tuple[str, ...]) -> Path:
    """Only the serving-format files of an export (no draftlab/ checkpoint, no `best`): a foreign folder."""
    dest.mkdir()
    for name in names:
        shutil.copy2(export / name, dest / name)
    return dest


def in_transformers4(code: str, *args: str) -> None:
    """Run `code` (argv: args) in a subprocess that imports the transformers 4.x CI installs (.ci/run), or skip."""
    found = [p.name for p in Path(TRANSFORMERS4).glob("transformers-*.dist-info")]
    if found != [f"transformers-{TRANSFORMERS4_VERSION}.dist-info"]:
        pytest.skip(f"transformers {TRANSFORMERS4_VERSION} is not installed at {TRANSFORMERS4} "
                    f"(found {found or 'none'}; `bash .ci/run` installs it there)")
    code = ("import sys, torch, transformers\n"
            f"assert transformers.__version__ == {TRANSFORMERS4_VERSION!r}, transformers.__version__\n" + code)
    env = {**os.environ, "PYTHONPATH": TRANSFORMERS4, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


# ----------------------------------------------------------------------------------------------------------
# small_lm: transformers assisted generation (5.23; 4.53.3 below, with every other export)


def tiny_llama_theta(tokenizer, theta: float):
    """The tiny Llama with a non-default rope theta, as SmolLM2's 100,000: a reader that falls back to 10,000
    computes different logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": theta})
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


@pytest.fixture
def small_lm_export(tiny_tokenizer, tmp_path, monkeypatch):
    from draftlab.drafters.small_lm import SmallLM

    monkeypatch.setitem(DRAFTERS, "small_lm", SmallLM)
    target = tiny_llama_theta(tiny_tokenizer, 100000.0)
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer.save_pretrained(tmp_path / "target")
    torch.manual_seed(0)
    drafter = SmallLM.from_target(target, SimpleNamespace(num_layers=1), tiny_tokenizer).eval()
    perturb(drafter)
    run = make_run(tmp_path / "run", drafter, target_path=str(tmp_path / "target"))
    out = hub.export_checkpoint(run, tmp_path / "export", target=target, tokenizer=tiny_tokenizer)
    return SimpleNamespace(target=target, drafter=drafter, export=out, target_dir=str(tmp_path / "target"))


def test_small_lm_card_snippet_runs_assisted_generation(small_lm_export, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    x = small_lm_export
    namespace: dict = {}
    exec(snippet(x.export, "transformers"), namespace)               # target.generate(..., assistant_model=draft)
    inputs = namespace["inputs"]
    plain = namespace["target"].generate(**inputs, max_new_tokens=128)
    assert torch.equal(namespace["out"], plain)                       # assisted generation changes nothing
    draft = AutoModelForCausalLM.from_pretrained(str(x.export)).eval()
    ids = plain[:, :96]
    with torch.no_grad():
        close(draft(ids).logits, x.drafter(ids))


def test_medusa2_merged_target_in_transformers(tiny_tokenizer, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from draftlab.drafters import load_drafter
    from draftlab.drafters.medusa2 import Medusa2Lora

    monkeypatch.setitem(DRAFTERS, "medusa2", Medusa2Lora)
    model, target_dir = saved_target(tiny_tokenizer, tmp_path / "target")
    drafter = Medusa2Lora.from_target(model, SimpleNamespace(lora_r=4, lora_alpha=8, medusa_heads=2))
    perturb(drafter)
    out = hub.export_checkpoint(make_run(tmp_path / "run", drafter, target_path=target_dir), tmp_path / "export")
    namespace: dict = {}
    exec(snippet(out, "transformers"), namespace)                      # AutoModelForCausalLM + generate
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    adapted = build_tiny_llama(tiny_tokenizer).requires_grad_(False)
    load_drafter(out, adapted)                                         # draftlab's own adapted target
    ids = namespace["out"]
    with torch.no_grad():
        close(merged(ids).logits, adapted(ids).logits)
        assert torch.equal(namespace["out"], adapted.generate(**namespace["inputs"], max_new_tokens=128))


def test_medusa2_export_in_the_medusa_model_code(tiny_tokenizer, tmp_path, monkeypatch):
    """The card's Medusa snippet on a Medusa-2 export: the merged target (base_model_name_or_path = the export
    itself) and the heads, as Medusa's model code loads them."""
    medusa_model = client("medusa.model.medusa_model", "medusa-llm 0.1")
    from transformers import LlamaForCausalLM

    from draftlab.drafters.medusa2 import Medusa2Lora

    monkeypatch.setitem(DRAFTERS, "medusa2", Medusa2Lora)
    model, target_dir = saved_target(tiny_tokenizer, tmp_path / "target")
    drafter = Medusa2Lora.from_target(model, SimpleNamespace(lora_r=4, lora_alpha=8, medusa_heads=2))
    perturb(drafter)
    out = hub.export_checkpoint(make_run(tmp_path / "run", drafter, target_path=target_dir), tmp_path / "export")
    monkeypatch.setattr(medusa_model, "KVLlamaForCausalLM", LlamaForCausalLM)    # see test_medusa_export_in_...
    namespace: dict = {}
    exec(snippet(out, "official Medusa code"), namespace)
    theirs = namespace["model"]
    ids = torch.randint(0, len(tiny_tokenizer), (1, 12))
    with torch.no_grad():
        close(theirs.base_model(ids).logits, model(ids).logits)                     # model: adapted in place
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]
        close(drafter.head_logits(hidden), torch.stack([theirs.medusa_head[k](hidden) for k in range(2)]))


# ----------------------------------------------------------------------------------------------------------
# EAGLE-3: speculators' own loader, both directions


def speculators_ttt_logits(draft, aux: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """speculators' Eagle3DraftModel.forward (training-time test, teacher forced) on aux [1,n,3d] with the next
    tokens x_1..x_n; the draft logits of every step, caught at its lm_head."""
    caught: list[torch.Tensor] = []
    hook = draft.lm_head.register_forward_hook(lambda module, args, output: caught.append(output))
    n = aux.shape[1]
    with torch.no_grad():
        draft(hidden_states=aux, input_ids=ids[:, 1:n + 1], document_ids=torch.zeros(1, n, dtype=torch.long),
              ttt_steps=steps)
    hook.remove()
    return caught


def ours_ttt_logits(head: EagleHead3, aux: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    head.ttt_steps = steps
    with torch.no_grad():
        outs = head.ttt_outputs(aux, ids, torch.ones(1, aux.shape[1], dtype=torch.bool))
        return [head.draft_logits(o) for o in outs]


def aux_states(model, head: EagleHead3, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in head.aux_layers], -1)


@pytest.fixture
def eagle3_case(tiny_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setitem(DRAFTERS, "eagle3", EagleHead3)
    model, target_dir = saved_target(tiny_tokenizer, tmp_path / "target", layers=8)
    head = EagleHead3(model, draft_vocab_size=100, draft_vocab=list(range(50, 250, 2))).eval()
    perturb(head)
    ids = torch.randint(0, len(tiny_tokenizer), (1, 129))       # 128 slots: flex attention's block size
    return SimpleNamespace(model=model, target_dir=target_dir, head=head, ids=ids)


def test_eagle3_export_loads_with_speculators_loader(eagle3_case, tmp_path):
    client("speculators.models.eagle3", "speculators 0.9.0")
    x = eagle3_case
    out = hub.export_checkpoint(make_run(tmp_path / "run", x.head, target_path=x.target_dir), tmp_path / "export",
                                target=x.model)
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == \
        str(Path(x.target_dir).resolve())
    embed = load_file(str(out / "model.safetensors"))["embed_tokens.weight"]   # carried, not left to the loader
    assert torch.equal(embed, x.model.get_input_embeddings().weight)
    namespace: dict = {}
    exec(snippet(out, "speculators"), namespace)                      # Eagle3DraftModel.from_pretrained(export)
    draft = namespace["draft"].eval()
    assert torch.equal(draft.embed_tokens.weight, x.model.get_input_embeddings().weight)
    assert draft.t2d.nonzero().flatten().tolist() == x.head.draft_vocab.tolist()
    aux = aux_states(x.model, x.head, x.ids[:, :128])
    for ours, theirs in zip(ours_ttt_logits(x.head, aux, x.ids, 3), speculators_ttt_logits(draft, aux, x.ids, 3)):
        close(ours, theirs)


def test_speculators_checkpoint_imports_into_draftlab(eagle3_case, tmp_path):
    """A head written by speculators itself (its default training flags: norm_before_fc, norm_before_residual,
    norm_output) is read by draftlab's importer and computes what speculators computes."""
    client("speculators.models.eagle3", "speculators 0.9.0")
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    x = eagle3_case
    vocab = torch.tensor(sorted(range(7, 310, 3)))
    t2d = torch.zeros(len(x.head._borrowed.embed.weight), dtype=torch.bool).index_fill_(0, vocab, True)
    d2t = vocab - torch.arange(len(vocab))
    layer_config = AutoConfig.from_pretrained(x.target_dir)
    layer_config.num_hidden_layers = 1                                 # speculators' train CLI: one draft layer
    theirs = Eagle3DraftModel.from_training_args(
        layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=x.target_dir,
        draft_vocab_size=len(vocab), norm_before_residual=True, norm_before_fc=True, norm_output=True, ttt_steps=3,
        target_layer_ids=[2, 4, 5]).eval()
    perturb(theirs, seed=3)
    theirs.save_pretrained(tmp_path / "spec")
    found = find_foreign(str(tmp_path / "spec"))
    assert found.kind == "speculators" and found.target == x.target_dir
    ours = found.load(x.model)
    assert ours.aux_layers == [2, 4, 5] and ours.draft_vocab.tolist() == vocab.tolist()
    aux = aux_states(x.model, ours, x.ids[:, :128])
    for a, b in zip(ours_ttt_logits(ours, aux, x.ids, 3), speculators_ttt_logits(theirs, aux, x.ids, 3)):
        close(a, b)


def official_eagle3_folder(head: EagleHead3, folder: Path) -> Path:
    """EagleHead3 written in SafeAILab/EAGLE's EAGLE-3 layout (cnets.py): midlayer.*, fc, norm, lm_head, d2t, t2d,
    and a Llama config with draft_vocab_size."""
    from safetensors.torch import save_file

    names = {"emb_norm.weight": "midlayer.input_layernorm.weight",
             "layer.input_layernorm.weight": "midlayer.hidden_norm.weight"}
    weights = {names.get(k, k.replace("layer.", "midlayer.", 1)): v.contiguous()
               for k, v in head.state_dict().items() if k in names or k.startswith(("layer.", "fc.", "norm.", "lm_"))}
    weights["d2t"], weights["t2d"] = head.d2t, head.t2d
    folder.mkdir()
    save_file(weights, str(folder / "model.safetensors"))
    text = head._borrowed.embed.weight.shape
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": text[1],
              "vocab_size": text[0], "draft_vocab_size": head.draft_vocab_size, "num_hidden_layers": 1,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 1024, "hidden_act": "silu", "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_official_eagle3_layout_agrees_with_speculators_converter(eagle3_case, tmp_path):
    """draftlab's reading of an official EAGLE-3 folder matches speculators' converter of that layout."""
    client("speculators.convert.eagle.eagle3_converter", "speculators 0.9.0")
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators.models.eagle3 import Eagle3DraftModel

    x = eagle3_case
    folder = official_eagle3_folder(x.head, tmp_path / "official")
    found = find_foreign(str(folder))
    assert found.kind == "eagle3" and found.target is None
    ours = found.load(x.model)
    assert ours.aux_layers == x.head.aux_layers == [2, 4, 5]
    Eagle3Converter().convert(folder, tmp_path / "converted", base_model=x.target_dir, validate=False,
                              eagle_aux_hidden_state_layer_ids=[2, 4, 5])
    theirs = Eagle3DraftModel.from_pretrained(str(tmp_path / "converted")).eval()
    # An official EAGLE-3 folder has no embed_tokens (the head reads the target's), and speculators' converter
    # does not add one: its model is left with an uninitialised embedding (whatever was in memory; seen here
    # with sums near 1e30). Engines give the draft the target's embedding, as draftlab's import does.
    assert torch.equal(ours._borrowed.embed.weight, x.model.get_input_embeddings().weight)
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(x.model.get_input_embeddings().weight)
    aux = aux_states(x.model, ours, x.ids[:, :128])
    for a, b in zip(ours_ttt_logits(ours, aux, x.ids, 2), speculators_ttt_logits(theirs, aux, x.ids, 2)):
        close(a, b)


# ----------------------------------------------------------------------------------------------------------
# EAGLE-1/2: the reference head (eagle-llm 1.2.1, SafeAILab/EAGLE), both directions


def test_eagle_export_in_the_reference_eagle_head(tiny_target, tmp_path):
    client("eagle.model.cnets", "eagle-llm 1.2.1")
    from eagle.model.cnets import Model

    model, tok = tiny_target
    head = EagleHead.from_target(model, None).eval()
    perturb(head)
    out = hub.export_checkpoint(make_run(tmp_path / "run", head), tmp_path / "export", target=model, tokenizer=tok)
    # eagle-llm's EConfig subclasses transformers' config class, whose 5.x `rope_scaling` is never None (it
    # mirrors rope_parameters) and breaks the 4.x-era head; the head reads the same keys from config.json itself
    config = json.loads((out / "config.json").read_text())
    theirs = Model(SimpleNamespace(**config), bias=config["bias"]).eval()
    theirs.load_state_dict(load_file(str(out / "model.safetensors")), strict=True)    # every name, nothing extra
    feats = torch.randn(1, 24, 64)
    ids = torch.randint(0, len(tok), (1, 24))
    mask = additive(torch.ones(24, 24, dtype=torch.bool).tril()[None], torch.float32)
    with torch.no_grad():
        reference = theirs(feats, ids)
        close(head.logits(head(feats, ids, torch.arange(24)[None], mask)), head.logits(reference))
    # and back: the official folder alone (config.json + weights) imports as the same head
    found = find_foreign(str(native_copy(out, tmp_path / "official", ("config.json", "model.safetensors"))))
    assert found.kind == "eagle"
    again = found.load(model)
    with torch.no_grad():
        close(head.logits(again(feats, ids, torch.arange(24)[None], mask)), head.logits(reference))


# ----------------------------------------------------------------------------------------------------------
# Medusa heads: the current Medusa model code (medusa-llm 0.1, FasterDecoding/Medusa), both directions


def test_medusa_export_in_the_medusa_model_code(tiny_target, tiny_target_dir, tmp_path, monkeypatch):
    medusa_model = client("medusa.model.medusa_model", "medusa-llm 0.1")
    from transformers import LlamaForCausalLM

    monkeypatch.setitem(DRAFTERS, "medusa", MedusaHeads)
    model, tok = tiny_target
    heads = MedusaHeads.from_target(model, SimpleNamespace(medusa_heads=3, medusa_layers=1))
    perturb(heads)
    out = hub.export_checkpoint(make_run(tmp_path / "run", heads, target_path=tiny_target_dir), tmp_path / "export",
                                target=model, tokenizer=tok)
    # Medusa's KV-cache Llama targets transformers 4.x and cannot be built under 5.23: the target only is
    # transformers' own Llama; MedusaConfig, the heads and the head loader are Medusa's.
    monkeypatch.setattr(medusa_model, "KVLlamaForCausalLM", LlamaForCausalLM)
    namespace: dict = {}
    exec(snippet(out, "official Medusa code"), namespace)             # MedusaModel.from_pretrained(export)
    theirs = namespace["model"]
    hidden = torch.randn(1, 12, 64)
    with torch.no_grad():
        reference = torch.stack([theirs.medusa_head[k](hidden) for k in range(3)])
        close(heads.head_logits(hidden), reference)
        found = find_foreign(str(native_copy(out, tmp_path / "heads", ("config.json", "medusa_lm_head.pt",
                                                                        "medusa_choices.json"))))
        assert found.kind == "medusa" and found.target == str(Path(tiny_target_dir).resolve())
        again = found.load(model)
        assert again.tree_choices() == heads.tree_choices()
        close(again.head_logits(hidden), reference)


# ----------------------------------------------------------------------------------------------------------
# transformers 4.x and 5.x: the converted GGUF target and every export read the same in both majors


TEXTS = ["The quick brown fox.", "  two  spaces\nand\ta tab", "<|im_start|>user\nHi!<|im_end|>", "naïve café 123"]

# Under transformers 4.x: read every folder of `case.json`, run the card snippets as written, save what was read.
READ_IN_4 = r"""
import json
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig
case = json.loads(Path(sys.argv[1]).read_text())
ids, feats = torch.load(case["ids"]), torch.load(case["feats"])
out = {"rope": {}, "tokens": {}}
def tokens(tok):
    return [tok(t, add_special_tokens=False).input_ids for t in case["texts"]]
target = AutoModelForCausalLM.from_pretrained(case["target"]).eval()
out["rope"]["target"] = AutoConfig.from_pretrained(case["target"]).rope_theta
out["tokens"]["target"] = tokens(AutoTokenizer.from_pretrained(case["target"]))
small = AutoModelForCausalLM.from_pretrained(case["small_lm"]).eval()
out["rope"]["small_lm"] = small.config.rope_theta
out["tokens"]["small_lm"] = tokens(AutoTokenizer.from_pretrained(case["small_lm"]))
out["rope"]["eagle"] = AutoConfig.from_pretrained(case["eagle"]).rope_theta
layer = json.loads(Path(case["eagle3"], "config.json").read_text())["transformer_layer_config"]
out["rope"]["eagle3"] = LlamaConfig(**layer).rope_theta
ns = {}
exec(case["medusa_snippet"], ns)                      # MedusaModel.from_pretrained(export): base model + tokenizer
medusa = ns["model"]
out["rope"]["medusa"] = medusa.base_model.config.rope_theta
out["tokens"]["medusa"] = tokens(medusa.tokenizer)
ns = {}
exec(case["eagle_snippet"], ns)                       # EaModel.from_pretrained(base_model_path=..., ea_model_path=...)
eagle = ns["model"]
out["tokens"]["eagle"] = tokens(eagle.tokenizer)
with torch.no_grad():
    run = target(ids, output_hidden_states=True)
    hidden = run.hidden_states[-1]
    tensors = {"target_logits": run.logits, "target_hidden": hidden, "small_lm_logits": small(ids).logits,
               "medusa_heads": torch.stack([h(hidden) for h in medusa.medusa_head]),
               "eagle_head_1.2.1": eagle.ea_layer(feats, ids)}
    # eagle-llm 1.2.1's head always builds its rotary embedding with base 10,000; the current EAGLE repository's
    # (cnets1.py) reads config.json's rope_theta, as here:
    for layer in eagle.ea_layer.layers:
        old = layer.self_attn.rotary_emb
        layer.self_attn.rotary_emb = type(old)(old.dim, old.max_position_embeddings,
                                               base=layer.self_attn.config.rope_theta)
    tensors["eagle_head"] = eagle.ea_layer(feats, ids)
torch.save(tensors, case["tensors"])
Path(case["out"]).write_text(json.dumps(out))
"""


def test_converted_target_and_exports_read_the_same_in_transformers_4_and_5(tiny_tokenizer, tmp_path, monkeypatch):
    """A GGUF target with rope theta 100,000 (as SmolLM2's) converted by draftlab, and the eagle, eagle3, medusa and
    small_lm exports made against it: transformers 4.53.3 (the official EAGLE and Medusa code's, in a subprocess,
    with their card snippets run as written) reads the same rope base and tokenizer as 5.x, and computes the same
    target logits and last hidden state, small_lm logits, Medusa head logits and EAGLE head outputs."""
    for module, name in (("medusa", "medusa-llm 0.1"), ("eagle", "eagle-llm 1.2.1")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{name} is not installed (`bash .ci/run` installs it; see README.md, 'Checked with')")
    from draftlab.drafters.small_lm import SmallLM
    from draftlab.target import convert_gguf, load_target
    from test_target import write_tiny_gguf

    for cls in (SmallLM, EagleHead, EagleHead3, MedusaHeads):
        monkeypatch.setitem(DRAFTERS, cls.kind, cls)
    monkeypatch.setenv("DRAFTLAB_CACHE", str(tmp_path / "cache"))
    write_tiny_gguf(tiny_llama_theta(tiny_tokenizer, 100000.0), tiny_tokenizer, tmp_path / "tiny.gguf")
    folder = convert_gguf(str(tmp_path / "tiny.gguf"))
    target, tok = load_target(folder)
    torch.manual_seed(0)
    drafters = {"eagle": EagleHead.from_target(target, None),
                "eagle3": EagleHead3(target, draft_vocab_size=100, draft_vocab=list(range(50, 250, 2))),
                "medusa": MedusaHeads.from_target(target, SimpleNamespace(medusa_heads=2, medusa_layers=1)),
                "small_lm": SmallLM.from_target(target, SimpleNamespace(num_layers=1), tok)}
    case = {"target": folder, "texts": TEXTS, "ids": str(tmp_path / "ids.pt"), "feats": str(tmp_path / "feats.pt"),
            "out": str(tmp_path / "read.json"), "tensors": str(tmp_path / "tensors.pt")}
    for kind, drafter in drafters.items():
        perturb(drafter.eval())
        run = make_run(tmp_path / f"run_{kind}", drafter, target_path=folder)
        case[kind] = str(hub.export_checkpoint(run, tmp_path / kind, target=target, tokenizer=tok))
    assert json.loads((Path(case["medusa"]) / "config.json").read_text())["base_model_name_or_path"] == folder
    case["medusa_snippet"] = snippet(Path(case["medusa"]), "official Medusa code")
    case["eagle_snippet"] = snippet(Path(case["eagle"]), "official EAGLE code")
    ids = torch.tensor([tok.encode(" ".join(TEXTS))[:40]])
    feats = torch.randn(1, ids.shape[1], target.config.hidden_size)
    torch.save(ids, case["ids"])
    torch.save(feats, case["feats"])
    (tmp_path / "case.json").write_text(json.dumps(case))
    in_transformers4(READ_IN_4, str(tmp_path / "case.json"))
    four, theirs = json.loads((tmp_path / "read.json").read_text()), torch.load(case["tensors"])

    # transformers 5.x, in this process
    from transformers import AutoConfig, AutoTokenizer

    def tokens(t):
        return [t(text, add_special_tokens=False).input_ids for text in TEXTS]

    assert four["rope"] == dict.fromkeys(["target", "small_lm", "eagle", "eagle3", "medusa"], 100000.0)
    assert AutoConfig.from_pretrained(folder).rope_parameters["rope_theta"] == 100000.0
    for kind in ("small_lm", "eagle"):
        assert AutoConfig.from_pretrained(case[kind]).rope_parameters["rope_theta"] == 100000.0
    reference = tokens(tiny_tokenizer)
    assert tokens(tok) == tokens(AutoTokenizer.from_pretrained(case["small_lm"])) == reference
    assert four["tokens"] == dict.fromkeys(["target", "small_lm", "medusa", "eagle"], reference)
    with torch.no_grad():
        run = target(ids, output_hidden_states=True)
        hidden = run.hidden_states[-1]
        close(theirs["target_logits"], run.logits)
        torch.testing.assert_close(theirs["target_hidden"], hidden, rtol=1e-4, atol=1e-4)
        close(theirs["small_lm_logits"], drafters["small_lm"](ids))
        close(theirs["medusa_heads"], drafters["medusa"].head_logits(hidden))
        head = drafters["eagle"]
        mask = additive(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()[None], torch.float32)
        ours = head(feats, ids, torch.arange(ids.shape[1])[None], mask)
        close(head.logits(theirs["eagle_head"]), head.logits(ours))
        assert not torch.allclose(theirs["eagle_head_1.2.1"], ours, atol=1e-4)     # the card's note on eagle-llm
