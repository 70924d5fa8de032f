"""Maps the top-level folders into the single import namespace ``streamrft.*``.

Everything else about the distribution is in pyproject.toml; only the package list is computed here, so a new
subpackage under any folder is picked up without editing a list.
"""
from setuptools import find_packages, setup

FOLDERS = {
    "streamrft": "streamrft",
    "streamrft.schemas": "schemas",
    "streamrft.producers": "producers",
    "streamrft.consumers": "consumers",
    "streamrft.engines": "engines",
}


def _packages() -> list[str]:
    names = []
    for package, folder in FOLDERS.items():
        names.append(package)
        names += [f"{package}.{sub}" for sub in find_packages(folder)]
    return names


setup(package_dir=FOLDERS, packages=_packages())
