"""llama.cpp serves draftlab's GGUF exports exactly.

A tiny 4-layer random Llama target, an EAGLE-3 head (drafter.norm_output=false) trained a few steps on the target's
own answers and a layer-skip small_lm are exported with `draftlab push --format gguf` (llama.cpp's own converter, the
target converted too) and decoded greedily by llama-speculative-simple. Every answer equals llama.cpp's target-only
answer and draftlab's; every served round that starts where a `draftlab eval` round starts accepts exactly as many
draft tokens. These need llama.cpp's tools (`draftlab engine build`) and skip without them. The refusal of a head
llama.cpp cannot run exactly (norm_output=true) needs no tools.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import yaml

from conftest import CORPUS, build_tiny_llama, greedy_answers
from draftlab import llama_cpp_tools as lct
from draftlab.checkpoint import save_drafter

K = 3                 # draft length
NEW_TOKENS = 40       # greedy tokens per prompt
PROMPTS = ["The quick brown fox", "def add(a, b):", "Numbers: 0 1 2 3 4", "Write a short poem about the sea"]

# The tiny test tokenizer is a byte-level BPE with GPT-2's split rules that llama.cpp's converter does not know by
# its hash (it knows real models' tokenizers, SmolLM2's included): this wrapper runs the pinned converter unchanged
# except that an unrecognised BPE pre-tokenizer is taken for GPT-2's (llama.cpp's "gpt-2").
CONVERTER_WRAPPER = '''
import runpy, sys
from pathlib import Path
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def any_bpe(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = any_bpe
script = Path(base.__file__).resolve().parents[1] / "convert_hf_to_gguf.py"
sys.argv[0] = str(script)
runpy.run_path(str(script), run_name="__main__")
'''


def save_run(root, drafter, target_dir):
    save_drafter(drafter, root / "step_1")
    (root / "best").write_text("step_1\n")
    (root / "config.yaml").write_text(yaml.safe_dump({"target": {"path": str(target_dir)},
                                                      "drafter": {"kind": drafter.kind}}))
    return root


def test_norm_output_head_is_refused_before_anything_is_written(tiny_target_4_layers, tmp_path, capsys):
    from draftlab.cli import main
    from draftlab.drafters.eagle3 import EagleHead3

    model, _ = tiny_target_4_layers
    head = EagleHead3.from_target(model, SimpleNamespace(norm_output=True))
    run = save_run(tmp_path / "run", head, tmp_path / "target")
    out = tmp_path / "export"
    assert main(["push", str(run), "--format", "gguf", "--to", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "drafter.norm_output=false" in err[0] and "llama.cpp" in err[0]
    assert not out.exists() and not list(tmp_path.glob("export*"))


def test_small_lm_with_a_reduced_vocabulary_is_refused(tiny_target_4_layers, tmp_path, capsys):
    from draftlab.drafters.small_lm import SmallLM
    from draftlab.hub import export_checkpoint
    from draftlab.errors import HubError

    model, tok = tiny_target_4_layers
    drafter = SmallLM.from_target(model, SimpleNamespace(num_layers=1), tok)
    drafter.draft_head.set_vocab(list(range(10, 60)))
    run = save_run(tmp_path / "run", drafter, tmp_path / "target")
    with pytest.raises(HubError, match="drafter.draft_vocab_size=0"):
        export_checkpoint(run, tmp_path / "export", fmt="gguf", target=model, tokenizer=tok)
    assert not list(tmp_path.glob("export*"))


# ----------------------------------------------------------------------------------------------------------
# served by llama.cpp


@pytest.fixture(scope="module")
def tools():
    """The batch-invariant build (`draftlab engine build --exact`, what CI builds), else the stock one."""
    found = lct.find_tools(variant="exact") or lct.find_tools()
    if not found:
        pytest.skip(f"llama.cpp's tools are not built here (looked in {lct.cache_dir(variant='exact')}): run "
                    "`draftlab engine build --exact`")
    return found


def tiny_target_and_prompts(root, tok, model=None):
    """(model, its saved folder, the prompt file of PROMPTS): the 4-layer tiny target the llama.cpp tests serve, or
    `model` saved the same way."""
    model = model if model is not None else build_tiny_llama(tok, layers=4).requires_grad_(False)
    target_dir = root / "target"
    model.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": p}]}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    return model, target_dir, prompts


def fit_to_answers(drafter, model, answers, steps: int):
    """The drafter fitted for a few Adam steps to the target's own greedy answers (one answer a step)."""
    from draftlab.target import target_features

    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    drafter.train()
    for step in range(steps):
        ids = answers[step % len(answers)][None]
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
        with torch.no_grad():
            features = target_features(model(ids, output_hidden_states=True).hidden_states, drafter.feature_layers)
        loss, _ = drafter.loss(batch, features)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


def trained_eagle3(model, answers, steps: int = 40):
    """An EAGLE-3 head (norm_output=false) fitted for a few steps to the target's own greedy answers."""
    from draftlab.drafters.eagle3 import EagleHead3

    torch.manual_seed(0)
    return fit_to_answers(EagleHead3.from_target(model, SimpleNamespace(norm_output=False, ttt_steps=3)), model,
                          answers, steps)


@pytest.fixture(scope="module")
def served(tools, tiny_tokenizer, tmp_path_factory):
    """Everything decoded once: {"prompts", "answers" (draftlab's), "rounds" (draftlab's), "reports",
    "llama" {drafter: [Served per prompt]}} for the drafters "eagle3", "small_lm" and "target"."""
    import os

    from draftlab.cli import main
    from draftlab.drafters.small_lm import SmallLM
    from draftlab.hub import export_checkpoint
    from draftlab.rounds import read_rounds

    root = tmp_path_factory.mktemp("llama_cpp")
    tok = tiny_tokenizer
    model, target_dir, prompts = tiny_target_and_prompts(root, tok)
    answers = greedy_answers(model, tok, CORPUS[:6])
    # a small_lm of all the target's layers, perturbed so that it agrees with the target often, not always
    small = SmallLM.from_target(model, SimpleNamespace(target_layers=[0, 1, 2, 3]), tok)
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in small.model.model.layers.parameters():
            p.add_(0.003 * torch.randn(p.shape, generator=noise))
    drafters = {"eagle3": trained_eagle3(model, answers), "small_lm": small}
    wrapper = root / "convert_any_bpe.py"
    wrapper.write_text(CONVERTER_WRAPPER)
    os.environ["DRAFTLAB_GGUF_CONVERTER"] = str(wrapper)
    result = {"prompts": [], "prompt_ids": [], "answers": [], "rounds": {}, "reports": {}, "llama": {},
              "exports": {}, "model": model}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # the evaluations below crawl with two spinning threads on a busy 2-core machine
    try:
        for kind, drafter in drafters.items():
            run = save_run(root / f"run_{kind}", drafter, target_dir)
            export = export_checkpoint(run, root / f"export_{kind}", fmt="gguf", target=model, tokenizer=tok)
            result["exports"][kind] = export
            report, log = root / f"{kind}.json", root / f"{kind}.rounds.jsonl"
            assert main(["eval", "--checkpoint", str(export), "--target", str(target_dir), "--prompts",
                         str(prompts), "--out", str(report), "--draft-length", str(K), "--max-new-tokens",
                         str(NEW_TOKENS), "--log-rounds", str(log)]) == 0
            result["reports"][kind] = json.loads(report.read_text())
            result["rounds"][kind] = read_rounds(log)
    finally:
        os.environ.pop("DRAFTLAB_GGUF_CONVERTER", None)
        torch.set_num_threads(threads)
    meta = json.loads((result["exports"]["eagle3"] / "export.json").read_text())
    target_gguf = result["exports"]["eagle3"] / meta["gguf"]["target"]
    rows = result["rounds"]["eagle3"]
    eos = tok.eos_token_id
    for i in range(len(PROMPTS)):
        first = next(r for r in rows if r.prompt == i and r.round == 0)
        seq = [first.root] + [t for r in rows if r.prompt == i for t in r.new_tokens]
        answer = seq[:NEW_TOKENS]
        answer = answer[:answer.index(eos)] if eos in answer else answer
        result["prompts"].append(tok.decode(first.prompt_ids, skip_special_tokens=False))
        result["prompt_ids"].append(list(first.prompt_ids))
        result["answers"].append(answer)
    for kind in ("target", "eagle3", "small_lm"):
        runs = []
        for i, text in enumerate(result["prompts"]):
            prompt_file = lct.write_prompt(root / f"prompt_{i}.txt", text)
            if kind == "target":
                cmd = lct.speculative_command(tools, target_gguf, prompt_file, NEW_TOKENS)
            else:
                export = result["exports"][kind]
                info = json.loads((export / "export.json").read_text())["gguf"]
                cmd = lct.speculative_command(tools, target_gguf, prompt_file, NEW_TOKENS,
                                              draft_gguf=export / info["draft"], spec_type=info["spec_type"],
                                              draft_length=K)
            runs.append(lct.run_speculative(cmd, text))
        result["llama"][kind] = runs
    result["agree"] = [lct.agreed_tokens(tok, a, s.text) for a, s in zip(result["answers"], result["llama"]["target"])]
    return result


def test_export_holds_the_gguf_pair_and_the_serving_command(served):
    for kind, spec_type in (("eagle3", "draft-eagle3"), ("small_lm", "draft-simple")):
        export = served["exports"][kind]
        info = json.loads((export / "export.json").read_text())["gguf"]
        assert info["spec_type"] == spec_type and (export / info["draft"]).is_file()
        assert (export / info["target"]).is_file() and info["target_in_export"]
        card = (export / "README.md").read_text()
        assert "## Serve it with llama.cpp" in card and f"--spec-type {spec_type}" in card
        assert f"llama-server -m {info['target']} -md {info['draft']}" in card


def near_tie_gap(model, prompt_ids: list[int], answer: list[int], t: int) -> float:
    """The gap between the target's two best logits (draftlab's fp32 forward) where answer[t] is chosen."""
    ids = torch.tensor(prompt_ids + answer[:t])[None]
    with torch.no_grad():
        top = model(ids).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def test_served_answers_equal_target_only(served, tiny_tokenizer):
    """Within llama.cpp, every speculative answer is its target-only answer. Across the two engines (llama.cpp's
    ggml sums against PyTorch's), the target-only answers agree up to the end or up to a near tie: the random tiny
    target's two best logits within 1e-3 where they part."""
    tok = tiny_tokenizer
    for i, answer in enumerate(served["answers"]):
        target_only = served["llama"]["target"][i]
        for kind in ("eagle3", "small_lm"):
            # llama-speculative-simple may accept a draft past -n: its answer starts with the target-only one
            assert lct.same_answer(served["llama"][kind][i], target_only), f"prompt {i}: {kind} changed it"
        t = served["agree"][i]
        if t < len(answer):
            gap = near_tie_gap(served["model"], served["prompt_ids"][i], answer, t)
            assert gap < 1e-3, f"prompt {i}: llama.cpp's target-only answer leaves draftlab's at token {t}, gap {gap}"
    assert sum(t == len(a) for t, a in zip(served["agree"], served["answers"])) >= len(PROMPTS) // 2
    assert all(r["lossless"] for r in served["reports"].values() if "lossless" in r)


@pytest.mark.parametrize("kind", ["eagle3", "small_lm"])
def test_served_acceptance_equals_draftlab_eval(served, kind):
    rows = served["rounds"][kind]
    compared = differ = accepted_served = 0
    for i in range(len(PROMPTS)):
        prompt_len = len(next(r for r in rows if r.prompt == i and r.round == 0).prompt_ids)
        reference = {r.context - prompt_len: len(r.accepted) for r in rows if r.prompt == i}
        c, d = lct.compare_rounds(served["llama"][kind][i].rounds, reference, K, agree=served["agree"][i])
        compared, differ = compared + c, differ + d
        accepted_served += sum(a for a, _ in served["llama"][kind][i].rounds)
    assert compared >= 2 * len(PROMPTS) and differ == 0, f"{differ} of {compared} aligned rounds differ"
    served_tau = (sum(s.tokens for s in served["llama"][kind])
                  / sum(len(s.rounds) for s in served["llama"][kind]))
    assert accepted_served > 0 and served_tau > 1.1, f"tau {served_tau:.3f}: too little accepted to compare"
    draftlab_tau = served["reports"][kind]["acceptance_length"]
    assert abs(served_tau - draftlab_tau) <= 0.1 * draftlab_tau, (served_tau, draftlab_tau)


def test_engine_build_is_instant_once_built(tools):
    import time

    variant = "exact" if lct.find_tools(variant="exact") == tools else "stock"
    start = time.time()
    assert lct.build(variant=variant) == tools
    assert time.time() - start < 5


def test_engine_builds_are_kept_apart(tmp_path, monkeypatch, capsys):
    """The exact build (llamafile off) has its own folder and flags; `engine where --exact` names it; an unknown
    build is one line."""
    monkeypatch.setenv("DRAFTLAB_LLAMA_CPP_CACHE", str(tmp_path))
    stock, exact = lct.cache_dir(), lct.cache_dir(variant="exact")
    assert stock.parent == exact.parent == tmp_path and exact.name == stock.name + "-exact"
    assert lct.VARIANTS["exact"] == ("-DGGML_LLAMAFILE=OFF",) and lct.VARIANTS["stock"] == ()
    assert lct.source_dir() == stock / "src"                      # one unpacked source for both builds
    assert lct.find_tools(variant="exact") is None
    assert lct.main(["where", "--exact"]) == 0
    assert capsys.readouterr().out.strip() == f"not built (would be in {exact})"
    with pytest.raises(lct.EngineError, match="unknown llama.cpp build 'fast'"):
        lct.cache_dir(variant="fast")
