#!/bin/bash
# Add-on chunk for an air-gapped GPU node that already has the base chunks (c00..c07 of
# ../shared/gpu/stage.sh): the WebShop env services' wheels (bm25s, PyStemmer, spaCy and its small
# English model, their closure), i.e. the lines of requirements/gpu-node-py312.txt after its
# "WebShop env services" marker. Run on a machine with PyPI access (docs/gpu.md §7).
#
# Steps, as stage.sh does them: cp312 manylinux x86_64 wheels with --no-deps; a --no-deps
# --no-compile --target install under Python 3.12; one `tar | xz -6` archive site-ws.tar.xz (the
# tree's top-level entries without bin/ and __pycache__/), which unpack_chunks.py extracts into
# /tmp/site; a chunk folder OUT (default $REPO/.whl/c08) with the archive and an ALL.sha256 that is
# the union of BASE's (default $REPO/.whl/c00/ALL.sha256) and the archive's sum, so the node's
# unpack script accepts it whatever chunk's ALL.sha256 it last received. Send it after the others.
#
# Environment: REPO (git top level), OUT, BASE, WORK (scratch, default ${TMPDIR:-/tmp}/ws-stage;
# its downloads, install tree and archive are reused: delete it to start afresh), PY312.
set -euo pipefail
REPO=${REPO:-$(git rev-parse --show-toplevel)}
OUT=${OUT:-$REPO/.whl/c08}
BASE=${BASE:-$REPO/.whl/c00/ALL.sha256}
WORK=${WORK:-${TMPDIR:-/tmp}/ws-stage}
REQ=$REPO/requirements/gpu-node-py312.txt
LIMIT=52428800   # 50 MiB: one transfer with room for the checkout
PY312=${PY312:-$(ls -d "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -1)}
"$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' || { echo "set PY312 to a Python 3.12" >&2; exit 1; }
[ -f "$BASE" ] || { echo "no base ALL.sha256 at $BASE (stage the base chunks first)" >&2; exit 1; }
SPECS=$(sed -n '/WebShop env services/,$p' "$REQ" | grep -v '^\s*#' | grep -v '^\s*$')
PLAT=""
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
         manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
  PLAT="$PLAT --platform ${p}_x86_64"
done
mkdir -p "$WORK/wheels"
"$PY312" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
  -d "$WORK/wheels" $SPECS
echo "== $(ls "$WORK"/wheels/*.whl | wc -l) wheels, $(du -cb "$WORK"/wheels/*.whl | tail -1 | cut -f1) bytes"
if [ ! -d "$WORK/site" ]; then
  "$PY312" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$WORK"/wheels/*.whl
fi
if [ ! -s "$WORK/site-ws.tar.xz" ]; then
  (cd "$WORK/site" && ls -A | grep -v -x -e bin -e __pycache__ > "$WORK/members.lst" &&
   tar -cf - --files-from="$WORK/members.lst" | xz -6 -T2 -c > "$WORK/site-ws.tar.xz.tmp") &&
  mv "$WORK/site-ws.tar.xz.tmp" "$WORK/site-ws.tar.xz"
fi
SIZE=$(stat -c %s "$WORK/site-ws.tar.xz")
[ "$SIZE" -le "$LIMIT" ] || { echo "site-ws.tar.xz is $SIZE bytes, over $LIMIT: split it as pack_chunks.py does" >&2; exit 1; }
mkdir -p "$OUT"
cp "$WORK/site-ws.tar.xz" "$OUT/"
{ cat "$BASE"; (cd "$OUT" && sha256sum site-ws.tar.xz); } | sort -k2 -u > "$OUT/ALL.sha256"
echo "== $OUT: $(du -sb "$OUT" | cut -f1) bytes"
(cd "$OUT" && sha256sum site-ws.tar.xz ALL.sha256)
