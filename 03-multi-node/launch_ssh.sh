#!/bin/bash
# Multi-node training without Slurm: starts the same torchrun command on every host over ssh.
# Run it from the repo root, with a host list and the training flags:
#
#   03-multi-node/launch_ssh.sh hosts.txt --experiment-name llama-1b --model-name meta-llama/Llama-3.2-1B ...
#
# hosts.txt: one host per line (# comments allowed); the first host runs the rendezvous, so the others
# must reach it by that name. Every host needs this repo and the Python environment at the same paths,
# and ssh access from here without a password prompt. Ctrl-C stops the training on every host.
#
# Environment variables:
#   TRAIN_SCRIPT    the chapter to run (default: 03-multi-node/train_llm.py; e.g. 04-fsdp/train_llm.py)
#   NPROC_PER_NODE  processes per host (default: gpu, one per GPU)
#   RDZV_PORT       rendezvous port on the first host (default: 29500)
#   MAX_RESTARTS    times torchrun restarts the workers after a failure (default: 0)
#   REMOTE_SETUP    shell commands each host runs before torchrun (default: put the folder of this
#                   host's torchrun, i.e. this Python environment, first on PATH), for example
#                   REMOTE_SETUP='source /shared/venv/bin/activate; module load cuda'
# Forwarded to every host when set here: NCCL_*, GLOO_*, TORCH_*, HF_*, WANDB_*, OMP_NUM_THREADS, PYTHONPATH.
# They travel in ssh's input into a file only the user can read, never in a command line: `ps` shows
# command lines to every user of a host, and HF_TOKEN or WANDB_API_KEY are secrets.
# The script gets --device cuda; on CPU-only hosts pass --device cpu among the training flags.
set -euo pipefail

hosts_file=$1
shift
mapfile -t hosts < <(grep -Ev '^[[:space:]]*(#|$)' "$hosts_file")
head_node=${hosts[0]}
rdzv_id=$(date +%s)-$$  # new for every launch, so a stale rendezvous is never joined

# See launch.sbatch: a fresh rendezvous store for every restart attempt.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
forwarded=$(env | grep -E '^(NCCL_|GLOO_|TORCH_|HF_|WANDB_|OMP_NUM_THREADS=|PYTHONPATH=)' | while IFS= read -r var; do
    printf 'export %q\n' "$var"
done)
remote_setup=${REMOTE_SETUP:-"export PATH=$(printf %q "$(dirname "$(command -v torchrun)")"):\$PATH"}

torchrun_command="$remote_setup && exec torchrun \
--nnodes=${#hosts[@]} \
--nproc-per-node=${NPROC_PER_NODE:-gpu} \
--rdzv-backend=c10d \
--rdzv-endpoint=$head_node:${RDZV_PORT:-29500} \
--rdzv-id=$rdzv_id \
--max-restarts=${MAX_RESTARTS:-0} \
$(printf %q "${TRAIN_SCRIPT:-03-multi-node/train_llm.py}") --device cuda $(printf '%q ' "$@")"

pids=()
status=0
# Background commands of a script ignore Ctrl-C: stop the ssh sessions explicitly. Each closes its
# terminal (-tt) on the host, which hangs up torchrun there, and torchrun stops its workers.
trap 'status=130; kill "${pids[@]}" 2>/dev/null || true' INT TERM

for i in "${!hosts[@]}"; do
    [[ $status == 0 ]] || break  # Ctrl-C while starting: start no more hosts
    host=${hosts[i]}
    env_file=/tmp/launch_ssh-$rdzv_id-$i.env
    # BatchMode: fail instead of asking for a password.
    ssh -o BatchMode=yes "$host" "umask 077 && cat > $env_file" <<<"$forwarded"
    # Each host's output, prefixed with its name (a terminal ends lines with \r\n).
    ssh -tt -o BatchMode=yes "$host" "cd $(printf %q "$PWD") && . $env_file && rm $env_file && $torchrun_command" \
        </dev/null > >(sed -u "s/\r$//; s/^/[$host] /") 2>&1 &
    pids+=($!)
done
# A Ctrl-C as a session started runs the trap before `pids+=($!)`: that session was not stopped.
[[ $status == 0 ]] || kill "${pids[@]}" 2>/dev/null || true

for pid in "${pids[@]}"; do
    code=0
    wait "$pid" || code=$?
    # wait returns early when a signal arrives: wait again until that session has really ended.
    while kill -0 "$pid" 2>/dev/null; do wait "$pid" || code=$?; done
    if [[ $status == 0 ]]; then status=$code; fi
done
exit $status
