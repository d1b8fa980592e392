#!/bin/bash
# Times the imports a verl session's processes pay, on a freshly staged GPU node (issue 16, item 2;
# docs/gpu.md §8): each of torch, ray, transformers, vllm and verl imported in a new python3 twice.
# Run it before prepare_node.sh to see what byte code saves: the chunks carry none and the node's
# image sets PYTHONDONTWRITEBYTECODE=1, so neither pass finds any; after prepare_node.sh (which
# compiles the tree) both passes read it. `-X importtime` of each vllm import is kept to show which
# modules cost the time.
# usage: [MODULES="torch vllm"] bash tools/gpu/import_times.sh OUTDIR   (on the node, after every
# chunk is unpacked; MODULES defaults to the five above)
set -u
OUTDIR=${1:?usage: import_times.sh OUTDIR}
SITE=${FEDAGENT_SITE:-/tmp/site}
MODULES=${MODULES:-torch ray transformers vllm verl}
mkdir -p "$OUTDIR"
pyc() { find "$SITE" -name '*.pyc' 2>/dev/null | wc -l; }
{
  echo "node: $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg); byte-code files in $SITE: $(pyc)"
  for pass in 1 2; do
    for module in $MODULES; do
      start=$(date +%s%N)
      PYTHONPATH=$SITE python3 -X importtime -c "import $module" 2> "$OUTDIR/importtime-$module-pass$pass.txt"
      status=$?
      end=$(date +%s%N)   # (the node has no bc: integer nanoseconds, divided by awk)
      printf 'pass %d  import %-13s %6.2f s  (exit %d)\n' "$pass" "$module" \
        "$(awk -v a="$start" -v b="$end" 'BEGIN { print (b - a) / 1e9 }')" "$status"
    done
    echo "after pass $pass: byte-code files in $SITE: $(pyc); load $(cut -d' ' -f1-3 /proc/loadavg)"
  done
  # the slowest packages of the second vllm import (cumulative microseconds; -X importtime's own
  # bookkeeping makes every import above a little slower than a plain one)
  [ -f "$OUTDIR/importtime-vllm-pass2.txt" ] || exit 0
  echo "vllm import, pass 2, packages by cumulative time:"
  awk -F'|' '/^import time:/ && $3 !~ /^ *imported package/ {
      name=$3; gsub(/^ +| +$/, "", name); if (name !~ /^\./ && index(name, ".") == 0) print $2+0, name }' \
      "$OUTDIR/importtime-vllm-pass2.txt" | sort -rn | head -12 | awk '{printf "  %-28s %7.2f s\n", $2, $1/1e6}'
} 2>&1 | tee "$OUTDIR/import-times.txt"
