#!/bin/bash
# Pack what a GPU session must keep (the device machine keeps nothing) into one archive under
# $OUT: every run's summary, metrics, curve, the arms report (arms.*) and the matrix launched
# (matrix.json), the verl sessions' phases (phases.md, and each phases.jsonl), verl's per-step metrics
# of every client-round (metrics.jsonl keeps a round's last step only) and its request fingerprints
# where they were on, the node's memory samples (hostmem.jsonl), and the tails of the logs: $OUT's
# own *.log and each persistent trainer's server.log (not the client-rounds' logs), and every line of
# those server logs that the job's hooks print when they act (<run>/client_<c>-hooks.log).
# usage: OUT=/tmp/out bash tools/gpu/collect.sh [ARCHIVE]   (ARCHIVE default $OUT/results.tgz)
set -u
OUT=${OUT:-/tmp/out}
ARCHIVE=${1:-$OUT/results.tgz}
# a relative OUT or ARCHIVE is the caller's, not the repository root's (where the script works)
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
case $ARCHIVE in /*) ;; *) ARCHIVE=$PWD/$ARCHIVE ;; esac
# The archive is renamed into place below with a plain (POSIX) mv, which, given a directory (or a link
# to one), moves the file INTO it and succeeds: the archive would land at $ARCHIVE/.<name>.partial.<pid>,
# none where the caller looks. So a directory there is refused first, before anything is packed. (This
# was GNU mv -T at the rename, which BSD and macOS mv lack; -T replaced a link to a directory, which is
# refused here too. Nothing else in this script is GNU-only.)
if [ -d "$ARCHIVE" ]; then
  echo "collect.sh: $ARCHIVE is a directory: name a file for the archive; nothing packed" >&2
  exit 1
fi
cd "$(dirname "$0")/../.."
python3 tools/gpu/arms.py report --out "$OUT" > /dev/null 2>&1 || true
python3 tools/gpu/arms.py phases --out "$OUT" > /dev/null 2>&1 || true
STAGE=$(mktemp -d)
# The archive is packed under a temporary name beside it, then renamed: a call cut off mid-pack
# (its time limit) returns the previous complete archive, never a truncated one in its place. The
# partial file is removed on any exit (and one that a killed earlier call left, at the start), so
# it never travels back with $OUT.
PARTIAL="$(dirname "$ARCHIVE")/.$(basename "$ARCHIVE").partial.$$"
rm -f "$(dirname "$ARCHIVE")/.$(basename "$ARCHIVE").partial."*
trap 'rm -f "$PARTIAL"; rm -rf "$STAGE"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
mkdir -p "$STAGE/results"
# keep_per_client_round RUN NAME FILE FOLDER: each RUN/round_<r>/client_<c>/verl/FILE as
# results/NAME/FOLDER/round_<r>-client_<c>.jsonl
keep_per_client_round() {
  local found client_dir
  for found in "$1"/round_*/client_*/verl/"$3"; do
    [ -f "$found" ] || continue
    client_dir=$(dirname "$(dirname "$found")")
    mkdir -p "$STAGE/results/$2/$4"
    cp "$found" "$STAGE/results/$2/$4/$(basename "$(dirname "$client_dir")")-$(basename "$client_dir").jsonl"
  done
}
cp "$OUT"/arms.* "$OUT"/phases.md "$OUT"/matrix.json "$OUT"/hostmem.jsonl "$STAGE/results/" 2>/dev/null
# a glob that matches nothing stays the pattern itself: a session without runs (or without top-level
# logs) would otherwise leave a results/*/ folder (an empty results/*.log.tail); each loop skips it
for run in "$OUT"/runs/*/; do
  [ -d "$run" ] || continue
  name=$(basename "$run")
  mkdir -p "$STAGE/results/$name"
  cp "$run"/federated_summary.json "$run"/metrics.jsonl "$run"/learning_curve.png "$STAGE/results/$name/" 2>/dev/null
  # the persistent sessions' phases, where tools/gpu/phases.py finds them again (results/<run>/trainers/...)
  for phases in "$run"/trainers/client_*/phases.jsonl; do
    [ -f "$phases" ] && mkdir -p "$STAGE/results/$name/trainers/$(basename "$(dirname "$phases")")" \
      && cp "$phases" "$STAGE/results/$name/trainers/$(basename "$(dirname "$phases")")/"
  done
  # verl's metrics of every training step, which each client-round writes under its output in both
  # trainer modes (round_<r>/client_<c>/verl/steps.jsonl), as results/<run>/steps/round_<r>-client_<c>.jsonl:
  # a round's first step is where two runs of one config can first differ (docs/results.md, the
  # reproducibility pairs). A subprocess job killed by its timeout leaves verl's raw step lines there
  # instead, perhaps with a cut-off last line; arms.py steps reads those too (tools/gpu/arms_steps.py)
  keep_per_client_round "$run" "$name" steps.jsonl steps
  # the agent loop's per-request fingerprints where trainer.request_fingerprints was on
  # (round_<r>/client_<c>/verl/request_fingerprints.jsonl), as
  # results/<run>/fingerprints/round_<r>-client_<c>.jsonl: tools/gpu/fingerprints.py joins two runs'
  # files request by request and names the first request whose prompt, tokens or log-probs differ
  keep_per_client_round "$run" "$name" request_fingerprints.jsonl fingerprints
  # the persistent trainers' logs (trainers/client_<c>/server.log), tails only, as
  # results/<run>/client_<c>-server.log.tail; no client-round's own log is kept
  for log in "$run"/trainers/client_*/server.log; do
    [ -f "$log" ] || continue
    client=$(basename "$(dirname "$log")")
    tail -c 200000 "$log" > "$STAGE/results/$name/$client-server.log.tail"
    # every line the job's hooks print when they act (a weight sync waiting for the host lock; vLLM's
    # sleep check tolerated on a shared GPU), from the whole log: a tail may have lost them, and they
    # are how a batch shows whether the hooks ever acted (docs/gpu.md, "Stalls"); none, no file
    grep -a -e '[weight-sync lock]' -e '[vllm sleep]' -F "$log" > "$STAGE/results/$name/$client-hooks.log" \
      || rm -f "$STAGE/results/$name/$client-hooks.log"
  done
done
for log in "$OUT"/*.log; do
  [ -f "$log" ] || continue
  tail -c 300000 "$log" > "$STAGE/results/$(basename "$log").tail"
done
if ! tar czf "$PARTIAL" -C "$STAGE" results || ! mv -f "$PARTIAL" "$ARCHIVE"; then
  echo "collect.sh: packing $ARCHIVE failed; any previous archive is kept" >&2
  exit 1
fi
ls -la "$ARCHIVE"
