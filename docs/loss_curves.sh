#!/usr/bin/env bash
# The picture in the README: chapters 01-06 on the tiny default, on the CPU, with the same global
# batch of 8 rows and the same seed, 200 steps each, plotted by python -m tools.plot.
#     bash docs/loss_curves.sh                          # from the repo root: loss_curves.png here
#     bash docs/loss_curves.sh docs/loss_curves.png     # the README's picture, made again
# About 5 minutes on 2 cores. The runs go to a temporary folder, removed at the end.
set -euo pipefail
output=${1:-loss_curves.png}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--max-steps 200 --log-freq 10 --eval-every 50 --save-dir "$out")
export WANDB_MODE=disabled
python 01-single-gpu/train_llm.py "${common[@]}" --batch-size 8
for chapter in 02-multi-gpu 03-multi-node 04-fsdp; do
    torchrun --standalone --nproc-per-node 2 "$chapter/train_llm.py" "${common[@]}" --batch-size 4
done
torchrun --standalone --nproc-per-node 2 05-tensor-parallel/train_llm.py "${common[@]}" --batch-size 8 --tp-size 2
torchrun --standalone --nproc-per-node 2 06-fp8/train_llm.py "${common[@]}" --batch-size 4 --fp8-emulate
python -m tools.plot "$out"/0* --output "$output"
