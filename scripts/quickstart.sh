#!/usr/bin/env bash
# Sets up what is missing, then trains DLRM on 2 CPU ranks on the synthetic planted-teacher data.
#   bash scripts/quickstart.sh [extra Hydra overrides]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
run_dir="outputs/quickstart-$(date +%Y%m%d-%H%M%S)"
.venv/bin/torchrun --nproc_per_node=2 train.py model=dlrm trainer.steps=300 hydra.run.dir="$run_dir" "$@"
echo "logs: $run_dir/train.log  metrics: $run_dir/metrics.jsonl  summary: $run_dir/summary.json"
echo "TensorBoard: .venv/bin/tensorboard --logdir $run_dir/tensorboard"
