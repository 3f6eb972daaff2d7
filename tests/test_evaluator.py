"""The speculative decoding loop: losslessness, counting, cache compaction, the commit contract, the report."""
import json

import pytest
import torch
from transformers import DynamicCache

from draftlab.evaluator import compact_cache, evaluate, run_baseline, speculative_generate, target_generate
from draftlab.proposers import CausalLMProposer, PromptLookupProposer, RandomProposer
from draftlab.report import report_markdown, summary_line, write_report
from draftlab.report import save_plots
from draftlab.trees import TreeSpec
from draftlab.verify import Sampling

GREEDY = Sampling()
SPECS = {
    "chain": TreeSpec("chain", draft_length=4),
    "static": TreeSpec("static"),                                   # EAGLE-1 default tree, 25 nodes
    "dynamic": TreeSpec("dynamic", depth=4, top_k=3, total_tokens=14),
}
REPORT_KEYS = ["acceptance_length", "acceptance_length_per_sample", "per_position_acceptance", "rounds",
               "new_tokens", "target_forwards", "draft_length", "temperature", "lossless", "tokens_per_second",
               "baseline_tokens_per_second", "speedup", "num_prompts", "tree", "wall_seconds"]


@pytest.fixture(scope="module")
def prompts(tiny_chat_prompts):
    return tiny_chat_prompts


@pytest.fixture(scope="module")
def greedy_outputs(tiny_target, prompts):
    model, _ = tiny_target
    return [target_generate(model, p, 24).tokens for p in prompts]


def make_proposer(name, model):
    return {"copy": lambda: CausalLMProposer(model), "lookup": lambda: PromptLookupProposer(max_ngram=3),
            "random": lambda: RandomProposer(model.config.vocab_size, seed=1)}[name]()


@pytest.mark.parametrize("tree", list(SPECS))
@pytest.mark.parametrize("proposer", ["copy", "lookup", "random"])
def test_greedy_speculation_is_lossless(tiny_target, prompts, greedy_outputs, tree, proposer):
    model, _ = tiny_target
    spec = SPECS[tree]
    for p, ref in zip(prompts[:2], greedy_outputs):
        res = speculative_generate(model, make_proposer(proposer, model), p, spec, GREEDY, 24)
        assert res.tokens == ref
        tau = res.new_tokens / res.rounds
        assert 1 <= tau <= spec.max_depth + 1
        assert res.new_tokens >= len(ref) - 1            # counted before truncation; the first token is free
        if proposer == "random":
            assert tau < 1.2
        if proposer == "copy" and tree != "dynamic":      # every draft on the greedy path is accepted
            assert res.accepted == [spec.max_depth] * res.rounds
            assert tau == spec.max_depth + 1


def test_copy_chain_reaches_k_plus_one_for_every_k(tiny_target, prompts):
    model, _ = tiny_target
    for k in (1, 2, 5):
        res = speculative_generate(model, CausalLMProposer(model), prompts[0], TreeSpec(draft_length=k), GREEDY, 23)
        assert res.new_tokens / res.rounds == k + 1


def test_eos_stops_and_counts_whole_rounds(tiny_target, prompts, greedy_outputs):
    model, _ = tiny_target
    eos = greedy_outputs[0][6]
    ref = target_generate(model, prompts[0], 24, eos_token_ids=[eos]).tokens
    assert ref[-1] == eos and len(ref) <= 7
    res = speculative_generate(model, CausalLMProposer(model), prompts[0], TreeSpec(draft_length=4), GREEDY, 24,
                               eos_token_ids=[eos])
    assert res.tokens == ref
    assert res.new_tokens == 5 * res.rounds


def test_empty_rounds_are_plain_target_steps(tiny_target, prompts, greedy_outputs):
    model, _ = tiny_target
    lookup = PromptLookupProposer(max_ngram=3, min_ngram=3)     # often finds nothing: zero-node rounds
    res = speculative_generate(model, lookup, prompts[0], TreeSpec(draft_length=3), GREEDY, 24)
    assert res.tokens == greedy_outputs[0]
    assert 0 in res.draft_nodes


def test_compacted_cache_continues_like_a_fresh_forward(tiny_target):
    """Keep the cached prefix + a tree path, drop the other branches: the next step matches a fresh forward."""
    from draftlab.trees import tree_attention_bias, tree_position_ids

    model, _ = tiny_target
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(model.config.vocab_size, (8,), generator=g)
    tokens = torch.randint(model.config.vocab_size, (7,), generator=g)
    root = torch.randint(model.config.vocab_size, (1,), generator=g)
    parents = torch.tensor([-1, -1, 0, 1, 2, 3, 4])              # two branches: 0-2-4-6 and 1-3-5
    nxt = torch.randint(model.config.vocab_size, (1,), generator=g)
    with torch.no_grad():
        for path in ([1, 3, 5], [0, 2], [], [0, 2, 4, 6]):
            cache = DynamicCache(config=model.config)
            model(input_ids=prefix[None], past_key_values=cache, use_cache=True)
            model(input_ids=torch.cat([root, tokens])[None], past_key_values=cache, use_cache=True,
                  attention_mask=tree_attention_bias(parents, 8, model.dtype),
                  position_ids=tree_position_ids(parents, 8)[None])
            compact_cache(cache, 8, torch.tensor([0] + [c + 1 for c in path]))
            assert cache.get_seq_length() == 8 + 1 + len(path)
            step = model(input_ids=nxt[None], past_key_values=cache, use_cache=True).logits[0, -1]
            fresh = model(input_ids=torch.cat([prefix, root, tokens[path], nxt])[None]).logits[0, -1]
            torch.testing.assert_close(step, fresh, rtol=1e-4, atol=1e-4)


class FeatureChecker(PromptLookupProposer):
    """Prompt lookup that checks every commit against a fresh forward over the committed sequence."""

    feature_layers = (1, -1)

    def __init__(self, model):
        super().__init__(max_ngram=2, num_tokens=3)
        self.model, self.commits = model, 0

    def reset(self, prompt_ids):
        super().reset(prompt_ids)
        self.processed = 0                            # positions the target has processed so far

    def commit(self, tokens, features):
        seq_before = len(self.seq)
        super().commit(tokens, features)
        m = features.shape[0]
        assert m == (seq_before if self.processed == 0 else len(tokens))
        assert features.shape[1] == 2 * self.model.config.hidden_size
        with torch.no_grad():
            hs = self.model(input_ids=torch.tensor(self.seq)[None], output_hidden_states=True).hidden_states
        ref = torch.cat([hs[1], hs[-1]], -1)[0, self.processed:self.processed + m]
        torch.testing.assert_close(features, ref, rtol=1e-4, atol=1e-4)
        self.processed += m
        assert self.processed == len(self.seq) - 1    # the newest token (the next root) is not processed yet
        self.commits += 1


def test_commit_receives_features_at_root_and_accepted_nodes(tiny_target, prompts, greedy_outputs):
    model, _ = tiny_target
    checker = FeatureChecker(model)
    res = speculative_generate(model, checker, prompts[2], TreeSpec(draft_length=3), GREEDY, 24)
    assert res.tokens == greedy_outputs[2] and checker.commits == res.rounds + 1


def test_evaluate_report(tiny_target, prompts, tmp_path):
    model, tok = tiny_target
    spec = TreeSpec(draft_length=3)
    baseline = run_baseline(model, prompts, sampling=GREEDY, max_new_tokens=20, eos_token_ids=tok.eos_token_id,
                            progress=False)
    report = evaluate(model, CausalLMProposer(model), prompts, spec=spec, sampling=GREEDY, max_new_tokens=20,
                      eos_token_ids=tok.eos_token_id, baseline=baseline, categories=["a", "b", "a"], progress=False)
    for key in REPORT_KEYS:
        assert key in report
    assert report["lossless"] is True and report["acceptance_length"] == 4
    assert report["new_tokens"] == report["acceptance_length"] * report["target_forwards"]
    assert report["per_position_acceptance"] == [1.0, 1.0, 1.0] and report["num_prompts"] == 3
    assert report["speedup"] == pytest.approx(report["tokens_per_second"] / report["baseline_tokens_per_second"])
    assert set(report["per_category"]) == {"a", "b"}
    write_report(report, tmp_path / "eval.json")
    assert json.loads((tmp_path / "eval.json").read_text())["acceptance_length"] == 4
    assert "| acceptance length" in report_markdown(report) and "| a |" in report_markdown(report)
    assert "tau 4.00" in summary_line(report) and "lossless yes" in summary_line(report)
    assert all(p.endswith(".png") for p in save_plots(report, tmp_path))

    useless = evaluate(model, RandomProposer(model.config.vocab_size), prompts, spec=spec, sampling=GREEDY,
                       max_new_tokens=20, eos_token_ids=tok.eos_token_id, baseline=baseline, progress=False)
    assert useless["lossless"] is True and 1 <= useless["acceptance_length"] < 1.2
    with pytest.raises(ValueError):   # a baseline from other settings is refused
        evaluate(model, RandomProposer(model.config.vocab_size), prompts, spec=spec, sampling=GREEDY,
                 max_new_tokens=21, baseline=baseline, progress=False)


def test_lossless_flag_catches_a_wrong_output(tiny_target, prompts):
    model, _ = tiny_target
    baseline = run_baseline(model, prompts[:1], sampling=GREEDY, max_new_tokens=10, progress=False, warmup=False)
    baseline["outputs"][0][-1] += 1
    report = evaluate(model, RandomProposer(model.config.vocab_size), prompts[:1], spec=TreeSpec(draft_length=2),
                      sampling=GREEDY, max_new_tokens=10, baseline=baseline, progress=False, warmup=False)
    assert report["lossless"] is False and report["lossless_mismatched_prompts"] == [0]


@pytest.mark.parametrize("tree", list(SPECS))
def test_seeded_sampling_is_reproducible(tiny_target, prompts, tree):
    model, _ = tiny_target
    spec, sampling = SPECS[tree], Sampling(temperature=1.0, top_p=0.9)
    runs = [speculative_generate(model, CausalLMProposer(model), prompts[1], spec, sampling, 12,
                                 generator=torch.Generator().manual_seed(s)).tokens for s in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_sampled_copy_of_target_is_almost_always_accepted(tiny_target, prompts, tmp_path):
    """Under sampling the copy's q equals the target's p, so min(1, p/q) is 1 up to float noise."""
    model, _ = tiny_target
    sampling = Sampling(temperature=0.8, top_k=50)
    report = evaluate(model, CausalLMProposer(model), prompts, spec=TreeSpec(draft_length=4), sampling=sampling,
                      max_new_tokens=20, progress=False)
    assert report["lossless"] is None and report["temperature"] == 0.8
    assert report["acceptance_length"] > 4.5
