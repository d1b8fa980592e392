#!/bin/bash
# Copies the WebShop files a run reads into .gpu-data/webshop of this checkout, a git-ignored
# folder, so that the device call's `carry` takes them to the air-gapped GPU node (docs/gpu.md,
# "WebShop on the GPU"). Only the catalogue and its instructions are read by the env (products,
# attributes; the goals are generated from them); human goals and lookalike decoys are left
# behind unless LOOKALIKE=1 (partition=lookalike needs them).
# With EXPERT=1 it also plays the warm start's expert episodes here, on the CPU (~40 s on 2 cores),
# into .gpu-data/webshop-expert, which webshop_warm_start.sh on the node reuses when their key matches
# (same settings, data and code), instead of playing them again there (in a scratch folder of its
# own under TMPDIR, removed afterwards; the log stays in ${TMPDIR:-/tmp}/ws-expert-stage.log).
# usage: bash tools/gpu/stage_webshop_data.sh [SRC]   (a given SRC is taken from the caller's folder;
#        the default, ../shared/data/webshop, from the repository root)
set -eu
# SRC and TMPDIR as the caller means them: a relative one is taken from the caller's folder, made
# absolute before the script moves to the repository root
SRC=
if [ -n "${1:-}" ]; then SRC=$(CDPATH= cd -- "$1" 2>/dev/null && pwd) || { echo "stage_webshop_data.sh: no folder $1" >&2; exit 1; }; fi
if [ -n "${TMPDIR:-}" ]; then
  tmp_abs=$(CDPATH= cd -- "$TMPDIR" 2>/dev/null && pwd) || { echo "stage_webshop_data.sh: TMPDIR=$TMPDIR is not a folder" >&2; exit 1; }
  export TMPDIR=$tmp_abs
fi
cd "$(dirname "$0")/../.."
SRC=${SRC:-../shared/data/webshop}
DEST=.gpu-data/webshop
if ! git check-ignore -q "$DEST/"; then
  echo "stage_webshop_data.sh: $DEST is not git-ignored; add /.gpu-data/ to .gitignore" >&2
  exit 1
fi
mkdir -p "$DEST"
for f in items_shuffle_1000.json items_ins_v2_1000.json; do
  [ -f "$SRC/$f" ] || { echo "stage_webshop_data.sh: $SRC has no $f; fetch it with: python -m fedagent_flwr.envs.webshop.download $SRC" >&2; exit 1; }
  install -m 0644 "$SRC/$f" "$DEST/$f"   # the shared copy is read-only; re-runs overwrite
done
if [ "${LOOKALIKE:-0}" = 1 ]; then cp -r "$SRC/lookalike" "$DEST/"; fi
(cd "$DEST" && sha256sum items_*.json > SHA256SUMS)
echo "$DEST: $(du -sb "$DEST" | cut -f1) bytes; on the node: env.data_dir=\$PWD/$DEST"
if [ "${EXPERT:-0}" = 1 ]; then
  PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
  LOG=${TMPDIR:-/tmp}/ws-expert-stage.log
  # EXPERT_ONLY: the OUT_DIR argument is checked but never written.
  if ! EXPERT_ONLY=1 SAVE_EXPERT_CACHE=1 EXPERT_CACHE=.gpu-data/webshop-expert PYTHON=$PY \
       bash tools/gpu/webshop_warm_start.sh /tmp/ws-expert-unused > "$LOG" 2>&1; then
    tail -5 "$LOG" >&2; echo "stage_webshop_data.sh: playing the expert episodes failed (above; $LOG)" >&2; exit 1
  fi
  tail -2 "$LOG"
fi
