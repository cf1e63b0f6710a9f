#!/usr/bin/env bash
# Multi-machine variant of Paddle's multi-GPU guide: `fleetrun --ips="A,B" train.py`, the torch-hapi way.
#
# examples/hapitrain.py runs unchanged on two machines: start one torchrun agent
# on each, both pointing at the same c10d rendezvous (HOST:PORT, on machine A).
# On two real machines, with A's address 192.168.1.2, run on A (node 0):
#
#   torchrun --nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d \
#       --rdzv-endpoint=192.168.1.2:29400 --rdzv-id=hapitrain-1 examples/hapitrain.py
#
# and on B (node 1) the very same command:
#
#   torchrun --nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d \
#       --rdzv-endpoint=192.168.1.2:29400 --rdzv-id=hapitrain-1 examples/hapitrain.py
#
# As with fleetrun --ips, the command is the same everywhere: the c10d
# rendezvous numbers the nodes as they join (torchrun ignores --node-rank with
# c10d, with a warning), and the agent on the endpoint's host keeps the store.
#
# What to change there: HOST:PORT = an address of A that B can reach and a free
# port (open it in the firewall); --nproc_per_node = the GPUs per machine (each
# process takes cuda:LOCAL_RANK; batch_size stays per process); --rdzv-id = any
# name, the same on both machines and new for each job; leave HAPI_BACKEND unset
# (NCCL on GPUs, Gloo on CPUs); give --output a directory both machines see if
# you want to read the checkpoints back from either. fleetrun's --gpus=0,1 is
# CUDA_VISIBLE_DEVICES=0,1 in front of torchrun.
#
# This script is the local try: both agents on this machine, on 127.0.0.1,
# with Gloo, one CPU thread each. Arguments after the script name go to
# hapitrain.py:
#
#   examples/multi_machine.sh                              # full data, one epoch
#   PORT=29401 examples/multi_machine.sh --num-iters 20 --output /tmp/mm
#
# Environment: HOST (default 127.0.0.1), PORT (default 29400), RDZV_ID
# (default hapitrain-local), TORCHRUN (default `torchrun`; e.g.
# "python3 -m torch.distributed.run" for a specific interpreter). Exits with
# the first non-zero status of the two agents.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
HOST="${HOST:-127.0.0.1}"
PORT="${PORT:-29400}"
RDZV_ID="${RDZV_ID:-hapitrain-local}"
read -r -a LAUNCHER <<< "${TORCHRUN:-torchrun}"

# Local try only: two processes may share one GPU (or none), which NCCL refuses.
export HAPI_BACKEND="${HAPI_BACKEND:-gloo}"
# Two processes share this machine's cores; torchrun sets this only for >1 process per agent.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

pids=()
cleanup() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
}
trap cleanup INT TERM

for node in 0 1; do  # the same command twice, as on two machines
    echo "node $node: ${LAUNCHER[*]} --nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d --rdzv-endpoint=$HOST:$PORT --rdzv-id=$RDZV_ID $HERE/hapitrain.py $*" >&2
    "${LAUNCHER[@]}" --nnodes=2 --nproc_per_node=1 \
        --rdzv-backend=c10d --rdzv-endpoint="$HOST:$PORT" --rdzv-id="$RDZV_ID" \
        "$HERE/hapitrain.py" "$@" &
    pids+=("$!")
done

status=0
for _ in "${pids[@]}"; do
    code=0
    wait -n || code=$?  # whichever agent ends first
    if [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then
        status=$code
        cleanup  # one node failed: do not leave the other waiting for it
    fi
done
exit "$status"
