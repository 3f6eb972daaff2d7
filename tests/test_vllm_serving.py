"""vLLM serves draftlab's exports exactly.

A tiny random Llama target (4 layers, hidden 128: vLLM's CPU attention needs a head size of at least 32) and one
drafter of each kind vLLM serves, fitted for a few steps to the target's own greedy answers (so that it accepts
something), are exported with `draftlab push` and served by vLLM's OpenAI server (`draftlab engine build --vllm`'s CPU
vLLM, or the user's own on a GPU machine) with the kind's `--speculative-config`. On the same prompts (draftlab's
token ids, chat template included), greedy, the same draft length: every served answer equals `draftlab eval`'s
(which equals target-only decoding: its lossless check), and vLLM's /metrics counters equal draftlab's round log,
prompt by prompt: drafts == rounds, accepted tokens == accepted tokens, so the served mean acceptance length
1 + accepted / drafts is draftlab's acceptance_length.

One server per kind (one at a time: each holds about 4.5 GiB), about 40 s each to start on a 2-core machine; the
drafters, exports and `draftlab eval` reports are built once for the module. Skipped where vLLM is not set up.
"""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import CORPUS, greedy_answers
from draftlab import vllm_tools as vt
from test_llama_cpp_serving import PROMPTS, fit_to_answers, save_run, tiny_target_and_prompts

K = 3                   # draft length
NEW_TOKENS = 32         # greedy tokens per prompt
KINDS = ("eagle3", "dflash", "small_lm", "eagle", "medusa")


@pytest.fixture(scope="module")
def engine():
    found = vt.find_engine()
    if found is None:
        pytest.skip(f"vLLM is not set up here (looked in {vt.cache_dir()}): run `draftlab engine build --vllm`")
    return found


def vllm_target(tok):
    """A tiny random Llama that vLLM's CPU backend runs (head size 32) and whose greedy answers are not loops of one
    token: larger random weights (std 0.2) than conftest's target; its two best logits stay at least 0.06 apart on
    the test's answers, far from where two engines' float sums could pick differently."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False, initializer_range=0.2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model.requires_grad_(False)


def fitted(kind: str, model, tok, answers):
    """A drafter of `kind` that agrees with the tiny target often, not always."""
    from draftlab.drafters.dflash import DFlashDrafter
    from draftlab.drafters.eagle import EagleHead
    from draftlab.drafters.eagle3 import EagleHead3
    from draftlab.drafters.medusa import MedusaHeads
    from draftlab.drafters.small_lm import SmallLM

    torch.manual_seed(0)
    if kind == "small_lm":   # all the target's layers, perturbed
        small = SmallLM.from_target(model, SimpleNamespace(target_layers=[0, 1, 2, 3]), tok)
        noise = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in small.model.model.layers.parameters():
                p.add_(0.003 * torch.randn(p.shape, generator=noise))
        return small
    build = {"eagle3": lambda: EagleHead3.from_target(model, SimpleNamespace(norm_output=False, ttt_steps=3)),
             "eagle": lambda: EagleHead.from_target(model, SimpleNamespace(fc_bias=False)),
             "medusa": lambda: MedusaHeads.from_target(model, SimpleNamespace(medusa_heads=K)),
             "dflash": lambda: DFlashDrafter.from_target(model, SimpleNamespace(
                 num_layers=2, block_size=K + 1, target_layers=[1, 2], num_anchors=64))}[kind]
    return fit_to_answers(build(), model, answers, steps=80)


@pytest.fixture(scope="module")
def world(engine, tiny_tokenizer, tmp_path_factory):
    """The target, the exports and draftlab's side: {"target_dir", "exports", "reports", "rounds", "prompt_ids",
    "answers" (draftlab's, per prompt), "root"}."""
    from draftlab.cli import main
    from draftlab.hub import export_checkpoint
    from draftlab.rounds import read_rounds

    root = tmp_path_factory.mktemp("vllm")
    tok = tiny_tokenizer
    model, target_dir, prompts = tiny_target_and_prompts(root, tok, vllm_target(tok))
    out = {"root": root, "target_dir": target_dir, "exports": {}, "reports": {}, "rounds": {}}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # tiny matrices on a shared 2-core machine
    try:
        answers = greedy_answers(model, tok, [*PROMPTS, *CORPUS[:6]])
        for kind in KINDS:
            run = save_run(root / f"run_{kind}", fitted(kind, model, tok, answers), target_dir)
            export = export_checkpoint(run, root / f"export_{kind}", target=model, tokenizer=tok)
            report, log = root / f"{kind}.json", root / f"{kind}.rounds.jsonl"
            assert main(["eval", "--checkpoint", str(export), "--target", str(target_dir), "--prompts", str(prompts),
                         "--out", str(report), "--draft-length", str(K), "--max-new-tokens", str(NEW_TOKENS),
                         "--log-rounds", str(log)]) == 0
            out["exports"][kind] = export
            out["reports"][kind] = json.loads(report.read_text())
            out["rounds"][kind] = read_rounds(log)
    finally:
        torch.set_num_threads(threads)
    rows = out["rounds"]["eagle3"]
    out["prompt_ids"], out["answers"] = [], []
    for i in range(len(PROMPTS)):
        first = next(r for r in rows if r.prompt == i and r.round == 0)
        out["prompt_ids"].append([int(t) for t in first.prompt_ids])
        out["answers"].append(vt.draftlab_answer(rows, i, NEW_TOKENS, tok.eos_token_id))
    return out


@pytest.fixture(scope="module")
def served(world, engine, tiny_tokenizer):
    """Every kind served once, one server at a time: {kind: {"answers", "counts" [SpecCounters per prompt],
    "start_s"} or {"error": one line}}."""
    eos = tiny_tokenizer.eos_token_id
    result = {}
    for kind in ("target", *KINDS):
        export = None if kind == "target" else world["exports"][kind]
        start = time.monotonic()
        try:
            with vt.VllmServer(world["target_dir"], export=export, draft_length=K, max_model_len=512, kv_cache_gib=1,
                               engine=engine, log_path=world["root"] / f"vllm_{kind}.log") as server:
                ready = time.monotonic() - start
                got = vt.serve_prompts(server, world["prompt_ids"], NEW_TOKENS, eos)
        except vt.VllmError as e:
            result[kind] = {"error": str(e)}
            continue
        result[kind] = {"answers": got.answers, "counts": got.counts, "start_s": ready,
                        "total_s": time.monotonic() - start}
    print("\nvLLM served (k=%d, %d prompts, %d tokens):" % (K, len(PROMPTS), NEW_TOKENS))
    for kind, got in result.items():
        if "error" in got:
            print(f"  {kind}: {got['error']}")
            continue
        drafts = sum(c.drafts for c in got["counts"])
        accepted = sum(c.accepted for c in got["counts"])
        rows = world["rounds"].get(kind, [])
        print(f"  {kind}: served tau {1 + accepted / drafts if drafts else float('nan'):.4f} ({drafts:.0f} drafts, "
              f"{accepted:.0f} accepted); draftlab {world['reports'].get(kind, {}).get('acceptance_length', 'n/a')} "
              f"({len(rows)} rounds, {sum(len(r.accepted) for r in rows)} accepted); ready in {got['start_s']:.0f} s, "
              f"{got['total_s']:.0f} s in all; identical: {got['answers'] == world['answers']}")
    return result


def test_target_only_served_answers_equal_draftlab(served, world):
    got = served["target"]
    assert "error" not in got, got.get("error")
    assert got["answers"] == world["answers"]
    assert all(c.drafts == 0 for c in got["counts"])
    assert all(r["lossless"] for r in world["reports"].values())    # draftlab's answers are target-only's


@pytest.mark.parametrize("kind", KINDS)
def test_served_answers_and_acceptance_equal_draftlab_eval(served, world, kind):
    got = served[kind]
    assert "error" not in got, got.get("error")
    assert got["answers"] == world["answers"], f"{kind}: a served answer differs from draftlab's"
    rows = world["rounds"][kind]
    for i, counts in enumerate(got["counts"]):
        mine = [r for r in rows if r.prompt == i]
        assert (counts.drafts, counts.accepted) == (len(mine), sum(len(r.accepted) for r in mine)), \
            f"{kind}, prompt {i}: vLLM {counts}, draftlab {len(mine)} rounds"
    drafts = sum(c.drafts for c in got["counts"])
    accepted = sum(c.accepted for c in got["counts"])
    assert accepted > 0, f"{kind}: nothing accepted, nothing compared"
    assert 1 + accepted / drafts == pytest.approx(world["reports"][kind]["acceptance_length"], abs=1e-9)
    card = (world["exports"][kind] / "README.md").read_text()      # the card gives the command that was checked
    assert f'--speculative-config \'{{"method": "{vt.METHODS[kind]}"' in card


# ----------------------------------------------------------------------------------------------------------
# the set-up and the server's life, without vLLM


def test_speculative_config_per_kind_and_what_vllm_does_not_serve(tmp_path):
    methods = {kind: vt.speculative_config(kind, tmp_path, 4)["method"] for kind in vt.METHODS}
    assert methods == {"eagle3": "eagle3", "dflash": "dflash", "small_lm": "draft_model", "eagle": "eagle",
                       "medusa": "medusa"}
    assert vt.speculative_config("eagle3", tmp_path, 4) == {"method": "eagle3", "model": str(tmp_path.resolve()),
                                                            "num_speculative_tokens": 4}
    from draftlab.drafters import DRAFTERS

    assert set(vt.METHODS) | set(vt.NOT_SERVED) == set(DRAFTERS)          # every kind is one or the other
    for kind in vt.NOT_SERVED:
        with pytest.raises(vt.VllmError, match=f"does not serve a '{kind}' drafter"):
            vt.speculative_config(kind, tmp_path, 3)
    with pytest.raises(vt.VllmError, match="not a draftlab export"):
        vt.export_kind(tmp_path)


def test_metrics_counters_and_the_acceptance_length():
    page = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 75.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.79e+09',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 225.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 51.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 30.0'])
    got = vt.parse_metrics(page)
    assert got == vt.SpecCounters(drafts=75, draft_tokens=225, accepted=51)
    assert got.acceptance_length == pytest.approx(1 + 51 / 75)
    fewer = got - vt.SpecCounters(drafts=5, draft_tokens=15, accepted=1)
    assert fewer.acceptance_length == pytest.approx(1 + 50 / 70)


def test_engine_commands_say_one_line(tmp_path, monkeypatch, capsys):
    from draftlab.cli import main

    monkeypatch.setenv("DRAFTLAB_VLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(vt, "user_vllm", lambda: None)
    assert main(["engine", "where", "--vllm"]) == 0
    assert capsys.readouterr().out.strip() == f"not set up (would be in {tmp_path / 'cache' / vt.VERSION / 'venv'})"
    for argv, says in ((["engine", "frob", "--vllm"], "unknown engine command 'frob'"),
                       (["engine", "build", "--vllm", "--exact"], "--exact is a llama.cpp build option"),
                       (["engine", "serve", "--vllm", "--target", str(tmp_path)], "vLLM is not set up here")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err


def test_a_setup_that_cannot_run_is_one_line_and_leaves_nothing_marked(tmp_path, monkeypatch, capsys):
    from draftlab.cli import main

    monkeypatch.setenv("DRAFTLAB_VLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(vt, "user_vllm", lambda: None)
    monkeypatch.setattr(vt.sys, "executable", str(tmp_path / "no-python"))
    assert main(["engine", "build", "--vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "setting up vLLM failed at creating the venv" in err[0], err
    assert not (tmp_path / vt.VERSION / "complete.json").exists() and vt.find_engine() is None


def test_a_second_setup_says_it_waits_then_finds_the_first_ones(tmp_path, monkeypatch):
    import threading

    from draftlab.runlock import FolderLock

    monkeypatch.setenv("DRAFTLAB_VLLM_CACHE", str(tmp_path))
    done = vt.Engine(python=tmp_path / "python", source="venv", version=vt.VERSION)
    state = {"finished": False}
    monkeypatch.setattr(vt, "find_engine", lambda version=vt.VERSION: done if state["finished"] else None)
    vt.cache_dir().mkdir(parents=True)                  # as setup() makes it before it locks
    first = FolderLock(vt.cache_dir() / ".setup.lock", "the first set-up", "wait").acquire()
    said, result = [], {}
    second = threading.Thread(target=lambda: result.update(engine=vt.setup(log=said.append)))
    second.start()
    for _ in range(100):
        if said:
            break
        time.sleep(0.05)
    state["finished"] = True
    first.release()
    second.join(timeout=30)
    assert result["engine"] is done
    assert len(said) == 1 and said[0].startswith("waiting: ") and f"pid {__import__('os').getpid()}" in said[0]


def fake_engine(tmp_path, body: str) -> vt.Engine:
    """An Engine whose "python" is a shell script (its arguments ignored)."""
    script = tmp_path / "fake-python"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return vt.Engine(python=script, source="venv", version="fake")


def test_a_server_that_exits_early_is_one_line_with_its_log(tmp_path):
    engine = fake_engine(tmp_path, "echo 'ValueError: this target has no config.json'; exit 3")
    server = vt.VllmServer(tmp_path, engine=engine, log_path=tmp_path / "server.log", ready_timeout=30)
    with pytest.raises(vt.VllmError, match=r"exited with code 3 before it was ready \(ValueError: this target"):
        with server:
            pass
    assert server.proc is None and "ValueError" in (tmp_path / "server.log").read_text()


def test_a_server_that_never_answers_is_stopped_with_its_children(tmp_path):
    import os

    pids = tmp_path / "pids"
    engine = fake_engine(tmp_path, f"sleep 300 & echo $! > {pids}; trap '' TERM; sleep 300")  # ignores SIGTERM
    server = vt.VllmServer(tmp_path, engine=engine, log_path=tmp_path / "server.log", ready_timeout=2, stop_grace=1)
    start = time.monotonic()
    with pytest.raises(vt.VllmError, match="not ready after 2 s"):
        with server:
            pass
    child = int(pids.read_text())
    assert time.monotonic() - start < 30
    with pytest.raises(ProcessLookupError):     # SIGKILL after the grace period reached the whole group
        os.kill(child, 0)


def test_draftlab_answer_from_the_round_log():
    rows = [SimpleNamespace(prompt=0, round=0, root=5, new_tokens=[6, 7]),
            SimpleNamespace(prompt=1, round=0, root=9, new_tokens=[2, 4]),
            SimpleNamespace(prompt=0, round=1, root=7, new_tokens=[8, 9, 10])]
    assert vt.draftlab_answer(rows, 0, 5, None) == [5, 6, 7, 8, 9]
    assert vt.draftlab_answer(rows, 1, 8, {2}) == [9, 2]                # cut after EOS, EOS kept (vLLM keeps it)
    assert vt.cut_at_eos([1, 2, 3], {7}) == [1, 2, 3]
