#!/bin/bash
# Files one batch-24 seed's results, as the device call's reply brought them back (its files_at
# folder: outWL.tgz, smi.log, warm/ws-warm.log, warm/warm_start.json; tools/gpu/batch24_session.sh),
# into the batch's folder under the names the earlier seeds have there (docs/results.md §3):
#   <arm>-s<SEED>-summary.json, -metrics.jsonl, -curve.png, steps-<arm>-s<SEED>/ (federated, local),
#   <arm>-s<SEED>-client_<c>-hooks.log where a hook printed a line,
#   batch24-s<SEED>-arms.md, -arms.png, -hostmem.jsonl, phases-s<SEED>.md, gpu-memory-s<SEED>.log,
#   warm_start-s<SEED>-<CARD>.json, warm-start-s<SEED>.log
# It refuses a seed whose files are already there (FORCE=1 overwrites), and one whose runs lack a
# summary, metrics or curve; it prints what it filed, each run's status and last completed round, and
# whether the warm start trained on the batch's expert episodes (data_sha256, the same in every seed).
# usage: bash tools/gpu/batch24_collect.sh SEED CARD FILES_AT   (CARD: h100 or h200, the reply's device)
#        DEST=<folder> overrides the batch's folder (tests)
set -eu
SEED=${1:?usage: batch24_collect.sh SEED CARD FILES_AT}
CARD=${2:?usage: batch24_collect.sh SEED CARD FILES_AT}
FROM=$(realpath -m "${3:?usage: batch24_collect.sh SEED CARD FILES_AT}")
case "$CARD" in h100 | h200) ;; *) echo "batch24_collect.sh: CARD must be h100 or h200 (the reply's device), not '$CARD'" >&2; exit 2 ;; esac
case "$SEED" in '' | *[!0-9]*) echo "batch24_collect.sh: SEED must be a whole number, not '$SEED'" >&2; exit 2 ;; esac
DEST=${DEST:+$(realpath -m "$DEST")}
cd "$(dirname "$0")/../.."
DEST=${DEST:-docs/gpu-runs/2026-12-06/webshop-fed-vs-local}
for f in outWL.tgz smi.log warm/ws-warm.log warm/warm_start.json; do
  [ -f "$FROM/$f" ] || { echo "batch24_collect.sh: $FROM has no $f: give the folder of the session's last call (files_at)" >&2; exit 1; }
done
if [ "${FORCE:-0}" != 1 ] && compgen -G "$DEST/*-s$SEED-*" > /dev/null; then
  echo "batch24_collect.sh: $DEST already holds files of seed $SEED; FORCE=1 overwrites them" >&2; exit 1
fi
unpacked=$(mktemp -d)
trap 'rm -rf "$unpacked"' EXIT
tar -C "$unpacked" -xzf "$FROM/outWL.tgz"
results=$unpacked/results
for arm in federated local; do
  run=$results/$arm-s$SEED
  for f in federated_summary.json metrics.jsonl learning_curve.png; do
    [ -f "$run/$f" ] || { echo "batch24_collect.sh: the archive has no results/$arm-s$SEED/$f: nothing filed" >&2; exit 1; }
  done
done
mkdir -p "$DEST"
put() { install -m 0644 "$1" "$DEST/$2"; echo "  $2"; }
echo "filed into $DEST:"
for arm in federated local; do
  run=$results/$arm-s$SEED
  put "$run/federated_summary.json" "$arm-s$SEED-summary.json"
  put "$run/metrics.jsonl" "$arm-s$SEED-metrics.jsonl"
  put "$run/learning_curve.png" "$arm-s$SEED-curve.png"
  if [ -d "$run/steps" ]; then
    rm -rf "$DEST/steps-$arm-s$SEED"; mkdir -p "$DEST/steps-$arm-s$SEED"
    for steps in "$run"/steps/*.jsonl; do put "$steps" "steps-$arm-s$SEED/$(basename "$steps")"; done
  fi
  for hooks in "$run"/client_*-hooks.log; do
    [ -f "$hooks" ] && put "$hooks" "$arm-s$SEED-$(basename "$hooks")"
  done
done
for f in arms.md arms.png hostmem.jsonl; do
  [ -f "$results/$f" ] && put "$results/$f" "batch24-s$SEED-$f"
done
[ -f "$results/phases.md" ] && put "$results/phases.md" "phases-s$SEED.md"
put "$FROM/smi.log" "gpu-memory-s$SEED.log"
put "$FROM/warm/warm_start.json" "warm_start-s$SEED-$CARD.json"
put "$FROM/warm/ws-warm.log" "warm-start-s$SEED.log"
for arm in federated local; do
  python3 -c 'import json, sys; s = json.load(open(sys.argv[1]))
print(sys.argv[2] + ": status", s.get("status"), "last completed round", s.get("last_completed_round"))' \
    "$DEST/$arm-s$SEED-summary.json" "$arm-s$SEED"
done
# Seeds 4-8's warm starts all trained on these expert episodes (warm_start-s*.json); from seed 9 on they
# are played on the CPU before the session and carried (stage_webshop_data.sh EXPERT=1).
python3 - "$DEST/warm_start-s$SEED-$CARD.json" 0efebc81be2d9d5bc9333bb3558d6c03dba1804a0590b8dc70ee980b030c39a8 <<'PY'
import json, sys
record, batch = sys.argv[1:]
got = json.load(open(record)).get("data_sha256")
if got == batch:
    print(f"warm start: the batch's expert episodes (data_sha256 {got[:16]}...)")
else:
    print(f"warm start: NOT the batch's expert episodes: data_sha256 {got}, the batch's {batch}")
PY
