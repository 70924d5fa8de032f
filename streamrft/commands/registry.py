"""``streamrft registry``: the embedded schema registry (``schema_registry.url: embedded``). ``setup`` resolves
Apicurio Registry from Maven Central ahead of time and checks that it starts; ``streamrft run`` starts one
beside the run's broker."""
from __future__ import annotations

import argparse

from .common import console


def register(subparsers) -> None:
    parser = subparsers.add_parser("registry", help="the embedded schema registry (Apicurio, Confluent API)")
    actions = parser.add_subparsers(dest="registry_action", metavar="ACTION", required=True)
    setup = actions.add_parser("setup", help="download the registry now (Maven) and check that it starts")
    setup.add_argument("-c", "--config", default=None, metavar="CONFIG",
                       help="run configuration whose `schema_registry:` section (embedded_version, heap) to use")
    setup.add_argument("--no-check", action="store_true", help="only resolve it; do not start a registry")
    setup.set_defaults(func=setup_registry)


def setup_registry(args: argparse.Namespace) -> int:
    """Resolve the distribution and, unless --no-check, start and stop a registry once (Java and the app work)."""
    from ..config import load_config
    from ..registry import EmbeddedRegistry, ensure_registry

    config = load_config(args.config).schema_registry
    jar = ensure_registry(config.embedded_version)
    console.print(f"Apicurio Registry {config.embedded_version} in {jar.parent.parent}")
    if not args.no_check:
        with console.status("checking that the registry starts…"), EmbeddedRegistry(config) as registry:
            seconds, rss = registry.startup_s, registry.rss_bytes()
        console.print(f"registry check passed: answered the Confluent API in {seconds:.1f} s, "
                      f"RSS {rss / 2**20:.0f} MiB")
    return 0
