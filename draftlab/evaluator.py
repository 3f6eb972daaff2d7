"""The speculative decoding loop that scores every drafter, the target-only baseline, and `evaluate`.

One round = proposer.propose -> ONE target forward over (root, tree nodes) with a tree attention mask
over the target's KV cache -> acceptance (verify.py) -> the cache is compacted to the accepted path ->
proposer.commit. The target's cache always holds every committed token except the newest (the root).
Counting (ARCHITECTURE.md): the prefill forward and its first token are not counted; each round is one
target forward and yields accepted + 1 tokens, counted before truncation at EOS / max_new_tokens.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from statistics import median

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import DynamicCache

from draftlab.report import build_report
from draftlab.target import target_features
from draftlab.trees import TreeSpec, additive, layer_masks, tree_masks, tree_position_ids, whole_cache
from draftlab.verify import Sampling, accept


@dataclass
class GenerationResult:
    """One prompt's decoding. tokens: emitted ids after the prompt (first token included), truncated."""

    tokens: list[int]
    seconds: float
    prefill_seconds: float = 0.0                           # of `seconds`: the prompt's forward (and the first commit)
    accepted: list[int] = field(default_factory=list)      # per round: accepted draft nodes
    draft_nodes: list[int] = field(default_factory=list)   # per round: nodes in the proposed tree
    draft_depth: list[int] = field(default_factory=list)   # per round: depth of the proposed tree
    predicted: list[float] = field(default_factory=list)   # per verified draft node: the proposer's P(accept)
    outcome: list[int] = field(default_factory=list)       # ... and whether the target accepted it (0/1)

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def new_tokens(self) -> int:
        return sum(self.accepted) + self.rounds


def _sync(device: torch.device) -> None:
    """Wait for queued kernels so wall-clock timings cover the work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eos_set(eos_token_ids) -> set[int]:
    if eos_token_ids is None:
        return set()
    if isinstance(eos_token_ids, int):
        return {eos_token_ids}
    return {int(t) for t in eos_token_ids}


def _append(out: list[int], new: list[int], eos: set[int], max_new_tokens: int) -> bool:
    """Append `new` to `out` up to the first EOS (kept) and max_new_tokens; True when decoding must stop."""
    for t in new:
        out.append(t)
        if t in eos or len(out) >= max_new_tokens:
            return True
    return False


def compact_cache(cache: DynamicCache, start: int, keep: Tensor) -> None:
    """Keep cache positions [0, start) followed by positions start + keep (in that order); drop the rest.

    keep [m]: offsets into the block the last forward appended (0 = the root). The chain case (keep is
    0..m-1) is a plain crop; a branch in a tree needs a gather, which `crop()` cannot do. Only the m kept
    positions move (into start..start+m-1, in place), then the tail is cropped: gathering the whole cache
    instead copied every cached position each round, on top of the copy the next forward's concatenation makes
    anyway (SmolLM2, 305 cached positions, one thread: 1.35 ms a round before, 0.35 ms now, 0.08 ms for a crop).
    """
    m = int(keep.shape[0])
    contiguous = bool((keep == torch.arange(m, device=keep.device)).all())
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        if hasattr(layer, "cumulative_length"):
            raise NotImplementedError("sliding-window cache layers cannot be compacted to a tree path")
        if not contiguous:      # index_select copies the kept rows before they are written over
            idx = (start + keep).to(layer.keys.device)
            layer.keys[..., start:start + m, :] = layer.keys.index_select(-2, idx)
            layer.values[..., start:start + m, :] = layer.values.index_select(-2, idx)
        layer.keys = layer.keys[..., : start + m, :]
        layer.values = layer.values[..., : start + m, :]


# Largest logit gap between one explicit-mask forward and the model's own causal decoding that still counts as the
# same computation: fp32 sums in another order differ by ~1e-6 (ALiBi or unwindowed local attention: 0.2 and more).
MASK_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}


@torch.inference_mode()
def explicit_mask_gap(target, tree: bool = True) -> float:
    """How far a forward under draftlab's explicit masks is from the target's own decoding, on random tokens: one
    verification forward over a two-branch tree (tree_masks, depth positions) against each branch fed as a chain
    with the model's own causal mask; tree=False: one forward under an explicit causal 4-D mask (what packed
    training rows use) against the model's own mask. The prompt is one token longer than the shortest sliding
    window (capped at 1,024 tokens), so windows are crossed. Returns the largest absolute logit difference
    (inf when the model refuses the mask)."""
    text = target.config.get_text_config(decoder=True)
    windows = [w for w in (getattr(text, "sliding_window", None), getattr(text, "attention_chunk_size", None)) if w]
    length = min(max(24, min(windows, default=0) + 1), 1024)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, text.vocab_size, (length + 6,), generator=generator).to(target.device)
    prompt, rest = ids[:length], ids[length:]
    try:
        if not tree:
            full = target(input_ids=prompt[None]).logits[0]
            visible = torch.ones(length, length, dtype=torch.bool, device=target.device).tril()
            bias = layer_masks(target.config, additive(visible, target.dtype),
                               torch.arange(length, device=target.device), torch.arange(length, device=target.device))
            return float((target(input_ids=prompt[None], attention_mask=bias).logits[0] - full).abs().max())
        cache = whole_cache()
        target(input_ids=prompt[None], past_key_values=cache, use_cache=True)
        parents = torch.tensor([-1, -1, 0, 1, 2], device=target.device)   # branches root-0-2-4 and root-1-3
        out = target(input_ids=rest[None], attention_mask=tree_masks(target.config, parents, length, target.dtype),
                     position_ids=tree_position_ids(parents, length)[None], past_key_values=cache, use_cache=True)
        gap = 0.0
        for path in ([0, 2, 4], [1, 3]):
            compact_cache(cache, length, torch.zeros(0, dtype=torch.long, device=target.device))
            rows = [0] + [n + 1 for n in path]
            chain = target(input_ids=rest[rows][None], past_key_values=cache, use_cache=True).logits[0]
            gap = max(gap, float((out.logits[0, rows] - chain).abs().max()))
        return gap
    except (RuntimeError, ValueError, TypeError):
        return float("inf")


def check_explicit_masks(target, tree: bool = True) -> None:
    """Refuse, in one line, drafting trees (tree=True) or packed training rows (tree=False) on a target whose attention
    does not follow explicit masks and position ids (its bias from key order, as ALiBi; local attention that its
    config does not describe as sliding windows): speculative output would not be the target's. Checked once per
    target and shape."""
    checked = target.__dict__.setdefault("_draftlab_masks", {})
    if tree not in checked:
        checked[tree] = explicit_mask_gap(target, tree)
    gap, tolerance = checked[tree], MASK_TOLERANCE.get(target.dtype, 5e-2)
    if gap > tolerance:
        from draftlab.errors import TargetError

        what, fix = (("a draft tree verified in one forward", "evaluate chains: eval.tree=chain / --tree chain") if tree
                     else ("a packed training row under its 4-D mask", "train unpacked: train.pack_tokens=0"))
        raise TargetError(f"target {target.config.model_type}: {what} does not compute what its own decoding does "
                          f"(largest logit gap {gap:.3g}; its attention ignores explicit masks or position ids, e.g. "
                          f"ALiBi): {fix}")


def _record_predictions(result: GenerationResult, proposer, tree, path: list[int]) -> None:
    """Pair the proposer's predicted acceptance of each node (if it exposes `predicted_acceptance`) with the
    verdict, for the nodes the target actually judged: children of the root or of an accepted node."""
    predicted = getattr(proposer, "predicted_acceptance", None)
    if predicted is None:
        return
    accepted = set(path)
    for node, (p, parent) in enumerate(zip(predicted, tree.parents.tolist())):
        if math.isfinite(p) and (parent < 0 or parent in accepted):
            result.predicted.append(float(p))
            result.outcome.append(int(node in accepted))


def _features(out, layers: tuple[int, ...]) -> Tensor | None:
    """[T, F] target features of a batch-1 forward, or None when the proposer needs none."""
    return target_features(out.hidden_states, layers)[0] if layers else None


@torch.inference_mode()
def speculative_generate(target, proposer, prompt_ids: Tensor, spec: TreeSpec, sampling: Sampling,
                         max_new_tokens: int, eos_token_ids=None, generator: torch.Generator | None = None,
                         log=None) -> GenerationResult:
    """Decode one prompt (prompt_ids [P]) speculatively; the result holds the tokens and per-round counts.
    log: a `rounds.PromptLog` that receives every round (None, the default, does no extra work)."""
    device = target.device
    layers = tuple(proposer.feature_layers)
    eos = _eos_set(eos_token_ids)
    prompt = prompt_ids.to(device).long()
    _sync(device)
    start = time.perf_counter()

    cache = whole_cache()
    proposer.reset(prompt)
    out = target(input_ids=prompt[None], past_key_values=cache, use_cache=True, output_hidden_states=bool(layers))
    root = sampling.sample(out.logits[0, -1], generator).reshape(1)
    proposer.commit(root, _features(out, layers))
    _sync(device)
    result = GenerationResult(tokens=[], seconds=0.0, prefill_seconds=time.perf_counter() - start)
    done = max_new_tokens <= 0 or _append(result.tokens, root.tolist(), eos, max_new_tokens)
    if log is not None:
        log.begin(proposer)

    while not done:
        tree = proposer.propose(spec, sampling, generator)
        prefix = cache.get_seq_length()
        ids = torch.cat([root, tree.tokens.to(device)])[None]
        if tree.max_depth == len(tree):      # a chain (or nothing): the model's own causal mask is the tree mask
            mask = positions = None
        else:
            parents = tree.parents.to(device)
            mask = tree_masks(target.config, parents, prefix, target.dtype)
            positions = tree_position_ids(parents, prefix)[None]
        out = target(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                     use_cache=True, output_hidden_states=bool(layers))
        verdict = accept(tree, out.logits[0], sampling, generator)

        keep = torch.tensor([0] + [c + 1 for c in verdict.path], device=device)
        compact_cache(cache, prefix, keep)
        new = tree.tokens[verdict.path].tolist() + [verdict.bonus]
        root = torch.tensor([verdict.bonus], device=device)
        feats = _features(out, layers)
        proposer.commit(torch.tensor(new, device=device), feats[keep] if feats is not None else None)

        if log is not None:
            log.round(len(prompt) + len(result.tokens), int(ids[0, 0]), tree, verdict.path, verdict.bonus,
                      out.logits[0], sampling)
        _record_predictions(result, proposer, tree, verdict.path)
        result.accepted.append(len(verdict.path))
        result.draft_nodes.append(len(tree))
        result.draft_depth.append(tree.max_depth)
        done = _append(result.tokens, new, eos, max_new_tokens)

    if log is not None:
        log.end(proposer)
    _sync(device)
    result.seconds = time.perf_counter() - start
    return result


@torch.inference_mode()
def target_generate(target, prompt_ids: Tensor, max_new_tokens: int, eos_token_ids=None,
                    sampling: Sampling | None = None, generator: torch.Generator | None = None) -> GenerationResult:
    """Plain target-only decoding with a KV cache (the baseline), timed like `speculative_generate`."""
    sampling = sampling or Sampling()
    device = target.device
    eos = _eos_set(eos_token_ids)
    prompt = prompt_ids.to(device).long()
    _sync(device)
    start = time.perf_counter()

    cache = whole_cache()
    out = target(input_ids=prompt[None], past_key_values=cache, use_cache=True)
    token = sampling.sample(out.logits[0, -1], generator).reshape(1)
    result = GenerationResult(tokens=[], seconds=0.0)
    done = max_new_tokens <= 0 or _append(result.tokens, token.tolist(), eos, max_new_tokens)
    while not done:
        out = target(input_ids=token[None], past_key_values=cache, use_cache=True)
        token = sampling.sample(out.logits[0, -1], generator).reshape(1)
        result.accepted.append(0)            # one target forward, one token: tau = 1
        result.draft_nodes.append(0)
        result.draft_depth.append(0)
        done = _append(result.tokens, token.tolist(), eos, max_new_tokens)

    _sync(device)
    result.seconds = time.perf_counter() - start
    return result


def prompt_generator(device: torch.device, seed: int, index: int) -> torch.Generator:
    """One generator per prompt, so a prompt's draws do not depend on which prompts ran before it."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)


def run_baseline(target, prompts: list[Tensor], *, sampling: Sampling, max_new_tokens: int, eos_token_ids=None,
                 seed: int = 0, progress: bool = True, warmup: bool = True) -> dict:
    """Target-only outputs and timings for a prompt set, computed once and reusable by every `evaluate`.

    Returns {"outputs": [[ids]...], "seconds": [...], "tokens_per_second", "max_new_tokens", "sampling", "seed"}.
    """
    device = target.device
    if warmup and prompts:
        target_generate(target, prompts[0], min(4, max_new_tokens), eos_token_ids, sampling,
                        prompt_generator(device, seed, 0))
    results = [target_generate(target, p, max_new_tokens, eos_token_ids, sampling, prompt_generator(device, seed, i))
               for i, p in enumerate(tqdm(prompts, desc="target-only", disable=not progress, leave=False))]
    seconds = sum(r.seconds for r in results)
    return {
        "outputs": [r.tokens for r in results],
        "seconds": [r.seconds for r in results],
        "tokens_per_second": sum(len(r.tokens) for r in results) / seconds if seconds > 0 else None,
        "max_new_tokens": max_new_tokens,
        "sampling": sampling.to_dict(),
        "seed": seed,
    }


def _check_baseline(baseline: dict, prompts: list[Tensor], sampling: Sampling, max_new_tokens: int) -> None:
    if (len(baseline["outputs"]) != len(prompts) or baseline["max_new_tokens"] != max_new_tokens
            or baseline["sampling"] != sampling.to_dict()):
        raise ValueError(f"the baseline was run on {len(baseline['outputs'])} prompts, max_new_tokens="
                         f"{baseline['max_new_tokens']}, sampling {baseline['sampling']}; this evaluation uses "
                         f"{len(prompts)}, {max_new_tokens}, {sampling.to_dict()}: run run_baseline again")


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the OS does not report one)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def interleaved_side_by_side(target, drafts: dict, prompts: list[Tensor], *, sampling: Sampling, max_new_tokens: int,
                             eos_token_ids=None, seed: int = 0, repeats: int = 1, progress: bool = True,
                             warmup: bool = True, log_rounds: dict | None = None) -> tuple[dict, list, dict]:
    """Target-only decoding and every drafter (drafts = {label: (proposer, TreeSpec)}), timed alternately prompt by
    prompt, `repeats` times each, the order rotating each repeat (neither side always runs second on warm caches),
    so every speedup is against the same target-only runs under the same load. Every side is deterministic given
    the per-prompt seed, so every repeat decodes the same tokens and only the clock differs.
    Returns ({label: first-repeat results}, first-repeat target-only results, {label: timing}) where timing =
    {tokens_per_second, baseline_tokens_per_second, speedup: the medians over repeats, speedup_min, speedup_max,
    speedups (per repeat), timing_repeats, timing: "interleaved", load_average: [before, after]}.
    log_rounds: {label: rounds.RoundLog}: those drafters' rounds of the first repeat are written to their log."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: time at least one repeat (or pass a baseline and repeats=0)")
    device = target.device
    load_before = load_average()
    labels = list(drafts)
    if warmup and prompts:
        target_generate(target, prompts[0], min(4, max_new_tokens), eos_token_ids, sampling,
                        prompt_generator(device, seed, 0))
        for proposer, spec in drafts.values():
            speculative_generate(target, proposer, prompts[0], spec, sampling, min(4, max_new_tokens), eos_token_ids,
                                 prompt_generator(device, seed, 0))
    runs = {key: [[None] * len(prompts) for _ in range(repeats)] for key in [None] + labels}   # None: target-only
    bar = tqdm(total=len(prompts) * repeats, desc="target-only | speculating", disable=not progress, leave=False)
    for i, p in enumerate(prompts):
        for r in range(repeats):
            order = [None] + labels
            shift = r % len(order)
            for key in order[shift:] + order[:shift]:
                if key is None:
                    out = target_generate(target, p, max_new_tokens, eos_token_ids, sampling,
                                          prompt_generator(device, seed, i))
                else:
                    proposer, spec = drafts[key]
                    log = (log_rounds or {}).get(key)
                    out = speculative_generate(target, proposer, p, spec, sampling, max_new_tokens, eos_token_ids,
                                               prompt_generator(device, seed, i),
                                               log.for_prompt(i, p) if log is not None and r == 0 else None)
                runs[key][r][i] = out
            bar.update(1)
    bar.close()

    def tps(results):
        seconds = sum(x.seconds for x in results)
        return sum(len(x.tokens) for x in results) / seconds if seconds > 0 else None

    base_tps = [tps(results) for results in runs[None]]
    load_after = load_average()
    timings = {}
    for key in labels:
        spec_tps = [tps(results) for results in runs[key]]
        speedups = [s / b for s, b in zip(spec_tps, base_tps) if s and b]
        timings[key] = {
            "tokens_per_second": median([t for t in spec_tps if t]) if any(spec_tps) else None,
            "baseline_tokens_per_second": median([t for t in base_tps if t]) if any(base_tps) else None,
            "speedup": median(speedups) if speedups else None,
            "speedup_min": min(speedups) if speedups else None,
            "speedup_max": max(speedups) if speedups else None,
            "speedups": speedups,
            "timing_repeats": repeats,
            "timing": "interleaved" if len(labels) == 1 else f"interleaved with {len(labels) - 1} other drafter(s)",
            "load_average": [load_before, load_after],
        }
    return {key: runs[key][0] for key in labels}, runs[None][0], timings


def evaluate_side_by_side(target, drafts: dict, prompts: list[Tensor], *, sampling: Sampling, max_new_tokens: int,
                          eos_token_ids=None, categories: list[str] | None = None, seed: int = 0,
                          repeats: int = 1, progress: bool = True, warmup: bool = True) -> dict[str, dict]:
    """Reports ({label: report}) for several drafters ({label: (proposer, TreeSpec)}) timed against the same
    interleaved target-only runs (`interleaved_side_by_side`); lossless against those runs' outputs."""
    wall = time.perf_counter()
    results, base, timings = interleaved_side_by_side(
        target, drafts, prompts, sampling=sampling, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
        seed=seed, repeats=repeats, progress=progress, warmup=warmup)
    baseline = {"outputs": [r.tokens for r in base]}
    reports = {}
    for key, (proposer, spec) in drafts.items():
        reports[key] = build_report(results[key], {**baseline, "tokens_per_second": timings[key][
            "baseline_tokens_per_second"]}, spec=spec, sampling=sampling, categories=categories,
            wall_seconds=time.perf_counter() - wall, timing=timings[key])
    return reports


def evaluate(target, proposer, prompts: list[Tensor], *, spec: TreeSpec, sampling: Sampling, max_new_tokens: int,
             eos_token_ids=None, baseline: dict | None = None, categories: list[str] | None = None,
             seed: int = 0, progress: bool = True, warmup: bool = True, repeats: int = 1,
             log_rounds=None) -> dict:
    """Speculate on every prompt ([P_i] each) and return the report dict (see report.build_report).

    repeats >= 1 (default): target-only and speculative decoding are timed interleaved, prompt by prompt,
    `repeats` times (`interleaved_side_by_side`); the speedup is the median over repeats, with its min and max.
    repeats = 0: only speculative decoding runs here; its speed is compared with `baseline`'s timing (from
    `run_baseline`, same prompts / sampling / max_new_tokens), which the report marks as reused: the in-loop
    evaluations of a training run do this to save the target-only runs.
    Greedy outputs are compared token by token with the target-only outputs (`lossless`).
    log_rounds: a `rounds.RoundLog` that receives every round of the (first repeat's) speculative decoding.
    """
    wall = time.perf_counter()
    device = target.device
    if spec.kind != "chain":
        check_explicit_masks(target, tree=True)
    if repeats >= 1:
        results, base_results, timing = interleaved_side_by_side(
            target, {"": (proposer, spec)}, prompts, sampling=sampling, max_new_tokens=max_new_tokens,
            eos_token_ids=eos_token_ids, seed=seed, repeats=repeats, progress=progress, warmup=warmup,
            log_rounds={"": log_rounds} if log_rounds is not None else None)
        results, timing = results[""], timing[""]
        outputs = [r.tokens for r in base_results]
        if baseline is not None:   # given reference outputs too: an output must match both to count as lossless
            _check_baseline(baseline, prompts, sampling, max_new_tokens)
            outputs = [o if list(o) == list(ref) else None for o, ref in zip(outputs, baseline["outputs"])]
        baseline = {"outputs": outputs, "tokens_per_second": timing["baseline_tokens_per_second"]}
    else:
        if baseline is None:
            raise ValueError("repeats=0 reuses a baseline's timing: pass baseline=run_baseline(...) (or repeats >= 1)")
        _check_baseline(baseline, prompts, sampling, max_new_tokens)
        load_before = load_average()
        if warmup and prompts:
            speculative_generate(target, proposer, prompts[0], spec, sampling, min(4, max_new_tokens),
                                 eos_token_ids, prompt_generator(device, seed, 0))
        results = [speculative_generate(target, proposer, p, spec, sampling, max_new_tokens, eos_token_ids,
                                        prompt_generator(device, seed, i),
                                        log_rounds.for_prompt(i, p) if log_rounds is not None else None)
                   for i, p in enumerate(tqdm(prompts, desc="speculating", disable=not progress, leave=False))]
        timing = {"timing": "baseline reused", "timing_repeats": 0, "load_average": [load_before, load_average()]}
    report = build_report(results, baseline, spec=spec, sampling=sampling, categories=categories,
                          wall_seconds=time.perf_counter() - wall, timing=timing)
    if getattr(proposer, "adaptive", None) is not None and spec.kind == "chain":  # trees: the base drafter's own
        report["adaptive"] = dict(proposer.adaptive)
    return report


def evaluate_adaptive(target, make_proposer, prompts: list[Tensor], *, spec: TreeSpec, sampling: Sampling,
                      max_new_tokens: int, adaptive_threshold: float | None = None, min_draft: int | None = None,
                      fixed_lengths: list[int] | None = None, baseline: dict | None = None, **kw) -> dict:
    """Adaptive-length chains (stopping within [min_draft, spec.draft_length]) and fixed-k chains, on one baseline.

    make_proposer(adaptive_threshold=..., min_draft=...) -> proposer (e.g. `partial(head.proposer, target)`);
    None keeps the drafter's own setting, and threshold 1 gives fixed-k drafting. fixed_lengths: the k of the
    fixed runs (default [spec.draft_length]). Returns the adaptive report with report["fixed_k"][str(k)] = the
    fixed-k report. Other keyword arguments go to `evaluate` (each run is timed against its own interleaved
    target-only runs unless repeats=0).
    """
    if spec.kind != "chain":
        raise ValueError(f"adaptive draft length applies to chains; got a {spec.kind} tree")
    if baseline is None and kw.get("repeats", 1) == 0:
        baseline = run_baseline(target, prompts, sampling=sampling, max_new_tokens=max_new_tokens,
                                eos_token_ids=kw.get("eos_token_ids"), seed=kw.get("seed", 0),
                                progress=kw.get("progress", True), warmup=kw.get("warmup", True))
    run = dict(prompts=prompts, sampling=sampling, max_new_tokens=max_new_tokens, baseline=baseline, **kw)
    report = evaluate(target, make_proposer(adaptive_threshold=adaptive_threshold, min_draft=min_draft),
                      spec=spec, **run)
    report["fixed_k"] = {str(k): evaluate(target, make_proposer(adaptive_threshold=1.0, min_draft=min_draft),
                                          spec=replace(spec, draft_length=k), **run)
                         for k in (fixed_lengths or [spec.draft_length])}
    return report
