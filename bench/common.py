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
