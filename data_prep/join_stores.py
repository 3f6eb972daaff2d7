"""Join feature stores: the store of a data set that grew by new conversations, from the store of the old ones
and a store of the new ones alone, without running the target again (shards are hard-linked, not copied).

    python data_prep/dump_features.py --target T --data new.jsonl --out new.store --layers 2,15,27,-1 --max-length 512
    python data_prep/join_stores.py --target T --max-length 512 \\
        --part old.jsonl old.store --part new.jsonl new.store --out-data all.jsonl --out all.store

Writes the parts' conversations end to end to --out-data and the joined store to --out (both must be new). Each
part's store must have been built from exactly its data file with the same --max-length (checked by hash), and all
stores with the same target, layers, dtype and top-k. Training then reads data.train=all.jsonl data.store=all.store.
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path

if importlib.util.find_spec("draftlab") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftlab.data import ChatDataset, DataError, read_conversations
from draftlab.store import join_stores
from draftlab.target import TargetError, load_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="the stores' target (its tokenizer checks the rows)")
    parser.add_argument("--part", nargs=2, action="append", required=True, metavar=("DATA", "STORE"),
                        help="a data file and its store, in the order the joined data should hold them (repeat)")
    parser.add_argument("--out-data", required=True, help="the joined conversations (a new JSONL file)")
    parser.add_argument("--out", required=True, help="the joined store (a new folder)")
    parser.add_argument("--max-length", type=int, default=2048, help="= the stores' and training's data.max_length")
    args = parser.parse_args(argv)
    out_data, out = Path(args.out_data), Path(args.out)
    try:
        for path in (out_data, out):
            if path.exists():
                raise DataError(f"{path} already exists: choose a new path (nothing was overwritten)")
        for data, store in args.part:
            if not Path(data).is_file():
                raise DataError(f"--part {data} {store}: {data} is not a file")
        tokenizer = load_tokenizer(args.target)
        tmp = out_data.with_name(out_data.name + ".tmp")
        with open(tmp, "wb") as f:
            for data, _ in args.part:
                with open(data, "rb") as part:
                    shutil.copyfileobj(part, f)
                    if part.tell() and not _ends_with_newline(part):
                        f.write(b"\n")
        try:
            conversations, stats = read_conversations(str(tmp))
            dataset = ChatDataset(conversations, tokenizer, args.max_length)
            manifest = join_stores(out, [store for _, store in args.part], dataset)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        tmp.replace(out_data)
    except (DataError, TargetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{out_data}: {len(dataset)} conversations from {len(args.part)} files; {out}: {manifest['rows']} rows, "
          f"{manifest['tokens']} tokens, {len(manifest['shards'])} shards (hard links to the parts' shards)")
    return 0


def _ends_with_newline(f) -> bool:
    f.seek(-1, 2)
    return f.read(1) == b"\n"


if __name__ == "__main__":
    sys.exit(main())
