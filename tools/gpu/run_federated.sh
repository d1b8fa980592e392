#!/bin/bash
# One federated job in Flower's simulation on a GPU node, logged to OUT/NAME.log; the SuperLink it
# leaves running is stopped at the end. Run it detached for jobs longer than your session's patience:
#   setsid nohup bash tools/gpu/run_federated.sh grpo "trainer=verl num_rounds=2" "num-supernodes=2 client-resources-num-gpus=0.5" &
# usage: run_federated.sh NAME HYDRA_OVERRIDES [FEDERATION_CONFIG]
set -u
NAME=$1; OVERRIDES=$2
FEDERATION=${3:-"num-supernodes=2 client-resources-num-gpus=0.5 client-resources-num-cpus=4"}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
source tools/gpu/node_env.sh
# One Flower home per output folder and run: runs of two matrices launched side by side share run
# names (federated-s1) and would otherwise share a SuperLink state and stop each other's SuperLink.
# Named by a digest of the folder's absolute path (two folders may share a base name), under /tmp.
OUT_KEY=$(cd "$OUT" && pwd -P | sha256sum | cut -c1-12)
export FLWR_HOME=/tmp/flwr-$OUT_KEY-$NAME
# Each job gets its own local SuperLink ports, so jobs can run side by side (PORT picks them;
# pin a job to a GPU with CUDA_VISIBLE_DEVICES).
case $NAME in *ppo*) P=39291;; *) P=39191;; esac
P=${PORT:-$P}
export FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=$P FLWR_LOCAL_CONTROL_API_PORT=$((P + 2))
T0=$(date +%s)
stop_superlink() { python3 -m fedagent_flwr.launch stop-local "$FLWR_HOME" >> "$OUT/$NAME.log" 2>&1; }
# Stopping a job (kill -TERM -- -PGID, as arms.py stop does) must take its SuperLink and simulation
# along: Flower starts them in their own sessions, outside this script's process group, so killing
# flwr alone leaves the run training on.
trap 'stop_superlink; echo "[$NAME] stopped by a signal after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/$NAME.log"; exit 143' TERM INT
echo "[$NAME] start $(date -u +%FT%TZ) overrides: $OVERRIDES | federation: $FEDERATION | GPUs: ${CUDA_VISIBLE_DEVICES:-all}"
# outcome: the exit status is the run's own (0 completed, 3 degraded, 1 failed), not flwr's 0.
python3 -m fedagent_flwr.outcome run -- flwr run . --stream --federation-config "$FEDERATION" \
  --run-config "overrides=\"output_dir=$OUT/runs run_name=$NAME $OVERRIDES\"" > "$OUT/$NAME.log" 2>&1
rc=$?
stop_superlink
echo "[$NAME] exit rc=$rc after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/$NAME.log"
