#!/bin/bash
# Multi-node training without Slurm: starts the same torchrun command on every host over ssh.
# Run it from the repo root, with a host list and the training flags:
#
#   03-multi-node/launch_ssh.sh hosts.txt --experiment-name llama-1b --model-name meta-llama/Llama-3.2-1B ...
#
# hosts.txt: one host per line (# comments allowed); the first host runs the rendezvous, so the others
# must reach it by that name. Every host needs this repo at the same path and the same Python
# environment, and ssh access from here without a password prompt.
#
# Environment variables:
#   NPROC_PER_NODE  processes per host (default: gpu, one per GPU)
#   RDZV_PORT       rendezvous port on the first host (default: 29500)
#   MAX_RESTARTS    times torchrun restarts the workers after a failure (default: 0)
# Forwarded to every host when set here: NCCL_*, GLOO_*, TORCH_*, HF_*, WANDB_*, OMP_NUM_THREADS.
set -euo pipefail

hosts_file=$1
shift
mapfile -t hosts < <(grep -Ev '^[[:space:]]*(#|$)' "$hosts_file")
head_node=${hosts[0]}
rdzv_id=$(date +%s)-$$  # new for every launch, so a stale rendezvous is never joined

# See launch.sbatch: a fresh rendezvous store for every restart attempt.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
forwarded=$(env | grep -E '^(NCCL_|GLOO_|TORCH_|HF_|WANDB_|OMP_NUM_THREADS=)' | while IFS= read -r var; do
    printf 'export %q; ' "$var"
done)

remote_command="cd $(printf %q "$PWD") && $forwarded exec torchrun \
--nnodes=${#hosts[@]} \
--nproc-per-node=${NPROC_PER_NODE:-gpu} \
--rdzv-backend=c10d \
--rdzv-endpoint=$head_node:${RDZV_PORT:-29500} \
--rdzv-id=$rdzv_id \
--max-restarts=${MAX_RESTARTS:-0} \
03-multi-node/train_llm.py $(printf '%q ' "$@")"

pids=()
for host in "${hosts[@]}"; do
    # Each host's output, prefixed with its name. BatchMode: fail instead of asking for a password.
    ssh -o BatchMode=yes "$host" "$remote_command" > >(sed "s/^/[$host] /") 2>&1 &
    pids+=($!)
done

status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
done
exit $status
