#!/bin/bash
# A DPO sweep as Slurm jobs, one per candidate of the beta x learning-rate grid, then the job that
# selects (soup, merge) and goes on with the chain:
#   slurm/sweep.sh [--sbatch-option=value ...] recipe=NAME [key=value ...]
# Candidate 0 runs first, alone: it runs the stages before dpo, samples the on-policy pairs and tokenises
# them, computes the reference log-probs, and trains its candidate. Candidates 1..N-1 then run side by
# side as one array (stage.sbatch), reusing that work, so nothing is written by two jobs at once. The
# last job is slurm/pipeline.sbatch with the same arguments: it reuses the finished candidates. A failed
# job cancels the jobs that depend on it. `redo=[...]` goes to the first job only.
set -euo pipefail
cd "$(dirname "$0")/.."
opts=() args=() first=()
for arg in "$@"; do
  case $arg in
    -*) opts+=("$arg") ;;
    redo=*) first+=("$arg") ;;
    *) args+=("$arg") ;;
  esac
done
n=$(python - "${args[@]}" <<'PY'
import sys

from pipeline.config import ConfigError, grid, load_config

try:
    print(len(grid(load_config(sys.argv[1:]).dpo)))
except ConfigError as err:
    sys.exit(f"error: {err}")
PY
)
submit() {
  local id
  id=$(sbatch --parsable --kill-on-invalid-dep=yes "${opts[@]}" "$@")
  echo "${id%%;*}"
}
jobs=$(submit --job-name=dpo-candidate --array=0 slurm/stage.sbatch dpo "${args[@]}" "${first[@]}")
echo "candidate 0: job $jobs"
if [ "$n" -gt 1 ]; then
  rest=$(submit --job-name=dpo-candidate --array=1-$((n - 1)) --dependency="afterok:$jobs" slurm/stage.sbatch dpo \
    "${args[@]}")
  echo "candidates 1-$((n - 1)): array job $rest"
  jobs+=":$rest"
fi
select=$(submit --job-name=dpo-select --dependency="afterok:$jobs" slurm/pipeline.sbatch "${args[@]}")
echo "selection and the rest of the chain: job $select"
