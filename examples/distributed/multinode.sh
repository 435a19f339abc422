#!/usr/bin/env bash
# Two machines (nodes), each with its GPUs: run this on every node, with its own NODE_RANK (0 on the first).
#   MASTER_ADDR=10.0.0.1 NODE_RANK=0 NNODES=2 GPUS_PER_NODE=8 bash examples/distributed/multinode.sh my.yaml
#   MASTER_ADDR=10.0.0.1 NODE_RANK=1 NNODES=2 GPUS_PER_NODE=8 bash examples/distributed/multinode.sh my.yaml
# Every node needs the same gemmaforge config, the dataset at the path the config names, and the base model.
# The run directory may be shared (NFS) or local to each node: gemmaforge probes it at start. Local run
# directories: each node prepares the data (checked to be identical across nodes), keeps its own checkpoints
# and writes the same adapter; after a node dies, the same command on every node resumes from the newest
# checkpoint all nodes have. FSDP2/DeepSpeed write sharded checkpoints and need a shared run directory.
set -euo pipefail
config=${1:?usage: multinode.sh CONFIG [key=value ...]}
shift
exec torchrun \
  --nnodes "${NNODES:-2}" --nproc_per_node "${GPUS_PER_NODE:-1}" --node_rank "${NODE_RANK:?set NODE_RANK}" \
  --master_addr "${MASTER_ADDR:?set MASTER_ADDR}" --master_port "${MASTER_PORT:-29500}" \
  -m gemmaforge train "$config" "$@"
