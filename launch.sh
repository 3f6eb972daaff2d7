#!/usr/bin/env bash
# launch.sh: start draftlab training under `accelerate launch` on one GPU, one node or many nodes.
# It only chooses an accelerate config and the process counts; everything else goes to draftlab/train.py.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG_DIR="$ROOT/recipes/accelerate"

usage() {
  cat <<'EOF'
Usage: ./launch.sh [--deepspeed zero2|zero3 | --fsdp] [--cpu] [--dry-run] [--] recipe=NAME [key=value ...]

Runs: accelerate launch --config_file CONFIG --num_processes N --num_machines M --machine_rank R
        --main_process_ip ADDR --main_process_port PORT draftlab/train.py recipe=NAME key=value ...

Options (anywhere on the line; after `--` everything goes to train.py unread):
  --deepspeed zero2|zero3  use recipes/accelerate/deepspeed_zeroN.yaml (DeepSpeed JSON in recipes/deepspeed/);
                           with --cpu: DeepSpeed on CPU processes (gloo), e.g. to check a ZeRO run before a cluster
  --fsdp                   use recipes/accelerate/fsdp.yaml (FSDP2, GPUs only: accelerate applies FSDP on
                           accelerator devices alone, so --fsdp --cpu is refused)
  --cpu                    run on the CPU: config cpu_ddp (gloo), 2 processes unless GPUS_PER_NODE is set
  --dry-run                print the accelerate command and exit 0 without running it (launch.sh runs it through
                           `python -m draftlab.launcher`, which takes the same arguments and reports a failed
                           training process in one line, exit code 2 for a mistake the user can fix)
  -h, --help               this help
Every other argument is passed to draftlab/train.py verbatim (recipe=NAME and key=value overrides).

Environment:
  GPUS_PER_NODE  processes per node (default: GPUs visible to nvidia-smi, within CUDA_VISIBLE_DEVICES; else 1)
  NNODES         number of nodes (default 1); --num_processes = GPUS_PER_NODE * NNODES
  NODE_RANK      rank of this node, 0 .. NNODES-1 (default 0)
  MASTER_ADDR    address of node 0 (default 127.0.0.1)
  MASTER_PORT    port on node 0 (default 29500)
  PYTHON         interpreter for the check before the launch (default: python3 on PATH)
  ACCEL_CONFIG   accelerate config: a name in recipes/accelerate/ (without .yaml) or a path to a YAML file.
                 Default: single_gpu (1 process), multi_gpu (1 node, >1 GPU), multi_node (NNODES>1),
                 cpu_ddp (--cpu), deepspeed_zero2/3 (--deepspeed), fsdp (--fsdp).

Examples:
  ./launch.sh recipe=eagle_head target.path=/models/llama train.max_steps=1000
  GPUS_PER_NODE=8 ./launch.sh --deepspeed zero3 recipe=distill_online_whitebox eval.every=0  # ZeRO-3: draftlab eval
  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 ./launch.sh recipe=eagle_head   # run on every node
  ./launch.sh --cpu --dry-run recipe=quickstart
  ./launch.sh --cpu --deepspeed zero3 recipe=eagle_head train.max_steps=50      # ZeRO-3 on two CPU processes
  GPUS_PER_NODE=8 ./launch.sh recipe=eagle_head train.resume=auto   # continue out_dir's run after a crash
EOF
}

die() {  # one clear line, exit 2 (bad usage)
  echo "launch.sh: error: $*" >&2
  exit 2
}

quote() {  # shell-quote one word so that the printed command can be pasted back as is
  if [[ $1 =~ ^[A-Za-z0-9_./:=,+@%^-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

count_gpus() {  # visible GPUs, or 0 when nvidia-smi is missing or fails
  local n=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    n=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)
  fi
  if [[ -n ${CUDA_VISIBLE_DEVICES-} && $n -gt 0 ]]; then
    local visible
    IFS=, read -r -a visible <<<"$CUDA_VISIBLE_DEVICES"
    ((${#visible[@]} < n)) && n=${#visible[@]}
  fi
  echo "$n"
}

available_configs() {  # "a, b, c": the names in recipes/accelerate/
  local f out=""
  for f in "$CONFIG_DIR"/*.yaml; do out+="${out:+, }$(basename "$f" .yaml)"; done
  echo "$out"
}

# --- arguments ---------------------------------------------------------------------------------------------
deepspeed="" fsdp=0 cpu=0 dry_run=0
passthrough=()
while (($#)); do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --deepspeed)
      (($# >= 2)) || die "--deepspeed needs a value: zero2 or zero3"
      deepspeed=$2; shift 2 ;;
    --deepspeed=*) deepspeed=${1#*=}; shift ;;
    --fsdp) fsdp=1; shift ;;
    --cpu) cpu=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; passthrough+=("$@"); break ;;
    *) passthrough+=("$1"); shift ;;
  esac
done

# --- topology ----------------------------------------------------------------------------------------------
if [[ -z ${GPUS_PER_NODE-} ]]; then
  if ((cpu)); then
    GPUS_PER_NODE=2
  else
    GPUS_PER_NODE=$(count_gpus)
    ((GPUS_PER_NODE > 0)) || GPUS_PER_NODE=1
  fi
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
for var in GPUS_PER_NODE NNODES; do
  [[ ${!var} =~ ^[1-9][0-9]*$ ]] || die "$var=${!var} must be a positive integer"
done
[[ $NODE_RANK =~ ^[0-9]+$ ]] || die "NODE_RANK=$NODE_RANK must be an integer in 0..$((NNODES - 1))"
((NODE_RANK < NNODES)) || die "NODE_RANK=$NODE_RANK must be below NNODES=$NNODES"
[[ $MASTER_PORT =~ ^[0-9]+$ ]] && ((MASTER_PORT <= 65535)) || die "MASTER_PORT=$MASTER_PORT is not a port number"
num_processes=$((GPUS_PER_NODE * NNODES))

# --- accelerate config -------------------------------------------------------------------------------------
if [[ -n $deepspeed ]]; then
  [[ $deepspeed == zero2 || $deepspeed == zero3 ]] || die "--deepspeed $deepspeed: choose zero2 or zero3"
  ((fsdp == 0)) || die "--deepspeed and --fsdp both given; choose one of them"
  [[ -z ${ACCEL_CONFIG-} ]] || die "both ACCEL_CONFIG=$ACCEL_CONFIG and --deepspeed given; use one of them"
fi
if ((fsdp)); then
  ((cpu == 0)) || die "--fsdp needs GPUs: accelerate applies FSDP on accelerator devices only (on a CPU it would" \
    "train as plain DDP); for sharded training on CPUs use --deepspeed zero3 --cpu"
  [[ -z ${ACCEL_CONFIG-} ]] || die "both ACCEL_CONFIG=$ACCEL_CONFIG and --fsdp given; use one of them"
fi
if [[ -n ${ACCEL_CONFIG-} ]]; then
  config=$ACCEL_CONFIG
elif [[ -n $deepspeed ]]; then
  config=deepspeed_$deepspeed
elif ((fsdp)); then
  config=fsdp
elif ((cpu)); then
  config=cpu_ddp
elif ((NNODES > 1)); then
  config=multi_node
elif ((GPUS_PER_NODE > 1)); then
  config=multi_gpu
else
  config=single_gpu
fi

name=${config%.yaml}
if [[ $config != */* && -f $CONFIG_DIR/$name.yaml ]]; then
  config_file=$CONFIG_DIR/$name.yaml
elif [[ -f $config ]]; then
  config_file=$(cd "$(dirname "$config")" && pwd)/$(basename "$config")
elif [[ $config == */* || $config == *.yaml || $config == *.yml ]]; then
  die "accelerate config file '$config' not found"
else
  die "unknown accelerate config '$config'; available in recipes/accelerate/:" \
    "$(available_configs) (or give a path to a YAML file)"
fi

# The DeepSpeed JSON named in the config is passed as an absolute path, so that the launch works from any
# directory: a relative name is looked up in the current directory (accelerate's own rule), then in the repository.
ds_args=()
ds_file=$(sed -n 's/^[[:space:]]*deepspeed_config_file:[[:space:]]*//p' "$config_file" |
  sed 's/[[:space:]]*#.*$//; s/^["'\'']//; s/["'\'']$//')
if [[ -n $ds_file ]]; then
  if [[ $ds_file != /* && -f $ds_file ]]; then
    ds_file=$PWD/$ds_file
  elif [[ $ds_file != /* && -f $ROOT/$ds_file ]]; then
    ds_file=$ROOT/$ds_file
  fi
  [[ -f $ds_file ]] || die "$config_file names deepspeed_config_file '$ds_file', which is missing"
  ds_args=(--deepspeed_config_file "$ds_file")
fi

cmd=(accelerate launch
  --config_file "$config_file"
  --num_processes "$num_processes"
  --num_machines "$NNODES"
  --machine_rank "$NODE_RANK"
  --main_process_ip "$MASTER_ADDR"
  --main_process_port "$MASTER_PORT"
  ${ds_args[@]+"${ds_args[@]}"}
  "$ROOT/draftlab/train.py"
  ${passthrough[@]+"${passthrough[@]}"})
env_prefix=()
# Plain DDP on CPUs: the processes must ask for the CPU themselves, or each one runs alone as world size 1.
# Not under DeepSpeed: ACCELERATE_USE_CPU would make accelerate skip it (train.py forms the gloo group itself).
((cpu)) && [[ -z $deepspeed ]] && env_prefix=(ACCELERATE_USE_CPU=true)

if ((dry_run)); then
  words=()
  for word in ${env_prefix[@]+"${env_prefix[@]}"} "${cmd[@]}"; do words+=("$(quote "$word")"); done
  echo "${words[*]}"
  exit 0
fi

command -v accelerate >/dev/null 2>&1 || die "'accelerate' is not on PATH; install the project first: pip install -e ."
# Check the configuration (and on node 0 the run folder) once, before any process starts: a mistake is then one
# line and exit code 2, not one traceback per rank followed by the launcher's own. Other nodes check the
# configuration only: node 0's run may already hold the run folder.
python=${PYTHON:-$(command -v python3 || command -v python)} || die "no python on PATH"
check=--check
((NODE_RANK == 0)) || check=--check-config
"$python" "$ROOT/draftlab/train.py" "$check" ${passthrough[@]+"${passthrough[@]}"} || exit $?
# `accelerate launch` itself, through draftlab.launcher: a rank that fails prints its one line, not a traceback
exec env ${env_prefix[@]+"${env_prefix[@]}"} PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
  "$python" -m draftlab.launcher "${cmd[@]:2}"
