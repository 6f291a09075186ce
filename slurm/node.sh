#!/bin/bash
# The command every node of a pipeline job step runs (slurm/launch.sh starts it on each node with srun):
#   slurm/node.sh recipe=NAME [key=value ...]
# runs `smol-pipeline` (accelerate's launcher, keeping the pipeline's exit code: 0, 2, 3, 4, 5, 6, 75, 1) as machine
# $SLURM_NODEID of $SLURM_NNODES, and says the command it runs on stderr. Environment:
#   MAIN_PROCESS_IP, MAIN_PROCESS_PORT  the rendezvous address on the first node (launch.sh sets both)
#   NPROC_PER_NODE     processes per node (default: the node's GPUs; 1 on a node without GPUs: the pipeline
#                      then runs on CPU processes over gloo by itself)
#   ACCELERATE_CONFIG  a shipped accelerate config's name (zero3, ...: smol-pipeline --help lists them) or a config
#                      file's path (default: plain DDP)
set -euo pipefail
trap '' USR1 TERM  # until the launcher takes them over: preemption signals are for the pipeline processes
nodes=${SLURM_NNODES:-1}
rank=${SLURM_NODEID:-0}
gpus=${SLURM_GPUS_ON_NODE:-$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)}
per_node=${NPROC_PER_NODE:-$((gpus > 0 ? gpus : 1))}
total=$((per_node * nodes))
cmd=(smol-pipeline --num_machines "$nodes" --machine_rank "$rank" --num_processes "$total"
  --main_process_ip "$MAIN_PROCESS_IP" --main_process_port "$MAIN_PROCESS_PORT")
if [ -n "${ACCELERATE_CONFIG:-}" ]; then
  cmd+=(--config_file "$ACCELERATE_CONFIG")
else
  cmd+=(--mixed_precision no --dynamo_backend no)
  if [ "$total" -gt 1 ]; then cmd+=(--multi_gpu); fi
fi
cmd+=(-- "$@")
# the command as run, each secret-keyed value (sft.hub_token=...) redacted (pipeline/redact.py): job logs are read
# by others, and keep it after the job
shown=$(python -c 'import sys; from pipeline.redact import argv; print(" ".join(argv(sys.argv[1:])))' "${cmd[@]}") \
  || shown="${cmd[0]} (arguments not shown: pipeline.redact did not load)"
echo "slurm: node $rank of $nodes: $per_node process(es), $gpus GPU(s), config ${ACCELERATE_CONFIG:-DDP}:" \
  "$shown" >&2
exec "${cmd[@]}"
