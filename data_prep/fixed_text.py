"""Build a fixed-text corpus: human-written documents the target did not write, as `{"id", "text"}` JSONL rows.

    python data_prep/fixed_text.py --out checkpoints/smollm2_data/fixed_text.jsonl --max-tokens 400000

Fixed-text white-box training (what the original EAGLE did with ShareGPT): the target only *scores* these
documents (one forward, no generation), and the drafter learns the target's own next-token distributions on
them; `draftlab.data` places a `text` row as one assistant turn so every token counts. Scoring is several times
faster per token than answering prompts, which is the point: more training tokens per CPU-hour of preparation.

The corpus ships with Python itself, so it is rebuilt identically anywhere without a download: the interpreter's
language reference topics (`pydoc_data.topics`) and the docstrings of the standard-library modules, their
classes and functions (PSF licence), cut into chunks of about --chunk-chars characters at paragraph breaks.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pkgutil
import sys
import warnings
from pathlib import Path


def _docstrings(module_name: str) -> list[str]:
    """The module's docstring and those of its public classes, functions and methods (empty on import error)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(module_name)
    except BaseException:                     # some modules exit, need a display, or are platform-specific
        return []
    docs = [inspect.getdoc(module) or ""]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            docs.append(f"{name}: {inspect.getdoc(obj) or ''}")
            if inspect.isclass(obj):
                docs += [f"{name}.{m}: {inspect.getdoc(f) or ''}" for m, f in sorted(vars(obj).items())
                         if not m.startswith("_") and inspect.isfunction(f) and inspect.getdoc(f)]
    return [d for d in docs if len(d) > 80]


def documents() -> list[tuple[str, str]]:
    """(id, text) of every document, in a fixed order."""
    from pydoc_data.topics import topics

    docs = [(f"topic-{name}", text) for name, text in sorted(topics.items())]
    skip = ("antigravity", "this", "idlelib", "tkinter", "turtle", "test", "lib2to3", "ensurepip", "venv", "pydoc")
    names = sorted(m.name for m in pkgutil.iter_modules() if m.module_finder.path.startswith(sys.base_prefix)
                   and not m.name.startswith("_") and m.name not in skip)
    for name in names:
        for i, text in enumerate(_docstrings(name)):
            docs.append((f"doc-{name}-{i}", text))
    return docs


def chunks(text: str, size: int) -> list[str]:
    """Paragraph-aligned pieces of about `size` characters."""
    out, current = [], ""
    for para in text.split("\n\n"):
        if current and len(current) + len(para) > size:
            out.append(current.strip())
            current = ""
        current += para + "\n\n"
    if current.strip():
        out.append(current.strip())
    return [c for c in out if len(c) > 200]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output JSONL (overwritten)")
    ap.add_argument("--max-tokens", type=int, default=400_000, help="stop after about this many tokens (4 chars each)")
    ap.add_argument("--chunk-chars", type=int, default=1500)
    args = ap.parse_args(argv)
    rows, chars = [], 0
    for doc_id, text in documents():
        for j, piece in enumerate(chunks(text, args.chunk_chars)):
            rows.append({"id": f"{doc_id}-{j}", "source": "python-docs", "text": piece})
            chars += len(piece)
        if chars >= 4 * args.max_tokens:
            break
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{out}: {len(rows)} documents, {chars:,} characters (about {chars // 4:,} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
