"""The model card of an export: YAML front matter, measured acceptance length, usage per serving engine, recipe.

Everything is read from the export folder itself (hub.py writes it): export.json (what was exported), the native
checkpoint's eval.json, the extra eval reports and the run's config.yaml under draftlab/. So the card can be
rendered again later, e.g. when an export made with `--to` is pushed under a repository id.
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from draftlab.errors import HubError
from draftlab.report import fmt, tree_label

NATIVE_DIR = "draftlab"          # the draftlab checkpoint inside an export
MARKER = "export.json"           # what was exported, for re-rendering the card and for pushing an export as is
REPORTS_DIR = "eval_reports"     # extra `--eval` reports, inside NATIVE_DIR

FORMAT_NAMES = {"eagle": "the official EAGLE-1/2 layout (SafeAILab/EAGLE)",
                "speculators": "the speculators format (vllm-project/speculators) that vLLM serves",
                "medusa": "the Medusa heads layout (FasterDecoding/Medusa, TGI)",
                "gumiho": "the official Gumiho layout (AMD-AIG-AIMA/Gumiho)",
                "hf": "a standard transformers model folder", "draftlab": "the draftlab checkpoint only"}
PLOT_NAME = "acceptance.png"


def write_card(folder: str | Path) -> Path:
    """Render README.md (and the acceptance plot) for the export in `folder`; returns the README path."""
    folder = Path(folder)
    meta = json.loads((folder / MARKER).read_text())
    native = folder / NATIVE_DIR
    run = yaml.safe_load((native / "config.yaml").read_text()) if (native / "config.yaml").is_file() else None
    reports = collect_reports(native, sorted((native / REPORTS_DIR).glob("*.json")), run, meta.get("step"))
    plotted = plot_acceptance(reports, folder / PLOT_NAME)
    readme = folder / "README.md"
    readme.write_text(render_card(meta, reports, run, plotted))
    return readme


def read_report(path) -> tuple[str, dict]:
    """(path, report) of a `draftlab eval` report JSON, checked to be one."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HubError(f"--eval {path}: cannot read it as JSON ({type(e).__name__}): pass a report written by "
                       "`draftlab eval --out`") from None
    if not isinstance(report, dict) or "acceptance_length" not in report:
        raise HubError(f"--eval {path} is not a draftlab eval report (no acceptance_length): pass a report written "
                       "by `draftlab eval --out`")
    return str(path), report


def commit_message_for(export: Path) -> str:
    """Default commit message: kind, step, format and tau."""
    meta = json.loads((export / MARKER).read_text()) if (export / MARKER).is_file() else {}
    own = export / NATIVE_DIR / "eval.json"
    tau = json.loads(own.read_text()).get("acceptance_length") if own.is_file() else None
    return (f"draftlab {meta.get('kind', 'drafter')} ({meta.get('step', '?')}, {meta.get('format', '?')} format)"
            + (f", tau {tau:.2f}" if isinstance(tau, (int, float)) else ""))


def collect_reports(native: Path, extra: list[Path], run: dict | None, step: str | None) -> list[tuple[str, dict]]:
    """(prompt-set label, report) pairs: the checkpoint's own eval.json first, then the extra reports."""
    out = []
    if (native / "eval.json").is_file():
        prompts = ((run or {}).get("data") or {}).get("eval_prompts")
        label = f"{Path(prompts).stem if prompts else 'eval prompts'} (in-training eval, {step})"
        out.append((label, json.loads((native / "eval.json").read_text())))
    for path in extra:
        report = json.loads(path.read_text())
        out.append((Path(report["prompts"]).stem if report.get("prompts") else path.stem.split("_", 1)[-1], report))
    return out


def front_matter(meta: dict) -> dict:
    """base_model (only a real Hub id), library_name, license, tags, pipeline_tag when the repo is a full LM."""
    kind, fmt = meta["kind"], meta["format"]
    full_lm = fmt == "hf" or (meta.get("details") or {}).get("merged_target")
    data = {"license": meta.get("license") or "apache-2.0",
            "library_name": "transformers" if full_lm else "draftlab",
            "tags": ["speculative-decoding", "draftlab", kind] + ([fmt] if fmt not in ("draftlab", kind, "hf") else [])}
    if meta.get("base_model"):
        data["base_model"] = meta["base_model"]
    if full_lm:
        data["pipeline_tag"] = "text-generation"
    return data


def tau_table(reports: list[tuple[str, dict]]) -> str:
    lines = ["| prompt set | draft | temperature | tau | tau per prompt (mean) | per-position acceptance | speedup "
             "| lossless | prompts |", "|---|---|---|---|---|---|---|---|---|"]
    for label, r in reports:
        per_pos = ", ".join(fmt(float(a), 2) for a in r.get("per_position_acceptance") or [])
        speedup = f"{r['speedup']:.2f}x" if isinstance(r.get("speedup"), (int, float)) else "-"
        lines.append(f"| {label} | {tree_label(r)} | {fmt(float(r.get('temperature') or 0.0), 2)} | "
                     f"{fmt(r.get('acceptance_length'))} | {fmt(r.get('acceptance_length_macro'))} | {per_pos} | "
                     f"{speedup} | {fmt(r.get('lossless')) if r.get('lossless') is not None else 'n/a'} | "
                     f"{fmt(r.get('num_prompts'))} |")
    return "\n".join(lines)


def plot_acceptance(reports: list[tuple[str, dict]], path: Path) -> bool:
    """Per-position acceptance, one line per report; False (no file) when no report has it."""
    rows = [(label, r) for label, r in reports if r.get("per_position_acceptance")]
    if not rows:
        path.unlink(missing_ok=True)
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for label, r in rows:
        acc = r["per_position_acceptance"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{label}: tau {fmt(r.get('acceptance_length'), 2)}")
    ax.set_xticks(range(1, max(len(r["per_position_acceptance"]) for _, r in rows) + 1))
    ax.set(xlabel="draft position (depth)", ylabel="share of rounds accepted", ylim=(0, 1.02),
           title="Per-position acceptance")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def chain_k(meta: dict, reports) -> int:
    return int(meta.get("draft_length") or next((r.get("draft_length") for _, r in reports if r.get("draft_length")),
                                                None) or 5)


def sglang_tree_flags(reports, k: int) -> str:
    """The SGLang draft shape matching the first evaluated one (chain: top-k 1, k+1 draft tokens)."""
    tree = (reports[0][1].get("tree") if reports else None) or {}
    if tree.get("kind") == "dynamic":
        return (f"--speculative-num-steps {tree['depth']} --speculative-eagle-topk {tree['top_k']} "
                f"--speculative-num-draft-tokens {tree['total_tokens'] + 1}")
    return f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"


def target_name(meta: dict) -> str:
    """The target as other tools load it: the export's verifier (a Hub id or a local transformers folder)."""
    return meta.get("verifier") or meta.get("base_model") or meta.get("target") or "TARGET"


def python_block(code: str) -> str:
    return f"```python\n{code}\n```"


VLLM_CHECKED = ("draftlab's CI serves this format in vLLM 0.32 (tests/test_vllm_serving.py): greedy answers and "
                "acceptance counts (`/metrics`: drafts, accepted tokens) equal `draftlab eval`'s. On a CPU, "
                "`draftlab engine build --vllm` sets up vLLM's CPU build and `draftlab engine serve --vllm --target "
                "TARGET --export .` starts the same server.")


def vllm_serve(base: str, method: str, repo: str, k: int) -> str:
    """The `vllm serve` line of a drafter served with `--speculative-config` (vllm_tools.METHODS)."""
    return (f"```bash\nvllm serve {base} --speculative-config "
            f"'{{\"method\": \"{method}\", \"model\": \"{repo}\", \"num_speculative_tokens\": {k}}}'\n```\n\n"
            + VLLM_CHECKED)


def usage(meta: dict, reports) -> dict[str, str]:
    """Engine -> markdown: a command that loads this export, or why that engine cannot."""
    repo = meta.get("repo_id") or "ORG/NAME"
    base = target_name(meta)
    fmt_, k = meta["format"], chain_k(meta, reports)
    details = meta.get("details") or {}
    no_tf = ("Not supported by transformers: `generate(assistant_model=...)` needs a complete language model, and "
             "this drafter reads the target's hidden states.")
    sh = "```bash\n{}\n```".format
    if fmt_ == "eagle":
        vllm = vllm_serve(base, "eagle", repo, k) + " vLLM's EAGLE-1 drafter is built for Llama-architecture targets."
        if details.get("fc_bias", True):
            vllm = ("Not supported by vLLM as exported: vLLM's EAGLE-1 module has no FC bias and would drop this "
                    "head's trained `fc.bias`; a head trained with `drafter.fc_bias=false` serves in vLLM.")
        return {"vLLM": vllm,
                "SGLang": sh(f"python -m sglang.launch_server --model-path {base} --speculative-algorithm EAGLE \\\n"
                             f"  --speculative-draft-model-path {repo} {sglang_tree_flags(reports, k)}"),
                "transformers": no_tf,
                "official EAGLE code": python_block(
                    "from eagle.model.ea_model import EaModel   # eagle-llm 1.2.1, under transformers 4.x\n\nmodel = "
                    f"EaModel.from_pretrained(base_model_path=\"{base}\", ea_model_path=\"{repo}\")")
                + "\n\nThe current SafeAILab/EAGLE repository takes `use_eagle3=False` as well and reads the target's "
                  "embedding through the target folder's `model.safetensors.index.json` (draftlab's converted GGUF "
                  "folders carry one; a target with a single model.safetensors and no index needs one). eagle-llm "
                  "1.2.1's target class and head always use rope theta 10,000, so it serves only targets with that "
                  "rope base faithfully."}
    if fmt_ == "speculators":
        vllm = (sh(f"vllm serve {repo}   # the speculators config names the target; vLLM loads both") + "\n\nor, "
                "explicitly:\n\n" + vllm_serve(base, "eagle3", repo, k))
        if details.get("repeated_aux"):
            vllm = (f"Not supported by vLLM for this head: its aux layer ids {details['aux_layers']} repeat a layer "
                    "and vLLM collects each target layer once (a target with more layers gives distinct ids).")
        return {"vLLM": vllm, "transformers": no_tf,
                "SGLang": "Not supported by SGLang as exported: its EAGLE-3 loader expects the official EAGLE-3 "
                          "config and weight layout, not the speculators format.",
                "speculators": python_block(
                    "from speculators.models.eagle3 import Eagle3DraftModel\n\n"
                    f"draft = Eagle3DraftModel.from_pretrained(\"{repo}\")   # also reads the verifier the "
                    "config names")}
    if fmt_ == "medusa":
        shared = ("" if details.get("layers", 1) == 1 else " The official Medusa code shares one ResBlock across "
                  "a head's layers, so these multi-layer heads load correctly only in TGI.")
        heads = int(details.get("heads") or k)
        out = {"vLLM": vllm_serve(base, "medusa", repo, min(k, heads)) + " vLLM drafts a chain from the heads' top-1 "
                       f"tokens (up to {heads}, one per head), not Medusa's tree.",
               "SGLang": "Not supported by SGLang (it has no Medusa heads).",
               "transformers": no_tf,
               "TGI": sh(f"text-generation-launcher --model-id {repo}   # reads medusa_num_heads and "
                         "base_model_name_or_path from config.json"),
               "official Medusa code": python_block(
                   "from medusa.model.medusa_model import MedusaModel\n\n"
                   f"model = MedusaModel.from_pretrained(\"{repo}\")   # base model from base_model_name_or_path")
               + "\n\nUse `medusa.model.medusa_model`: `medusa_model_legacy` builds heads without their vocabulary "
                 "projection and silently drops the trained one. medusa-llm 0.1's target class always uses rope "
                 "theta 10,000, so it serves only targets with that rope base faithfully." + shared}
        if details.get("merged_target"):
            out["vLLM"] = ("Not supported by vLLM as exported: this Medusa-2 export's target is adapted (LoRA merged), "
                           "and vLLM's `medusa` drafter reads only heads beside an unchanged target.")
            out["transformers"] = ("The adapted (LoRA-merged) target is the model here; transformers' `generate` "
                                   "serves it without the heads:\n\n" + python_block(
                                       "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                                       f"tokenizer = AutoTokenizer.from_pretrained(\"{repo}\")\n"
                                       f"model = AutoModelForCausalLM.from_pretrained(\"{repo}\")\n"
                                       "inputs = tokenizer.apply_chat_template([{\"role\": \"user\", \"content\": "
                                       "\"Hello!\"}], add_generation_prompt=True, return_dict=True, "
                                       "return_tensors=\"pt\")\n"
                                       "out = model.generate(**inputs, max_new_tokens=128)"))
        return out
    if fmt_ == "gumiho":
        fit = ("" if details.get("reference_shape", True) else " This head's shape (serial_tokens "
               f"{details.get('serial_tokens')}, mlp_layers {details.get('mlp_layers')}) is not the one the reference "
               "code builds (2 and 5), so it loads only in draftlab.")
        if details.get("draft_vocab"):
            fit += (" It was trained on a draft vocabulary of "
                    f"{details['draft_vocab']} tokens, which the reference code does not have: it drafts over the "
                    "full vocabulary with the same weights, so its drafts may differ from draftlab's.")
        return {"vLLM": "Not supported by upstream vLLM as exported (it has no Gumiho drafter).",
                "SGLang": "Not supported by SGLang (it has no Gumiho drafter).", "transformers": no_tf,
                "official Gumiho code": "The reference code (AMD-AIG-AIMA/Gumiho, gumiho/model/gumiho_model.py) reads "
                f"pytorch_model.bin from this folder, with `--mlp_num {details.get('mlp_heads')}` and a depth of "
                f"serial tokens + MLP heads on its command line." + fit}
    if fmt_ == "dflash":    # z-lab's DFlashDraftModel layout (drafters/dflash.py); the engines were not run here
        block, layers = details.get("block_size", 16), list(details.get("target_layers") or [])
        return {"SGLang": sh(f"python -m sglang.launch_server --model-path {base} --speculative-algorithm DFLASH \\\n"
                             f"  --speculative-draft-model-path {repo}"),
                "vLLM": vllm_serve(base, "dflash", repo, block - 1) if len(set(layers)) == len(layers) else (
                    f"Not supported by vLLM for this drafter: its target layer ids {layers} repeat a layer and vLLM "
                    "collects each target layer once (a target with more layers gives distinct ids)."),
                "llama.cpp": sh(f"python convert_hf_to_gguf.py {repo} --target-model-dir {base} --outfile draft.gguf\n"
                                f"llama-server -m TARGET.gguf -md draft.gguf --spec-type draft-dflash "
                                f"--spec-draft-n-max {block - 1}"),
                "transformers": no_tf}
    if fmt_ == "hf":
        head_note = ("The acceptance head (acceptance_head/) sets the draft length adaptively (SpecDec++) only in "
                     "draftlab (`draftlab eval --checkpoint`); the engines below draft a fixed number of tokens with "
                     "the draft model.\n\n") if details.get("acceptance_head") else ""
        return {"transformers": head_note + python_block(
                "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                f"tokenizer = AutoTokenizer.from_pretrained(\"{base}\")\n"
                f"target = AutoModelForCausalLM.from_pretrained(\"{base}\")\n"
                f"draft = AutoModelForCausalLM.from_pretrained(\"{repo}\")\n"
                "inputs = tokenizer.apply_chat_template([{\"role\": \"user\", \"content\": \"Hello!\"}], "
                "add_generation_prompt=True, return_dict=True, return_tensors=\"pt\")\n"
                "out = target.generate(**inputs, assistant_model=draft, max_new_tokens=128)"),
                "vLLM": vllm_serve(base, "draft_model", repo, k),
                "SGLang": sh(f"python -m sglang.launch_server --model-path {base} --speculative-algorithm STANDALONE "
                             f"\\\n  --speculative-draft-model-path {repo} {sglang_tree_flags([], k)}")}
    return {"vLLM": "Not supported by vLLM (draftlab-native format).",
            "SGLang": "Not supported by SGLang (draftlab-native format).", "transformers": no_tf}


def training_section(run: dict | None, meta: dict) -> str:
    if not run:
        return "The run's config.yaml was not found beside this checkpoint: data and recipe unknown."
    pick = lambda section, *keys: [(f"{section}.{k}", (run.get(section) or {}).get(k)) for k in keys]  # noqa: E731
    rows = [("recipe", run.get("recipe")), ("checkpoint", meta.get("step"))]
    rows += pick("target", "path") + pick("data", "train", "regenerate_from", "regenerate_num", "eval_prompts",
                                          "max_length", "store")
    rows += [(f"drafter.{k}", v) for k, v in (run.get("drafter") or {}).items() if v not in (None, "", [], {})]
    rows += pick("train", "max_steps", "lr", "batch_size", "grad_accum", "schedule", "warmup_steps",
                 "mixed_precision") + [("seed", run.get("seed")), ("world_size", run.get("world_size"))]
    table = ["| setting | value |", "|---|---|"] + [f"| {k} | `{v}` |" for k, v in rows if v not in (None, "")]
    full = yaml.safe_dump(run, sort_keys=False).rstrip()
    return ("Training data and recipe, from the run's resolved config (`draftlab/config.yaml`):\n\n"
            + "\n".join(table) + f"\n\n<details><summary>full config</summary>\n\n```yaml\n{full}\n```\n\n</details>")


def disco_section(meta: dict, repo: str | None) -> str:
    """The card's lines on a shipped DISCO stop classifier (hub.export_checkpoint --disco)."""
    info = meta["disco"]
    acc = info.get("val_accuracy")
    return (f"`{info['folder']}/` holds a DISCO stop classifier (disco.json, disco.safetensors; arXiv 2405.04304) "
            f"trained on {info.get('examples')} draft tokens this drafter proposed and the target judged ("
            f"{fmt(info.get('positive_rate'))} accepted" + (f"; held-out accuracy {fmt(acc)}" if acc is not None
                                                           else "") + "). From the drafter's top-1 / top-2 "
            f"probability, entropy and position it predicts each next token's acceptance, and chains stop when one "
            "more token no longer pays under the round costs measured on the serving machine. Serving engines do "
            "not read it; draftlab does:\n\n```bash\nhf download {0} --local-dir drafter\ndraftlab eval "
            "--checkpoint drafter --target {1} --draft-length disco --disco drafter/{2} --prompts prompts.jsonl "
            "--out report.json\n```".format(repo or "ORG/NAME", target_name(meta), info["folder"]))


def render_card(meta: dict, reports: list[tuple[str, dict]], run: dict | None, plotted: bool) -> str:
    kind, repo = meta["kind"], meta.get("repo_id")
    base = meta.get("base_model")
    target = f"[{base}](https://huggingface.co/{base})" if base else f"`{meta.get('target') or 'its target'}`"
    title = repo.split("/")[-1] if repo else f"draftlab {kind} drafter"
    what = meta.get("card_name") or kind
    intro = (f"{'An' if what[0] in 'AEIOU' else 'A'} {what} that drafts tokens for speculative decoding with "
             f"{target}, trained and scored with draftlab. The target verifies every drafted token, so the "
             "generated text is the target's own (greedy: token-identical; sampling: the same distribution).")
    if meta.get("card_note"):
        intro += " " + meta["card_note"]
    if not base:
        intro += (f"\n\nThe target was a local model (`{meta.get('target')}`), not a Hub id, so the card has no "
                  f"`base_model` and serving configs name the local folder `{target_name(meta)}`: export again with "
                  "`--base-model ORG/NAME` to link it.")
    parts = ["---\n" + yaml.safe_dump(front_matter(meta), sort_keys=False) + "---", f"# {title}", intro,
             "## Acceptance length",
             "tau = tokens emitted per target forward pass, measured by real speculative decoding against the target "
             "(bonus token included; 1 means no gain, a chain of k drafts reaches at most k+1). Per-position "
             "acceptance = share of rounds whose i-th draft token was accepted. Speedups are wall-clock on the "
             f"machine that ran the evaluation. Measured against the target loaded from `{meta.get('target')}`"
             + (" (GGUF weights, dequantised: serve the same weights to see the same tau)."
                if str(meta.get("target", "")).lower().endswith(".gguf") else ".")]
    parts.append(tau_table(reports) if reports else "No evaluation report was available for this checkpoint.")
    if plotted:
        parts.append(f"![per-position acceptance]({PLOT_NAME})")
    cats = next((r["per_category"] for _, r in reports if r.get("per_category")), None)
    if cats:
        parts.append("Per prompt category (first report):\n\n| category | tau | prompts |\n|---|---|---|\n" + "\n".join(
            f"| {c} | {fmt(v.get('acceptance_length'))} | {v.get('num_prompts')} |" for c, v in cats.items()))
    parts += ["## Files", f"Format: {FORMAT_NAMES.get(meta['format'], meta['format'])}. The draftlab checkpoint is in "
              "`draftlab/` (drafter_config.json, model.safetensors, eval.json, config.yaml); the `best` file points "
              "there, so the downloaded folder works directly with `draftlab eval --checkpoint`."]
    parts.append("## Usage")
    for engine, text in usage(meta, reports).items():
        parts += [f"### {engine}", text]
    parts += ["### draftlab", "```bash\nhf download {0} --local-dir drafter\ndraftlab eval --checkpoint drafter "
              "--target {1} --prompts prompts.jsonl --out report.json\n```".format(
                  repo or "ORG/NAME", target_name(meta))]
    if meta.get("disco"):
        parts += ["## Stopping rule (DISCO)", disco_section(meta, repo)]
    parts += ["## Training", training_section(run, meta)]
    return "\n\n".join(parts) + "\n"
