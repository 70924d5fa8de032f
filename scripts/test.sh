#!/usr/bin/env bash
# Set up (with test dependencies) and run the whole test suite: unit, integration (real embedded Kafka broker)
# and end-to-end (tiny model). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev --demo  # the demo model too: the vLLM tests run on it
exec .venv/bin/python -m pytest "$@"
