#!/usr/bin/env bash
# Set up (with test dependencies) and run the whole test suite: unit, integration (real embedded Kafka broker)
# and end-to-end (tiny model). Extra arguments go to pytest.
#
# The suite runs on STREAMRFT_TEST_WORKERS pytest-xdist workers (default 2; 0 runs it in one process). Much of
# it waits on brokers, sessions and subprocesses, so two workers keep two cores busier than one. Each worker has
# its own session broker and takes whole files (--dist loadfile), so a module's cluster or chaos run starts once.
# OpenMP threads sleep when idle, as `streamrft run` sets for its roles: spinning ones would starve the other
# worker's processes on shared cores.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev --demo  # the demo model too: the vLLM tests run on it
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec .venv/bin/python -m pytest -n "${STREAMRFT_TEST_WORKERS:-2}" --dist loadfile --durations=40 "$@"
