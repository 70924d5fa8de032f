"""The generated reference pages (streamrft/reference/): every config key described and on the page with the
environment variable that really sets it, every command on the CLI page, no secret default shown, and the pages in
docs/reference/ the same as what their modules render now."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import get_args, get_origin

import pytest
from pydantic import BaseModel, Field, SecretStr

from streamrft.cli import build_parser
from streamrft.config.environment import read_environment
from streamrft.config.run import RunConfig
from streamrft.reference import COMMAND, PAGES, cli_page, config_page
from streamrft.reference.__main__ import main, page_modules
from streamrft.reference.config_keys import keys

ROOT = Path(__file__).resolve().parents[2]
OUR_PAGES = (config_page, cli_page)


def _model_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of ``model``, walked here on its own (not with the walk the page is built from): a list's
    items under ``[]``, a mapping's entries under ``<name>``."""
    out = []
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        out.append(key)
        for nested, container in _models_in(info.annotation):
            part = {"list": "[]", "mapping": ".<name>"}.get(container, "")
            out += _model_keys(nested, key + part + ".")
    return out


def _models_in(annotation, container: str = "single"):
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, container
        return
    origin = get_origin(annotation)
    inner = "list" if origin in (tuple, list) else "mapping" if origin is dict else container
    for arg in get_args(annotation):
        yield from _models_in(arg, inner)


def _field(model: type[BaseModel], dotted: str):
    """The FieldInfo at a dotted key of ``_model_keys``."""
    info = None
    for part in dotted.replace("[]", "").replace(".<name>", "").split("."):
        info = next(f for n, f in model.model_fields.items() if part in (n, f.alias))
        model = next((m for m, _ in _models_in(info.annotation)), model)
    return info


def test_every_config_key_has_a_description():
    every = _model_keys(RunConfig)
    assert len(every) > 350  # the walk reached the nested sections (engines' settings included)
    missing = [key for key in every if not (_field(RunConfig, key).description or "").strip()]
    assert not missing, f"{len(missing)} config key(s) without a description (add description=... to the field): " \
                        + ", ".join(missing)


def test_the_configuration_page_holds_every_key():
    page = config_page.render()
    absent = [key for key in _model_keys(RunConfig) if f"`{key}`" not in page]
    assert not absent, f"keys missing from {config_page.PATH}: {', '.join(absent)}"


@pytest.mark.parametrize("module", OUR_PAGES, ids=lambda m: m.PATH)
def test_the_page_in_docs_is_up_to_date(module):
    on_disk = (ROOT / module.PATH).read_text(encoding="utf-8") if (ROOT / module.PATH).is_file() else ""
    if on_disk != module.render():
        pytest.fail(f"{module.PATH} is out of date: run `{COMMAND}`", pytrace=False)


@pytest.mark.parametrize("module", OUR_PAGES, ids=lambda m: m.PATH)
def test_each_page_says_it_is_generated_and_how(module):
    first = module.render().splitlines()[0]
    assert "Generated" in first and COMMAND in first


def test_the_environment_variable_of_each_key_sets_that_key():
    """What the page names is what pydantic-settings reads (streamrft/config/environment.py), for every key that has
    a variable; a key inside a list names its list's variable instead."""
    wrong = []
    for key in keys():
        if key.env is None:
            assert key.list_env and "[]" in key.path, key.path
            continue
        got = read_environment({key.env.replace("<NAME>", "entry"): "1"}, RunConfig)
        for part in key.path.replace("<name>", "entry").split("."):
            got = got.get(part) if isinstance(got, dict) else None
        if got is None:
            wrong.append(f"{key.path} ({key.env})")
    assert not wrong, "variables the page names that do not set their key: " + ", ".join(wrong)


def test_the_cli_page_names_every_subcommand():
    parser = build_parser()
    progs = []

    def walk(p: argparse.ArgumentParser) -> None:
        progs.append(p.prog)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(parser)
    assert "streamrft run" in progs and "streamrft broker start" in progs
    headings = {re.sub(r"\s*\{.*\}$", "", line.lstrip("#").strip()) for line in cli_page.render().splitlines()
                if line.startswith("#")}
    missing = sorted(set(progs) - headings)
    assert not missing, f"commands without a heading on {cli_page.PATH}: {', '.join(missing)}"


def test_the_cli_page_lists_options_with_their_defaults():
    page = cli_page.render()
    run = page[page.index("## streamrft run {"):]
    run = run[:run.index("\n## ")]
    assert "`--workers WORKERS`" in run and "`--resume`" in run
    stop = page[page.index("### streamrft broker stop {"):]
    assert re.search(r"\| `--timeout TIMEOUT` \| [^|]+ \| `20\.0` \|", stop)


@pytest.mark.parametrize("module", OUR_PAGES, ids=lambda m: m.PATH)
def test_every_table_row_keeps_its_columns_and_links_land(module):
    """A ``|`` in a description or a default must not split its row; every in-page link has its heading."""
    page = module.render()
    broken, width, rows = [], 0, 0
    for line in page.splitlines():
        if not line.startswith("|"):
            width = 0
            continue
        bare = re.sub(r"`[^`]*`|<code>.*?</code>", "", line)
        cells = len(re.findall(r"(?<!\\)\|", bare)) - 1
        width = width or cells  # a table's first line is its header
        rows += 1
        if cells != width:
            broken.append(line[:100])
    assert rows > 50
    assert not broken, "rows with a stray column separator:\n" + "\n".join(broken)
    ids = re.findall(r"\{ #([\w-]+) \}", page)
    assert len(ids) == len(set(ids)), "two headings with one id"
    dangling = sorted(set(re.findall(r"\]\(#([\w-]+)\)", page)) - set(ids))
    assert not dangling, f"links to no heading: {dangling}"


def test_no_page_shows_a_secret_default():
    """The run config's secrets: none has a default whose text appears in a description or on the page."""
    secrets = [key for key in keys() if key.secret]
    assert {"kafka.sasl_password", "trainer.weights.group_secret", "serve.api_key"} <= {k.path for k in secrets}
    page = config_page.render()
    descriptions = " ".join(key.field.description or "" for key in keys())
    for key in secrets:
        default = key.default.get_secret_value() if isinstance(key.default, SecretStr) else key.default
        if isinstance(default, str) and default:
            assert default not in descriptions and default not in page, key.path


class _WithSecret(BaseModel):
    token_secret: SecretStr = Field(default=SecretStr("not-for-any-page-123"), description="a secret")
    password: str = Field(default="hunter2-plain", description="a password kept in a plain string")


class _Run(BaseModel):
    service: _WithSecret = Field(default=_WithSecret(), description="a section holding secrets")


def test_a_secret_default_is_hidden_on_the_page():
    page = config_page.render(_Run)
    assert "not-for-any-page-123" not in page and "hunter2-plain" not in page
    assert page.count(config_page.HIDDEN) == 2


def test_check_names_stale_pages_and_the_command(tmp_path, capsys):
    assert main(["--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert config_page.PATH in err and cli_page.PATH in err and COMMAND in err
    assert main(["--root", str(tmp_path)]) == 0
    assert (tmp_path / config_page.PATH).read_text() == config_page.render()
    assert main(["--check", "--root", str(tmp_path)]) == 0
    (tmp_path / cli_page.PATH).write_text("edited by hand\n")
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert cli_page.PATH in capsys.readouterr().err


def test_a_page_module_not_written_yet_is_skipped(caplog):
    assert {"config_page", "cli_page", "metrics_page"} <= set(PAGES)
    modules = page_modules(("config_page", "no_such_page"))
    assert [m.__name__ for m in modules] == ["streamrft.reference.config_page"]
    assert "no_such_page" in caplog.text


def test_making_the_pages_loads_no_torch_and_the_config_page_no_kafka_client():
    code = ("import sys\n"
            "from streamrft.reference import config_page, cli_page\n"
            "config_page.render()\n"
            "heavy = ('torch', 'transformers', 'vllm')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy + ('confluent_kafka',)))\n"
            "cli_page.render()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    after_config, after_cli = out.stdout.splitlines()
    assert after_config == "[]", f"the configuration page loaded {after_config}"
    assert after_cli == "[]", f"the CLI page loaded {after_cli}"
