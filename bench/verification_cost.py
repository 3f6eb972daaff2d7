"""What verification costs: one target forward over k+1 / tree-size tokens against one decode step, and the
evaluator's own overhead (time outside the model forwards and the drafting).

    python bench/verification_cost.py                       # a tiny random Llama (a smoke run)
    python bench/verification_cost.py --target PATH         # a real target (HF folder, .gguf, Hub id)

Prints a table and writes bench/results/verification_cost.json. Medians of repeated forwards; the decode step
and the verification forwards run on the same cached prefix, so their ratio is the price of speculating.
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

from draftlab.evaluator import speculative_generate  # noqa: E402
from draftlab.proposers import PromptLookupProposer, RandomProposer  # noqa: E402
from draftlab.trees import TreeSpec, static_tree_layout, tree_attention_bias, tree_position_ids  # noqa: E402
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
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "verification_cost.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
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
              "loop_overhead": loops}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
