"""Proposers that are not trained drafters: baselines and references for the evaluator.

- PromptLookupProposer: training-free n-gram lookup in the committed sequence (a chain, deterministic).
- TargetCopyProposer: drafts with the target itself through its own KV cache. Under greedy decoding every
  draft on the greedy path is accepted, so a chain of k gives tau == k+1 exactly: the reference drafter.
- LookupFirstProposer: prompt lookup in front of a trained drafter (lookup where the sequence repeats itself).
- RandomProposer: uniformly random tokens: a useless drafter (tau close to 1) for tests and benchmarks.
All follow the Proposer protocol in ARCHITECTURE.md (feature_layers, reset, commit, propose).
"""
from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache

from draftlab.trees import DraftTree, TreeSpec, chain, empty_tree, node_depths, rerank, static_tree_layout, subtree
from draftlab.verify import Sampling


class PromptLookupProposer:
    """Prompt lookup decoding: find the latest earlier occurrence of the sequence's last n tokens
    (n = max_ngram down to min_ngram) and propose the tokens that followed it.

    num_tokens: draft length (None = spec.draft_length). May propose fewer tokens, or none (then the
    round is one plain target step). Proposals are deterministic ("topk"): no q needed.
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, num_tokens: int | None = None, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram, self.num_tokens = max_ngram, min_ngram, num_tokens
        self.seq: list[int] = []
        self.device = torch.device("cpu")

    def reset(self, prompt_ids: Tensor) -> None:
        self.seq = prompt_ids.tolist()
        self.device = prompt_ids.device

    def commit(self, tokens: Tensor, features: Tensor | None) -> None:
        self.seq.extend(tokens.tolist())

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest matching suffix n-gram."""
        seq = torch.tensor(self.seq)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(self.seq) <= n:
                continue
            windows = seq[:-1].unfold(0, n, 1)                 # [L-n, n]: every n-gram ending before the last token
            hits = (windows == seq[-n:]).all(-1).nonzero().flatten()
            if len(hits):
                start = int(hits[-1]) + n
                return self.seq[start:start + k]
        return []

    def propose(self, spec: TreeSpec, sampling: Sampling, generator: torch.Generator | None = None) -> DraftTree:
        tokens = self.lookup(self.num_tokens or spec.max_depth)
        if not tokens:
            return empty_tree(self.device)
        return chain(torch.tensor(tokens, device=self.device))


class LookupFirstProposer:
    """A drafter's proposer with prompt lookup in front: when the committed sequence ends with an n-gram
    (n >= min_ngram) that occurred before, the tokens that followed it are the chain (no model runs); otherwise
    the drafter drafts. Targets that repeat themselves (small models in loops, code, extraction) give long exact
    matches, which a trained drafter can miss and lookup gets for free. Chains only: trees go to the drafter.

    Lookup chains are deterministic ("topk"), which the verifier accepts with the target's own probability
    under sampling, so output stays lossless either way. `lookup_rounds` counts the rounds lookup drafted.
    """

    def __init__(self, inner, min_ngram: int = 3, max_ngram: int = 4, min_tokens: int = 2):
        self.inner, self.min_tokens = inner, min_tokens
        self.lookup = PromptLookupProposer(max_ngram=max_ngram, min_ngram=min_ngram)
        self.feature_layers = tuple(inner.feature_layers)
        self.lookup_rounds = 0

    def reset(self, prompt_ids: Tensor) -> None:
        self.inner.reset(prompt_ids)
        self.lookup.reset(prompt_ids)

    def commit(self, tokens: Tensor, features: Tensor | None) -> None:
        self.inner.commit(tokens, features)
        self.lookup.commit(tokens, None)

    def propose(self, spec: TreeSpec, sampling: Sampling, generator: torch.Generator | None = None) -> DraftTree:
        if spec.kind == "chain":
            tokens = self.lookup.lookup(spec.draft_length)
            if len(tokens) >= min(self.min_tokens, spec.draft_length):
                self.lookup_rounds += 1
                return chain(torch.tensor(tokens, device=self.lookup.device))
        return self.inner.propose(spec, sampling, generator)


class RandomProposer:
    """Uniformly random draft tokens in the spec's shape (chain, static layout, or a random dynamic-size
    tree). Under sampling q is uniform and the proposal i.i.d. ("with_replacement")."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.own = torch.Generator().manual_seed(seed)
        self.device = torch.device("cpu")

    def reset(self, prompt_ids: Tensor) -> None:
        self.device = prompt_ids.device

    def commit(self, tokens: Tensor, features: Tensor | None) -> None:
        pass

    def propose(self, spec: TreeSpec, sampling: Sampling, generator: torch.Generator | None = None) -> DraftTree:
        if spec.kind == "chain":
            parents = torch.arange(-1, spec.draft_length - 1)
        elif spec.kind == "static":
            parents, _ = static_tree_layout(spec.choices)
        else:   # random shape: each node hangs under the root or an earlier node that is not at the last level
            par, depth = [], []
            for i in range(spec.total_tokens):
                options = [-1] + [j for j in range(i) if depth[j] < spec.depth]
                p = options[int(torch.randint(len(options), (), generator=self.own))]
                par.append(p)
                depth.append(1 if p < 0 else depth[p] + 1)
            parents = torch.tensor(par, dtype=torch.long)
        tokens = torch.randint(self.vocab_size, parents.shape, generator=self.own)
        q = None if sampling.greedy else torch.full((len(tokens), self.vocab_size), 1.0 / self.vocab_size)
        return DraftTree(tokens.to(self.device), parents.to(self.device),
                         q.to(self.device) if q is not None else None, "topk" if q is None else "with_replacement")


class TargetCopyProposer:
    """Drafts with the target model itself, level by level through its own KV cache.

    chain: the target's greedy / sampled continuation (q = its processed distribution, "with_replacement").
    static: EAGLE-1-style autoregressive tree: a rank-r child is the target's top-r token at its parent
      (greedy), or the r-th draw without replacement from its distribution (sampling).
    dynamic: EAGLE-2 expansion (top_k children per frontier node, frontier = best top_k by cumulative
      log-prob) then `rerank` to total_tokens; deterministic ("topk") even when sampling.
    head (a vocab.DraftHead on the model's LM head; small_lm's trees): the model's decoder is read through it, so
    only the draft vocabulary's rows are computed and drafted (q zero outside); None = the model's own logits.
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(self, target, head=None):
        self.target, self.head = target, head
        self.seq: list[int] = []
        self.cache = None

    def reset(self, prompt_ids: Tensor) -> None:
        self.seq = prompt_ids.tolist()
        self.cache = DynamicCache(config=self.target.config)

    def commit(self, tokens: Tensor, features: Tensor | None) -> None:
        self.seq.extend(tokens.tolist())

    @torch.inference_mode()
    def propose(self, spec: TreeSpec, sampling: Sampling, generator: torch.Generator | None = None) -> DraftTree:
        device = self.target.device
        # catch the own cache up with the committed sequence (root included): logits at the root
        new = torch.tensor(self.seq[self.cache.get_seq_length():], device=device)
        root_logits = self._logits(1, input_ids=new[None], past_key_values=self.cache, use_cache=True)[-1]
        self.base = self.cache.get_seq_length()
        self.nodes: list[dict] = []          # token, parent, depth, ancestors (incl. self), q
        self.in_cache: list[int] = []        # node index of every tree position appended to the cache
        try:
            if spec.kind == "dynamic":
                return self._dynamic(spec, root_logits)
            if spec.kind == "chain":
                layout = [[0] * d for d in range(1, spec.draft_length + 1)]
            else:
                layout = spec.choices
            return self._static(layout, root_logits, sampling, generator)
        finally:   # keep the committed prefix without the root: a repeated propose (cost measurement) feeds it again
            self.cache.crop(self.base - 1 - self.cache.get_seq_length())

    def _logits(self, keep: int, **inputs) -> Tensor:
        """Logits [n, V] of a batch-1 forward (draft logits [n, Vd] through `head`), the last `keep` positions
        when the head is used (0 = all)."""
        if self.head is None:
            return self.target(**inputs).logits[0]
        from draftlab.vocab import lm_step

        return lm_step(self.target, self.head, keep, **inputs)[1][0]

    def _ids(self, index: Tensor) -> list[int]:
        """Indices into `_logits`' last dimension -> target token ids."""
        return (self.head.to_target(index) if self.head is not None else index).tolist()

    def _add(self, token: int, parent: int, q: Tensor | None = None, score: float = 0.0) -> int:
        depth = 1 if parent < 0 else self.nodes[parent]["depth"] + 1
        ancestors = ({len(self.nodes)} | self.nodes[parent]["anc"]) if parent >= 0 else {len(self.nodes)}
        self.nodes.append({"token": token, "parent": parent, "depth": depth, "anc": ancestors, "q": q,
                           "score": score})
        return len(self.nodes) - 1

    def _expand(self, frontier: list[int]) -> Tensor:
        """Target logits [len(frontier), V] after each frontier node, via one forward with a tree mask."""
        device, dtype = self.target.device, self.target.dtype
        n_old = len(self.in_cache)
        bias = torch.zeros(1, 1, len(frontier), self.base + n_old + len(frontier), dtype=dtype, device=device)
        cols = self.in_cache + frontier
        for row, f in enumerate(frontier):
            hidden = [self.base + c for c, node in enumerate(cols) if node not in self.nodes[f]["anc"]]
            bias[0, 0, row, hidden] = torch.finfo(dtype).min
        ids = torch.tensor([self.nodes[f]["token"] for f in frontier], device=device)
        pos = torch.tensor([self.base - 1 + self.nodes[f]["depth"] for f in frontier], device=device)
        logits = self._logits(0, input_ids=ids[None], attention_mask=bias, position_ids=pos[None],
                              past_key_values=self.cache, use_cache=True)
        self.in_cache += frontier
        return logits

    def _static(self, layout: list[list[int]], root_logits: Tensor, sampling: Sampling,
                generator: torch.Generator | None) -> DraftTree:
        parents, ranks = static_tree_layout(layout)
        depths = node_depths(parents).tolist()
        parents, ranks = parents.tolist(), ranks.tolist()
        slot: dict[int, int] = {}                    # layout index -> node index (absent: dropped)
        logits_at = {-1: root_logits}                # node index -> target logits after it
        for level in range(1, max(depths, default=0) + 1):
            members = [i for i in range(len(parents)) if depths[i] == level]
            if level > 1:   # forward the previous level's nodes that have children here
                frontier = sorted({slot[parents[i]] for i in members if parents[i] in slot})
                if frontier:
                    logits_at.update(zip(frontier, self._expand(frontier)))
            by_parent: dict[int, list[int]] = {}
            for i in members:
                if parents[i] < 0 or parents[i] in slot:
                    by_parent.setdefault(slot[parents[i]] if parents[i] >= 0 else -1, []).append(i)
            for node, kids in by_parent.items():
                drawn, q = self._children(logits_at[node], max(ranks[i] for i in kids) + 1, sampling, generator)
                for i in kids:
                    if ranks[i] < len(drawn):
                        slot[i] = self._add(drawn[ranks[i]], node, q)
        return self._tree("topk" if sampling.greedy else "without_replacement", with_q=not sampling.greedy)

    def _children(self, logits: Tensor, m: int, sampling: Sampling, generator) -> tuple[list[int], Tensor | None]:
        """m ranked children: top-m (greedy) or m draws without replacement (as many as the support has)."""
        if sampling.greedy:
            return self._ids(logits.topk(min(m, logits.shape[-1])).indices), None
        q = sampling.probs(self.head.expand(logits) if self.head is not None else logits)
        m = min(m, int((q > 0).sum()))
        return torch.multinomial(q, m, replacement=False, generator=generator).tolist(), q

    def _dynamic(self, spec: TreeSpec, root_logits: Tensor) -> DraftTree:
        logp = root_logits.float().log_softmax(-1).topk(min(spec.top_k, root_logits.shape[-1]))
        frontier = [self._add(t, -1, score=s) for s, t in zip(logp.values.tolist(), self._ids(logp.indices))]
        for _ in range(spec.depth - 1):
            children = []
            for f, logits in zip(frontier, self._expand(frontier)):
                top = logits.float().log_softmax(-1).topk(min(spec.top_k, logits.shape[-1]))
                base = self.nodes[f]["score"]
                children += [self._add(t, f, score=base + s)
                             for s, t in zip(top.values.tolist(), self._ids(top.indices))]
            frontier = sorted(children, key=lambda c: -self.nodes[c]["score"])[: spec.top_k]
        full = self._tree("topk", with_q=False)
        scores = torch.tensor([n["score"] for n in self.nodes])
        return subtree(full, *rerank(full.parents, scores.to(full.parents.device), spec.total_tokens))

    def _tree(self, proposal: str, with_q: bool) -> DraftTree:
        device = self.target.device
        tokens = torch.tensor([n["token"] for n in self.nodes], dtype=torch.long, device=device)
        parents = torch.tensor([n["parent"] for n in self.nodes], dtype=torch.long, device=device)
        q = torch.stack([n["q"] for n in self.nodes]) if with_q and self.nodes else None
        return DraftTree(tokens, parents, q, proposal if q is not None else "topk")
