"""Maps the top-level folders into the single import namespace ``streamrft.*``.

Everything else about the distribution is in pyproject.toml, the folder -> package map included
(``[tool.streamrft.package-folders]``); only the package list is computed here, so a new sub-package under any
folder is picked up without editing a list.
"""
import tomllib
from pathlib import Path

from setuptools import find_packages, setup

FOLDERS = tomllib.loads((Path(__file__).parent / "pyproject.toml").read_text())["tool"]["streamrft"]["package-folders"]


def _packages() -> list[str]:
    names = []
    for package, folder in FOLDERS.items():
        names.append(package)
        names += [f"{package}.{sub}" for sub in find_packages(folder)]
    return names


setup(package_dir=FOLDERS, packages=_packages())
