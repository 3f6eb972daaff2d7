"""What the bench scripts beside this module share: the checkout's paths (the checkout goes on sys.path, so
`draftlab` imports from it), the default drafter, a time-stamped log line and the argument parser's start.

A script imports it by its bare name (`python bench/NAME.py` puts bench/ first on sys.path):
    from common import ROOT, SHARED, log, parser
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "bench"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CHECKPOINT = ROOT / "checkpoints" / "peer_ablation" / "base"
"""The default --checkpoint: bench/peer_ablation.py's EAGLE-3 head for SmolLM2-135M-Instruct."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser: the first paragraph of its docstring `doc` as description, and --checkpoint (default
    CHECKPOINT); the script adds its own arguments."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=str(CHECKPOINT))
    return ap


def cached_baseline(target, ids: list, path: Path, max_new_tokens: int, eos_token_ids) -> dict:
    """draftlab's greedy target-only outputs for `ids`, computed once into `path` (a lock file beside it: two
    benchmark processes at once compute it once) and read back after."""
    import fcntl
    import json

    from draftlab.evaluator import run_baseline
    from draftlab.verify import Sampling

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            log(f"target-only outputs for {path.stem} ({len(ids)} prompts)")
            path.write_text(json.dumps(run_baseline(target, ids, sampling=Sampling(), max_new_tokens=max_new_tokens,
                                                    eos_token_ids=eos_token_ids)))
    return json.loads(path.read_text())
