"""docs/reference/cli.md: every command of ``streamrft`` (usage, each option with its help and default), walked
from the argparse parser the CLI runs, :func:`streamrft.cli.build_parser`."""
from __future__ import annotations

import argparse
from collections.abc import Iterator

from streamrft.errors import OPERATOR_EXIT

from .markdown_cells import code, generated_notice, table, text, value

PATH = "docs/reference/cli.md"
WIDTH = 100  # the usage lines' width, fixed so the page does not depend on the terminal that generates it
HEADER = ("option", "description", "default")
# actions whose default says nothing a reader needs (a flag is off, help is help)
_NO_DEFAULT = (argparse._HelpAction, argparse._VersionAction, argparse._StoreTrueAction, argparse._StoreFalseAction,
               argparse._CountAction, argparse._StoreConstAction, argparse._AppendConstAction)

_INTRO = f"""\
# Command line reference

`streamrft COMMAND ...`; `streamrft COMMAND --help` prints the same as each section below. A command that takes a
run configuration (`CONFIG`, a YAML file) reads it as the [configuration reference](configuration.md) says, with the
environment's `STREAMRFT_<SECTION>__<KEY>` variables over it. Exit codes: 0 done; 2 an error the message explains
(a bad configuration, a missing tool); {OPERATOR_EXIT} a role stopped for a decision only a person can make (`streamrft
run` does not restart it); 130 interrupted; a command may name others of its own in its help.
"""


def render() -> str:
    """The page, the same for the same parser."""
    from streamrft.cli import build_parser  # the commands' modules, imported only when the page is made

    parser = build_parser()
    parts = [generated_notice("the parser of streamrft/cli.py and streamrft/commands/"), _INTRO]
    parts += [_command(parser, summary, depth) for parser, summary, depth in commands(parser)]
    return "\n".join(parts).rstrip("\n") + "\n"


def commands(parser: argparse.ArgumentParser, summary: str = "", depth: int = 0
             ) -> Iterator[tuple[argparse.ArgumentParser, str, int]]:
    """``parser`` and every subcommand under it, depth first in the order of ``--help``, each with its one-line
    help and its depth (0: ``streamrft`` itself)."""
    yield parser, summary, depth
    for action in _subcommand_actions(parser):
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        seen: set[int] = set()
        for name, sub in action.choices.items():
            if id(sub) not in seen:  # an alias names the same parser again
                seen.add(id(sub))
                yield from commands(sub, helps.get(name, ""), depth + 1)


def anchor(prog: str) -> str:
    """``streamrft broker start`` -> ``streamrft-broker-start`` (what MkDocs would make of the heading too)."""
    return "-".join(prog.split())


def _subcommand_actions(parser: argparse.ArgumentParser) -> list[argparse._SubParsersAction]:
    return [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]


def _command(parser: argparse.ArgumentParser, summary: str, depth: int) -> str:
    formatter = parser.formatter_class(prog=parser.prog, width=WIDTH)
    level = "#" * min(2 + max(depth - 1, 0), 6)  # streamrft and its commands at ##, their actions below
    lines = [f"{level} {parser.prog} {{ #{anchor(parser.prog)} }}", ""]
    about = [part for part in (summary, parser.description) if part]
    if len(about) == 2 and " ".join(about[1].split()).startswith(" ".join(about[0].split())):
        about = about[1:]  # the description already begins with the summary
    lines += [f"{text(part)}\n" for part in about]
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    lines += ["```text", formatter.format_help().strip("\n"), "```", ""]
    rows = [_option(action, formatter) for action in parser._actions
            if not isinstance(action, (argparse._SubParsersAction, argparse._HelpAction))
            and action.help != argparse.SUPPRESS]
    if rows:
        lines += [table(HEADER, rows), ""]
    for action in _subcommand_actions(parser):
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        lines += ["| command | what it does |", "|---|---|"]
        for name, sub in action.choices.items():
            if name in helps:
                lines.append(f"| [{code(sub.prog)}](#{anchor(sub.prog)}) | {text(helps[name])} |")
        lines.append("")
    if parser.epilog:
        lines += [text(parser.epilog), ""]
    return "\n".join(lines)


def _option(action: argparse.Action, formatter: argparse.HelpFormatter) -> tuple[str, str, str]:
    invocation = formatter._format_action_invocation(action)  # what --help prints: "-c, --config PATH"
    help_text = formatter._expand_help(action) if action.help else ""  # %(default)s and the like filled in
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        help_text += f" (one of {', '.join(str(choice) for choice in action.choices)})"
    if action.required and action.option_strings:
        default = "required"
    elif isinstance(action, _NO_DEFAULT) or action.default in (None, argparse.SUPPRESS):
        default = ""
    else:
        default = code(value(action.default))
    return code(invocation), text(help_text.strip()), default
