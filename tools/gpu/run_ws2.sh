#!/bin/bash
# Issue 19 on a host with 2 (or more) GPUs: 2 clients x 2 rounds of verl GRPO in Flower's simulation,
# client 0 at FSDP world size 2 (trainer.per_client={0:{n_gpus_per_node:2}}), client 1 at world
# size 1; then `python -m fedagent_flwr.checkpoint.verify` on every round's global model, and the
# clients' world sizes and timings. One run per trainer mode (subprocess, then persistent: the
# persistent one also loads round 1's global model into client 0's live 2-rank actor).
#
# GPUs: Flower gives every ClientApp the same share (client-resources-num-gpus=2), so each client
# sees two GPUs (CUDA_VISIBLE_DEVICES=0,1 on a 2-GPU host) and client 1's job uses the first. On
# 2 GPUs the clients take turns; with GPUS=0,1,2,3 they train side by side (client 1 on GPU 2).
# usage: bash tools/gpu/run_ws2.sh      (repository root, after tools/gpu/prepare_node.sh)
#   OUT=/tmp/out (logs and runs), GPUS=0,1, MODES="subprocess persistent", EXTRA="..." (more overrides)
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
GPUS=${GPUS:-0,1}
MODES=${MODES:-subprocess persistent}
EXTRA=${EXTRA:-}
have=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$have" -lt 2 ]; then
  echo "run_ws2: this host has $have GPU(s); issue 19 needs 2 (client 0 trains on two)" >&2
  exit 2
fi
source tools/gpu/node_env.sh
export CUDA_VISIBLE_DEVICES=$GPUS
status=0
for mode in $MODES; do
  name=ws2-$mode
  # storage.keep_client_checkpoints=true: verify re-reads the clients' FSDP shards of every round.
  overrides="trainer=verl trainer.mode=$mode num_rounds=2 clients.total=2 storage.keep_client_checkpoints=true"
  overrides="$overrides trainer.per_client={0:{n_gpus_per_node:2}} $EXTRA"
  PORT=39491 bash tools/gpu/run_federated.sh "$name" "$overrides" \
    "num-supernodes=2 client-resources-num-gpus=2 client-resources-num-cpus=8"
  rc=$?
  [ "$rc" -eq 0 ] || status=1
  run=$OUT/runs/$name
  echo "[$name] python -m fedagent_flwr.checkpoint.verify $run" | tee -a "$OUT/$name.log"
  python3 -m fedagent_flwr.checkpoint.verify "$run" 2>&1 | tee -a "$OUT/$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  python3 - "$run" <<'PY' 2>&1 | tee -a "$OUT/$name.log"
# Per round and client: the checkpoint's FSDP world size (its rank files) and the job's timings.
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
summary = json.loads((run / "federated_summary.json").read_text())
print(f"{run.name}: status {summary.get('status')}, {len(summary.get('rounds', []))} round(s)")
for entry in summary.get("rounds", []):
    r = entry["round"]
    print(f"round {r}: aggregated clients {entry.get('client_actor_ids')} -> {entry.get('aggregated_actor')}")
    for result in sorted(run.glob(f"round_{r}/client_*/train_result.json")):
        res = json.loads(result.read_text())
        m = res.get("metrics", {})
        shards = sorted(p.name for p in Path(res["actor_dir"]).glob("model_world_size_*_rank_*.pt"))
        keys = ("train_seconds", "verl/cold_start_s", "verl/reload_s", "verl/timing_s/step",
                "verl/timing_s/update_actor", "verl/timing_s/save_checkpoint", "fedprox/active_workers")
        timings = ", ".join(f"{k}={m[k]}" for k in keys if k in m)
        print(f"  {result.parent.name}: world size {res.get('world_size')} ({', '.join(shards)}); {timings}")
PY
done
exit $status
