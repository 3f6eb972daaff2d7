"""The `draftlab` console script.

    draftlab train recipe=NAME key=value ...        train (same arguments as draftlab/train.py)
    draftlab eval --checkpoint DIR --prompts FILE --out REPORT.json [options]
    draftlab eval --proposer prompt_lookup --target PATH --prompts FILE --out REPORT.json
    draftlab recipes                                 list the recipes
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types whose message is meant for the user: printed as one line, exit code 2."""
    from draftlab.checkpoint import CheckpointError
    from draftlab.config import ConfigError

    errors: list[type[BaseException]] = [ConfigError, CheckpointError]
    for module, name in (("draftlab.data", "DataError"), ("draftlab.target", "TargetError"),
                         ("draftlab.hub", "HubError")):
        try:
            errors.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def run_guarded(fn) -> int:
    """Run fn(); user errors become one line on stderr and exit code 2, Ctrl-C exit code 130."""
    try:
        fn()
    except user_errors() as e:
        print(f"draftlab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("draftlab: interrupted", file=sys.stderr)
        return 130
    return 0


def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draftlab eval", description="Score a drafter by real speculative decoding.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="run folder (its best step), step_N folder or export, or a drafter trained "
                     "elsewhere (folder or Hub id): speculators EAGLE-3, official EAGLE-1/2/3, Medusa heads")
    src.add_argument("--proposer", choices=["prompt_lookup"], help="training-free proposer (needs --target)")
    p.add_argument("--prompts", required=True, help="JSONL prompt set (rows with `messages` or `prompt`)")
    p.add_argument("--out", required=True, help="report JSON to write (a .md table and plots go beside it)")
    p.add_argument("--target", help="target model (default: the one the checkpoint was trained for)")
    p.add_argument("--draft-length", type=int, default=5, help="chain draft length k (default 5)")
    p.add_argument("--tree", choices=["chain", "static", "dynamic"], default="chain")
    p.add_argument("--depth", type=int, default=5, help="dynamic tree depth")
    p.add_argument("--top-k", type=int, default=8, help="dynamic tree branching")
    p.add_argument("--total-tokens", type=int, default=48, help="dynamic tree size")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (with the identity check)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sampling-top-k", type=int, default=0, help="top-k filter applied to draft and target")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--turns", choices=["1", "2", "both"], default="1",
                   help="MT-bench style rows with `turns`: score the first turn, the second turn (a real two-turn "
                        "conversation whose first answer is the target's own greedy answer), or both")
    p.add_argument("--adaptive-threshold", type=float, default=None,
                   help="acceptance heads: stop a chain once 1 - prod(predicted acceptance) exceeds this "
                        "(1 = never: fixed k; default: the checkpoint's drafter.adaptive_threshold)")
    p.add_argument("--min-draft", type=int, default=None,
                   help="acceptance heads: draft at least this many tokens per round (default: the checkpoint's)")
    p.add_argument("--fixed-k", default="",
                   help="acceptance heads: comma-separated k, e.g. 2,4,6: also run fixed-k chains, reported beside "
                        "the adaptive run under fixed_k")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    return p


def checkpoint_target(folder: Path) -> str:
    """The target path a checkpoint was trained with: its run's config.yaml, else its drafter config."""
    from omegaconf import OmegaConf

    from draftlab.checkpoint import CheckpointError, read_drafter_config

    for cfg_file in (folder / "config.yaml", folder.parent / "config.yaml"):
        if cfg_file.is_file():
            path = OmegaConf.select(OmegaConf.load(cfg_file), "target.path")
            if path:
                return str(path)
    name = (read_drafter_config(folder).get("target") or {}).get("name_or_path")
    if not name:
        raise CheckpointError(f"cannot tell which target {folder} belongs to: pass --target PATH")
    return name


def parse_lengths(text: str) -> list[int]:
    """--fixed-k '2,4,6' -> [2, 4, 6]; anything but positive integers is a ConfigError."""
    from draftlab.config import ConfigError

    items = [item.strip() for item in text.split(",") if item.strip()] if text else []
    if not all(item.isdigit() and int(item) >= 1 for item in items):
        raise ConfigError(f"--fixed-k {text!r}: give comma-separated draft lengths of at least 1, e.g. --fixed-k 2,4,6")
    return [int(item) for item in items]


def cmd_eval(argv: list[str]) -> None:
    import json

    from draftlab.checkpoint import load_drafter, resolve_checkpoint
    from draftlab.config import ConfigError
    from draftlab.data import encode_prompt, load_prompts
    from draftlab.evaluator import evaluate, run_baseline
    from draftlab.report import report_markdown, save_plots, summary_line, write_report
    from draftlab.target import load_target
    from draftlab.train import eos_ids
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    args = eval_parser().parse_args(argv)
    if args.draft_length < 1 or args.max_new_tokens < 1:
        raise ConfigError("--draft-length and --max-new-tokens must be at least 1")
    fixed_lengths = parse_lengths(args.fixed_k)
    from draftlab.foreign import find_foreign

    foreign = find_foreign(args.checkpoint) if args.checkpoint else None     # a drafter trained elsewhere
    folder = resolve_checkpoint(args.checkpoint) if args.checkpoint and not foreign else None
    if not args.checkpoint and not args.target:
        raise ConfigError("--proposer prompt_lookup needs --target PATH (the model to speculate for)")
    if foreign and not (args.target or foreign.target):
        raise ConfigError(f"--checkpoint {args.checkpoint} ({foreign.kind} format) does not name its target: pass "
                          "--target PATH")
    prompts = load_prompts(args.prompts, limit=args.num_prompts)  # bad prompt files fail before the model loads
    target_path = args.target or (foreign.target if foreign else checkpoint_target(folder) if folder else None)
    target, tokenizer = load_target(target_path, args.dtype, args.device)
    adaptive = {k: v for k, v in (("adaptive_threshold", args.adaptive_threshold), ("min_draft", args.min_draft))
                if v is not None}
    if args.checkpoint:
        drafter = foreign.load(target) if foreign else load_drafter(folder, target).eval()
        if (adaptive or args.fixed_k) and drafter.kind != "acceptance":
            raise ConfigError("--adaptive-threshold, --min-draft and --fixed-k need an acceptance-head checkpoint "
                              f"(drafter kind 'acceptance'); {args.checkpoint} is a '{drafter.kind}' drafter")
        proposer = drafter.proposer(target, **adaptive)
        label = f"{foreign.label} ({foreign.kind} format)" if foreign else str(folder)
    else:
        from draftlab.proposers import PromptLookupProposer

        proposer, label = PromptLookupProposer(num_tokens=args.draft_length), "prompt_lookup"
    spec = TreeSpec(kind=args.tree, draft_length=args.draft_length, depth=args.depth, top_k=args.top_k,
                    total_tokens=args.total_tokens)
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.sampling_top_k)
    eos = eos_ids(tokenizer, target)
    conversations, categories = conversations_for_turns(prompts, args.turns, target, tokenizer, args.max_new_tokens, eos)
    prompt_ids = [encode_prompt(tokenizer, messages) for messages in conversations]
    baseline = run_baseline(target, prompt_ids, max_new_tokens=args.max_new_tokens, eos_token_ids=eos,
                            sampling=sampling, seed=args.seed)
    if args.fixed_k:  # adaptive and fixed-k chains side by side, on one baseline
        from functools import partial

        from draftlab.evaluator import evaluate_adaptive

        report = evaluate_adaptive(target, partial(drafter.proposer, target), prompt_ids, spec=spec, sampling=sampling,
                                   max_new_tokens=args.max_new_tokens, baseline=baseline, eos_token_ids=eos,
                                   fixed_lengths=fixed_lengths, categories=categories,
                                   seed=args.seed, **adaptive)
    else:
        report = evaluate(target, proposer, prompt_ids, spec=spec, sampling=sampling,
                          max_new_tokens=args.max_new_tokens, eos_token_ids=eos, baseline=baseline,
                          categories=categories, seed=args.seed)
    report["drafter"] = label
    report["prompts"] = args.prompts
    report["turns"] = args.turns
    write_report(report, args.out)
    out = Path(args.out)
    out.with_suffix(".md").write_text(report_markdown(report) + "\n")
    plots = save_plots(report, out.parent, prefix=out.stem)
    print(summary_line(report))
    print(f"report: {out} (table: {out.with_suffix('.md')}; plots: {', '.join(plots)})")


def conversations_for_turns(prompts, turns: str, target, tokenizer, max_new_tokens: int, eos: list[int]):
    """Message lists to score, with their categories. Second turns need the first answer: the target's own
    greedy answer to turn 1 (what a served model would have said), so the conversation is real."""
    from draftlab.evaluator import target_generate

    first = [p.messages for p in prompts]
    cats = [p.category for p in prompts]
    if turns == "1":
        return first, cats
    from draftlab.data import encode_prompt

    second, second_cats = [], []
    for p in prompts:
        if not p.turns or len(p.turns) < 2:
            continue
        answer = target_generate(target, encode_prompt(tokenizer, p.messages), max_new_tokens, eos).tokens
        text = tokenizer.decode([t for t in answer if t not in eos], skip_special_tokens=True)
        second.append(p.messages + [{"role": "assistant", "content": text}, {"role": "user", "content": p.turns[1]}])
        second_cats.append(f"{p.category}/turn2" if p.category else "turn2")
    if not second:
        from draftlab.config import ConfigError

        raise ConfigError("--turns 2 needs prompt rows with at least two `turns` (MT-bench format)")
    if turns == "2":
        return second, second_cats
    return first + second, [f"{c}/turn1" if c else "turn1" for c in cats] + second_cats


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = __doc__.strip()
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from draftlab.config import load_config
        from draftlab.train import main as train_main

        return run_guarded(lambda: train_main(load_config(rest)))
    if command == "eval":
        return run_guarded(lambda: cmd_eval(rest))
    if command == "push":
        from draftlab.hub import cmd_push

        return run_guarded(lambda: cmd_push(rest))
    if command == "recipes":
        from draftlab.config import available_recipes

        print("\n".join(available_recipes()))
        return 0
    print(f"draftlab: error: unknown command '{command}': use train, eval, push or recipes\n\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
