#!/usr/bin/env bash
# Build a CPU-only virtualenv in which one vLLM release's KV-cache coordinators
# (vllm.v1.core.*, and the Mooncake store mirror from 0.22.0 on) import, as
# the oracle of the differential tests:
#
#   tools/vllm-env.sh VENV VERSION        (e.g. .venv-vllm-0.26.0 0.26.0)
#
# vLLM goes in without its dependencies (its wheel pins a CUDA torch and a
# serving stack the coordinator never touches); torch is the CPU 2.13.0 build
# for every release (0.16-0.26 pin 2.9.1-2.11.0 and 0.33 pins 2.14.0 for CUDA,
# but their coordinators, block pool and scheduler import with 2.13.0), and
# only the modules each release's import chain reaches are added:
# transformers 4.x before 0.25 (they import transformers' v4 layout),
# gguf and diskcache for the older releases, uvicorn for 0.27-0.28's Mooncake
# store worker (its module imports the serving stack). The newest range, <5.21, is
# inside both 0.33.0's pin (>=5.16.1,<5.21) and 0.34.0's (>=5.16.1,<5.23).
# WHEELS (default /work/wheels, else pip's cache) holds the vLLM wheels.
#
# One line per step on the terminal; pip's output (its resolver's complaints
# about the dependencies vLLM declares and this environment leaves out are
# expected) goes to LOG (default VENV.log), which a failed step names.
set -euo pipefail
VENV=${1:?usage: tools/vllm-env.sh VENV VERSION}
VERSION=${2:?usage: tools/vllm-env.sh VENV VERSION}
WHEELS=${WHEELS:-/work/wheels}
minor=$(echo "$VERSION" | cut -d. -f2)
case 1 in
  $((minor < 25))) transformers='transformers>=4.56.0,<5' ;;
  $((minor < 29))) transformers='transformers>=5.5.3,<5.21' ;;
  $((minor < 32))) transformers='transformers>=5.10.4,<5.18' ;;
  *) transformers='transformers>=5.16.1,<5.21' ;;
esac
LOG=${LOG:-$VENV.log}
: > "$LOG"
start=$(date +%s)
n=0
# step WHAT COMMAND...: one line, the command's output in $LOG.
step() {
  local what=$1 t0
  shift
  n=$((n + 1))
  t0=$(date +%s)
  printf 'vllm-env [%d/5] %s ... ' "$n" "$what"
  echo "== $what: $*" >> "$LOG"
  if "$@" >> "$LOG" 2>&1; then
    echo "ok ($(( $(date +%s) - t0 )) s)"
  else
    echo "FAILED; the last lines of $LOG:"
    tail -n 20 "$LOG" | sed 's/^/  /'
    exit 1
  fi
}
PIP="$VENV/bin/pip"
step "virtualenv $VENV" bash -c "python3 -m venv '$VENV' && '$PIP' install -q --upgrade pip"
step "torch 2.13.0 (CPU)" "$PIP" install -q torch==2.13.0
if [ -d "$WHEELS" ]; then
  step "vllm $VERSION (no dependencies)" "$PIP" install -q --no-deps --find-links "$WHEELS" "vllm==$VERSION"
else
  step "vllm $VERSION (no dependencies)" "$PIP" install -q --no-deps "vllm==$VERSION"
fi
step "the modules vLLM's import chain reaches" "$PIP" install -q packaging urllib3 "$transformers" aiohttp requests \
  uvicorn openai-harmony openai pillow pybase64 cloudpickle uvloop py-cpuinfo \
  prometheus_client xgrammar fastapi partial-json-parser llguidance msgspec \
  pyzmq numpy regex cachetools psutil pydantic typing_extensions cbor2 xxhash blake3 einops \
  gguf diskcache sentencepiece tokenizers protobuf
printf 'vllm-env [5/5] importing vLLM ... '
"$VENV/bin/python" - "$VERSION" 2>>"$LOG" <<'PY' || { echo "FAILED; the error is at the end of $LOG"; exit 1; }
import importlib, sys
import vllm
assert vllm.__version__ == sys.argv[1], (vllm.__version__, sys.argv[1])
importlib.import_module("vllm.v1.core.kv_cache_coordinator")
importlib.import_module("vllm.v1.core.sched.scheduler")
try:
    importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator")
    mirror = "and the Mooncake store mirror"
except ImportError:
    mirror = "(no Mooncake store mirror in this release)"
print(f"vllm {vllm.__version__}: engine coordinator importable {mirror}")
PY
echo "built $VENV (vllm $VERSION) in $(( $(date +%s) - start ))s; pip's output: $LOG"
