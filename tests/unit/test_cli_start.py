"""A command's ``--help`` pays only for building its parser: no torch, no Kafka client, no run config models
(what a user or a shell completion waits for), checked on what a real interpreter loads."""
from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "vllm", "confluent_kafka", "streamrft.config.run", "streamrft.engines.training")


@pytest.mark.parametrize("command", [["tasks", "produce", "--help"], ["tail", "--help"]])
def test_help_loads_nothing_heavy(command: list[str]):
    code = ("import sys\nfrom streamrft.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            f"heavy = {HEAVY!r}\n"
            "print(sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') for h in heavy)))")
    done = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True, check=True)
    assert "usage: streamrft" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_mistyped_command_lists_every_command(capsys):
    from streamrft.cli import main

    with pytest.raises(SystemExit):
        main(["taks", "produce"])
    err = capsys.readouterr().err
    assert "invalid choice: 'taks'" in err and all(name in err for name in ("tasks", "tail", "run", "serve"))
