"""llama.cpp serves draftlab's DFlash export exactly (`--spec-type draft-dflash`).

A tiny 4-layer random Llama target and a DFlash drafter fitted for a few steps on the target's own answers are
exported with `draftlab push --format gguf` (llama.cpp's own converter, the target converted too) and decoded greedily
by llama-speculative-simple: every answer equals llama.cpp's target-only answer, and every served round that starts
where a `draftlab eval` round starts accepts as many draft tokens. Needs llama.cpp's tools (`draftlab engine build`);
skips without them.
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from conftest import CORPUS, greedy_answers
from draftlab import llama_cpp_tools as lct
from test_llama_cpp_serving import (CONVERTER_WRAPPER, PROMPTS, fit_to_answers, save_run,  # noqa: F401
                                    tiny_target_and_prompts, tools)  # tools: a fixture

K = 3
NEW_TOKENS = 40


def fitted_dflash(model, answers, steps: int = 80):
    """A 2-layer DFlash drafter (blocks of 4) fitted to the target's greedy answers."""
    from draftlab.drafters.dflash import DFlashDrafter

    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(model, SimpleNamespace(num_layers=2, block_size=4, num_anchors=64))
    return fit_to_answers(drafter, model, answers, steps)


@pytest.fixture(scope="module")
def served(tools, tiny_tokenizer, tmp_path_factory):  # noqa: F811 (the imported fixture)
    from draftlab.cli import main
    from draftlab.hub import export_checkpoint
    from draftlab.rounds import read_rounds

    root = tmp_path_factory.mktemp("dflash_llama_cpp")
    tok = tiny_tokenizer
    model, target_dir, prompts = tiny_target_and_prompts(root, tok)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices on a shared 2-core machine
    os.environ["DRAFTLAB_GGUF_CONVERTER"] = str(root / "convert_any_bpe.py")
    (root / "convert_any_bpe.py").write_text(CONVERTER_WRAPPER)
    try:
        answers = greedy_answers(model, tok, [*PROMPTS, *CORPUS[:6]])
        run = save_run(root / "run", fitted_dflash(model, answers), target_dir)
        export = export_checkpoint(run, root / "export", fmt="gguf", target=model, tokenizer=tok)
        report, log = root / "dflash.json", root / "dflash.rounds.jsonl"
        assert main(["eval", "--checkpoint", str(export), "--target", str(target_dir), "--prompts", str(prompts),
                     "--out", str(report), "--draft-length", str(K), "--max-new-tokens", str(NEW_TOKENS),
                     "--log-rounds", str(log)]) == 0
    finally:
        os.environ.pop("DRAFTLAB_GGUF_CONVERTER", None)
        torch.set_num_threads(threads)
    info = json.loads((export / "export.json").read_text())["gguf"]
    rows = read_rounds(log)
    result = {"export": export, "info": info, "report": json.loads(report.read_text()), "rows": rows,
              "llama": {"target": [], "dflash": []}, "tokenizer": tok}
    for i in range(len(PROMPTS)):
        first = next(r for r in rows if r.prompt == i and r.round == 0)
        text = tok.decode(first.prompt_ids, skip_special_tokens=False)
        prompt_file = lct.write_prompt(root / f"prompt_{i}.txt", text)
        target_gguf = export / info["target"]
        result["llama"]["target"].append(lct.run_speculative(
            lct.speculative_command(tools, target_gguf, prompt_file, NEW_TOKENS), text))
        result["llama"]["dflash"].append(lct.run_speculative(
            lct.speculative_command(tools, target_gguf, prompt_file, NEW_TOKENS, draft_gguf=export / info["draft"],
                                    spec_type=info["spec_type"], draft_length=K, extra=tuple(info["serve_args"])),
            text))
    return result


def test_the_dflash_export_is_a_gguf_pair_with_its_serving_command(served):
    info, export = served["info"], served["export"]
    assert info["spec_type"] == "draft-dflash" and (export / info["draft"]).is_file()
    card = (export / "README.md").read_text()
    assert "--spec-type draft-dflash" in card and "-fa on" in card


def test_served_dflash_answers_equal_target_only(served):
    assert served["report"]["lossless"] is True
    for i, (target_only, dflash) in enumerate(zip(served["llama"]["target"], served["llama"]["dflash"])):
        # llama-speculative-simple may accept a draft past -n: its answer starts with the target-only one
        assert lct.same_answer(dflash, target_only), f"prompt {i}: the DFlash draft changed the answer"


def test_served_dflash_acceptance_equals_draftlab_eval(served):
    rows = served["rows"]
    compared = differ = 0
    for i in range(len(PROMPTS)):
        prompt_len = len(next(r for r in rows if r.prompt == i and r.round == 0).prompt_ids)
        reference = {r.context - prompt_len: len(r.accepted) for r in rows if r.prompt == i}
        first = next(r for r in rows if r.prompt == i and r.round == 0)
        answer = ([first.root] + [t for r in rows if r.prompt == i for t in r.new_tokens])[:NEW_TOKENS]
        # rounds past the token where llama.cpp's target-only answer leaves draftlab's (a near tie) are not compared
        agree = lct.agreed_tokens(served["tokenizer"], answer, served["llama"]["target"][i].text)
        c, d = lct.compare_rounds(served["llama"]["dflash"][i].rounds, reference, K, agree=agree)
        compared, differ = compared + c, differ + d
    runs = served["llama"]["dflash"]
    served_tau = sum(s.tokens for s in runs) / sum(len(s.rounds) for s in runs)
    assert served_tau > 1.1, f"tau {served_tau:.3f}: too little accepted to compare"
    assert compared >= len(PROMPTS) and differ == 0, f"{differ} of {compared} aligned rounds differ"
    draftlab_tau = served["report"]["acceptance_length"]
    print(f"DFlash served tau {served_tau:.3f}, draftlab eval {draftlab_tau:.3f}, {compared} aligned rounds equal")
    assert abs(served_tau - draftlab_tau) <= 0.1 * draftlab_tau, (served_tau, draftlab_tau)
