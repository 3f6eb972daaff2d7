"""launch.sh (dry runs), the accelerate configs and the DeepSpeed JSONs they name."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch.sh"
ACCEL_DIR = ROOT / "recipes" / "accelerate"
DS_DIR = ROOT / "recipes" / "deepspeed"
LAUNCH_VARS = ("GPUS_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCEL_CONFIG",
               "CUDA_VISIBLE_DEVICES", "ACCELERATE_USE_CPU")
EXPECTED_STAGE = {"zero2.json": 2, "zero3.json": 3}


def run_launch(*args: str, env: dict | None = None, gpus: int = 0, timeout: int = 30) -> subprocess.CompletedProcess:
    """Run launch.sh with the launch variables cleared, then set from env, and a fake nvidia-smi that sees
    `gpus` GPUs (0: it fails, as on a machine without a driver), so the real machine never changes the result."""
    fake_dir = Path(tempfile.mkdtemp(prefix="fake-smi-"))
    fake = fake_dir / "nvidia-smi"
    lines = "".join(f'echo "GPU {i}: Fake GPU (UUID: GPU-{i})"\n' for i in range(gpus))
    fake.write_text("#!/bin/sh\n" + (lines if gpus else "echo 'NVIDIA-SMI has failed' >&2; exit 9\n"))
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    base["PATH"] = f"{fake_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
    base.update(env or {})
    try:
        return subprocess.run(["bash", str(LAUNCH), *args], env=base, capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(fake_dir, ignore_errors=True)


def dry_run(*args: str, **env: str) -> tuple[dict, list[str], list[str]]:
    """-> (accelerate flags, train.py arguments, env assignments) of the printed command."""
    out = run_launch("--dry-run", *args, env=env)
    assert out.returncode == 0, out.stderr
    words = shlex.split(out.stdout)
    assert out.stdout.count("\n") == 1, "one command line"
    i = words.index("accelerate")
    assignments, words = words[:i], words[i:]
    assert words[:2] == ["accelerate", "launch"]
    script = words.index(str(ROOT / "draftlab" / "train.py"))
    flags, rest = {}, words[2:script]
    while rest:  # every accelerate option here takes one value
        key, value, *rest = rest
        assert key.startswith("--"), key
        flags[key[2:]] = value
    return flags, words[script + 1:], assignments


# --- launch.sh -------------------------------------------------------------------------------------------------

def test_help_documents_every_knob():
    out = run_launch("--help")
    assert out.returncode == 0
    for word in ("GPUS_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCEL_CONFIG",
                 "--deepspeed", "--fsdp", "--cpu", "--dry-run", "recipe="):
        assert word in out.stdout, word


def test_launch_script_is_executable():
    assert os.access(LAUNCH, os.X_OK)


def test_one_gpu():
    flags, script_args, assignments = dry_run("recipe=eagle_head", "train.max_steps=3", GPUS_PER_NODE="1")
    assert flags["num_processes"] == "1" and flags["num_machines"] == "1" and flags["machine_rank"] == "0"
    assert flags["config_file"] == str(ACCEL_DIR / "single_gpu.yaml")
    assert flags["main_process_ip"] == "127.0.0.1" and flags["main_process_port"] == "29500"
    assert script_args == ["recipe=eagle_head", "train.max_steps=3"]
    assert assignments == []


def test_eight_gpus():
    flags, script_args, _ = dry_run("recipe=medusa_heads", "train.lr=1e-4", GPUS_PER_NODE="8", MASTER_PORT="29611")
    assert flags["num_processes"] == "8" and flags["num_machines"] == "1"
    assert flags["config_file"] == str(ACCEL_DIR / "multi_gpu.yaml")
    assert flags["main_process_port"] == "29611"
    assert script_args == ["recipe=medusa_heads", "train.lr=1e-4"]


def test_two_nodes_of_eight():
    flags, _, _ = dry_run("recipe=eagle_head", GPUS_PER_NODE="8", NNODES="2", NODE_RANK="1", MASTER_ADDR="10.1.2.3")
    assert flags["num_processes"] == "16" and flags["num_machines"] == "2" and flags["machine_rank"] == "1"
    assert flags["main_process_ip"] == "10.1.2.3"
    assert flags["config_file"] == str(ACCEL_DIR / "multi_node.yaml")


def test_overrides_pass_through_verbatim_with_quoting():
    odd = ["recipe=eagle_head", "data.train=/data/my chats.jsonl", "out_dir=it's here", 'msg="quoted"',
           "x=$HOME", "y=a;b", "empty=", "--some-flag", "--cpu"]
    # after `--`, even launcher options go to train.py untouched
    flags, script_args, _ = dry_run(*odd[:-1], "--", odd[-1], GPUS_PER_NODE="1")
    assert script_args == odd
    assert flags["config_file"].endswith("single_gpu.yaml")  # the --cpu after -- was not read


def test_deepspeed_configs_and_their_json():
    for stage in ("zero2", "zero3"):
        flags, script_args, _ = dry_run("--deepspeed", stage, "recipe=small_lm", GPUS_PER_NODE="8")
        assert flags["config_file"] == str(ACCEL_DIR / f"deepspeed_{stage}.yaml")
        assert flags["deepspeed_config_file"] == str(DS_DIR / f"{stage}.json")
        assert flags["num_processes"] == "8"
        assert script_args == ["recipe=small_lm"]
    flags, _, _ = dry_run("--deepspeed=zero3", GPUS_PER_NODE="4", NNODES="2")
    assert flags["num_processes"] == "8" and flags["config_file"].endswith("deepspeed_zero3.yaml")


def test_cpu_two_processes():
    flags, _, assignments = dry_run("--cpu", "recipe=quickstart")
    assert flags["config_file"] == str(ACCEL_DIR / "cpu_ddp.yaml")
    assert flags["num_processes"] == "2"
    assert assignments == ["ACCELERATE_USE_CPU=true"]


def test_deepspeed_on_cpu_processes():
    """--cpu --deepspeed: DeepSpeed's config with two processes, and no ACCELERATE_USE_CPU (which would make
    accelerate skip DeepSpeed and train as plain DDP)."""
    for stage in ("zero2", "zero3"):
        flags, script_args, assignments = dry_run("--cpu", "--deepspeed", stage, "recipe=eagle_head")
        assert flags["config_file"] == str(ACCEL_DIR / f"deepspeed_{stage}.yaml")
        assert flags["deepspeed_config_file"] == str(DS_DIR / f"{stage}.json")
        assert flags["num_processes"] == "2"
        assert assignments == [] and script_args == ["recipe=eagle_head"]


def test_fsdp_on_gpus():
    flags, _, assignments = dry_run("--fsdp", "recipe=eagle3_head", GPUS_PER_NODE="8")
    assert flags["config_file"] == str(ACCEL_DIR / "fsdp.yaml") and flags["num_processes"] == "8"
    assert "deepspeed_config_file" not in flags and assignments == []


def test_fsdp_is_not_set_up_on_a_cpu_which_is_why_launch_refuses_it():
    """What `--fsdp --cpu` is refused for: accelerate applies FSDP only on accelerator devices. In a process started
    the way `accelerate launch` starts FSDP ranks, a CPU-only machine gets plain multi-CPU DDP (cpu=True) or no
    distribution at all (cpu=False), never FSDP. If a later accelerate sets FSDP up on CPUs, this fails: then
    allow --fsdp --cpu and test it like DeepSpeed."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: FSDP is set up there")
    probe = ("import sys\nfrom accelerate import Accelerator\n"
             "print(Accelerator(cpu=sys.argv[1] == 'cpu').distributed_type.value)\n")
    env = {**os.environ, "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "LOCAL_RANK": "0", "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env.pop("ACCELERATE_USE_CPU", None)
    got = {}
    for mode in ("cpu", "auto"):
        out = subprocess.run([sys.executable, "-c", probe, mode], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        got[mode] = out.stdout.split()[-1]
    assert got == {"cpu": "MULTI_CPU", "auto": "NO"}


def test_accel_config_by_name_and_by_path(tmp_path):
    flags, _, _ = dry_run(ACCEL_CONFIG="multi_gpu", GPUS_PER_NODE="2")
    assert flags["config_file"] == str(ACCEL_DIR / "multi_gpu.yaml")
    own = tmp_path / "mine.yaml"
    own.write_text((ACCEL_DIR / "multi_gpu.yaml").read_text())
    flags, _, _ = dry_run(ACCEL_CONFIG=str(own), GPUS_PER_NODE="2")
    assert flags["config_file"] == str(own)


def test_gpu_count_from_nvidia_smi():
    out = run_launch("--dry-run", gpus=4)
    assert out.returncode == 0, out.stderr
    assert "--num_processes 4 " in out.stdout and "multi_gpu.yaml" in out.stdout
    out = run_launch("--dry-run", gpus=4, env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert "--num_processes 2 " in out.stdout
    out = run_launch("--dry-run", gpus=1)
    assert "--num_processes 1 " in out.stdout and "single_gpu.yaml" in out.stdout
    out = run_launch("--dry-run")  # nvidia-smi fails: one process
    assert "--num_processes 1 " in out.stdout and "single_gpu.yaml" in out.stdout
    out = run_launch("--dry-run", "--cpu", gpus=4)  # the CPU path ignores the GPUs
    assert "--num_processes 2 " in out.stdout and "cpu_ddp.yaml" in out.stdout


@pytest.mark.parametrize("args, env, message", [
    ([], {"ACCEL_CONFIG": "no_such_config"}, "cpu_ddp"),  # the list of available names
    ([], {"ACCEL_CONFIG": "missing/dir/config.yaml"}, "not found"),
    (["--deepspeed", "zero9"], {}, "zero2 or zero3"),
    (["--deepspeed"], {}, "zero2 or zero3"),
    (["--fsdp", "--cpu"], {}, "--fsdp needs GPUs"),
    (["--deepspeed", "zero2", "--fsdp"], {}, "--fsdp"),
    (["--fsdp"], {"ACCEL_CONFIG": "multi_gpu"}, "ACCEL_CONFIG"),
    (["--deepspeed", "zero2"], {"ACCEL_CONFIG": "multi_gpu"}, "ACCEL_CONFIG"),
    ([], {"GPUS_PER_NODE": "0"}, "GPUS_PER_NODE"),
    ([], {"NNODES": "two"}, "NNODES"),
    ([], {"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK"),
    ([], {"MASTER_PORT": "99999"}, "MASTER_PORT"),
])
def test_bad_input_exits_2_with_one_clear_line(args, env, message):
    out = run_launch("--dry-run", *args, env=env)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch.sh: error:") and message in lines[0]
    if env.get("ACCEL_CONFIG") == "no_such_config":
        for f in ACCEL_DIR.glob("*.yaml"):
            assert f.stem in lines[0]


# --- shipped configs -----------------------------------------------------------------------------------------

ACCEL_FILES = sorted(ACCEL_DIR.glob("*.yaml"))
DS_FILES = sorted(DS_DIR.glob("*.json"))


def test_the_expected_configs_ship():
    assert {f.stem for f in ACCEL_FILES} >= {"single_gpu", "multi_gpu", "multi_node", "cpu_ddp",
                                              "deepspeed_zero2", "deepspeed_zero3"}
    assert {f.name for f in DS_FILES} >= set(EXPECTED_STAGE)


@pytest.mark.parametrize("path", ACCEL_FILES, ids=lambda p: p.name)
def test_accelerate_yaml_parses_and_names_existing_deepspeed_json(path):
    from accelerate.commands.config.config_args import load_config_from_file

    raw = yaml.safe_load(path.read_text())
    assert isinstance(raw, dict) and "distributed_type" in raw
    config = load_config_from_file(str(path))  # accelerate's own reader accepts every key
    ds = (raw.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if raw["distributed_type"] == "DEEPSPEED":
        assert ds and (ROOT / ds).is_file(), f"{path.name} names {ds}"
        # accelerate refuses mixed_precision next to a deepspeed_config_file
        assert "mixed_precision" not in raw
    else:
        assert ds is None
    assert config.num_processes >= 1


@pytest.mark.parametrize("path", DS_FILES, ids=lambda p: p.name)
def test_deepspeed_json_parses_with_expected_stage(path):
    config = json.loads(path.read_text())
    zero = config["zero_optimization"]
    assert zero["stage"] == EXPECTED_STAGE[path.name]
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert config[key] == "auto", key  # filled by accelerate from the training config
    assert "bf16" in config and not config.get("fp16", {}).get("enabled", False)
    if zero["stage"] == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    # accelerate fills "auto" bucket sizes from model.config.hidden_size, which a drafter need not have
    assert not any(v == "auto" for k, v in zero.items() if "bucket" in k or "threshold" in k)


@pytest.mark.parametrize("launch_args, env", [
    ([], {"GPUS_PER_NODE": "1"}),
    ([], {"GPUS_PER_NODE": "8"}),
    ([], {"GPUS_PER_NODE": "8", "NNODES": "2", "NODE_RANK": "1"}),
    (["--cpu"], {}),
    (["--deepspeed", "zero2"], {"GPUS_PER_NODE": "8"}),
    (["--deepspeed", "zero3"], {"GPUS_PER_NODE": "8", "NNODES": "2"}),
    (["--cpu", "--deepspeed", "zero3"], {}),
    (["--fsdp"], {"GPUS_PER_NODE": "8"}),
], ids=["1gpu", "8gpu", "2x8", "cpu", "zero2", "zero3", "cpu-zero3", "fsdp"])
def test_accelerate_accepts_the_printed_command(launch_args, env, monkeypatch):
    """accelerate's own argument validation (and DeepSpeed plugin checks) on the exact printed command."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    out = run_launch("--dry-run", *launch_args, "recipe=x", env=env)
    words = shlex.split(out.stdout)
    args = launch_command_parser().parse_args(words[words.index("launch") + 1:])
    args, defaults, mixed_from_config = _validate_launch_command(args)
    expected = int(env.get("GPUS_PER_NODE", "2")) * int(env.get("NNODES", "1"))
    assert args.num_processes == expected
    assert args.training_script_args == ["recipe=x"]
    if launch_args == ["--cpu"]:
        # several local processes need torchrun, which accelerate uses for the multi-device types only
        assert args.multi_gpu and args.use_cpu
    if args.use_deepspeed:
        from accelerate.utils import DeepSpeedPlugin

        # what `accelerate launch` hands the processes: the DeepSpeed fields that came from the YAML
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_from_config else [])
        monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", ",".join(fields))
        plugin = DeepSpeedPlugin(hf_ds_config=args.deepspeed_config_file)
        plugin.set_mixed_precision("bf16")
        assert plugin.deepspeed_config["bf16"]["enabled"] is True
        assert plugin.zero_stage == int(launch_args[-1][-1])
    if launch_args == ["--fsdp"]:
        assert args.use_fsdp and str(args.fsdp_version) == "2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cpu_ddp_forms_a_two_process_gloo_group(tmp_path):
    """The printed --cpu command, with a probe in place of train.py, really starts a 2-process CPU group."""
    probe = tmp_path / "probe.py"
    # each rank writes its own file: two processes printing to one pipe can interleave their lines
    probe.write_text(
        "import os, sys\nfrom accelerate import Accelerator\n"
        "a = Accelerator()\n"
        "line = f'{a.process_index} {a.num_processes} {a.distributed_type.value} {sys.argv[1:]}'\n"
        "open(os.path.join(os.environ['PROBE_DIR'], f'rank{a.process_index}.txt'), 'w').write(line)\n")
    out = run_launch("--cpu", "--dry-run", "key=a b", env={"MASTER_PORT": str(_free_port())})
    words = shlex.split(out.stdout)
    env_words, cmd = words[:1], words[1:]
    cmd[cmd.index(str(ROOT / "draftlab" / "train.py"))] = str(probe)
    env = {**os.environ, **dict(w.split("=", 1) for w in env_words), "OMP_NUM_THREADS": "1",
           "PROBE_DIR": str(tmp_path)}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = sorted(p.read_text() for p in tmp_path.glob("rank*.txt"))
    assert lines == ["0 2 MULTI_CPU ['key=a b']", "1 2 MULTI_CPU ['key=a b']"]


def test_an_error_found_after_the_processes_started_is_one_line(tmp_path, tiny_target_dir, tiny_chat_file):
    """Every conversation longer than data.max_length is found by the training processes, not by the check before
    the launch: each rank meets it, the user sees its line once and launch.sh's line naming the rank, exit code 2,
    no torchrun traceback."""
    env = {"MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    out = run_launch("--cpu", "recipe=eagle_head", f"target.path={tiny_target_dir}", f"data.train={tiny_chat_file}",
                     f"out_dir={tmp_path / 'run'}", "eval.every=0", "data.max_length=4", env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("draftlab: error:")]
    assert len(errors) == 1 and "data.max_length" in errors[0], out.stderr[-3000:]
    assert "launch.sh: training stopped: rank" in out.stderr and "exited with code 2" in out.stderr
    assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr


def test_an_empty_data_file_is_refused_before_the_launch(tmp_path, tiny_target_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = run_launch("--cpu", "recipe=eagle_head", f"target.path={tiny_target_dir}", f"data.train={empty}",
                     f"out_dir={tmp_path / 'run'}", "eval.every=0", env={"PATH": os.path.dirname(sys.executable) + os.pathsep
                                                         + os.environ.get("PATH", "")})
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("draftlab: error: data.train") and "no usable" in lines[0]
    assert not (tmp_path / "run").exists()


def test_the_launcher_reports_a_single_failed_process_in_one_line(tmp_path):
    """One process: accelerate runs it itself and raises CalledProcessError on failure; the launcher turns that into
    one line and the process's exit code, like a failed rank of several."""
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('draftlab: error: a mistake', file=sys.stderr)\nsys.exit(2)\n")
    out = subprocess.run([sys.executable, "-m", "draftlab.launcher", "--num_processes", "1", "--cpu",
                          "--mixed_precision", "no", "--num_machines", "1", "--dynamo_backend", "no", str(script)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and out.stderr.count("draftlab: error: a mistake") == 1
    assert "launch.sh: training stopped: the process exited with code 2" in out.stderr
