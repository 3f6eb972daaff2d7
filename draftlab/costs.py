"""Cost-aware draft shapes: what a draft step and a verification cost on this machine, and the draft length
(or tree size) that maximises the expected tokens per second of a drafter.

A round of speculative decoding costs one draft of the chosen shape plus one target forward over the root and
the n draft nodes, and yields 1 + (accepted drafts) tokens. For a chain of k:
    E[tokens](k) = 1 + sum_{i=1..k} P(at least i drafts accepted)            (per-position acceptance)
    E[time](k)   = verify(k + 1) + draft(k) + overhead                        (measured on this machine)
and the best k maximises E[tokens](k) / E[time](k). verify(n) is not n x verify(1): on a CPU a forward over a
few tokens costs little more than over one (the weights are read once), then grows with n; on a GPU it stays
flat much longer. So the right k depends on the machine as much as on the drafter, and is measured, not assumed.

`measure_verify_cost` times target forwards of n tokens over a real prompt's cache (chain: the causal mask;
tree: an explicit tree mask, as the evaluator uses); `measure_draft_cost` times a proposer's `propose` for
chains of k = 1..K on a committed prompt; `pilot` runs real speculative decoding with the longest chain on a
few calibration prompts for the per-position acceptance; `choose_draft_length` combines them.
"""
from __future__ import annotations

import time

import torch
from torch import Tensor

from draftlab.trees import TreeSpec, tree_masks, tree_position_ids, whole_cache
from draftlab.verify import Sampling


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _timed_interleaved(fns: dict, repeats: int) -> dict:
    """Median wall-clock seconds of each fn over `repeats` passes that time every fn once, ascending then
    descending order in turn (after one untimed pass): a drift in the machine's speed while measuring (other
    jobs, frequency) then spreads over every key instead of landing on the few timed at that moment."""
    keys = list(fns)
    for key in keys:
        fns[key]()
    times = {key: [] for key in keys}
    for r in range(repeats):
        for key in (keys if r % 2 == 0 else keys[::-1]):
            start = time.perf_counter()
            fns[key]()
            times[key].append(time.perf_counter() - start)
    return {key: _median(values) for key, values in times.items()}


def _timed(fn, repeats: int) -> float:
    """Median wall-clock seconds of fn() over `repeats` calls, after one untimed call."""
    return _timed_interleaved({0: fn}, repeats)[0]


@torch.inference_mode()
def measure_verify_cost(target, prompt_ids: Tensor, sizes: list[int], *, tree: bool = False,
                        feature_layers: tuple[int, ...] = (), repeats: int = 7) -> dict[int, float]:
    """Seconds of one target forward over n new tokens (n in sizes) after the prompt's cache, median of repeats
    (interleaved passes over every size).

    tree=False: a chain (the model's causal mask); tree=True: a bushy tree under an explicit 4-D tree mask
    (every node a child of the root or of node 0), the evaluator's path for trees. feature_layers: hidden states
    are returned too when the proposer needs them, as in the evaluator.
    """
    device = target.device
    cache = whole_cache()
    target(input_ids=prompt_ids.to(device)[None], past_key_values=cache, use_cache=True)
    prefix = cache.get_seq_length()

    def forward_over(n: int):
        ids = torch.randint(0, target.config.get_text_config().vocab_size, (1, n), device=device)
        mask = positions = None
        if tree and n > 1:
            parents = torch.tensor([-1] + [(-1 if i % 2 else 0) for i in range(1, n - 1)], device=device)
            mask = tree_masks(target.config, parents, prefix, target.dtype)
            positions = tree_position_ids(parents, prefix)[None]

        def forward():
            target(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                   output_hidden_states=bool(feature_layers))
            cache.crop(prefix - cache.get_seq_length())
        return forward
    return _timed_interleaved({n: forward_over(n) for n in sizes}, repeats)


@torch.inference_mode()
def measure_draft_cost(target, proposer, prompt_ids: Tensor, lengths: list[int], sampling: Sampling,
                       repeats: int = 7, trees: dict[str, TreeSpec] | None = None) -> dict:
    """Seconds of `proposer.propose` for a chain of k (k in lengths) on the committed prompt, median of repeats
    (interleaved passes over every length), keyed by k; trees: more shapes to time in the same passes, keyed by
    their names. The proposer is reset and committed to the prompt as the evaluator does after a prefill."""
    device = target.device
    layers = tuple(proposer.feature_layers)
    prompt = prompt_ids.to(device).long()
    cache = whole_cache()
    out = target(input_ids=prompt[None], past_key_values=cache, use_cache=True, output_hidden_states=bool(layers))
    proposer.reset(prompt)
    from draftlab.target import target_features

    features = target_features(out.hidden_states, layers)[0] if layers else None
    proposer.commit(out.logits[0, -1].argmax().reshape(1), features)
    generator = torch.Generator(device=device).manual_seed(0)
    shapes = {**{k: TreeSpec(kind="chain", draft_length=k) for k in lengths}, **(trees or {})}
    return _timed_interleaved({key: (lambda spec=spec: proposer.propose(spec, sampling, generator))
                               for key, spec in shapes.items()}, repeats)


def expected_tokens(per_position: list[float], k: int) -> float:
    """E[tokens per round] of a chain of k: the bonus token plus P(at least i accepted) for i = 1..k."""
    return 1.0 + sum(per_position[:k])


def choose_draft_length(per_position: list[float], verify: dict[int, float], draft: dict[int, float],
                        overhead: float = 0.0) -> tuple[int, dict[int, dict]]:
    """The chain length k (1..len(per_position)) with the highest expected tokens per second.

    per_position[i]: share of rounds whose (i+1)-th draft was accepted, measured with a chain at least that long;
    verify[n]: seconds of a target forward over n tokens; draft[k]: seconds to draft a chain of k;
    overhead: per-round seconds outside both (acceptance, cache compaction, commit).
    Returns (best k, {k: {expected_tokens, expected_seconds, expected_tokens_per_second}}).
    """
    table = {}
    for k in range(1, len(per_position) + 1):
        if k + 1 not in verify or k not in draft:
            continue
        tokens, seconds = expected_tokens(per_position, k), verify[k + 1] + draft[k] + overhead
        table[k] = {"expected_tokens": tokens, "expected_seconds": seconds,
                    "expected_tokens_per_second": tokens / seconds}
    if not table:
        raise ValueError("no draft length has both a verification and a draft cost measured")
    best = max(table, key=lambda k: table[k]["expected_tokens_per_second"])
    return best, table


def pilot(target, proposer, prompts: list[Tensor], spec: TreeSpec, sampling: Sampling, max_new_tokens: int,
          eos_token_ids=None, seed: int = 0) -> dict:
    """Real speculative decoding of a few calibration prompts with `spec`: tau, per-position acceptance, and the
    mean seconds per round, drafting and verifying included (the prompts' prefills excluded)."""
    from draftlab.evaluator import prompt_generator, speculative_generate

    results = [speculative_generate(target, proposer, p, spec, sampling, max_new_tokens, eos_token_ids,
                                    prompt_generator(target.device, seed, i)) for i, p in enumerate(prompts)]
    rounds = sum(r.rounds for r in results)
    accepted = [a for r in results for a in r.accepted]
    depth = spec.max_depth
    return {"acceptance_length": sum(r.new_tokens for r in results) / max(rounds, 1),
            "per_position_acceptance": [sum(a > i for a in accepted) / max(rounds, 1) for i in range(depth)],
            "seconds_per_round": sum(r.seconds - r.prefill_seconds for r in results) / max(rounds, 1),
            "draft_lengths": [d for r in results for d in r.draft_nodes], "rounds": rounds}


def auto_draft_length(target, proposer, calibration: list[Tensor], sampling: Sampling, *, max_length: int = 8,
                      max_new_tokens: int = 64, eos_token_ids=None, seed: int = 0) -> dict:
    """Measure costs and acceptance on calibration prompts and pick the chain length (see the module docstring).

    Returns {chosen_draft_length, draft_cost: {k: s}, draft_step_cost: s per extra draft token, verify_cost:
    {n: s}, target_step_cost: verify_cost[1], per_position_acceptance, cost_model: {k: ...},
    calibration_prompts, pilot_tau}.
    """
    layers = tuple(proposer.feature_layers)
    lengths = list(range(1, max_length + 1))
    verify = measure_verify_cost(target, calibration[0], [1] + [k + 1 for k in lengths], feature_layers=layers)
    draft = measure_draft_cost(target, proposer, calibration[0], lengths, sampling)
    run = pilot(target, proposer, calibration, TreeSpec(kind="chain", draft_length=max_length), sampling,
                max_new_tokens, eos_token_ids, seed)
    overhead = max(0.0, run["seconds_per_round"] - verify[max_length + 1] - draft[max_length])
    best, table = choose_draft_length(run["per_position_acceptance"], verify, draft, overhead)
    step = (draft[max_length] - draft[1]) / (max_length - 1) if max_length > 1 else draft[1]
    return {"chosen_draft_length": best, "draft_cost": draft, "draft_step_cost": step, "verify_cost": verify,
            "target_step_cost": verify[1], "round_overhead": overhead,
            "per_position_acceptance": run["per_position_acceptance"], "pilot_tau": run["acceptance_length"],
            "cost_model": table, "calibration_prompts": len(calibration)}


TREE_SIZES = (4, 8, 16, 32, 48)     # dynamic-tree sizes (nodes after reranking) that `auto_tree` tries


def auto_tree(target, proposer, calibration: list[Tensor], sampling: Sampling, *, max_length: int = 8,
              sizes: tuple[int, ...] = TREE_SIZES, depth: int | None = None, top_k: int = 8,
              max_new_tokens: int = 64, eos_token_ids=None, seed: int = 0) -> dict:
    """`auto_draft_length`'s best chain against EAGLE-2 dynamic trees of each size in `sizes` (depth: the chosen
    chain length unless given, at least 2), each measured by a pilot on the calibration prompts (tau) and timed
    (drafting the tree, verifying it under a tree mask). Returns auto_draft_length's dict plus
    {chosen_tree: TreeSpec as dict, tree_candidates: {label: {tau, expected_tokens_per_second, ...}}}."""
    chain = auto_draft_length(target, proposer, calibration, sampling, max_length=max_length,
                              max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, seed=seed)
    k = chain["chosen_draft_length"]
    best_chain = chain["cost_model"][k]
    candidates = {f"chain k={k}": {"tree": TreeSpec(kind="chain", draft_length=k).to_dict(),
                                   "tau": best_chain["expected_tokens"],
                                   "expected_tokens_per_second": best_chain["expected_tokens_per_second"]}}
    layers = tuple(proposer.feature_layers)
    verify = measure_verify_cost(target, calibration[0], [n + 1 for n in sizes], tree=True, feature_layers=layers)
    for n in sizes:
        spec = TreeSpec(kind="dynamic", depth=max(2, depth or k), top_k=top_k, total_tokens=n)
        draft = _draft_tree_cost(target, proposer, calibration[0], spec, sampling)
        run = pilot(target, proposer, calibration, spec, sampling, max_new_tokens, eos_token_ids, seed)
        seconds = verify[n + 1] + draft + chain["round_overhead"]
        candidates[f"dynamic {n} nodes"] = {"tree": spec.to_dict(), "tau": run["acceptance_length"],
                                            "verify_cost": verify[n + 1], "draft_cost": draft,
                                            "expected_tokens_per_second": run["acceptance_length"] / seconds}
    best = max(candidates, key=lambda c: candidates[c]["expected_tokens_per_second"])
    return {**chain, "chosen_tree": candidates[best]["tree"], "chosen_label": best, "tree_candidates": candidates}


THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)   # stopping thresholds `auto_threshold` tries


def expected_adaptive_seconds(draft_lengths: list[int], verify: dict[int, float], draft: dict[int, float],
                              overhead: float = 0.0) -> float:
    """Mean seconds of a round when chains stop at the lengths observed (draft[k] + verify[k + 1] per round)."""
    if not draft_lengths:
        raise ValueError("no rounds to cost")
    return sum(draft[k] + verify[k + 1] for k in draft_lengths) / len(draft_lengths) + overhead


def auto_threshold(target, make_proposer, calibration: list[Tensor], sampling: Sampling, *, max_length: int = 8,
                   thresholds: tuple[float, ...] = THRESHOLDS, min_draft: int | None = None,
                   max_new_tokens: int = 64, eos_token_ids=None, seed: int = 0) -> dict:
    """An acceptance head's stopping threshold, chosen against fixed chains.

    make_proposer(adaptive_threshold=..., min_draft=...) -> proposer (threshold 1 = fixed-k drafting, the head
    still read after every token, so the draft costs below include it). The fixed chains k = 1..max_length are
    costed as in `auto_draft_length` (k = 1 is the control that adaptive stopping must beat); each threshold runs
    a pilot with chains of up to max_length on the calibration prompts, which gives its tau and the length at
    which every round stopped, costed with the same measured draft[k] and verify[k + 1]. The candidate with the
    most expected tokens per second wins. Returns auto_draft_length's dict plus {chosen_threshold (1.0 when a
    fixed chain wins), chosen_draft_length (the chain's k, or max_length for a threshold), chosen_label,
    threshold_candidates: {label: {threshold, draft_length, tau, mean_draft_length, expected_tokens_per_second}}}.
    """
    chain = auto_draft_length(target, make_proposer(adaptive_threshold=1.0, min_draft=min_draft), calibration,
                              sampling, max_length=max_length, max_new_tokens=max_new_tokens,
                              eos_token_ids=eos_token_ids, seed=seed)
    draft, verify, overhead = chain["draft_cost"], chain["verify_cost"], chain["round_overhead"]
    candidates = {f"fixed k={k}": {"threshold": 1.0, "draft_length": k, "tau": row["expected_tokens"],
                                   "mean_draft_length": float(k),
                                   "expected_tokens_per_second": row["expected_tokens_per_second"]}
                  for k, row in chain["cost_model"].items()}
    spec = TreeSpec(kind="chain", draft_length=max_length)
    for t in thresholds:
        run = pilot(target, make_proposer(adaptive_threshold=t, min_draft=min_draft), calibration, spec, sampling,
                    max_new_tokens, eos_token_ids, seed)
        seconds = expected_adaptive_seconds(run["draft_lengths"], verify, draft, overhead)
        candidates[f"threshold {t:g}"] = {
            "threshold": t, "draft_length": max_length, "tau": run["acceptance_length"],
            "mean_draft_length": sum(run["draft_lengths"]) / len(run["draft_lengths"]),
            "expected_tokens_per_second": run["acceptance_length"] / seconds}
    best = max(candidates, key=lambda c: candidates[c]["expected_tokens_per_second"])
    return {**chain, "chosen_threshold": candidates[best]["threshold"],
            "chosen_draft_length": candidates[best]["draft_length"], "chosen_label": best,
            "threshold_candidates": candidates}


@torch.inference_mode()
def _draft_tree_cost(target, proposer, prompt_ids: Tensor, spec: TreeSpec, sampling: Sampling, repeats: int = 3):
    """Seconds of proposing `spec` on the committed prompt (median)."""
    measure_draft_cost(target, proposer, prompt_ids, [1], sampling, repeats=1)     # reset + commit the prompt
    generator = torch.Generator(device=target.device).manual_seed(0)
    return _timed(lambda: proposer.propose(spec, sampling, generator), repeats)
