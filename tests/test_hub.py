"""Hub export and upload: round-trips of every export format, the official EAGLE-1 and speculators layouts, the
model card (front matter, tau table, plot), and the upload path against a local HTTP stand-in for the Hub."""
from __future__ import annotations

import base64
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

from draftlab import hub
from draftlab.checkpoint import save_drafter
from draftlab.drafters import load_drafter
from draftlab.drafters import DRAFTERS
from draftlab.drafters.eagle import EagleHead
from draftlab.trees import additive

TOKEN = "hf_FAKEtoken0123456789secret"
REPORT = {"acceptance_length": 2.3456, "acceptance_length_macro": 2.2, "per_position_acceptance": [0.8, 0.5, 0.2],
          "draft_length": 3, "temperature": 0.0, "tree": {"kind": "chain", "draft_length": 3}, "num_prompts": 4,
          "lossless": True, "speedup": 1.5}


def make_run(root: Path, drafter, target_path: str = "HuggingFaceTB/SmolLM2-135M-Instruct", step: int = 3) -> Path:
    """A run folder as train.py leaves it: config.yaml, step_N with eval.json, best."""
    save_drafter(drafter, root / f"step_{step}", extra_files={"eval.json": json.dumps(REPORT)})
    (root / "best").write_text(f"step_{step}\n")
    (root / "config.yaml").write_text(yaml.safe_dump({
        "recipe": "eagle_head", "target": {"path": target_path},
        "data": {"train": "answers.jsonl", "eval_prompts": "data_prep/prompts/mtbench.jsonl"},
        "drafter": {"kind": drafter.kind}, "train": {"max_steps": step, "lr": 0.001}}))
    return root


def card(folder: Path) -> tuple[dict, str]:
    text = (folder / "README.md").read_text()
    _, front, body = text.split("---\n", 2)
    return yaml.safe_load(front), body


def tau_rows(body: str) -> list[list[str]]:
    lines = body.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| prompt set |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def eagle3_class():
    """The EAGLE-3 head class (named EagleHead3, formerly Eagle3Head)."""
    from draftlab.drafters import eagle3

    return getattr(eagle3, "EagleHead3", None) or getattr(eagle3, "Eagle3Head")


@pytest.fixture
def eagle_run(tiny_target, tmp_path):
    torch.manual_seed(0)
    return make_run(tmp_path / "run", EagleHead.from_target(tiny_target[0], None).eval())


# ----------------------------------------------------------------------------------------------------------
# export formats


def test_eagle_export_round_trips_and_official_layout(eagle_run, tiny_target, tmp_path):
    model, tok = tiny_target
    out = hub.export_checkpoint(eagle_run, tmp_path / "export", target=model, tokenizer=tok, repo_id="me/tiny")
    assert {"README.md", "acceptance.png", "config.json", "model.safetensors", "best", "export.json"} <= {
        p.name for p in out.iterdir()}
    # The export is a checkpoint: load_drafter reaches draftlab/ through `best`; identical outputs.
    original, loaded = load_drafter(eagle_run, model).eval(), load_drafter(out, model).eval()
    feats, ids, pos = torch.randn(1, 6, 64), torch.randint(0, len(tok), (1, 6)), torch.arange(6)[None]
    mask = additive(torch.ones(6, 6, dtype=torch.bool).tril()[None], torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(feats, ids, pos, mask), original(feats, ids, pos, mask), rtol=0, atol=0)

    # Official EAGLE layout: its names, the target's embedding, no input_layernorm in layer 0.
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == 64 and config["bias"] is True
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == len(tok)
    weights = load_file(str(out / "model.safetensors"))
    layer = {f"layers.0.self_attn.{n}_proj.weight" for n in "qkvo"} | {
        f"layers.0.mlp.{n}_proj.weight" for n in ("gate", "up", "down")} | {"layers.0.post_attention_layernorm.weight"}
    assert set(weights) == {"fc.weight", "fc.bias", "embed_tokens.weight"} | layer
    assert torch.equal(weights["embed_tokens.weight"], model.get_input_embeddings().weight)
    native = load_file(str(eagle_run / "step_3" / "model.safetensors"))
    assert all(torch.equal(weights[k], v) for k, v in native.items())       # our names are the official ones


def test_eagle_two_layers_and_no_fc_bias(tiny_target, tmp_path):
    model, tok = tiny_target
    head = EagleHead.from_target(model, SimpleNamespace(num_layers=2, fc_bias=False))
    out = hub.export_checkpoint(make_run(tmp_path / "run", head), tmp_path / "export", target=model, tokenizer=tok)
    weights = load_file(str(out / "model.safetensors"))
    assert "layers.1.input_layernorm.weight" in weights and "layers.0.input_layernorm.weight" not in weights
    config = json.loads((out / "config.json").read_text())
    # no FC bias, and `bias` false: vLLM reads that key as an attention bias it would build and never load
    assert "fc.bias" not in weights and config["bias"] is False and config["num_hidden_layers"] == 2
    _, body = card(out)
    assert '"method": "eagle"' in body                                      # vLLM can serve a bias-free head


def test_eagle3_speculators_export(tiny_tokenizer, tmp_path, monkeypatch):
    from conftest import build_tiny_llama

    Eagle3Head = eagle3_class()
    monkeypatch.setitem(DRAFTERS, "eagle3", Eagle3Head)
    model = build_tiny_llama(tiny_tokenizer, layers=8).requires_grad_(False)
    vocab = list(range(40, 240, 2))
    torch.manual_seed(0)
    head = Eagle3Head(model, draft_vocab_size=len(vocab), draft_vocab=vocab)
    out = hub.export_checkpoint(make_run(tmp_path / "run", head), tmp_path / "export", target=model,
                                tokenizer=tiny_tokenizer, repo_id="me/e3")
    config = json.loads((out / "config.json").read_text())
    spec = config["speculators_config"]
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == REPORT["draft_length"]
    assert spec["verifier"] == {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                "architectures": ["LlamaForCausalLM"]}
    assert config["draft_vocab_size"] == len(vocab) and config["norm_before_residual"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == head.aux_layers
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    weights = load_file(str(out / "model.safetensors"))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "layers.0.hidden_norm.weight",
            "layers.0.input_layernorm.weight", "layers.0.self_attn.q_proj.weight", "d2t", "t2d"} <= set(weights)
    assert not any(k.startswith(("layer.", "emb_norm")) for k in weights)
    assert weights["t2d"].dtype == torch.bool and int(weights["t2d"].sum()) == len(vocab)
    assert (torch.arange(len(vocab)) + weights["d2t"]).tolist() == vocab   # target id = draft id + d2t
    torch.testing.assert_close(weights["layers.0.hidden_norm.weight"], head.layer.input_layernorm.weight)
    torch.testing.assert_close(weights["layers.0.input_layernorm.weight"], head.emb_norm.weight)
    loaded = load_drafter(out, model)
    assert loaded.draft_vocab.tolist() == vocab
    _, body = card(out)
    assert "vllm serve me/e3" in body and "Not supported by SGLang" in body


def test_eagle3_export_loads_in_speculators(tiny_tokenizer, tmp_path, monkeypatch):
    """The speculators config classes read the export and its model computes what our head computes."""
    pytest.importorskip("speculators.models.eagle3", exc_type=ImportError)
    from conftest import build_tiny_llama
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    Eagle3Head = eagle3_class()
    monkeypatch.setitem(DRAFTERS, "eagle3", Eagle3Head)
    model = build_tiny_llama(tiny_tokenizer, layers=8).requires_grad_(False)
    head = Eagle3Head(model, draft_vocab_size=100, draft_vocab=list(range(50, 250, 2))).eval()
    out = hub.export_checkpoint(make_run(tmp_path / "run", head), tmp_path / "export", target=model,
                                tokenizer=tiny_tokenizer)
    config = Eagle3SpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = Eagle3DraftModel(config).eval()
    weights = load_file(str(out / "model.safetensors"))
    weights["embed_tokens.weight"] = model.get_input_embeddings().weight
    result = theirs.load_state_dict(weights, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"verifier_lm_head.weight",
                                                                        "verifier_norm.weight"}
    g, ids, pos = torch.randn(1, 7, 3 * 64), torch.randint(0, len(tiny_tokenizer), (1, 7)), torch.arange(7)[None]
    mask = additive(torch.ones(7, 7, dtype=torch.bool).tril()[None], torch.float32)
    with torch.no_grad():
        x = torch.cat([theirs.embed_tokens(ids), theirs.fc(g)], -1)
        y = theirs.layers[0](x, attention_mask=mask, position_ids=pos, position_embeddings=theirs.rotary_emb(x, pos))
        y = y[0] if isinstance(y, tuple) else y
        ours = head(g, ids, pos, mask)
        torch.testing.assert_close(ours, y)
        torch.testing.assert_close(head.draft_logits(ours), theirs.lm_head(theirs.norm(y)))


def test_medusa_heads_layout(tiny_target, tmp_path, monkeypatch):
    from draftlab.drafters.medusa import MedusaHeads

    monkeypatch.setitem(DRAFTERS, "medusa", MedusaHeads)
    model, tok = tiny_target
    heads = MedusaHeads.from_target(model, SimpleNamespace(medusa_heads=3, medusa_layers=1))
    out = hub.export_checkpoint(make_run(tmp_path / "run", heads), tmp_path / "export", target=model, tokenizer=tok,
                                repo_id="me/medusa")
    config = json.loads((out / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 1
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    weights = load_file(str(out / "medusa_lm_head.safetensors"))
    assert set(weights) == {f"{k}.0.linear.{p}" for k in range(3) for p in ("weight", "bias")} | {
        f"{k}.1.weight" for k in range(3)}
    torch.testing.assert_close(weights["2.1.weight"], heads.heads[2][1].weight)
    assert set(torch.load(out / "medusa_lm_head.pt")) == set(weights)
    assert json.loads((out / "medusa_choices.json").read_text()) == heads.tree_choices()
    assert "text-generation-launcher --model-id me/medusa" in card(out)[1]


def test_medusa2_export_is_the_adapted_target(tiny_tokenizer, tiny_target_dir, tmp_path, monkeypatch):
    from conftest import build_tiny_llama
    from transformers import AutoModelForCausalLM

    from draftlab.drafters.medusa2 import Medusa2Lora

    monkeypatch.setitem(DRAFTERS, "medusa2", Medusa2Lora)
    model = build_tiny_llama(tiny_tokenizer).requires_grad_(False)
    torch.manual_seed(0)
    drafter = Medusa2Lora.from_target(model, SimpleNamespace(lora_r=4, lora_alpha=8, medusa_heads=2))
    with torch.no_grad():                          # LoRA B starts at zero: move it so the adapted model differs
        for name, p in drafter.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ids = torch.tensor(tiny_tokenizer("The quick brown fox")["input_ids"])[None]
    with torch.no_grad():
        adapted = model(ids).logits
    run = make_run(tmp_path / "run", drafter, target_path=tiny_target_dir)
    out = hub.export_checkpoint(run, tmp_path / "export", repo_id="me/m2")
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=1e-4, atol=1e-4)
    config = json.loads((out / "config.json").read_text())
    assert config["base_model_name_or_path"] == "me/m2" and config["medusa_num_heads"] == 2
    front, _ = card(out)
    assert front["library_name"] == "transformers" and front["pipeline_tag"] == "text-generation"


def test_small_lm_export_is_an_assistant_model(tiny_target, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from draftlab.drafters.small_lm import SmallLM

    monkeypatch.setitem(DRAFTERS, "small_lm", SmallLM)
    model, tok = tiny_target
    torch.manual_seed(0)
    drafter = SmallLM.from_target(model, SimpleNamespace(num_layers=1), tok)
    out = hub.export_checkpoint(make_run(tmp_path / "run", drafter), tmp_path / "export", target=model,
                                tokenizer=tok, repo_id="me/small")
    draft = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor(tok("<|im_start|>user\nThe quick brown fox<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    plain = model.generate(ids[None], **kw)
    assisted = model.generate(ids[None], assistant_model=draft, **kw)
    assert torch.equal(plain, assisted)
    front, body = card(out)
    assert front["library_name"] == "transformers" and "assistant_model=draft" in body
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()


def test_acceptance_head_exports_beside_its_drafter(tiny_target, tmp_path, monkeypatch):
    from draftlab.drafters.acceptance import AcceptanceHead
    from draftlab.drafters.small_lm import SmallLM

    monkeypatch.setitem(DRAFTERS, "small_lm", SmallLM)
    monkeypatch.setitem(DRAFTERS, "acceptance", AcceptanceHead)
    model, tok = tiny_target
    torch.manual_seed(0)
    save_drafter(SmallLM.from_target(model, SimpleNamespace(num_layers=1), tok), tmp_path / "base" / "step_1")
    head = AcceptanceHead.from_target(model, SimpleNamespace(base=str(tmp_path / "base"), acceptance_layers=2))
    out = hub.export_checkpoint(make_run(tmp_path / "run", head), tmp_path / "export", target=model, tokenizer=tok)
    assert (out / "config.json").is_file() and (out / "draftlab" / "base" / "drafter_config.json").is_file()
    weights = load_file(str(out / "acceptance_head" / "model.safetensors"))
    assert set(weights) == {"blocks.0.linear.weight", "blocks.0.linear.bias", "blocks.1.linear.weight",
                            "blocks.1.linear.bias", "out.weight", "out.bias"}
    assert json.loads((out / "acceptance_head" / "config.json").read_text())["acceptance_layers"] == 2
    (tmp_path / "base").rename(tmp_path / "base_moved")          # the export no longer needs the original base
    out = out.rename(tmp_path / "export_moved")                  # and loads wherever it is copied
    assert json.loads((out / "draftlab" / "drafter_config.json").read_text())["base"] == "base"
    loaded = load_drafter(out, model).eval()
    states = torch.randn(5, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(states), head(states))
    assert "adaptively" in card(out)[1]


def test_format_must_fit_the_kind(eagle_run, tiny_target, tmp_path):
    with pytest.raises(hub.HubError, match="does not fit"):
        hub.export_checkpoint(eagle_run, tmp_path / "x", fmt="medusa", target=tiny_target[0])
    out = hub.export_checkpoint(eagle_run, tmp_path / "native", fmt="draftlab", target=tiny_target[0])
    assert not (out / "config.json").exists() and (out / "draftlab" / "model.safetensors").is_file()


# ----------------------------------------------------------------------------------------------------------
# model card


def test_card_front_matter_and_tau_table(eagle_run, tiny_target, tmp_path):
    extra = dict(REPORT, acceptance_length=3.1, prompts="prompts/humaneval.jsonl",
                 tree={"kind": "dynamic", "depth": 4, "top_k": 8, "total_tokens": 32})
    (tmp_path / "he.json").write_text(json.dumps(extra))
    out = hub.export_checkpoint(eagle_run, tmp_path / "export", target=tiny_target[0], repo_id="me/tiny",
                                eval_reports=[tmp_path / "he.json"], license="mit")
    front, body = card(out)
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and front["license"] == "mit"
    assert front["library_name"] == "draftlab" and {"speculative-decoding", "draftlab", "eagle"} <= set(front["tags"])
    own = json.loads((eagle_run / "step_3" / "eval.json").read_text())
    rows = tau_rows(body)
    assert [r[3] for r in rows] == [f"{own['acceptance_length']:.3f}", f"{extra['acceptance_length']:.3f}"]
    assert rows[0][0].startswith("mtbench") and rows[1][0] == "humaneval" and "dynamic" in rows[1][1]
    assert rows[0][5] == ", ".join(f"{a:.2f}" for a in own["per_position_acceptance"])
    assert "![per-position acceptance](acceptance.png)" in body and (out / "acceptance.png").stat().st_size > 0
    assert "answers.jsonl" in body and "eagle_head" in body                 # training data and recipe
    assert "--speculative-num-steps 3" in body                               # SGLang mirrors the evaluated chain
    with pytest.raises(hub.HubError, match="not a draftlab eval report"):
        (tmp_path / "bad.json").write_text("{}")
        hub.export_checkpoint(eagle_run, tmp_path / "e2", target=tiny_target[0], eval_reports=[tmp_path / "bad.json"])


def test_card_without_a_hub_target(tiny_target, tiny_target_dir, tmp_path):
    model, tok = tiny_target
    run = make_run(tmp_path / "run", EagleHead.from_target(model, None), target_path=tiny_target_dir)
    front, body = card(hub.export_checkpoint(run, tmp_path / "export", target=model, tokenizer=tok))
    assert "base_model" not in front and "--base-model" in body
    front, _ = card(hub.export_checkpoint(run, tmp_path / "e2", target=model, base_model="org/tiny-llama"))
    assert front["base_model"] == "org/tiny-llama"


# ----------------------------------------------------------------------------------------------------------
# upload


class FakeHub:
    """A local stand-in for the Hub endpoints create_repo + upload_folder use (huggingface_hub 2.x: repos/create,
    branch, validate-yaml, preupload answering "regular" for every file, commit with base64 ndjson). Records every
    request; `fail` maps a path fragment to (status, error). Stops by itself after 60 s at the latest."""

    def __init__(self, fail: dict | None = None):
        self.requests, self.files, self.fail = [], {}, fail or {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.answer()

            def do_POST(self):
                self.answer()

            def answer(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?")[0]
                fake.requests.append((path, {k.lower(): v for k, v in self.headers.items()}, body))
                status = next((s for key, s in fake.fail.items() if key in path), None)
                if status:
                    return self.reply(status[0], {"error": status[1]})
                if path == "/api/repos/create":
                    data = json.loads(body)
                    return self.reply(200, {"url": f"{fake.url}/{data['organization']}/{data['name']}"})
                if "/preupload/" in path:
                    files = json.loads(body)["files"]
                    return self.reply(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                       "shouldIgnore": False} for f in files]})
                if "/commit/" in path:
                    for line in body.splitlines():
                        item = json.loads(line)
                        if item["key"] == "file":
                            fake.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    repo = "/".join(path.split("/")[3:5])
                    return self.reply(200, {"commitUrl": f"{fake.url}/{repo}/commit/{'a' * 40}", "commitOid": "a" * 40})
                if path == "/api/validate-yaml" or "/branch/" in path:
                    return self.reply(200, {})
                return self.reply(404, {"error": f"no such endpoint {path}"})

            def reply(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.timer = threading.Timer(60, self.server.shutdown)
        self.timer.daemon = True
        self.timer.start()

    def close(self):
        self.timer.cancel()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """Online mode, a fake token, no token file; returns a factory of FakeHubs bound to HF_ENDPOINT."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    servers = []

    def start(fail=None):
        servers.append(FakeHub(fail))
        monkeypatch.setenv("HF_ENDPOINT", servers[-1].url)
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_push_uploads_the_export(eagle_run, tiny_target, hub_env):
    fake = hub_env()
    url = hub.push_checkpoint(eagle_run, "me/tiny-eagle", private=True, revision="dev", target=tiny_target[0],
                              tokenizer=tiny_target[1])
    assert url.endswith("/me/tiny-eagle/commit/" + "a" * 40)
    paths = [p for p, _, _ in fake.requests]
    assert paths[0] == "/api/repos/create" and "/api/models/me/tiny-eagle/branch/dev" in paths
    assert any("/preupload/dev" in p for p in paths) and paths[-1] == "/api/models/me/tiny-eagle/commit/dev"
    create = json.loads(fake.requests[0][2])
    assert create["name"] == "tiny-eagle" and create["organization"] == "me" and create["visibility"] == "private"
    assert all(h.get("authorization") == f"Bearer {TOKEN}" for _, h, _ in fake.requests)
    export = eagle_run / "hub_export" / "me--tiny-eagle"
    local = {str(p.relative_to(export)): p.read_bytes() for p in export.rglob("*") if p.is_file()}
    assert fake.files == local and "draftlab/model.safetensors" in local
    assert "sglang.launch_server" in local["README.md"].decode() and "me/tiny-eagle" in local["README.md"].decode()

    # Pushing the export folder itself uploads it as is (the retry path), re-rendering the card for a new repo.
    fake = hub_env()
    hub.push_checkpoint(export, "me/other")
    assert "me/other" in fake.files["README.md"].decode()


def _push_cli(argv, capsys):
    from draftlab.cli import main

    code = main(["push", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("fail, expect", [
    ({"/api/repos/create": (401, "Invalid credentials")}, "rejected the token"),
    ({"/commit/": (403, "You don't have the rights")}, "may not write to me/tiny"),
    ({"/preupload/": (404, "Repository not found")}, "was not found"),
    ("dead", "cannot reach the Hub"),
])
def test_upload_errors_are_one_line_without_the_token(fail, expect, eagle_run, tiny_target_dir, hub_env, capsys,
                                                      caplog, monkeypatch):
    import logging

    caplog.set_level(logging.DEBUG)
    if fail == "dead":                                     # a closed port: connection refused at once
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    else:
        hub_env(fail)
    code, out, err = _push_cli([str(eagle_run), "--repo-id", "me/tiny", "--target", tiny_target_dir], capsys)
    lines = [line for line in err.splitlines() if line.startswith("draftlab: error")]
    assert code == 2 and len(lines) == 1 and expect in lines[0]
    export = eagle_run / "hub_export" / "me--tiny"
    assert lines[0].endswith(f"retry: draftlab push {export} --repo-id me/tiny") and (export / "README.md").is_file()
    assert TOKEN not in out + err + caplog.text


def test_no_token_and_wrong_repo_type(eagle_run, tiny_target_dir, hub_env, capsys, monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    code, _, err = _push_cli([str(eagle_run), "--repo-id", "me/tiny", "--target", tiny_target_dir], capsys)
    assert code == 2 and "no Hugging Face token" in err and "retry: draftlab push" in err
    code, _, err = _push_cli([str(eagle_run), "--repo-id", "datasets/me/tiny"], capsys)
    assert code == 2 and "dataset repository" in err
    assert not (eagle_run / "hub_export" / "datasets--me--tiny").exists()       # refused before exporting


def test_cli_local_export_then_eval(eagle_run, tiny_target_dir, tiny_prompt_file, tmp_path, capsys):
    from draftlab.cli import main

    code, out, _ = _push_cli([str(eagle_run), "--to", str(tmp_path / "export"), "--target", tiny_target_dir], capsys)
    assert code == 0 and "model.safetensors" in out and "draftlab/drafter_config.json" in out
    code = main(["eval", "--checkpoint", str(tmp_path / "export"), "--target", tiny_target_dir, "--prompts",
                 tiny_prompt_file, "--out", str(tmp_path / "r.json"), "--num-prompts", "1", "--max-new-tokens", "6",
                 "--draft-length", "2"])
    assert code == 0 and json.loads((tmp_path / "r.json").read_text())["lossless"] is True
