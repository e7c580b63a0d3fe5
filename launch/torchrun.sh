#!/usr/bin/env bash
# Launch sft training with torchrun's agent (`sft train --nproc-per-node ...`), on one node or many. Every argument is
# passed to the training.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: launch/torchrun.sh [sft/train.py arguments...]

Runs `python -m sft train --nproc-per-node ... "$@"` on this node: torchrun's elastic agent (same rendezvous,
restarts and environment as `torchrun ... sft/train.py`), with sft's checks before the rendezvous (MASTER_ADDR is
node 0's own address there, the other nodes reach it) and one-line errors. Run it on every node with the same
arguments and environment, changing only NODE_RANK. Hyperparameters belong in the recipe, not here.

Environment (defaults in brackets):
  NNODES          nodes in the job, or MIN:MAX for an elastic job with RDZV_ENDPOINT [1]
  NPROC_PER_NODE  processes (GPUs) per node [number of GPUs nvidia-smi lists, else 1]
  NODE_RANK       this node's rank, 0..NNODES-1, static rendezvous only [0]
  MASTER_ADDR     address of node 0, static rendezvous [127.0.0.1]
  MASTER_PORT     port on node 0 [29500; on one node without MASTER_PORT, a free port]
  RDZV_ENDPOINT   host:port of a c10d rendezvous; when set, nodes need no NODE_RANK and may join late
  RDZV_ID         rendezvous id shared by the job's nodes [sft]
  RDZV_TIMEOUT    seconds the nodes wait for each other (and to reach node 0) before failing with a message [600]
  MAX_RESTARTS    restarts of the worker group after a failure; each restart resumes from the newest complete
                  checkpoint [0]
  DIST_TIMEOUT    seconds a collective may wait before the job fails (NCCL/gloo timeout) [1800]
  PYTHON          Python interpreter [python]
  DRY_RUN         if set, print the command instead of running it

Examples:
  launch/torchrun.sh --config recipes/demo.yaml
  NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/torchrun.sh --config recipes/llama-3.1-8b/sft/config_full.yaml
  NNODES=1:4 RDZV_ENDPOINT=node0:29400 MAX_RESTARTS=3 launch/torchrun.sh --config ...
USAGE
}

case "${1:-}" in
  -h | --help) usage; exit 0 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
fi
NNODES="${NNODES:-1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-$((gpus > 0 ? gpus : 1))}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT_SET="${MASTER_PORT:-}"
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ENDPOINT="${RDZV_ENDPOINT:-}"
RDZV_ID="${RDZV_ID:-sft}"
RDZV_TIMEOUT="${RDZV_TIMEOUT:-600}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
PYTHON="${PYTHON:-python}"
export SFT_DIST_TIMEOUT="${DIST_TIMEOUT:-${SFT_DIST_TIMEOUT:-1800}}"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

cmd=("$PYTHON" -m sft train --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS"
  --rdzv-timeout "$RDZV_TIMEOUT")
if [[ -n "$RDZV_ENDPOINT" ]]; then
  cmd+=(--rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID")
elif [[ "$NNODES" != 1 || -n "$MASTER_PORT_SET" ]]; then
  cmd+=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi
cmd+=("$@")

if [[ -n "${DRY_RUN:-}" ]]; then
  printf '%q ' "${cmd[@]}"
  printf '\n'
  exit 0
fi
exec "${cmd[@]}"
