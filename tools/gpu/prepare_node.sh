#!/bin/bash
# On an air-gapped GPU node, once every staged chunk is unpacked into /tmp/site (see docs/gpu.md):
# checks the imports, places the test model's GGUF in the project's cache and converts it once,
# so that runs started side by side do not each convert it.
# usage: bash tools/gpu/prepare_node.sh   (from the repository root; GGUF from /tmp/stage/model)
set -eu
cd "$(dirname "$0")/../.."
source tools/gpu/node_env.sh
# The GPU node's image sets PYTHONDONTWRITEBYTECODE=1, so no Python process there ever writes byte
# code, and each of a verl session's processes (TaskRunner, FSDP worker, vLLM's server, engine core
# and GPU worker) compiled every module of vLLM, verl, Ray and transformers it imported, again.
# Compiling the tree once (run this after every chunk is unpacked) took 3 s and 5 s on 16 cores in
# the two staging runs of 2026-12-02, and a single session's start went from 189.8 s to 169.5 s
# (docs/gpu.md §8). Python reads byte code whatever that variable says.
if ! python3 -m compileall -q -j 0 "$FEDAGENT_SITE" fedagent_flwr > /tmp/fa-compileall.log 2>&1; then
  echo "prepare_node.sh: compileall could not compile $(grep -c '^\*\*\*' /tmp/fa-compileall.log) file(s)" \
       "(list: /tmp/fa-compileall.log); they stay uncompiled, runs still work" >&2
fi
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
DEST=$FEDAGENT_CACHE_DIR/smollm2-0.1.2-gguf
mkdir -p "$DEST"
[ -f "$DEST/$GGUF" ] || cp "${STAGE:-/tmp/stage}/model/$GGUF" "$DEST/$GGUF"
python3 - <<'PY'
import importlib, time
versions = {n: importlib.import_module(n).__version__ for n in ("flwr", "verl", "vllm", "ray", "transformers", "torch")}
print("versions", versions, flush=True)
t0 = time.time()
from fedagent_flwr.models.smollm2 import default_model_dir
print("model", default_model_dir(), f"ready in {time.time() - t0:.1f} s", flush=True)
# vLLM inspects a model class in a child Python process (~20 s on the H200 node: imports again) when
# its model-info cache (~/.cache/vllm/modelinfos) has no entry, i.e. in the first session on a node
# (docs/gpu.md §8). Filling it here, once, spares the sessions that start side by side in round 1.
import json
from pathlib import Path
t0 = time.time()
try:
    from vllm.model_executor.models.registry import ModelRegistry
    archs = json.loads((Path(default_model_dir()) / "config.json").read_text()).get("architectures", [])
    from vllm import envs
    cached = []
    for arch in archs:
        model = ModelRegistry.models.get(arch)
        if model is None or not hasattr(model, "module_name"):
            continue  # not a lazily registered vLLM model: nothing is cached for it
        model.inspect_model_cls()
        name = f"{model.module_name}-{model.class_name}".replace(".", "-") + ".json"
        if (Path(envs.VLLM_CACHE_ROOT) / "modelinfos" / name).is_file():  # vLLM swallows its own write errors
            cached.append(arch)
    print(f"vLLM model info cached for {cached} of {archs} in {time.time() - t0:.1f} s", flush=True)
except Exception as exc:  # only a start-up saving is lost
    print(f"prepare_node.sh: could not fill vLLM's model-info cache ({exc!r}); sessions will inspect the model themselves", flush=True)
PY
df -h /dev/shm /tmp | tail -2
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
