"""``streamrft k8s CONFIG``: the run's Kubernetes manifests (Strimzi topics, the roles, KEDA, ServiceMonitors)."""
from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from ..config import load_config
from ..deploy.kubernetes import render
from .common import add_config_argument


def register(subparsers) -> None:
    parser = subparsers.add_parser("k8s", help="print the run's Kubernetes manifests (kubectl apply -f -)")
    add_config_argument(parser, positional=True)
    parser.add_argument("-o", "--output", metavar="FILE", default=None, help="write them here instead")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    text = Path(args.config).read_text()
    # the file alone, not this shell's STREAMRFT_* variables: the cluster's environment is in the manifests
    config = load_config(args.config, env={})
    manifests = yaml.safe_dump_all(render(config, text), sort_keys=False)
    if args.output:
        Path(args.output).write_text(manifests)
    else:
        print(manifests, end="")
    return 0
