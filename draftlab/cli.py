"""The `draftlab` console script.

    draftlab train recipe=NAME key=value ...        train (same arguments as draftlab/train.py)
    draftlab eval --checkpoint DIR --prompts FILE --out REPORT.json [options]
    draftlab eval --proposer prompt_lookup --target PATH --prompts FILE --out REPORT.json
    draftlab disco --rounds LOG.jsonl --out DIR     train DISCO's stop classifier (then eval --draft-length disco)
    draftlab serve-learn --checkpoint DIR --rounds LOG.jsonl --heldout FILE --out DIR [--follow]
                                                     update the drafter online from a round log, gated on tau
    draftlab recipes                                 list the recipes
    draftlab recipes --show NAME [key=value ...]     print a recipe's resolved config
    draftlab engine build [--exact]                  build llama.cpp's serving tools (cached per version and CPU;
                                                     --exact: llamafile off, served output equal to target-only)
    draftlab engine where [--exact]                  print the folder of the built tools
    draftlab engine build --vllm                     set up vLLM (CPU build in its own venv, cached; your own vLLM
                                                     where CUDA is); `where --vllm` prints its Python
    draftlab engine serve --vllm --target PATH [--export DIR] [--draft-length K]
                                                     start vLLM's OpenAI server, speculating with a draftlab export
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftlab.errors import OneLineParser, run_guarded


def eval_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="draftlab eval", description="Score a drafter by real speculative decoding.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="run folder (its best step), step_N folder or export, or a drafter trained "
                     "elsewhere (folder or Hub id): speculators EAGLE-3, official EAGLE-1/2/3, Medusa heads")
    src.add_argument("--proposer", choices=["prompt_lookup"], help="training-free proposer (needs --target)")
    p.add_argument("--prompts", required=True, help="JSONL prompt set (rows with `messages` or `prompt`)")
    p.add_argument("--out", required=True, help="report JSON to write (a .md table and plots go beside it)")
    p.add_argument("--target", help="target model (default: the one the checkpoint was trained for)")
    p.add_argument("--draft-length", default="5",
                   help="chain draft length k (default 5), or auto: measure the draft and verification costs on this "
                        "machine and the drafter's acceptance on calibration prompts, and take the k with the most "
                        "expected tokens/s (up to --max-draft-length), or disco: the same costs, and a stop classifier "
                        "(--disco DIR) ends each chain when one more token no longer pays (up to --max-draft-length)")
    p.add_argument("--disco", metavar="DIR", default=None,
                   help="with --draft-length disco: the stop classifier trained by draftlab disco --rounds LOG")
    p.add_argument("--tree", choices=["chain", "static", "dynamic", "auto"], default="chain",
                   help="draft shape; auto: the best of the auto chain and dynamic trees of 4..48 nodes, chosen "
                        "like --draft-length auto")
    p.add_argument("--lookup-first", type=int, default=0, metavar="N",
                   help="draft by prompt lookup whenever the sequence ends with an n-gram (n >= N) seen before, and "
                        "by the checkpoint's drafter otherwise (a hit drafts a chain, also for trees; 0 = off)")
    p.add_argument("--max-draft-length", type=int, default=8, help="longest chain --draft-length auto considers")
    p.add_argument("--calibration-prompts", default="4",
                   help="for auto shapes: a JSONL prompt file, or N = the first N prompts of --prompts (default 4)")
    p.add_argument("--depth", type=int, default=5, help="dynamic tree depth")
    p.add_argument("--top-k", type=int, default=8, help="dynamic tree branching")
    p.add_argument("--total-tokens", type=int, default=48, help="dynamic tree size")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (with the identity check)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sampling-top-k", type=int, default=0, help="top-k filter applied to draft and target")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="time target-only and speculative decoding interleaved prompt by prompt this many times; "
                        "the report's speedup is the median, with speedup_min / speedup_max (default 1)")
    p.add_argument("--turns", choices=["1", "2", "both"], default="1",
                   help="MT-bench style rows with `turns`: score the first turn, the second turn (a real two-turn "
                        "conversation whose first answer is the target's own greedy answer), or both")
    p.add_argument("--adaptive-threshold", default=None,
                   help="acceptance heads: stop a chain once 1 - prod(predicted acceptance) exceeds this "
                        "(1 = never: fixed k; default: the checkpoint's drafter.adaptive_threshold), or auto: "
                        "measure costs and pilot thresholds 0.1..0.9 against fixed chains k = 1..--max-draft-length "
                        "on calibration prompts and keep the most expected tokens/s (add --fixed-k 1 for the control)")
    p.add_argument("--min-draft", type=int, default=None,
                   help="acceptance heads: draft at least this many tokens per round (default: the checkpoint's)")
    p.add_argument("--fixed-k", default="",
                   help="acceptance heads: comma-separated k, e.g. 2,4,6: also run fixed-k chains, reported beside "
                        "the adaptive run under fixed_k")
    p.add_argument("--log-rounds", metavar="FILE", default=None,
                   help="write one JSON line per speculative round (draft tokens and their probabilities, the accepted "
                        "path, the bonus token, the target's top-k at each verified position; format: README, "
                        "draftlab/rounds.py); the file is replaced")
    p.add_argument("--log-topk", type=int, default=8, help="target top-k per verified position in --log-rounds")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    return p


def check_eval_args(args) -> None:
    """Every numeric option in range, and no draft longer than the generation, before anything loads."""
    from draftlab.config import SEEDS, ConfigError, range_problem

    ranges = {"lookup_first": "[0, inf)", "draft_length": "[1, inf)", "max_draft_length": "[1, inf)",
              "repeats": "[1, inf)", "max_new_tokens": "[1, inf)", "depth": "[1, inf)", "top_k": "[1, inf)",
              "total_tokens": "[1, inf)", "temperature": "[0, inf)", "top_p": "(0, 1]", "sampling_top_k": "[0, inf)",
              "num_prompts": "[1, inf)", "seed": SEEDS, "adaptive_threshold": "[0, 1]", "min_draft": "[1, inf)",
              "log_topk": "[1, inf)"}
    for name, interval in ranges.items():
        value = getattr(args, name)  # None: not given; "auto": chosen later
        problem = None if value in (None, "auto", "disco") else range_problem(f"--{name.replace('_', '-')}", value,
                                                                               interval)
        if problem:
            raise ConfigError(problem)
    longest = {"chain": "draft_length", "dynamic": "depth"}.get(args.tree)
    if longest == "draft_length" and args.draft_length in ("auto", "disco"):
        longest = "max_draft_length"
    for name, value in ([(longest, getattr(args, longest))] if longest else []) + [
            ("fixed_k", k) for k in parse_lengths(args.fixed_k)]:
        if value > args.max_new_tokens:
            raise ConfigError(f"--{name.replace('_', '-')} {value} is above --max-new-tokens {args.max_new_tokens}: "
                              "a round cannot draft more tokens than are generated")


def eval_inputs(args) -> list[tuple[str, str]]:
    """The paths `draftlab eval` reads (an output may be none of them)."""
    inputs = [("--prompts", args.prompts), ("--checkpoint", args.checkpoint), ("--target", args.target),
              ("--disco", args.disco)]
    if not args.calibration_prompts.isdigit():
        inputs.append(("--calibration-prompts", args.calibration_prompts))
    return [(option, path) for option, path in inputs if path]


def check_eval_files(args) -> None:
    """The files `draftlab eval` reads and writes, before anything loads: a prompt file that is a folder, and outputs
    that could not be written once the evaluation has run (an input of this command, a folder, a path through a file,
    a folder this user cannot write to), which would otherwise fail at the end and lose its results, or destroy an
    input (runlock.check_output)."""
    from draftlab.config import ConfigError
    from draftlab.runlock import check_output

    inputs = [("--prompts", args.prompts)]
    if not args.calibration_prompts.isdigit():
        inputs.append(("--calibration-prompts", args.calibration_prompts))
    for option, path in inputs:
        if Path(path).expanduser().is_dir():
            raise ConfigError(f"{option} {path} is a folder: pass a .jsonl file with `messages` or `prompt` rows")
    out = Path(args.out)  # as the report is written: no ~ expansion
    table = out.with_suffix(".md")  # written beside the report
    if table == out:
        raise ConfigError(f"--out {args.out}: the report's table is written beside it as {table.name}, which would "
                          f"replace the report: give the report a .json name, e.g. --out {out.with_suffix('.json')}")
    if table.is_dir():
        raise ConfigError(f"--out {args.out}: the report's table goes beside it as {table}, which is a folder: move "
                          "that folder away or give the report another name")
    reads = eval_inputs(args)
    check_output("--out", args.out, inputs=reads, example="report.json")
    for option, path in reads:
        if Path(str(path)).expanduser().exists() and Path(str(path)).expanduser().resolve() == table.resolve():
            raise ConfigError(f"--out {args.out}: the report's table is written beside it as {table}, which is "
                              f"{option}: give the report another name (nothing was written)")
    if args.log_rounds:
        check_output("--log-rounds", args.log_rounds, inputs=reads, example="rounds.jsonl")
        if Path(args.log_rounds).resolve() in (out.resolve(), table.resolve()):
            raise ConfigError(f"--log-rounds {args.log_rounds} is the report file --out"
                              f"{'' if Path(args.log_rounds).resolve() == out.resolve() else ' table'}: give the log "
                              "its own file")


def check_draft_depth(args, config: dict, where: str) -> None:
    """A chain longer, or a dynamic tree deeper, than the drafter can draft in one go (a DFlash block drafts
    block_size - 1 tokens): refused as training refuses eval.draft_length / eval.depth beyond it."""
    from draftlab.config import ConfigError

    if config.get("kind") != "dflash" or not config.get("block_size"):
        return
    block = int(config["block_size"])
    drafts = block - 1
    for option, value in (("--draft-length", args.draft_length if args.tree == "chain" else None),
                          ("--depth", args.depth if args.tree == "dynamic" else None),
                          ("--fixed-k", max(parse_lengths(args.fixed_k), default=None))):
        if isinstance(value, int) and value > drafts:
            raise ConfigError(f"{option} {value} exceeds the {drafts} tokens a DFlash block of {block} drafts "
                              f"({where}: drafter.block_size={block}): give {option} {drafts} or less")


def check_writable(option: str, path: str, example: str) -> None:
    """Refuse (ConfigError) a file that cannot be written at `path` (runlock.check_output)."""
    from draftlab.runlock import check_output

    check_output(option, path, example=example)


def parse_lengths(text: str) -> list[int]:
    """--fixed-k '2,4,6' -> [2, 4, 6]; anything but positive integers is a ConfigError."""
    from draftlab.config import ConfigError

    items = [item.strip() for item in text.split(",") if item.strip()] if text else []
    if not all(item.isdigit() and int(item) >= 1 for item in items):
        raise ConfigError(f"--fixed-k {text!r}: give comma-separated draft lengths of at least 1, e.g. --fixed-k 2,4,6")
    return [int(item) for item in items]


def cmd_eval(argv: list[str]) -> None:
    from draftlab.config import ConfigError

    args = eval_parser().parse_args(argv)
    auto = args.draft_length == "auto" or args.tree == "auto"
    auto_threshold = args.adaptive_threshold == "auto"
    if args.adaptive_threshold is not None and not auto_threshold:
        try:
            args.adaptive_threshold = float(args.adaptive_threshold)
        except ValueError:
            raise ConfigError(f"--adaptive-threshold {args.adaptive_threshold!r}: give a number in [0, 1], or auto") \
                from None
    if auto_threshold and (auto or args.tree != "chain"):
        raise ConfigError("--adaptive-threshold auto chooses the chain's length too: drop --draft-length auto / "
                          "--tree (it drafts chains of up to --max-draft-length)")
    use_disco = args.draft_length == "disco"
    if args.draft_length not in ("auto", "disco"):
        if not args.draft_length.isdigit():
            raise ConfigError(f"--draft-length {args.draft_length!r}: give a whole number of at least 1, auto or disco")
        args.draft_length = int(args.draft_length)
    if use_disco != bool(args.disco):
        raise ConfigError("--draft-length disco needs --disco DIR (a classifier from draftlab disco --rounds LOG)"
                          if use_disco else "--disco DIR goes with --draft-length disco")
    if use_disco and (args.tree != "chain" or args.adaptive_threshold is not None or args.fixed_k
                      or args.lookup_first or not args.checkpoint):
        raise ConfigError("--draft-length disco stops a checkpoint's chains: drop --tree, --adaptive-threshold, "
                          "--fixed-k, --lookup-first and --proposer")
    check_eval_args(args)
    check_eval_files(args)
    from draftlab.config import check_device

    check_device("--device", args.device)
    fixed_lengths = parse_lengths(args.fixed_k)
    if args.log_rounds and args.fixed_k:
        raise ConfigError("--log-rounds logs one drafting rule: drop --fixed-k (or log each fixed k in its own run)")
    from draftlab.runlock import claim_outputs

    with claim_outputs([("--out", args.out), ("--log-rounds", args.log_rounds)]):  # one writer per output
        evaluate_to_files(args, auto, auto_threshold, use_disco, fixed_lengths)


def evaluate_to_files(args, auto: bool, auto_threshold: bool, use_disco: bool, fixed_lengths: list[int]) -> None:
    """The evaluation `draftlab eval` asked for (its options checked, its outputs locked), its report written.
    SIGINT and SIGTERM stop it with one line saying that no report was written and where the round log of the
    prompts decoded so far is (exit code 128 + the signal's number)."""
    import signal
    import threading

    from draftlab.errors import Interrupted

    def on_term(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_term) if main_thread else None
    state: dict = {}
    try:
        evaluate_and_report(args, auto, auto_threshold, use_disco, fixed_lengths, state)
    except KeyboardInterrupt as e:
        if isinstance(e, Interrupted):
            raise
        name = str(e) if str(e) in ("SIGTERM", "SIGINT", "SIGHUP") else "SIGINT"
        log = state.get("log")
        kept = (f"; the round log of the {log.prompts} prompt(s) decoded so far is kept as {log.path} ({log.rows} "
                "rows; a rerun replaces it)" if log is not None and log.path.is_file() and log.rows else "")
        raise Interrupted(f"interrupted ({name}): no report was written ({args.out} is as it was){kept}",
                          128 + signal.Signals[name].value) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def evaluate_and_report(args, auto: bool, auto_threshold: bool, use_disco: bool, fixed_lengths: list[int],
                        state: dict) -> None:
    """evaluate_to_files' work; `state["log"]` is the round log while it is written."""
    from draftlab.checkpoint import checkpoint_target, load_step, resolve_checkpoint
    from draftlab.config import ConfigError
    from draftlab.data import encode_prompt, load_prompts
    from draftlab.drafters import DRAFTERS, load_drafter
    from draftlab.evaluator import evaluate
    from draftlab.report import report_markdown, save_plots, summary_line, write_report
    from draftlab.rounds import drafter_identity
    from draftlab.runlock import write_atomic
    from draftlab.target import eos_ids, load_target
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling
    from draftlab.foreign import find_foreign

    foreign = find_foreign(args.checkpoint) if args.checkpoint else None     # a drafter trained elsewhere
    folder = resolve_checkpoint(args.checkpoint) if args.checkpoint and not foreign else None
    if not args.checkpoint and not args.target:
        raise ConfigError("--proposer prompt_lookup needs --target PATH (the model to speculate for)")
    if foreign and not (args.target or foreign.target):
        raise ConfigError(f"--checkpoint {args.checkpoint} ({foreign.kind} format) does not name its target: pass "
                          "--target PATH")
    adaptive = {k: v for k, v in (("adaptive_threshold", args.adaptive_threshold), ("min_draft", args.min_draft))
                if v is not None and v != "auto"}
    if adaptive or args.fixed_k or auto_threshold:  # acceptance-head options: check the kind before anything loads
        from draftlab.checkpoint import read_drafter_config

        kind = foreign.kind if foreign else read_drafter_config(folder).get("kind") if folder else "prompt_lookup"
        if not getattr(DRAFTERS.get(kind), "adaptive_length", False):
            raise ConfigError("--adaptive-threshold, --min-draft and --fixed-k need an acceptance-head checkpoint "
                              f"(drafter kind 'acceptance'); {args.checkpoint or '--proposer prompt_lookup'} is a "
                              f"'{kind}' drafter")
    if folder is not None:  # what training refuses for this drafter, refused here too: before anything loads
        from draftlab.checkpoint import read_drafter_config

        check_draft_depth(args, read_drafter_config(folder), str(folder))
    if use_disco:
        from draftlab import disco

        classifier = disco.load_classifier(args.disco)         # a missing or foreign classifier fails before loading
    prompts = load_prompts(args.prompts, limit=args.num_prompts)  # bad prompt files fail before the model loads
    target_path = args.target or (foreign.target if foreign else checkpoint_target(folder) if folder else None)
    target, tokenizer = load_target(target_path, args.dtype, args.device)
    vocab = target.get_output_embeddings().weight.shape[0]
    for name, value in (("--top-k", args.top_k if args.tree == "dynamic" else 0),
                        ("--sampling-top-k", args.sampling_top_k)):
        if value > vocab:
            raise ConfigError(f"{name} {value} is above the target's vocabulary size {vocab}")
    if args.checkpoint:
        if foreign:
            drafter = foreign.load(target)
            check_draft_depth(args, {"kind": drafter.kind, "block_size": getattr(drafter, "block_size", None)},
                              args.checkpoint)
        else:  # a step pruned by a training still writing the run (train.keep_last) falls back to its newest one
            folder, drafter = load_step(args.checkpoint, lambda step: load_drafter(step, target).eval(), folder)
        proposer = drafter.proposer(target, **adaptive)
        if args.lookup_first:
            from draftlab.proposers import LookupFirstProposer

            proposer = LookupFirstProposer(proposer, min_ngram=args.lookup_first,
                                           max_ngram=max(4, args.lookup_first))
        label = f"{foreign.label} ({foreign.kind} format)" if foreign else str(folder)
        if args.lookup_first:
            label += f" + prompt lookup first (n >= {args.lookup_first})"
        identity = drafter_identity(foreign.label if foreign else str(folder.resolve()),
                                    foreign.kind if foreign else drafter.kind, target)
    else:
        from draftlab.proposers import PromptLookupProposer

        proposer, label = PromptLookupProposer(), "prompt_lookup"
        identity = drafter_identity(None, "prompt_lookup", target)
    if use_disco:     # before any decoding: a classifier from another target's rounds is refused
        warning = disco.check_drafter(classifier.info, identity, args.disco)
        if warning:
            print(warning, file=sys.stderr, flush=True)
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.sampling_top_k)
    eos = eos_ids(tokenizer, target)
    conversations, categories = conversations_for_turns(prompts, args.turns, target, tokenizer, args.max_new_tokens, eos)
    prompt_ids = [encode_prompt(tokenizer, messages) for messages in conversations]
    shape = None
    if auto_threshold:
        from functools import partial

        shape = choose_threshold(args, target, tokenizer, partial(drafter.proposer, target), prompt_ids, sampling, eos)
        adaptive["adaptive_threshold"] = shape["chosen_threshold"]
        proposer = drafter.proposer(target, **adaptive)
        spec = TreeSpec(kind="chain", draft_length=shape["chosen_draft_length"])
    elif auto:
        shape = choose_shape(args, target, tokenizer, proposer, prompt_ids, sampling, eos)
        spec = TreeSpec(**shape["chosen_tree"])
    elif use_disco:
        shape = choose_shape(args, target, tokenizer, proposer, prompt_ids, sampling, eos)
        costs = disco.RoundCosts(shape["draft_cost"], shape["verify_cost"], shape["round_overhead"])
        proposer = disco.wrap(proposer, classifier, costs, args.max_draft_length, label=args.disco)
        spec = TreeSpec(kind="chain", draft_length=args.max_draft_length)
    else:
        spec = TreeSpec(kind=args.tree, draft_length=args.draft_length, depth=args.depth, top_k=args.top_k,
                        total_tokens=args.total_tokens)
    if args.fixed_k:  # adaptive and fixed-k chains side by side, on one baseline
        from functools import partial

        from draftlab.evaluator import evaluate_adaptive

        report = evaluate_adaptive(target, partial(drafter.proposer, target), prompt_ids, spec=spec, sampling=sampling,
                                   max_new_tokens=args.max_new_tokens, eos_token_ids=eos,
                                   fixed_lengths=fixed_lengths, categories=categories,
                                   seed=args.seed, repeats=args.repeats, **adaptive)
    else:
        from draftlab.rounds import RoundLog

        log = RoundLog(args.log_rounds, args.log_topk, drafter=identity, atomic=True) if args.log_rounds else None
        state["log"] = log
        try:
            report = evaluate(target, proposer, prompt_ids, spec=spec, sampling=sampling,
                              max_new_tokens=args.max_new_tokens, eos_token_ids=eos,
                              categories=categories, seed=args.seed, repeats=args.repeats, log_rounds=log)
        except KeyboardInterrupt:
            if log is not None:
                log.close()   # kept as PATH.partial: evaluate_to_files says where
            raise
        except BaseException:
            if log is not None:
                log.discard()
            raise
        if log is not None:
            log.commit()
            report["round_log"] = {"path": args.log_rounds, "rows": log.rows, "target_topk": args.log_topk}
    report["drafter"] = label
    if shape is not None and use_disco:
        report["draft_shape"] = {**shape, "used_for": "DISCO's round costs (chosen_draft_length: auto's choice)"}
        report["disco"] = {"classifier": args.disco, **{k: v for k, v in classifier.info.items()
                                                       if k in ("rounds", "examples", "positive_rate", "val_loss")}}
    elif shape is not None:
        report["draft_shape"] = shape
        report["chosen_draft_length"] = shape["chosen_draft_length"]
        if auto_threshold:
            report["chosen_threshold"] = shape["chosen_threshold"]
    report["prompts"] = args.prompts
    report["turns"] = args.turns
    write_report(report, args.out)
    out = Path(args.out)
    write_atomic(out.with_suffix(".md"), report_markdown(report) + "\n", f"report table {out.with_suffix('.md')}")
    plots = save_plots(report, out.parent, prefix=out.stem)
    print(summary_line(report))
    print(f"report: {out} (table: {out.with_suffix('.md')}; plots: {', '.join(plots)})")


def calibration_set(args, tokenizer, prompt_ids) -> tuple[list, str]:
    """--calibration-prompts: N = the first N prompts being scored, or a JSONL file (its first 8)."""
    from draftlab.data import encode_prompt, load_prompts

    text = args.calibration_prompts
    if text.isdigit():
        return prompt_ids[: max(1, int(text))], f"the first {max(1, int(text))} of {args.prompts}"
    return [encode_prompt(tokenizer, p.messages) for p in load_prompts(text, limit=8)], text


def choose_threshold(args, target, tokenizer, make_proposer, prompt_ids, sampling, eos) -> dict:
    """--adaptive-threshold auto: thresholds against fixed chains, costed on this machine (costs.auto_threshold)."""
    from draftlab import costs

    calibration, where = calibration_set(args, tokenizer, prompt_ids)
    shape = costs.auto_threshold(target, make_proposer, calibration, sampling,
                                 max_length=args.max_draft_length, min_draft=args.min_draft,
                                 max_new_tokens=min(64, args.max_new_tokens), eos_token_ids=eos, seed=args.seed)
    shape["calibration_prompts"] = where
    print(f"stopping rule: {shape['chosen_label']} (expected tokens/s: " + ", ".join(
        f"{label}: {c['expected_tokens_per_second']:.1f}" for label, c in shape["threshold_candidates"].items())
          + ")", flush=True)
    return shape


def choose_shape(args, target, tokenizer, proposer, prompt_ids, sampling, eos) -> dict:
    """--draft-length auto / --tree auto: costs measured here, acceptance from calibration prompts (costs.py)."""
    from draftlab import costs

    calibration, where = calibration_set(args, tokenizer, prompt_ids)
    common = dict(max_length=args.max_draft_length, max_new_tokens=min(64, args.max_new_tokens), eos_token_ids=eos,
                  seed=args.seed)
    if args.tree == "auto":
        shape = costs.auto_tree(target, proposer, calibration, sampling, top_k=args.top_k, **common)
    else:
        shape = costs.auto_draft_length(target, proposer, calibration, sampling, **common)
        shape["chosen_tree"] = {"kind": "chain", "draft_length": shape["chosen_draft_length"]}
    shape["calibration_prompts"] = where
    model = shape["cost_model"]
    print(f"draft shape: {shape.get('chosen_label') or 'chain k=' + str(shape['chosen_draft_length'])} "
          f"(target step {shape['target_step_cost'] * 1e3:.1f} ms, draft step {shape['draft_step_cost'] * 1e3:.1f} ms; "
          "expected tokens/s by k: " + ", ".join(f"{k}: {v['expected_tokens_per_second']:.1f}" for k, v in model.items())
          + ")", flush=True)
    return shape


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


def cmd_recipes(argv: list[str]) -> None:
    """`draftlab recipes`: the recipe names; `--show NAME [key=value ...]`: that recipe's resolved config."""
    from draftlab.config import available_recipes, compose, to_yaml

    p = OneLineParser(prog="draftlab recipes", description="List the recipes, or print one's resolved config.")
    p.add_argument("--show", metavar="NAME", help="print the config recipe NAME resolves to (defaults, the recipe "
                   "and its bases, then any key=value overrides given after it)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    if not args.show:
        if args.overrides:
            p.error("key=value overrides go with --show NAME")
        print("\n".join(available_recipes()))
        for command in COMMAND_RECIPES:
            for name in available_recipes(command):
                print(f"{name}  (draftlab {command} --recipe {name})")
        return
    for command in COMMAND_RECIPES:
        if args.show in available_recipes(command):
            if args.overrides:
                p.error(f"{args.show} is a recipe for draftlab {command}: give its options to that command")
            from draftlab.config import recipes_dir

            print((recipes_dir() / f"{args.show}.yaml").read_text(), end="")
            return
    from draftlab.config import check_ranges

    cfg = compose([f"recipe={args.show}", *args.overrides])
    check_ranges(cfg)  # ranges and the kind's own checks (paths are not needed to show a recipe)
    print(to_yaml(cfg), end="")


COMMAND_RECIPES = ("disco", "serve-learn")  # commands besides train that read recipes (`--recipe NAME`)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = __doc__.strip()
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from draftlab.train import cli as train_cli

        return train_cli(rest)
    if command == "eval":
        return run_guarded(lambda: cmd_eval(rest))
    if command == "push":
        from draftlab.hub import cmd_push

        return run_guarded(lambda: cmd_push(rest))
    if command == "recipes":
        return run_guarded(lambda: cmd_recipes(rest))
    if command == "disco":
        from draftlab.disco import cmd_disco

        return run_guarded(lambda: cmd_disco(rest))
    if command == "serve-learn":
        from draftlab.online import cmd_serve_learn

        return run_guarded(lambda: cmd_serve_learn(rest))
    if command == "engine":
        from draftlab.llama_cpp_tools import main as engine_main

        return engine_main(rest)
    print(f"draftlab: error: unknown command '{command}': use train, eval, push, recipes, disco, serve-learn or engine\n\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
