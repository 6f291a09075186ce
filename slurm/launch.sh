#!/bin/bash
# Runs the pipeline on every node of a Slurm allocation: one `slurm/node.sh ARGS` per node (srun), which
# runs `smol-pipeline` (accelerate's launcher, keeping the pipeline's exit code) as that node's machine
# rank. The batch scripts here exec it. Environment (see node.sh): ACCELERATE_CONFIG, NPROC_PER_NODE, and
#   MAIN_PROCESS_PORT  the rendezvous port on the first node (default: a free one)
# Preemption: Slurm's warning signal to the batch shell (`--signal=B:USR1@120`, or
# `scancel --batch --signal=USR1 JOB`) or a TERM is forwarded as USR1 to every process of the job step
# (the pipeline saves a checkpoint and exits 75); on exit 75 the job requeues itself and the requeued job
# resumes. Every other code ends the job, a memory alert (5) and a lost lock (6) included.
set -uo pipefail
nodes=${SLURM_NNODES:-1}
MAIN_PROCESS_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)
MAIN_PROCESS_PORT=${MAIN_PROCESS_PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}
export MAIN_PROCESS_IP MAIN_PROCESS_PORT
echo "slurm: job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}): $nodes node(s), main" \
  "$MAIN_PROCESS_IP:$MAIN_PROCESS_PORT, config ${ACCELERATE_CONFIG:-DDP}"

preempted=""
forward() {
  preempted=$1
  echo "slurm: $1 received; forwarding USR1 to the job steps"
  scancel --signal=USR1 "$SLURM_JOB_ID"
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
# srun does not pass the job's --cpus-per-task on to its steps (Slurm 22.05): pass it explicitly.
# The nodes end a run together (finished, bad input, a gate stop, preempted) with one code, but not at the same
# instant: --kill-on-bad-exit would kill the nodes still exiting, and the job would end 143 (not requeued). So
# the others get 60 s after the first node ends, and are then killed (a node that crashed alone).
srun --nodes="$nodes" --ntasks-per-node=1 --kill-on-bad-exit=0 --wait=60 \
  ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} \
  slurm/node.sh "$@" &
step=$!
wait "$step"
rc=$?
while kill -0 "$step" 2>/dev/null; do  # a trapped signal interrupted `wait`: wait for the step itself
  wait "$step"
  rc=$?
done
if [ "$rc" -eq 75 ]; then
  echo "slurm: preempted (exit 75${preempted:+ after $preempted}); requeueing job $SLURM_JOB_ID to resume"
  scontrol requeue "$SLURM_JOB_ID"
elif [ "$rc" -eq 5 ]; then
  echo "slurm: memory alert (exit 5): not requeued, the same settings would stop at the same step; lower what a" \
    "step needs (see the log), then submit the same command with those settings to resume"
fi
exit "$rc"
