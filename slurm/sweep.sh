#!/bin/bash
# A stage's sweep as Slurm jobs, one per candidate of its grid, then the job that selects (soup, merge)
# and goes on with the chain:
#   slurm/sweep.sh [--sbatch-option=value ...] [STAGE] recipe=NAME [key=value ...]
# STAGE: the stage whose sweep is spread over jobs; by default the first stage of the chain with a sweep.
# Candidate 0 runs first, alone: it runs the stages before STAGE, prepares what every candidate shares
# (e.g. DPO's on-policy pairs and reference log-probs), and trains its candidate. Candidates 1..N-1 then run side by
# side as one array (stage.sbatch), reusing that work, so nothing is written by two jobs at once. The
# last job is slurm/pipeline.sbatch with the same arguments: it reuses the finished candidates. A failed
# job cancels the jobs that depend on it. `redo=[...]` goes to the first job only.
set -euo pipefail
cd "$(dirname "$0")/.."
opts=() args=() first=() stage=""
for arg in "$@"; do
  case $arg in
    -*) opts+=("$arg") ;;
    redo=*) first+=("$arg") ;;
    *=*) args+=("$arg") ;;
    *) stage=$arg ;;
  esac
done
read -r stage n < <(python - "$stage" "${args[@]}" <<'PY'
import sys

from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.grid import grid, sweeps

try:
    cfg = load_config(sys.argv[2:])
except ConfigError as err:
    sys.exit(f"error: {err}")
swept = [n for n in cfg.stages if cfg[n].enabled and sweeps(cfg[n])]
stage = sys.argv[1] or (swept[0] if swept else "")
if stage not in swept:
    sys.exit(f"error: {f'stage {stage!r} has' if stage else 'no stage of the chain has'} no sweep to spread over jobs "
             f"(stages with one: {', '.join(swept) or 'none'})")
print(stage, len(grid(cfg[stage])))
PY
) || exit 2
[ -n "$stage" ] || exit 2
submit() {
  local id
  id=$(sbatch --parsable --kill-on-invalid-dep=yes "${opts[@]}" "$@")
  echo "${id%%;*}"
}
jobs=$(submit --job-name="$stage-candidate" --array=0 slurm/stage.sbatch "$stage" "${args[@]}" "${first[@]}")
echo "candidate 0: job $jobs"
if [ "$n" -gt 1 ]; then
  rest=$(submit --job-name="$stage-candidate" --array=1-$((n - 1)) --dependency="afterok:$jobs" slurm/stage.sbatch \
    "$stage" "${args[@]}")
  echo "candidates 1-$((n - 1)): array job $rest"
  jobs+=":$rest"
fi
select=$(submit --job-name="$stage-select" --dependency="afterok:$jobs" slurm/pipeline.sbatch "${args[@]}")
echo "selection and the rest of the chain: job $select"
