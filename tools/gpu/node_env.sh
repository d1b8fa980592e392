# Source on an air-gapped GPU node after the wheel set (requirements/gpu-node-py312.txt) was
# installed with `pip install --no-deps --target $FEDAGENT_SITE`: puts that tree and this checkout
# first on PYTHONPATH, Flower's console scripts on PATH, and Flower/vLLM settings in the environment.
# usage: source tools/gpu/node_env.sh   (from the repository root)
export FEDAGENT_SITE=${FEDAGENT_SITE:-/tmp/site}
export PYTHONPATH=$FEDAGENT_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -x "$FEDAGENT_SITE-bin/flwr" ] || python3 tools/gpu/make_bin.py "$FEDAGENT_SITE" "$FEDAGENT_SITE-bin"
export PATH=$FEDAGENT_SITE-bin:$PATH
export FLWR_HOME=${FLWR_HOME:-$PWD/.flwr}
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export VLLM_USE_FLASHINFER_SAMPLER=0   # FlashInfer is not in the wheel set
export TOKENIZERS_PARALLELISM=true
export FEDAGENT_CACHE_DIR=${FEDAGENT_CACHE_DIR:-/tmp/fa-cache}
