"""llama.cpp's serving tools, built once from the source that the pinned llama-cpp-python vendors.

draftlab's `engine` extra pins `llama-cpp-python==0.3.36`; its sdist carries a llama.cpp tree whose `llama-server` and
`llama-speculative-simple` serve speculative decoding with EAGLE-3 heads (`--spec-type draft-eagle3`), small draft
models (`draft-simple`) and n-gram methods, and whose `convert_hf_to_gguf.py` turns draftlab's exports into GGUF files.
This module fetches that sdist from the package registry (`pip download`), unpacks its llama.cpp tree and builds the
tools with cmake, all under one cache folder per version and CPU:

    ~/.cache/draftlab/llama.cpp/<version>-<cpu key>/
        src/            llama.cpp as vendored in the sdist (convert_hf_to_gguf.py, gguf-py/)
        build/bin/      llama-server, llama-speculative-simple, llama-bench and their shared libraries
        complete.json   written last: the tools are there (what find_tools() checks)

Two builds: `stock` (llama.cpp's own defaults, what users run) and `exact` (`draftlab engine build --exact`,
folder `<version>-<cpu key>-exact`): the same with `GGML_LLAMAFILE=OFF`. The stock CPU backend multiplies a batch of
2 or more tokens with llamafile's tiled sgemm and a single token with ggml's dot products, so a verification
forward and a one-token decode step sum in different orders; where the target's two best tokens are within about
1e-3 in logit, speculative decoding then emits another token than target-only decoding. With llamafile off every
token's products are the same dot products whatever the batch, and the served output equals target-only's.

The CPU key hashes /proc/cpuinfo's flags, because `GGML_NATIVE=ON` compiles for this CPU's instruction set. A build
that stops half-way resumes where it stopped (cmake and ninja only redo what is missing); a finished one returns at
once. `DRAFTLAB_LLAMA_CPP_CACHE` moves the cache root.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from draftlab.errors import HubError

VERSION = "0.3.36"  # the llama-cpp-python release of pyproject.toml's `engine` extra
TOOLS = ("llama-server", "llama-speculative-simple", "llama-bench")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_NATIVE=ON")
VARIANTS = {"stock": (), "exact": ("-DGGML_LLAMAFILE=OFF",)}  # extra cmake flags per build (module docstring)


class EngineError(HubError):
    """llama.cpp's tools cannot be built or found; the message is one line that says what to install or run."""


def cpu_key() -> str:
    """`<machine>-<10 hex digits of the CPU's flags>`: a native build runs only where these flags are."""
    try:
        from draftlab.target import cpu_flags

        flags = sorted(cpu_flags(Path("/proc/cpuinfo").read_text()))
    except OSError:
        flags = [platform.processor()]
    return f"{platform.machine()}-{hashlib.sha1(' '.join(flags).encode()).hexdigest()[:10]}"


def cache_root() -> Path:
    return Path(os.environ.get("DRAFTLAB_LLAMA_CPP_CACHE") or Path.home() / ".cache" / "draftlab" / "llama.cpp")


def cache_dir(version: str = VERSION, variant: str = "stock") -> Path:
    if variant not in VARIANTS:
        raise EngineError(f"unknown llama.cpp build '{variant}': use one of {', '.join(VARIANTS)}")
    return cache_root() / (f"{version}-{cpu_key()}" + ("" if variant == "stock" else f"-{variant}"))


def find_tools(version: str = VERSION, variant: str = "stock") -> dict[str, Path] | None:
    """The built tools by name (plus "src", the llama.cpp tree), or None when `draftlab engine build` has not
    finished here."""
    root = cache_dir(version, variant)
    if not (root / "complete.json").exists():
        return None
    tools = {name: root / "build" / "bin" / name for name in TOOLS}
    if not all(p.exists() for p in tools.values()):
        return None
    return {**tools, "src": source_dir(version)}


def source_dir(version: str = VERSION) -> Path:
    """Where the llama.cpp tree is unpacked: in the stock build's folder, shared by every build."""
    return cache_dir(version) / "src"


def source(version: str = VERSION, log=print) -> Path:
    """The llama.cpp tree of llama-cpp-python `version`'s sdist (downloaded and unpacked once): the converter
    needs only this, not the built tools."""
    root = cache_dir(version)
    src = source_dir(version)
    if (src / "convert_hf_to_gguf.py").exists():
        return src
    root.mkdir(parents=True, exist_ok=True)
    downloads = root / "downloads"
    sdist = next(iter(sorted(downloads.glob(f"llama_cpp_python-{version}.tar.gz"))), None)
    if sdist is None:
        log(f"downloading the llama-cpp-python {version} sdist (about 75 MB) from the package registry ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={version}", "-d", str(downloads)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        sdist = downloads / f"llama_cpp_python-{version}.tar.gz"
        if done.returncode != 0 or not sdist.exists():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise EngineError(f"could not download the llama-cpp-python {version} sdist with pip ({last}); "
                              f"put llama_cpp_python-{version}.tar.gz in {downloads} and run again")
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    partial = root / "src.partial"
    shutil.rmtree(partial, ignore_errors=True)
    log(f"unpacking llama.cpp from {sdist.name} ...")
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(prefix) or "/.git" in m.name[len(prefix) - 1:]:
                continue
            m.name = m.name[len(prefix):]
            if m.name:
                members.append(m)
        tar.extractall(partial, members=members, filter="data")
    if not (partial / "convert_hf_to_gguf.py").exists():
        raise EngineError(f"{sdist} holds no vendor/llama.cpp/convert_hf_to_gguf.py: not the expected sdist")
    partial.rename(src)
    return src


def missing_build_tools() -> str | None:
    """One line naming what the build needs and this machine lacks, or None."""
    if shutil.which("cmake") is None:
        return "cmake is not installed (apt-get install cmake, or pip install cmake)"
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "no C++ compiler found (apt-get install g++, or install clang)"
    return None


@contextlib.contextmanager
def _locked(path: Path):
    """One build at a time per cache folder (CI and a test run may start one together): a second one says in one line
    that it waits. A cache root that cannot hold the folder (read-only, a file) is one line naming it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a")
    except OSError as e:
        raise EngineError(f"cannot use {path.parent} as llama.cpp's build folder ({e.strerror or e}): set "
                          "DRAFTLAB_LLAMA_CPP_CACHE to a writable folder") from None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"draftlab: another process is building llama.cpp in {path.parent}: waiting for it to finish",
                  file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(version: str = VERSION, jobs: int = 2, log=print, variant: str = "stock") -> dict[str, Path]:
    """Build (or finish building) the tools; returns find_tools()'s map. Raises EngineError, one line, when cmake
    or a compiler is missing or the build fails (the log's path is in the message)."""
    found = find_tools(version, variant)
    if found:
        return found
    missing = missing_build_tools()
    if missing:
        raise EngineError(f"cannot build llama.cpp's tools: {missing}")
    root = cache_dir(version, variant)
    flags = CMAKE_FLAGS + VARIANTS[variant]
    with _locked(root / ".build.lock"):
        found = find_tools(version, variant)  # another process may have finished it while we waited
        if found:
            return found
        src = source(version, log)
        build_dir = root / "build"
        log_path = root / "build.log"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        steps = [["cmake", "-S", str(src), "-B", str(build_dir), *generator, *flags],
                 ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TOOLS]]
        log(f"building {', '.join(TOOLS)} from llama.cpp ({version}, {variant}) in {root}, -j{jobs}; log: {log_path} "
            "(about 12 minutes of CPU)")
        start = time.time()
        with open(log_path, "a") as out:
            for cmd in steps:
                out.write("$ " + " ".join(cmd) + "\n")
                out.flush()
                if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                    raise EngineError(f"building llama.cpp failed at `{' '.join(cmd[:3])} ...`: see {log_path}")
        (root / "complete.json").write_text(json.dumps(
            {"llama_cpp_python": version, "cpu_key": cpu_key(), "tools": list(TOOLS), "cmake_flags": list(flags),
             "variant": variant,
             "seconds": round(time.time() - start, 1)}, indent=1) + "\n")
    found = find_tools(version, variant)
    if not found:
        raise EngineError(f"the llama.cpp build finished but {', '.join(TOOLS)} are not all in {root / 'build/bin'}")
    return found


ENGINE_USAGE = """usage: draftlab engine build [--exact | --vllm]    build llama.cpp's serving tools (--exact: the batch-invariant
                                                 build tests use) or set up the CPU vLLM, cached per version
       draftlab engine where [--exact | --vllm]    print where the built tools (or vLLM's Python) are
       draftlab engine serve --vllm --target T [--export E] [--draft-length K]
                                                 run vLLM's OpenAI server on a target, with a drafter export"""


def main(argv: list[str] | None = None) -> int:
    """`python -m draftlab.llama_cpp_tools [build|where] [--exact]` (the same as `draftlab engine ...`); with --vllm,
    vllm_tools.main (build, where, serve)."""
    from draftlab.errors import run_guarded

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--vllm" in argv:           # the same `engine` command sets up and starts vLLM (vllm_tools.py)
        from draftlab.vllm_tools import main as vllm_main

        return vllm_main(argv)
    if {"-h", "--help"} & set(argv):
        print(ENGINE_USAGE)
        return 0
    variant = "exact" if "--exact" in argv else "stock"
    words = [a for a in argv if a != "--exact"]
    what = words[0] if words else "build"

    def run():
        if what == "build":
            tools = build(variant=variant)
            print(f"llama.cpp tools ({variant} build) ready in {tools['llama-server'].parent}")
        elif what == "where":
            tools = find_tools(variant=variant)
            print(tools["llama-server"].parent if tools else f"not built (would be in {cache_dir(variant=variant)})")
        else:
            raise EngineError(f"unknown engine command '{what}': use build or where (--exact: the batch-invariant "
                              "build; --vllm: vLLM's build, where or serve)")
    return run_guarded(run)


if __name__ == "__main__":
    sys.exit(main())


# ----------------------------------------------------------------------------------------------------------
# running llama-speculative-simple (tests/test_llama_cpp_serving.py, bench/llama_cpp_serving.py)

# target-only decoding in the same program: llama-speculative-simple refuses `--spec-type none`, and an n-gram
# lookup whose key is 1,024 tokens long (its maximum) never matches a shorter context, so every round is one plain
# one-token decode of the target
TARGET_ONLY = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1024")


@dataclass
class Served:
    """One prompt decoded by llama-speculative-simple."""
    text: str                        # what it printed after the prompt (the answer, EOS not included)
    rounds: list[tuple[int, int]]    # per target forward: (accepted draft tokens, drafted tokens)
    tokens: int                      # tokens it emitted (n_predict: every round's accepted + 1)
    decode_seconds: float            # its own timer over the decoding loop (prompt processing excluded)
    draft_ms: float | None = None    # the drafter's own timer over its draft calls (llama.cpp's "dur(b,g,a)" g)
    draft_tokens: int = 0            # tokens it drafted ("#gen tokens")

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def acceptance_length(self) -> float:
        """Tokens per target forward (the first round's included: llama.cpp verifies its first draft together with
        the prompt's last token)."""
        return self.tokens / max(len(self.rounds), 1)


ACCEPTED_RE = re.compile(r"accepted (\d+)/(\d+) draft tokens")
DECODED_RE = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
STATS_RE = re.compile(r"statistics\s+\S+: .*#gen tokens =\s*(\d+).*dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms")


def write_prompt(path: str | Path, text: str) -> Path:
    """The prompt file for -f: llama.cpp drops one trailing newline of a prompt file, and chat-templated prompts
    end with one, so the file gets one more."""
    Path(path).write_text(text + "\n")
    return Path(path)


def speculative_command(tools: dict, target_gguf: str | Path, prompt_file: str | Path, max_new_tokens: int, *,
                        draft_gguf: str | Path | None = None, spec_type: str | None = None, draft_length: int = 5,
                        threads: int = 1, extra: tuple[str, ...] = ()) -> list[str]:
    """argv of one greedy decoding. spec_type None: target-only (TARGET_ONLY). llama-speculative-simple emits one
    token more than -n, so -n is max_new_tokens - 1."""
    cmd = [str(tools["llama-speculative-simple"]), "-m", str(target_gguf), "-f", str(prompt_file),
           "-n", str(max_new_tokens - 1), "--temp", "0", "--seed", "0", "-t", str(threads), "-tb", str(threads),
           "-c", "4096", "-lv", "5"]
    if spec_type is None:
        cmd += TARGET_ONLY
    else:
        cmd += ["--spec-type", spec_type, "--spec-draft-n-max", str(draft_length)]
    if draft_gguf is not None:
        cmd += ["-md", str(draft_gguf), "-td", str(threads), "-tbd", str(threads)]
    return cmd + list(extra)


def run_speculative(cmd: list[str], prompt_text: str, timeout: float = 600) -> Served:
    """Run one speculative-simple command (from speculative_command) whose -f file holds prompt_text
    (write_prompt). Its log is written by a background thread that can lose the last lines when the program exits,
    so a run whose rounds do not add up to its token count is run again (up to RUNS times). The log is read from a
    --log-file: fewer runs lose their end that way (4 of 8 complete against 1 of 8 through the pipe, a DFlash
    drafter's verbose log on a busy 2-core machine)."""
    for attempt in range(RUNS):
        served = _run_once(cmd, prompt_text, timeout)
        if served and served.rounds and sum(a + 1 for a, _ in served.rounds) == served.tokens \
                and served.draft_ms is not None:
            return served
    raise EngineError(f"llama-speculative-simple's log lost its last lines in {RUNS} runs of {cmd[0]} (no 'decoded' "
                      "or 'statistics' line, or rounds that do not add up to the tokens)")


RUNS = 8


def _run_once(cmd: list[str], prompt_text: str, timeout: float) -> Served | None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="llama-log-") as tmp:
        log_file = Path(tmp) / "log.txt"
        done = subprocess.run([*cmd, "--log-file", str(log_file)], capture_output=True, text=True, timeout=timeout,
                              errors="replace")
        log = log_file.read_text(errors="replace") if log_file.is_file() else done.stderr
    if done.returncode != 0:
        tail = " | ".join(line for line in done.stderr.strip().splitlines()[-3:])
        raise EngineError(f"llama-speculative-simple failed (exit {done.returncode}): {tail[:400]}")
    decoded = DECODED_RE.search(log)
    if decoded is None:
        return None
    rounds = [(int(a), int(n)) for a, n in ACCEPTED_RE.findall(log)]
    # stdout: "\n\n", the prompt's tokens as text, the answer, "\n\n" twice
    out = done.stdout
    start = out.find(prompt_text)
    text = out[start + len(prompt_text):] if start >= 0 else out
    text = text[:-4] if text.endswith("\n\n\n\n") else text
    stats = STATS_RE.findall(log)
    draft_ms = sum(float(g) for _, _, g, _ in stats) if stats else None
    return Served(text=text, rounds=rounds, tokens=int(decoded.group(1)), decode_seconds=float(decoded.group(2)),
                  draft_ms=draft_ms, draft_tokens=sum(int(n) for n, *_ in stats))


def same_answer(speculative: Served, target_only: Served) -> bool:
    """Whether a speculative decoding emitted target-only's answer. It may accept a draft past -n, so its text only
    has to begin with target-only's; trailing newlines are left out of both (the program's own blank lines follow
    the answer on stdout, and an answer that ends in newlines cannot be told from them)."""
    return speculative.text.rstrip("\n").startswith(target_only.text.rstrip("\n"))


def served_starts(rounds: list[tuple[int, int]]) -> list[int]:
    """Where each served round's first new token sits in the answer (0-based): llama.cpp drafts from the prompt's
    last token, so its first round starts at answer[0]; the next starts accepted + 1 later."""
    starts, at = [], 0
    for accepted, _ in rounds:
        starts.append(at)
        at += accepted + 1
    return starts


def compare_rounds(served: list[tuple[int, int]], reference: dict[int, int], draft_length: int,
                   agree: int | None = None) -> tuple[int, int]:
    """(rounds compared, rounds that differ) between a served decoding and a reference one of the same answer.

    reference: {answer index where a round starts: its accepted count} (draftlab's round log). Rounds partition the
    answer differently until both start a round at the same index (draftlab's first round starts at answer[1]:
    its prefill yields answer[0]); from there on, greedy drafting from the same context must accept the same count.
    Served rounds whose draft was cut short by the token budget (fewer than draft_length drafted) are skipped, and
    so are rounds that reach past `agree` answer tokens (where llama.cpp's answer and the reference's part: two
    engines' sums can pick differently between near-tied logits)."""
    compared = differ = 0
    aligned = False
    for start, (accepted, drafted) in zip(served_starts(served), served):
        aligned = aligned or start in reference
        if not aligned or drafted < draft_length or start not in reference:
            continue
        if agree is not None and start + drafted + 1 > agree:
            continue
        compared += 1
        differ += reference[start] != accepted
    return compared, differ


def agreed_tokens(tokenizer, answer: list[int], text: str) -> int:
    """How many tokens of `answer` (token ids) llama.cpp's `text` begins with: the longest t whose decoding of
    answer[:t] is a prefix of text."""
    t = 0
    while t < len(answer) and text.startswith(tokenizer.decode(answer[:t + 1], skip_special_tokens=False)):
        t += 1
    return t
