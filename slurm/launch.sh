#!/bin/bash
# Runs `pipeline/run.py ARGS` under `accelerate launch` on every node of a Slurm allocation (one launcher
# per node); the batch scripts here exec it. Environment:
#   ACCELERATE_CONFIG  an accelerate config file, e.g. recipes/accelerate/zero3.yaml (default: plain DDP)
#   NPROC_PER_NODE     processes per node (default: the node's GPUs; 1 on a node without GPUs: the
#                      pipeline then runs on CPU processes over gloo by itself)
#   MAIN_PROCESS_PORT  the rendezvous port on the first node (default: a free one)
# Preemption: Slurm's warning signal to the batch shell (`--signal=B:USR1@120`, or
# `scancel --batch --signal=USR1 JOB`) or a TERM is forwarded as USR1 to every process of the job step
# (the launchers ignore it; the pipeline saves a checkpoint and exits 75), then the job requeues itself and
# the requeued job resumes. `accelerate launch` reports the pipeline's 75 as 1, hence the trap.
set -uo pipefail
nodes=${SLURM_NNODES:-1}
main=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)
port=${MAIN_PROCESS_PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}
gpus=${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
per_node=${NPROC_PER_NODE:-$((gpus > 0 ? gpus : 1))}
total=$((per_node * nodes))
launch=(--num_machines "$nodes" --num_processes "$total" --main_process_ip "$main" --main_process_port "$port")
if [ -n "${ACCELERATE_CONFIG:-}" ]; then
  launch+=(--config_file "$ACCELERATE_CONFIG")
else
  launch+=(--mixed_precision no --dynamo_backend no)
  if [ "$total" -gt 1 ]; then launch+=(--multi_gpu); fi
fi
echo "slurm: job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}): $nodes node(s) x $per_node process(es)," \
  "$gpus GPU(s) per node, main $main:$port, config ${ACCELERATE_CONFIG:-DDP}"

preempted=""
forward() {
  preempted=$1
  echo "slurm: $1 received; forwarding USR1 to the job steps"
  scancel --signal=USR1 "$SLURM_JOB_ID"
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
# srun does not pass the job's --cpus-per-task on to its steps (Slurm 22.05): pass it explicitly.
srun --nodes="$nodes" --ntasks-per-node=1 --kill-on-bad-exit=1 \
  ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} \
  bash -c 'trap "" USR1 TERM; exec accelerate launch --machine_rank "$SLURM_NODEID" "$@"' launch \
  "${launch[@]}" pipeline/run.py "$@" &
step=$!
wait "$step"
rc=$?
while kill -0 "$step" 2>/dev/null; do  # a trapped signal interrupted `wait`: wait for the step itself
  wait "$step"
  rc=$?
done
if [ "$rc" -ne 0 ] && [ -n "$preempted" ]; then
  echo "slurm: stopped after $preempted (exit $rc); requeueing job $SLURM_JOB_ID to resume"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
