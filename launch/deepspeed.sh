#!/usr/bin/env bash
# Launch sft/train.py with DeepSpeed's launcher, on the hosts of a hostfile. Every argument goes to sft/train.py.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: launch/deepspeed.sh [sft/train.py arguments...]

Runs `deepspeed --hostfile HOSTFILE ... sft/train.py "$@"` once, from the first node: DeepSpeed starts the
processes on every host of the hostfile over passwordless ssh (pdsh). A hostfile of `localhost` only runs here,
without ssh. Pass the DeepSpeed config as usual, e.g. `--deepspeed ds_configs/zero3.json`.

Environment (defaults in brackets):
  HOSTFILE      lines of `<host> slots=<GPUs>` [launch/hostfile.example]
  NUM_NODES     how many hosts of the hostfile to use [all]
  NUM_GPUS      processes per host [the host's slots]
  MASTER_ADDR   address the other hosts reach the first one at [first host of the hostfile]
  MASTER_PORT   [29500]
  NO_SSH        if set, start only this node's processes (run the script on every node, no ssh/pdsh)
  NODE_RANK     this node's index in the hostfile, with NO_SSH [0]
  DIST_TIMEOUT  seconds a collective may wait before the job fails [1800]
  PYTHON        Python interpreter [python]
  DRY_RUN       if set, print the command instead of running it

Environment on the hosts (over ssh every host, the first too, starts from a login environment): DeepSpeed forwards
variables whose names start with NCCL_, PYTHON, MV2_, UCX_ (and a few more), plus every `NAME=value` line of a
`.deepspeed_env` file in $HOME and in the working directory (see launch/deepspeed_env.example). Put HF_HOME,
HF_TOKEN, WANDB_* and the like there. Over ssh this script hands DeepSpeed one file (DS_ENV_FILE) that holds
SFT_DIST_TIMEOUT, then the lines of those two files (theirs win), without the comments and blank lines that
DeepSpeed's reader fails on; your files are only read.
USAGE
}

case "${1:-}" in
  -h | --help) usage; exit 0 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOSTFILE="${HOSTFILE:-$ROOT/launch/hostfile.example}"
if [[ ! -f "$HOSTFILE" ]]; then
  echo "launch/deepspeed.sh: HOSTFILE $HOSTFILE does not exist; write lines of '<host> slots=<GPUs>'." >&2
  exit 2
fi
first_host="$(awk '!/^[[:space:]]*(#|$)/ {print $1; exit}' "$HOSTFILE")"
MASTER_ADDR="${MASTER_ADDR:-$first_host}"
MASTER_PORT="${MASTER_PORT:-29500}"
PYTHON="${PYTHON:-python}"
export SFT_DIST_TIMEOUT="${DIST_TIMEOUT:-${SFT_DIST_TIMEOUT:-1800}}"

cmd=("$PYTHON" -m deepspeed.launcher.runner --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR"
  --master_port "$MASTER_PORT")
if [[ -n "${NUM_NODES:-}" ]]; then cmd+=(--num_nodes "$NUM_NODES"); fi
if [[ -n "${NO_SSH:-}" ]]; then
  cmd+=(--no_ssh --node_rank "${NODE_RANK:-0}")
elif ! awk '!/^[[:space:]]*(#|$)/ && $1 != "localhost" && $1 != "127.0.0.1" {found=1} END {exit !found}' "$HOSTFILE"; then
  cmd+=(--no_ssh_check)  # only this machine: DeepSpeed runs it locally, but would still try ssh to localhost first
fi
if [[ -n "${NUM_GPUS:-}" ]]; then cmd+=(--num_gpus "$NUM_GPUS"); fi
cmd+=("$ROOT/sft/train.py" "$@")

if [[ -n "${DRY_RUN:-}" ]]; then
  printf '%q ' "${cmd[@]}"
  printf '\n'
  exit 0
fi
if [[ -n "${NO_SSH:-}" ]] || [[ " ${cmd[*]} " == *" --no_ssh_check "* ]] || [[ -n "${DS_ENV_FILE:-}" ]]; then
  exec "${cmd[@]}"  # no ssh (this environment is inherited), or the user names the environment file
fi
env_file="$(mktemp "${TMPDIR:-/tmp}/sft-deepspeed-env.XXXXXX")"
trap 'rm -f "$env_file"' EXIT
{
  echo "SFT_DIST_TIMEOUT=$SFT_DIST_TIMEOUT"
  for f in "$HOME/.deepspeed_env" ./.deepspeed_env; do
    if [[ -f "$f" ]]; then grep -E '^[[:space:]]*[A-Za-z_][A-Za-z0-9_]*=' "$f" || true; fi
  done
} > "$env_file"
export DS_ENV_FILE="$env_file"
"${cmd[@]}"
