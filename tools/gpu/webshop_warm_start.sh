#!/bin/bash
# The supervised warm start of the windowed WebShop run (conf/recipe/webshop_windowed_verl.yaml), on
# the GPU node: expert episodes on training goals in the recipe's windowed layout, then
# `fedagent warm-start` on every turn of the successful ones; the model lands in OUT_DIR (outside the
# checkout: `flwr run .` packs the checkout, and a 540 MB model is no part of the app), for
# `model.path=OUT_DIR`. Prints one summary line last.
# usage: bash tools/gpu/webshop_warm_start.sh OUT_DIR      (repository root; on the node after
#        tools/gpu/prepare_node.sh, with .gpu-data/webshop carried: docs/gpu.md §7)
# Settings (environment; defaults are the GPU plan's, docs/gpu.md §7 says why):
#   EPISODES=1000 SHARDS=8     expert episodes, played by SHARDS processes; shard k starts at seed
#                              k * 6410 / SHARDS, so the episodes cover both clients' halves of the
#                              training goals evenly (seed s plays training goal 500 + s % 6410)
#   DEVICE=cuda EPOCHS=1 LR=5e-5 BATCH=8 (1 unless DEVICE=cuda) MAX_LEN=4608 SEED=0 SAVE_DTYPE=float32
#   GRAD_CKPT=1 (0 unless DEVICE=cuda)  --gradient-checkpointing: the 30 layers' activations at 8 x 4,608
#                              tokens are tens of GB; recomputed in the backward pass instead (~1/3 more
#                              compute), so the warm start leaves room for GPU work beside it
#   ATTENTION=auto             --attention: the SDPA kernels to train with; auto lets torch pick cuDNN's on an
#                              H100, whose backward is not deterministic; math pins the deterministic one
#   MAX_GPU_MEM_FRACTION=      unset: no cap; F: --max-gpu-memory-fraction F, the process's share of the
#                              card (it then stops with its own out-of-memory line, not its neighbours)
#   DATA=<repo>/.gpu-data/webshop  relative paths (OUT_DIR, WARM_SCRATCH too) are taken from the caller's directory
#   WARM_SCRATCH=              unset: the expert files go to a new folder under TMPDIR (/tmp), removed at the
#                              end (kept, and named, if the script fails); DIR: a new or empty folder outside
#                              OUT_DIR, kept. The script never empties a folder it did not make, and neither reads
#                              nor sets WORK (many clusters export it: a user's work filesystem)
#   OUT_DIR must be new, empty or an earlier warm start's output (a model with its warm_start.json): only such
#                              a folder is replaced, and any other is refused before any work
#   EXPERT_ONLY=1              stop after the expert episodes (to time them)
#   EXPERT_CACHE=<repo>/.gpu-data/webshop-expert   a folder of expert episodes played before (expert.jsonl.gz,
#                              its key, the expert's summary lines): reused, not played again, when its key
#                              is this run's (the settings above that shape the episodes, the data files'
#                              sha256, a digest of the package's code) and the file still has the sha256 the
#                              key records; played otherwise. SAVE_EXPERT_CACHE=1 writes it after playing.
#                              stage_webshop_data.sh fills it on the CPU before a GPU session (EXPERT=1), so
#                              the node skips the 15-29 s of playing. The key leaves out the Python and
#                              library versions (the venv here and the node's wheels differ): on 2026-12-07
#                              both played the same bytes (sha256 0efebc81...); check again after upgrading
#                              either (warm_start.json's data_sha256 records what was trained on)
set -eu
OUT_DIR=${1:?usage: webshop_warm_start.sh OUT_DIR}
# Resolved from the caller's directory (and .. and links folded) before moving to the repository root.
OUT_DIR=$(realpath -m "$OUT_DIR")
WARM_SCRATCH=${WARM_SCRATCH:+$(realpath -m "$WARM_SCRATCH")}
SCRATCH_PARENT=$(realpath -m "${TMPDIR:-/tmp}")
DATA=${DATA:+$(realpath -m "$DATA")}
EXPERT_CACHE=${EXPERT_CACHE:+$(realpath -m "$EXPERT_CACHE")}
cd "$(dirname "$0")/../.."
DATA=${DATA:-$PWD/.gpu-data/webshop}  # the default is the repository's, where stage_webshop_data.sh puts it
EXPERT_CACHE=${EXPERT_CACHE:-$PWD/.gpu-data/webshop-expert}
EPISODES=${EPISODES:-1000}; SHARDS=${SHARDS:-8}
DEVICE=${DEVICE:-cuda}; EPOCHS=${EPOCHS:-1}; LR=${LR:-5e-5}; MAX_LEN=${MAX_LEN:-4608}
# Off CUDA (cpu, or auto on a box without a GPU) a batch of 8 windows keeps their attention for the
# backward pass: killed for memory on a 23 GB machine.
if [ "$DEVICE" = cuda ]; then BATCH=${BATCH:-8}; else BATCH=${BATCH:-1}; fi
SEED=${SEED:-0}; SAVE_DTYPE=${SAVE_DTYPE:-float32}; ATTENTION=${ATTENTION:-auto}
if [ "$DEVICE" = cuda ]; then GRAD_CKPT=${GRAD_CKPT:-1}; else GRAD_CKPT=${GRAD_CKPT:-0}; fi
MEMORY_ARGS=()
[ "$GRAD_CKPT" = 1 ] && MEMORY_ARGS+=(--gradient-checkpointing)
[ -n "${MAX_GPU_MEM_FRACTION:-}" ] && MEMORY_ARGS+=(--max-gpu-memory-fraction "$MAX_GPU_MEM_FRACTION")
RECIPE=webshop_windowed_verl
case "$OUT_DIR/" in "$(realpath -m "$PWD")"/*) echo "webshop_warm_start.sh: OUT_DIR $OUT_DIR is inside the checkout; \`flwr run .\` would pack it into the app: put it elsewhere (e.g. /tmp/ws-warm)" >&2; exit 2;; esac
if [ -n "$WARM_SCRATCH" ]; then
  if [ -e "$WARM_SCRATCH" ] && { [ ! -d "$WARM_SCRATCH" ] || [ -n "$(ls -A "$WARM_SCRATCH")" ]; }; then
    echo "webshop_warm_start.sh: WARM_SCRATCH $WARM_SCRATCH exists and is not an empty folder; it is never emptied: name a new one, or leave WARM_SCRATCH unset" >&2; exit 2
  fi
  case "$WARM_SCRATCH/" in "$OUT_DIR"/*)
    echo "webshop_warm_start.sh: WARM_SCRATCH $WARM_SCRATCH is inside OUT_DIR $OUT_DIR, which the warm start replaces: put it elsewhere" >&2; exit 2;; esac
fi
# Shard k starts at seed k * 6410 / SHARDS: more episodes than the 6,410 training goals would make
# shards overlap and repeat goals in the supervised data.
if [ "$SHARDS" -lt 1 ] || [ "$EPISODES" -lt "$SHARDS" ] || [ "$EPISODES" -gt 6410 ]; then
  echo "webshop_warm_start.sh: need 1 <= SHARDS ($SHARDS) <= EPISODES ($EPISODES) <= 6410 (the training goals)" >&2; exit 2
fi
if [ -d "${FEDAGENT_SITE:-/tmp/site}" ]; then source tools/gpu/node_env.sh  # the node: its tree, cache dir
else export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; fi
PY=${PYTHON:-python3}
# `warm-start --force` below replaces OUT_DIR whole: the package's own check (no torch), before minutes of work.
$PY -m fedagent_flwr.trainers.common.warm_start_output "$OUT_DIR" || { echo "webshop_warm_start.sh: OUT_DIR refused (above)" >&2; exit 2; }
# cuBLAS is deterministic only with this set before the process starts (README, "Supervised warm
# start"): two GPU sessions on the same node type and wheels then make the same model more likely.
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
SECONDS=0
# The expert plays exactly the recipe's windowed limits (turns, per-turn budgets, history), read from
# the composed recipe, so the warm start sees the windows the RL run will show.
# ... and renders with the recipe's model.chat_template_kwargs (last: a JSON object, to the line's end).
read -r TURNS NEW PROMPT RESPONSE HISTORY RETURN_N TEMPLATE_KWARGS < <($PY - "$RECIPE" "$DATA" <<'PY'
import json, sys
from fedagent_flwr.config import load_settings
s = load_settings("config", f"recipe={sys.argv[1]} env.data_dir={sys.argv[2]}")
(train,) = s.train_env_spec["envs"]
t = s.trainer
assert s.raw["rollout"]["mode"] == "windowed", s.raw["rollout"]
print(train["max_turns"], t["max_new_tokens"], t["max_prompt_length"], t["max_response_length"],
      s.raw["rollout"]["history_length"], train["config"]["search_return_n"],
      json.dumps(dict(s.raw["model"].get("chat_template_kwargs") or {})))
PY
) || { echo "webshop_warm_start.sh: could not read the recipe $RECIPE with $PY (see above)" >&2; exit 1; }
running=()  # expert shards not yet waited for (a reaped pid may be reused): stopped with the script
if [ -n "$WARM_SCRATCH" ]; then SCRATCH=$WARM_SCRATCH; mkdir -p "$SCRATCH"
else SCRATCH=$(mktemp -d "$SCRATCH_PARENT/ws-warm-work.XXXXXX"); fi
finish() {
  local rc=$?
  kill ${running[@]+"${running[@]}"} 2>/dev/null || true
  if [ -z "$WARM_SCRATCH" ] && [ "$rc" = 0 ]; then rm -rf "$SCRATCH"
  elif [ -z "$WARM_SCRATCH" ]; then echo "webshop_warm_start.sh: the expert files and logs are kept in $SCRATCH (remove it when done)" >&2; fi
}
trap finish EXIT
trap 'exit 130' INT; trap 'exit 143' TERM HUP  # (a signal otherwise ends bash without its EXIT trap)
# What the episodes depend on: the settings that shape them, the data (by content, not path) and the
# code that plays them. A cache with another key is not used (and not removed); its key's second line
# is the episodes' sha256, so a damaged or mismatched file is played again rather than trusted.
KEY="episodes=$EPISODES shards=$SHARDS turns=$TURNS new=$NEW prompt=$PROMPT response=$RESPONSE history=$HISTORY"
KEY="$KEY return_n=$RETURN_N data=$(cat "$DATA"/items_shuffle_1000.json "$DATA"/items_ins_v2_1000.json | sha256sum | cut -c1-64)"
KEY="$KEY code=$(find fedagent_flwr -name '*.py' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-64)"
PER=$(( (EPISODES + SHARDS - 1) / SHARDS )); left=$EPISODES; pids=()
if [ "$(head -n 1 "$EXPERT_CACHE/key" 2>/dev/null)" = "$KEY" ]; then
  recorded=$(sed -n 's/^episodes_sha256=//p' "$EXPERT_CACHE/key")
  if gzip -dc "$EXPERT_CACHE/expert.jsonl.gz" > "$SCRATCH/expert.jsonl" 2>/dev/null \
     && [ "$(sha256sum < "$SCRATCH/expert.jsonl" | cut -c1-64)" = "$recorded" ]; then
    echo "expert: reused the episodes in $EXPERT_CACHE, played before under this run's key; their summary then:"
    sed 's/^/  /' "$EXPERT_CACHE/wrote.log" 2>/dev/null || true
    SHARDS=0  # nothing to play
  else
    echo "expert: the episodes in $EXPERT_CACHE are not the ones their key records (damaged or partly written): playing them"
    rm -f "$SCRATCH/expert.jsonl"
  fi
elif [ -f "$EXPERT_CACHE/key" ]; then
  # Say which of the key's fields differ, so that a session that carried them to skip the playing
  # (stage_webshop_data.sh EXPERT=1) sees why it did not: most often a commit after the staging.
  differ=$(diff <(head -n 1 "$EXPERT_CACHE/key" | tr ' ' '\n') <(printf '%s\n' "$KEY" | tr ' ' '\n') \
           | sed -n 's/^> \([^=]*\)=.*/\1/p' | paste -sd ' ' -)
  hint=""
  case " $differ " in *" code "*) hint=" (code: the package changed since they were played; stage them again after the last commit)" ;; esac
  echo "expert: the episodes in $EXPERT_CACHE were played under another key (differs in: ${differ:-its layout})$hint: playing them"
fi
for k in $(seq 0 $((SHARDS - 1))); do
  n=$(( left < PER ? left : PER )); left=$(( left - n ))
  [ "$n" -gt 0 ] || break
  # CPU only, as the env services run (envs/service/launch.py's CPU_ONLY_ENV): importing bm25s runs
  # JAX, which would otherwise take 75% of the GPU that training sessions beside it are using.
  CUDA_VISIBLE_DEVICES= JAX_PLATFORMS=cpu $PY -m fedagent_flwr.cli webshop-expert --data-dir "$DATA" --mode windowed --episodes "$n" \
      --first-seed $(( k * 6410 / SHARDS )) --max-turns "$TURNS" --max-new-tokens "$NEW" \
      --max-prompt-length "$PROMPT" --max-response-length "$RESPONSE" --history-length "$HISTORY" \
      --search-return-n "$RETURN_N" \
      --out "$SCRATCH/expert-$k.jsonl" --quiet > "$SCRATCH/expert-$k.log" 2>&1 &
  pids+=($!); running+=($!)
done
if [ "${#pids[@]}" -gt 0 ]; then  # (none when reused; an empty "${!pids[@]}" is unbound before bash 4.4)
  for k in "${!pids[@]}"; do
    shard_rc=0; wait "${pids[$k]}" || shard_rc=$?
    running=(${running[@]+"${running[@]:1}"})  # waited for, in order: reaped, no longer ours to signal
    [ "$shard_rc" = 0 ] || { echo "webshop_warm_start.sh: expert shard $k failed:" >&2
                             tail -3 "$SCRATCH/expert-$k.log" >&2; exit 1; }  # (the EXIT trap stops the others)
  done
  cat $(for k in "${!pids[@]}"; do echo "$SCRATCH/expert-$k.jsonl"; done) > "$SCRATCH/expert.jsonl"
  grep -h "^wrote" "$SCRATCH"/expert-*.log > "$SCRATCH/wrote.log"
  cat "$SCRATCH/wrote.log"
  if [ "${SAVE_EXPERT_CACHE:-0}" = 1 ]; then  # written under temporary names, then renamed
    mkdir -p "$EXPERT_CACHE"
    rm -f "$EXPERT_CACHE/key"  # the key goes last: no moment where a key names other episodes
    gzip -c "$SCRATCH/expert.jsonl" > "$EXPERT_CACHE/expert.jsonl.gz.tmp.$$"
    mv "$EXPERT_CACHE/expert.jsonl.gz.tmp.$$" "$EXPERT_CACHE/expert.jsonl.gz"
    cp "$SCRATCH/wrote.log" "$EXPERT_CACHE/wrote.log.tmp.$$"
    mv "$EXPERT_CACHE/wrote.log.tmp.$$" "$EXPERT_CACHE/wrote.log"
    printf '%s\nepisodes_sha256=%s\n' "$KEY" "$(sha256sum < "$SCRATCH/expert.jsonl" | cut -c1-64)" > "$EXPERT_CACHE/key.tmp.$$"
    mv "$EXPERT_CACHE/key.tmp.$$" "$EXPERT_CACHE/key"
    echo "expert: saved to $EXPERT_CACHE"
  fi
fi
EXPERT_S=$SECONDS
echo "expert: $EPISODES episodes in ${#pids[@]} shards, $(wc -l < "$SCRATCH/expert.jsonl") windows, $(sha256sum "$SCRATCH/expert.jsonl" | cut -c1-16), ${EXPERT_S} s"
[ "${EXPERT_ONLY:-0}" = 1 ] && exit 0
# --min-reward 10: the successful episodes' turns only (WebShop's reward is 10 for a purchase scoring 1.0).
$PY -m fedagent_flwr.cli warm-start --data "$SCRATCH/expert.jsonl" --out "$OUT_DIR" --force --min-reward 10 \
    --epochs "$EPOCHS" --lr "$LR" --batch-size "$BATCH" --max-len "$MAX_LEN" --seed "$SEED" --device "$DEVICE" \
    --save-dtype "$SAVE_DTYPE" --attention "$ATTENTION" --log-every 50 --chat-template-kwargs "$TEMPLATE_KWARGS" \
    ${MEMORY_ARGS[@]+"${MEMORY_ARGS[@]}"}
WARM_S=$(( SECONDS - EXPERT_S ))
$PY - "$OUT_DIR" "$SCRATCH/expert.jsonl" "$EXPERT_S" "$WARM_S" <<'PY'
import json, sys
out, data, expert_s, warm_s = sys.argv[1:]
r = json.load(open(f"{out}/warm_start.json"))
windows = sum(1 for line in open(data) if line.strip())
considered = r["examples_used"] + r["examples_dropped_too_long"]
print(f"ws-warm: windows kept {r['examples_used']} dropped {r['examples_dropped_too_long']} (> {r['max_len']} tokens), "
      f"{windows - considered} of {windows} skipped (unsuccessful episodes); steps {r['steps']}, "
      f"loss {r['loss_first_step']:.4f} -> {r['loss_last_step']:.4f}; expert {float(expert_s):.0f} s, "
      f"warm start {float(warm_s):.0f} s (training {r['seconds']} s) on {r['device']}; {r['save_dtype']} model in {out}"
      + (f"; peak GPU memory {r['peak_gpu_memory_gib']} GiB allocated" if r.get("peak_gpu_memory_gib") is not None else "")
      + f" (gradient checkpointing {'on' if r.get('gradient_checkpointing') else 'off'}, cap "
      f"{r.get('max_gpu_memory_fraction') or 'none'})", flush=True)
PY
