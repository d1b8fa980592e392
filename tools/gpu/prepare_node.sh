#!/bin/bash
# On an air-gapped GPU node, once every staged chunk is unpacked into /tmp/site (see docs/gpu.md):
# checks the imports, places the test model's GGUF in the project's cache and converts it once,
# so that runs started side by side do not each convert it.
# usage: bash tools/gpu/prepare_node.sh   (from the repository root; GGUF from /tmp/stage/model)
set -eu
cd "$(dirname "$0")/../.."
source tools/gpu/node_env.sh
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
PY
df -h /dev/shm /tmp | tail -2
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
