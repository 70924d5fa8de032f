"""bench/chaos.py as a module for the tests that use its harness and its exact-set checks (bench/ is not a
package: loaded by path, and registered so that its dataclasses resolve)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"


def chaos_module():
    name = "streamrft_bench_chaos"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
