"""GGUF exports for llama.cpp: made by llama.cpp's own converter, exact or refused.

`draftlab push CHECKPOINT --format gguf --to DIR` writes the kind's usual export (hub.py: the speculators folder of an
EAGLE-3 head, the transformers folder of a small_lm) and then runs `convert_hf_to_gguf.py` of the llama.cpp tree
vendored in the pinned llama-cpp-python (llama_cpp_tools.source()) over it:

    python convert_hf_to_gguf.py EXPORT [--target-model-dir TARGET_HF] --outtype f32 --outfile DIR/draft-KIND-f32.gguf

No GGUF is written by draftlab itself. The target's GGUF is the user's `.gguf` target when it has one, else the
target's transformers folder converted by the same script (`target-f32.gguf`). The model card gets the
`llama-server` / `llama-speculative-simple` commands that serve the pair.

Exact or refused: a drafter whose computation llama.cpp would change is refused, in one line and before anything is
written, naming the option to retrain (or evaluate) with. Today: an EAGLE-3 head trained with
`drafter.norm_output=true` (llama.cpp's draft-eagle3 feeds the pre-norm state back into the next draft step, and
the converter drops the flag silently), and a small_lm that drafts over a reduced vocabulary (llama.cpp's
draft-simple drafts over the whole vocabulary).

A kind plugs in with one `GgufKind` in GGUF_KINDS: its `--spec-type`, whether the converter needs the target's
folder (drafts that borrow the target's tokenizer and embeddings: EAGLE-3, DFlash), the refusal check and any
serving flags (DFlash: `draft-dflash`, the target's folder, `-fa on`).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from draftlab.errors import HubError

OUTTYPES = ("f32", "bf16", "f16", "q8_0")
CARD_SECTION = "## Serve it with llama.cpp"


def eagle3_problem(config: dict) -> str | None:
    if config.get("norm_output"):
        return ("this EAGLE-3 head was trained with drafter.norm_output=true, which llama.cpp cannot run exactly: its "
                "draft-eagle3 feeds the pre-norm state back into the next draft step (and the converter drops the "
                "flag silently); retrain with drafter.norm_output=false to serve it in llama.cpp (nothing was written)")
    return None


def small_lm_problem(config: dict) -> str | None:
    if config.get("draft_vocab"):
        return (f"this small_lm drafts over a reduced vocabulary ({len(config['draft_vocab'])} tokens, "
                "drafter.draft_vocab_size), which llama.cpp's draft-simple cannot: it drafts over the whole vocabulary; "
                "retrain (or evaluate) with drafter.draft_vocab_size=0 to serve it exactly (nothing was written)")
    return None


@dataclass(frozen=True)
class GgufKind:
    spec_type: str                                   # llama.cpp's --spec-type for this drafter
    needs_target: bool = False                       # converter's --target-model-dir (tokenizer, layer ids, embeddings)
    problem: Callable[[dict], str | None] = lambda config: None   # one-line refusal, or None when served exactly
    serve_args: tuple[str, ...] = field(default=())  # extra flags the serving command needs


GGUF_KINDS = {
    "eagle3": GgufKind("draft-eagle3", needs_target=True, problem=eagle3_problem),
    "small_lm": GgufKind("draft-simple", problem=small_lm_problem),
    # DFlash (z-lab layout, drafters/dflash.py): the converter takes the target's tokenizer and token embeddings;
    # llama.cpp's docs serve it with flash attention on
    "dflash": GgufKind("draft-dflash", needs_target=True, serve_args=("-fa", "on")),
}


def check(config: dict) -> GgufKind:
    """The kind's GgufKind, or a HubError (one line) when llama.cpp cannot serve this drafter exactly."""
    kind = config.get("kind")
    spec = GGUF_KINDS.get(kind)
    if spec is None:
        raise HubError(f"--format gguf: llama.cpp serves no '{kind}' drafter exactly (GGUF exports exist for "
                       f"{', '.join(GGUF_KINDS)}); use this kind's own --format (nothing was written)")
    problem = spec.problem(config)
    if problem:
        raise HubError(f"--format gguf: {problem}")
    return spec


def converter_problem() -> str | None:
    """What the converter needs and this Python lacks (one line), or None."""
    try:
        import sentencepiece  # noqa: F401  (the converter tries a SentencePiece vocabulary first, whatever the model)
    except ImportError:
        return "llama.cpp's GGUF converter needs sentencepiece: pip install 'draftlab[engine]' (or sentencepiece)"
    return None


def converter_command(draft_dir: Path, outfile: Path, outtype: str, target_dir: Path | None,
                      script: Path | None = None) -> tuple[list[str], dict]:
    """(argv, env) of one conversion. script: the converter (default: the pinned source's convert_hf_to_gguf.py;
    DRAFTLAB_GGUF_CONVERTER names a wrapper script that runs it)."""
    from draftlab.llama_cpp_tools import source

    src = source()
    script = Path(script or os.environ.get("DRAFTLAB_GGUF_CONVERTER") or src / "convert_hf_to_gguf.py")
    argv = [sys.executable, str(script), str(draft_dir), "--outfile", str(outfile), "--outtype", outtype]
    if target_dir is not None:
        argv += ["--target-model-dir", str(target_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(src / "gguf-py"), str(src), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return argv, env


def run_converter(draft_dir: Path, outfile: Path, outtype: str, target_dir: Path | None, what: str) -> None:
    """Convert into outfile (written under a temporary name and renamed, so a stopped conversion leaves no file
    that looks finished); a failure is one HubError line naming the converter's log."""
    partial = outfile.with_name(outfile.name + ".partial")
    argv, env = converter_command(draft_dir, partial, outtype, target_dir)
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    log = outfile.with_suffix(".convert.log")
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        log.write_text(done.stdout + done.stderr)
        last = ([line for line in done.stderr.strip().splitlines() if line.strip()] or ["no output"])[-1]
        raise HubError(f"llama.cpp's converter failed on {what} ({last[:300]}); its output: {log}")
    os.replace(partial, outfile)


def target_files(src) -> tuple[Path | None, Path | None]:
    """(the target's transformers folder, the target's .gguf file when it has one) of a hub.Source."""
    from draftlab.target import resolve_target_path

    gguf = None
    try:
        where = resolve_target_path(src.target_path)
        if str(where).lower().endswith(".gguf"):
            gguf = Path(where)
    except Exception:
        pass
    folder = Path(src.verifier) if (Path(src.verifier) / "config.json").is_file() else None
    return folder, gguf


def convert(export: Path, src, kind: GgufKind, *, outtype: str = "f32", target_gguf: str | None = None) -> dict:
    """Convert the kind's export in `export` (written by its `export`) to a GGUF draft beside it, and the target to
    a GGUF when the user has none. Returns what the card and export.json say about it."""
    if outtype not in OUTTYPES:
        raise HubError(f"--gguf-outtype {outtype}: one of {', '.join(OUTTYPES)}")
    problem = converter_problem()
    if problem:
        raise HubError(problem)
    target_dir, own_gguf = target_files(src)
    if kind.needs_target and target_dir is None:
        raise HubError(f"llama.cpp's converter reads the target's transformers folder for a '{src.kind}' draft, and "
                       f"{src.verifier!r} is not one here: pass --base-model with the target's local folder")
    draft = export / f"draft-{src.kind}-{outtype}.gguf"
    run_converter(export, draft, outtype, target_dir if kind.needs_target else None, f"the {src.kind} export")
    made_target = False
    if target_gguf:
        target = Path(target_gguf)
        if not target.is_file():
            raise HubError(f"--target-gguf {target_gguf} is not a file")
    elif own_gguf is not None:
        target = own_gguf
    elif target_dir is not None:
        target = export / f"target-{outtype}.gguf"
        run_converter(target_dir, target, outtype, None, f"the target {target_dir}")
        made_target = True
    else:
        raise HubError(f"the target {src.target_path!r} has no GGUF and no local transformers folder to convert: "
                       "pass --target-gguf with its GGUF file")
    return {"draft": draft.name, "target": target.name if made_target else str(target.resolve()),
            "target_in_export": made_target, "outtype": outtype, "spec_type": kind.spec_type,
            "serve_args": list(kind.serve_args)}


def serve_commands(info: dict, draft_length: int = 5) -> dict[str, str]:
    """The llama.cpp commands that serve an export's GGUF pair (paths relative to the export folder)."""
    target = info["target"]
    common = ["-m", target, "-md", info["draft"], "--spec-type", info["spec_type"], "--spec-draft-n-max",
              str(draft_length), *info.get("serve_args", [])]
    return {
        "llama-server": shlex.join(["llama-server", *common, "--port", "8080"]),
        "llama-speculative-simple": shlex.join(["llama-speculative-simple", *common, "--temp", "0", "-n", "128",
                                                "-p", "PROMPT"]),
    }


def card_section(info: dict, draft_length: int | None) -> str:
    k = int(draft_length or 5)
    cmds = serve_commands(info, k)
    where = ("the target's GGUF, converted here from its transformers folder" if info["target_in_export"]
             else "the target's own GGUF file")
    return "\n\n".join([
        CARD_SECTION,
        f"`{info['draft']}` is this drafter converted by llama.cpp's own `convert_hf_to_gguf.py` "
        f"(llama-cpp-python 0.3.36's llama.cpp, `--outtype {info['outtype']}`); `{info['target']}` is {where}. "
        f"llama.cpp serves it with `--spec-type {info['spec_type']}`, drafting exactly what draftlab drafts. Build the "
        "tools once with `draftlab engine build` (`draftlab engine where` prints their folder), then, from this "
        "folder:",
        "```bash\n" + cmds["llama-server"] + "\n```",
        "One prompt at a time, with each round's accepted count at `-lv 5` (the prompt is the chat-templated text):",
        "```bash\n" + cmds["llama-speculative-simple"] + "\n```",
    ])


def add_to_card(export: Path, info: dict, draft_length: int | None) -> None:
    """Append the llama.cpp section to the export's README.md (model_card.write_card wrote the rest)."""
    card = export / "README.md"
    text = card.read_text().rstrip("\n")
    card.write_text(text + "\n\n" + card_section(info, draft_length) + "\n")
