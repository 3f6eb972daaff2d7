"""Hub export and upload: the formats serving engines load, a model card with measured tau, and the push.

    draftlab push CHECKPOINT --repo-id ORG/NAME [--private] [--revision R] [--commit-message M]
                  [--format auto|draftlab|speculators|eagle|medusa|hf|gguf] [--to DIR] [--target PATH]
                  [--base-model HUB_ID] [--eval REPORT.json ...] [--license L]

An export folder holds, at its top, the files a serving engine loads (each drafter kind writes its format in its
`export`), the model card README.md and its acceptance plot. The draftlab checkpoint itself (drafter_config.json,
model.safetensors, eval.json, the run's config.yaml, extra eval reports) sits in `draftlab/`, and a `best` file
naming that folder makes the whole export a checkpoint again: `draftlab eval --checkpoint EXPORT` works on it,
and `draftlab push EXPORT --repo-id ...` uploads it as it is (the retry command printed after a failed upload).
The native files live in a subfolder because several serving layouts also use the name model.safetensors.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
from functools import cached_property
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftlab import checkpoint as ckpt
from draftlab import model_card
from draftlab.config import REPO_ID_RE, repo_id_problem
from draftlab.drafters import DRAFTERS, load_drafter
from draftlab.errors import HubError, OneLineParser, describe_disk_full, is_disk_full
from draftlab.model_card import MARKER, NATIVE_DIR, REPORTS_DIR

# ----------------------------------------------------------------------------------------------------------
# the checkpoint being exported


class Source:
    """A checkpoint folder with its drafter config, weights, run config and (loaded only when needed) target."""

    def __init__(self, folder: Path, target=None, tokenizer=None, target_path: str | None = None,
                 base_model: str | None = None):
        self.folder = folder
        self.config = ckpt.read_drafter_config(folder)
        self.kind = self.config.get("kind")
        if target_path is None:
            try:
                target_path = ckpt.checkpoint_target(folder)  # the run's target.path, else the drafter's record
            except ckpt.CheckpointError:
                if target is None:
                    raise
        self.target_path = target_path or getattr(target.config, "_name_or_path", "") or ""
        self._target = (target, tokenizer) if target is not None else None
        recorded = (self.config.get("target") or {}).get("name_or_path", "")
        # what serving configs and usage lines name as the target (a Hub id or a local transformers folder), and
        # the card's base_model (a Hub id only)
        self.verifier = verifier_name(base_model, self.target_path, recorded)
        self.base_model = self.verifier if looks_like_hub_id(self.verifier) else None

    @cached_property
    def weights(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.folder / ckpt.WEIGHTS_NAME))

    def target(self, fresh: bool = False):
        """(model, tokenizer), loaded from target_path on first use; fresh=True always loads a new copy."""
        if self._target is not None and not fresh:
            return self._target
        from draftlab.target import load_target

        loaded = load_target(self.target_path, "auto", "auto")
        if not fresh:
            self._target = loaded
        return loaded

    @cached_property
    def full_config(self):
        """The target's config (from the loaded model, else from its config.json without loading the weights)."""
        if self._target is not None:
            return self._target[0].config
        from transformers import AutoConfig

        from draftlab.target import convert_gguf, resolve_target_path

        where = resolve_target_path(self.target_path)
        try:
            return AutoConfig.from_pretrained(convert_gguf(where) if where.lower().endswith(".gguf") else where)
        except Exception as e:
            raise HubError(f"cannot read the target's config from {self.target_path} ({type(e).__name__}): pass "
                           "--target with the target's local folder") from None

    def drafter(self, model):
        """The checkpoint's drafter, loaded onto `model` (a target from `target()`)."""
        return load_drafter(self.folder, model)

    def target_config(self):
        return self.full_config.get_text_config()

    def architectures(self) -> list[str]:
        own = [type(self._target[0]).__name__] if self._target is not None else []
        return list(self.full_config.architectures or own)


def looks_like_hub_id(name: str | None) -> bool:
    """ORG/NAME that is not a local path (a Hub `base_model` must be a real model id)."""
    return bool(name) and bool(REPO_ID_RE.match(name)) and not Path(name).expanduser().exists()


def model_folder(name: str | None) -> str | None:
    """The absolute path of a local transformers model folder (one with config.json), else None."""
    path = Path(name or "").expanduser()
    return str(path.resolve()) if name and (path / "config.json").is_file() else None


def verifier_name(base_model: str | None, target_path: str, recorded: str = "") -> str:
    """The target's name for other tools (speculators' verifier, Medusa's base_model_name_or_path, usage lines):
    --base-model (a Hub id or a local folder), else the target itself when it is either, else, for a `.gguf` or
    `package:` target that only draftlab reads, the transformers folder it was dequantised into."""
    if base_model:
        found = base_model if looks_like_hub_id(base_model) else model_folder(base_model)
        if not found:
            raise HubError(f"--base-model {base_model} is neither a Hub model id (ORG/NAME) nor a local folder with "
                           "config.json: pass the target's Hub id or its transformers folder")
        return found
    for name in (target_path, recorded):
        found = name if looks_like_hub_id(name) else model_folder(name)
        if found:
            return found
    from draftlab.target import TargetError, convert_gguf, resolve_target_path

    try:
        where = resolve_target_path(target_path)
        if where.lower().endswith(".gguf"):
            return convert_gguf(where)
    except (TargetError, OSError) as e:
        raise HubError(f"the target {target_path!r} cannot be named for other tools ({e}): pass --base-model "
                       "with its Hub id (ORG/NAME) or a local transformers folder") from None
    raise HubError(f"the target {target_path!r} is neither a Hub id nor a local transformers folder, so serving "
                   "configs could not name it: pass --base-model with its Hub id (ORG/NAME) or a local folder")


FORMATS = ("auto", "draftlab", *dict.fromkeys(cls.export_format for cls in DRAFTERS.values()), "gguf")


# ----------------------------------------------------------------------------------------------------------
# export


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, fmt: str = "auto", target=None,
                      tokenizer=None, target_path: str | None = None, base_model: str | None = None,
                      eval_reports: list | tuple = (), license: str = "apache-2.0",
                      repo_id: str | None = None, disco: str | Path | None = None,
                      gguf_outtype: str = "f32", target_gguf: str | None = None) -> Path:
    """Write the export folder (serving format + card + native checkpoint) for a run or step folder.

    fmt: "auto" (the kind's serving format), "draftlab" (native files and card only), or a format name that must
    match the kind. target/tokenizer: an already loaded target (else it is loaded from target_path or the run's
    config when an exporter needs it). disco: a DISCO stop classifier for this drafter (`draftlab disco`), shipped
    in the export's disco/ folder. The folder is written beside out_dir and renamed into place.
    fmt "gguf": the kind's own format plus its GGUF for llama.cpp (gguf_export.py: gguf_outtype, target_gguf), or a
    one-line refusal before anything is written when llama.cpp cannot run this drafter exactly."""
    folder = ckpt.resolve_checkpoint(checkpoint)
    gguf = None
    if fmt == "gguf":
        from draftlab import gguf_export

        gguf, fmt = gguf_export.check(ckpt.read_drafter_config(folder)), "auto"
    reports = [model_card.read_report(p) for p in eval_reports]
    src = Source(folder, target, tokenizer, target_path, base_model)
    fmt = pick_format(src.kind, fmt)
    classifier = stop_classifier(disco, src) if disco else None     # a foreign one fails before anything is written
    out = Path(out_dir)
    if out.exists() and not is_export(out) and (not out.is_dir() or any(out.iterdir())):
        raise HubError(f"export folder {out_dir} already exists and is not a draftlab export: an export replaces "
                       "its folder whole, so pass a new or empty folder (nothing was written)")
    out = out.resolve() if out.name in ("", ".", "..") else out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / NATIVE_DIR / REPORTS_DIR).mkdir(parents=True)
    try:
        for path in [folder / n for n in (ckpt.CONFIG_NAME, ckpt.WEIGHTS_NAME, "eval.json", "config.yaml")] + [
                folder.parent / "config.yaml"]:
            if path.is_file() and not (tmp / NATIVE_DIR / path.name).exists():
                shutil.copy2(path, tmp / NATIVE_DIR / path.name)
        for i, (path, report) in enumerate(reports):
            (tmp / NATIVE_DIR / REPORTS_DIR / f"{i:02d}_{Path(path).stem}.json").write_text(json.dumps(report))
        (tmp / "best").write_text(NATIVE_DIR + "\n")
        first = json.loads((folder / "eval.json").read_text()) if (folder / "eval.json").is_file() else (
            reports[0][1] if reports else {})
        meta = {"draftlab_export": 1, "kind": src.kind, "format": fmt, "repo_id": repo_id, "base_model":
                src.base_model, "verifier": src.verifier, "target": src.target_path, "license": license,
                "step": folder.name,
                "draft_length": first.get("draft_length")}
        drafter_class = DRAFTERS.get(src.kind)
        meta.update(card_name=getattr(drafter_class, "card_name", src.kind),
                    card_note=getattr(drafter_class, "card_note", None))
        # the export's own folders, for exporters that write beside their format (never saved in export.json)
        paths = {"export_dir": str(out), "native_dir": str(tmp / NATIVE_DIR)}
        meta["details"] = drafter_class.export(src, tmp, {**meta, **paths}) if fmt != "draftlab" else {}
        if gguf is not None:
            meta["gguf"] = gguf_export.convert(tmp, src, gguf, outtype=gguf_outtype, target_gguf=target_gguf)
        if classifier is not None:
            from draftlab import disco as stop

            (tmp / DISCO_DIR).mkdir()
            shutil.copy2(classifier.folder / stop.WEIGHTS_NAME, tmp / DISCO_DIR / stop.WEIGHTS_NAME)
            # the drafter it stops is the export's own checkpoint, named relative to it, so it stays right wherever
            # the export is downloaded to (disco.check_drafter resolves it)
            shipped = {**classifier.info, "shipped_from": (classifier.info.get("drafter") or {}).get("checkpoint")}
            shipped["drafter"] = {**(shipped.get("drafter") or {}), "checkpoint": f"../{NATIVE_DIR}", "kind": src.kind}
            (tmp / DISCO_DIR / stop.CONFIG_NAME).write_text(json.dumps(shipped, indent=2))
            meta["disco"] = {"folder": DISCO_DIR, **{k: classifier.info.get(k) for k in (
                "features", "examples", "positive_rate", "val_accuracy", "recipe")}}
        (tmp / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
        model_card.write_card(tmp)
        if gguf is not None:
            gguf_export.add_to_card(tmp, meta["gguf"], meta.get("draft_length"))
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)        # nothing half-written is left behind
        if is_disk_full(e):
            raise HubError(f"{describe_disk_full(e)}: the partial export was removed and {out} (if any) is "
                           "unchanged; free space and export again") from None
        raise
    readable_like_new_files(tmp)
    ckpt.replace_folder(tmp, out)
    return out


def readable_like_new_files(folder: Path) -> None:
    """Give every file of an export the mode a new file gets under this umask (safetensors writes its files 0600,
    which a served or uploaded copy of the folder would keep)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, (0o777 if os.access(path, os.X_OK) and path.stat().st_mode & 0o100 else 0o666) & ~umask)


DISCO_DIR = "disco"  # an export's DISCO stop classifier (draftlab eval --draft-length disco --disco EXPORT/disco)


def stop_classifier(path: str | Path, src: Source):
    """The DISCO classifier at `path`, checked against the checkpoint it ships with: trained from another
    target's rounds is a HubError; from another checkpoint's rounds, a warning line."""
    import sys

    from draftlab import disco as stop
    from draftlab.target import check_fingerprint

    classifier = stop.load_classifier(path)
    logged = classifier.info.get("drafter") or {}
    check_fingerprint(logged.get("target") or {}, src.config.get("target") or {}, f"--disco {path}",
                      "ship the classifier trained from this drafter's rounds", HubError)
    if logged.get("checkpoint") not in (None, str(src.folder.resolve())):
        print(f"draftlab: warning: --disco {path} was trained from rounds of {logged.get('checkpoint')}, not of "
              f"{src.folder.resolve()}: its stops may suit this drafter less well", file=sys.stderr, flush=True)
    return classifier


def pick_format(kind: str, fmt: str) -> str:
    own = getattr(DRAFTERS.get(kind), "export_format", "draftlab")
    if fmt == "auto":
        return own
    if fmt in ("draftlab", own):
        return fmt
    raise HubError(f"--format {fmt} does not fit a '{kind}' drafter: its serving format is {own} (or use --format "
                   f"draftlab for the native checkpoint only; formats: {', '.join(FORMATS)})")


def is_export(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file() and (Path(path) / NATIVE_DIR / ckpt.CONFIG_NAME).is_file()


def default_export_dir(checkpoint: str | Path, repo_id: str) -> Path:
    """run_folder/hub_export/ORG--NAME (a step folder's run folder is its parent)."""
    folder = ckpt.resolve_checkpoint(checkpoint)
    run = folder.parent if ckpt.STEP_RE.match(folder.name) else folder
    return run / "hub_export" / repo_id.replace("/", "--")


# ----------------------------------------------------------------------------------------------------------
# upload


def check_repo_id(repo_id: str, option: str = "--repo-id") -> None:
    """ORG/NAME of a model repository; anything the Hub would refuse is refused before anything is written."""
    problem = repo_id_problem(repo_id, option)
    if problem:
        raise HubError(problem)


REVISION_BAD = re.compile(r"[\s~^:?*\[\\]|\.\.|@\{|//|^[-/.]|[/.]$|\.lock$")


def retry_command(export: Path, repo_id: str, private: bool, revision: str | None, message: str | None) -> str:
    cmd = ["draftlab", "push", str(export), "--repo-id", repo_id]
    cmd += ["--private"] if private else []
    cmd += ["--revision", revision] if revision else []
    cmd += ["--commit-message", message] if message else []
    return " ".join(shlex.quote(c) for c in cmd)


def describe_failure(e: BaseException, repo_id: str, endpoint: str) -> str:
    """One line saying what went wrong with the Hub and how to fix it."""
    from huggingface_hub import errors

    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, errors.OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set: unset it to upload"
    if isinstance(e, errors.RepositoryNotFoundError) or status == 404:
        return (f"repository {repo_id} was not found or this token cannot see it (HTTP 404): check the name and "
                "that the token belongs to a member of its organisation")
    if status == 401:
        return "the Hub rejected the token (HTTP 401): it is invalid or expired; create a new write token"
    if status == 403:
        return (f"this token may not write to {repo_id} (HTTP 403): use a token with write access to "
                f"{repo_id.split('/')[0]}")
    if isinstance(e, errors.HfHubHTTPError) and status is not None:
        return f"the Hub answered HTTP {status} for {repo_id}: {server_message(e)}"
    if isinstance(e, ValueError) and "metadata" in str(e):
        return f"the Hub rejected the model card's metadata: {' '.join(str(e).split())[:300]}"
    # huggingface_hub's HTTP client (httpx, or httpx2 in 2.x) and requests: match by base-class name
    network = {"TransportError", "RequestError", "ConnectionError", "Timeout", "TimeoutException"}
    if isinstance(e, OSError) or network & {c.__name__ for c in type(e).__mro__}:
        return (f"cannot reach the Hub at {endpoint} ({type(e).__name__}: {first_line(e)}): check the network, "
                "a proxy, or HF_ENDPOINT")
    return f"upload to {repo_id} failed ({type(e).__name__}: {first_line(e)})"


def server_message(e: BaseException) -> str:
    """The Hub's own error text when it sent JSON, else the exception's first line."""
    try:
        return str(e.response.json()["error"])
    except Exception:
        return first_line(e)


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or ["no message"])[0][:200]


def upload(export: Path, repo_id: str, *, private: bool = False, revision: str | None = None,
           commit_message: str | None = None, token: str | None = None) -> str:
    """create_repo(exist_ok) + upload_folder of an export folder; returns the commit URL. Failures raise one-line
    HubErrors naming the kept export and the retry command; the token never appears in them."""
    import huggingface_hub
    from huggingface_hub import HfApi, constants

    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    retry = retry_command(export, repo_id, private, revision, commit_message)
    token = token or huggingface_hub.get_token()
    if not token:
        raise HubError(f"no Hugging Face token: run `hf auth login` (or set HF_TOKEN) with a write token; the export "
                       f"is kept at {export}; retry: {retry}")
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        info = api.upload_folder(repo_id=repo_id, folder_path=str(export), revision=revision, repo_type="model",
                                 commit_message=commit_message or model_card.commit_message_for(export))
    except Exception as e:
        message = describe_failure(e, repo_id, endpoint).replace(token, "***")
        raise HubError(f"{message}; the export is kept at {export}; retry: {retry}") from None
    return str(getattr(info, "commit_url", info))


def push_checkpoint(checkpoint: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
                    commit_message: str | None = None, fmt: str = "auto", export_dir: str | Path | None = None,
                    target=None, tokenizer=None, target_path: str | None = None, base_model: str | None = None,
                    eval_reports: list | tuple = (), license: str = "apache-2.0", token: str | None = None,
                    disco: str | Path | None = None, gguf_outtype: str = "f32", target_gguf: str | None = None) -> str:
    """Export a run / step folder (or take an existing export as is) and upload it to ORG/NAME; returns the
    commit URL. The training loop calls this for `hub.push` (a run folder means its best step)."""
    check_repo_id(repo_id)
    if is_export(checkpoint):
        if disco:
            raise HubError(f"{checkpoint} is an export already: pass the run or step folder with --disco, so that "
                           "the classifier is checked and shipped in a new export")
        export = Path(checkpoint)
        retarget_export(export, repo_id)
    else:
        export = export_checkpoint(checkpoint, export_dir or default_export_dir(checkpoint, repo_id), fmt=fmt,
                                   target=target, tokenizer=tokenizer, target_path=target_path,
                                   base_model=base_model, eval_reports=eval_reports, license=license, repo_id=repo_id,
                                   disco=disco, gguf_outtype=gguf_outtype, target_gguf=target_gguf)
    print(f"export: {export}", flush=True)
    return upload(export, repo_id, private=private, revision=revision, commit_message=commit_message, token=token)


def retarget_export(export: Path, repo_id: str) -> None:
    """Point an existing export at `repo_id`: the card's usage lines, and a Medusa-2 config naming itself."""
    meta = json.loads((export / MARKER).read_text())
    if meta.get("repo_id") == repo_id:
        return
    meta["repo_id"] = repo_id
    (export / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    if meta.get("details", {}).get("merged_target"):
        config = json.loads((export / "config.json").read_text())
        (export / "config.json").write_text(json.dumps({**config, "base_model_name_or_path": repo_id}, indent=2))
    model_card.write_card(export)


# ----------------------------------------------------------------------------------------------------------
# command line


def push_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="draftlab push", description="Export a drafter for serving engines, with a "
                                "model card of its measured acceptance length, and upload it to the Hub.")
    p.add_argument("checkpoint", help="run folder (its best step), step_N folder, or an export folder")
    p.add_argument("--repo-id", help="Hub model repository ORG/NAME (required unless --to)")
    p.add_argument("--private", action="store_true", help="create the repository as private")
    p.add_argument("--revision", help="branch to push to (created when missing; default main)")
    p.add_argument("--commit-message", help="commit message (default: kind, step, format and tau)")
    p.add_argument("--format", default="auto", choices=FORMATS, help="serving format (auto: the drafter kind's; "
                   "gguf: that plus GGUF files for llama.cpp, made by llama.cpp's own converter)")
    p.add_argument("--gguf-outtype", default="f32", choices=("f32", "bf16", "f16", "q8_0"), help="--format gguf: "
                   "the GGUF weight type (default f32, what draftlab eval computes in)")
    p.add_argument("--target-gguf", help="--format gguf: the target's GGUF file to serve with (default: the target's "
                   "own .gguf, else its transformers folder converted into the export)")
    p.add_argument("--to", help="export into this folder only, no upload")
    p.add_argument("--target", help="target model (default: the one the checkpoint was trained with)")
    p.add_argument("--base-model", help="the target as other tools load it, a Hub id or a local transformers "
                   "folder, for the card and serving configs (default: the target when it is one, or the folder a "
                   ".gguf / package: target was dequantised into)")
    p.add_argument("--eval", action="append", default=[], metavar="REPORT.json",
                   help="extra `draftlab eval` report for the card's tau table (repeatable)")
    p.add_argument("--license", default="apache-2.0", help="license in the card (default apache-2.0)")
    p.add_argument("--disco", metavar="DIR", help="ship this DISCO stop classifier (draftlab disco) in the export's "
                   f"{DISCO_DIR}/ folder")
    return p


def check_target_gguf(path: str, drafter_config: dict) -> None:
    """HubError (one line, nothing written) unless `path` is a GGUF file of the target the checkpoint was trained
    for: GGUF's magic bytes, then its width, depth and vocabulary against the checkpoint's target fingerprint."""
    where = Path(path).expanduser()
    if not where.is_file():
        raise HubError(f"--target-gguf {path} is not a file: pass the target's .gguf file (nothing was written)")
    with open(where, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise HubError(f"--target-gguf {path} is not a GGUF file (it does not start with GGUF's magic bytes): pass "
                       "the target's .gguf file (nothing was written)")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(where))
        value = lambda key: reader.fields[key].contents() if key in reader.fields else None  # noqa: E731
        arch = value("general.architecture")
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        found = {"hidden_size": value(f"{arch}.embedding_length"), "num_hidden_layers": value(f"{arch}.block_count"),
                 "vocab_size": value(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)}
    except ImportError:
        return
    except Exception as e:  # noqa: BLE001 (a damaged file: whatever the reader trips on)
        raise HubError(f"--target-gguf {path} cannot be read as a GGUF file ({type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}): pass the target's .gguf file (nothing was "
                       "written)") from None
    target = drafter_config.get("target") or {}
    differ = [f"{key} {found[key]} (the checkpoint's target: {target[key]})" for key in found
              if found[key] is not None and target.get(key) is not None and int(found[key]) != int(target[key])]
    if differ:
        raise HubError(f"--target-gguf {path} ({arch}) is not a GGUF of the target this checkpoint was trained for "
                       f"({target.get('name_or_path') or target.get('model_type')}): {', '.join(differ)}; pass that "
                       "target's GGUF (nothing was written)")


def cmd_push(argv: list[str]) -> None:
    args = push_parser().parse_args(argv)
    if not args.to and not args.repo_id:
        raise HubError("give --repo-id ORG/NAME to upload, or --to DIR for a local export only")
    if args.repo_id:
        check_repo_id(args.repo_id)
    if args.base_model:
        verifier_name(args.base_model, "")          # a bad --base-model stops before anything is loaded
    if args.revision is not None and REVISION_BAD.search(args.revision or "/"):
        raise HubError(f"--revision {args.revision!r} is not a valid branch name: use letters, digits, '-', '_', "
                       "'.' and '/', e.g. --revision v1 (no spaces, '..', '~^:?*[\\', or a leading '-')")
    if args.format == "gguf" and args.target_gguf:  # before anything converts: a GGUF of this checkpoint's target
        check_target_gguf(args.target_gguf, ckpt.read_drafter_config(ckpt.resolve_checkpoint(args.checkpoint)))
    options = dict(fmt=args.format, target_path=args.target, base_model=args.base_model, eval_reports=args.eval,
                   license=args.license, disco=args.disco)
    if args.format == "gguf":
        options.update(gguf_outtype=args.gguf_outtype, target_gguf=args.target_gguf)
    if args.to:
        from draftlab.runlock import check_output, claim_outputs

        check_output("--to", args.to, folder=True, replaces=True, example="export", inputs=[
            ("the checkpoint", args.checkpoint), ("--target", args.target), ("--target-gguf", args.target_gguf),
            ("--base-model", args.base_model), ("--disco", args.disco), *(("--eval", e) for e in args.eval)])
        with claim_outputs([("--to", args.to)]):        # one export into a folder at a time
            out = export_checkpoint(args.checkpoint, args.to, repo_id=args.repo_id, **options)
        print(f"exported {ckpt.resolve_checkpoint(args.checkpoint)} to {out}:")
        print("\n".join(f"  {p.relative_to(out)}" for p in sorted(out.rglob("*")) if p.is_file()))
        return
    url = push_checkpoint(args.checkpoint, args.repo_id, private=args.private, revision=args.revision,
                          commit_message=args.commit_message, **options)
    print(f"pushed to {args.repo_id}: {url}")
