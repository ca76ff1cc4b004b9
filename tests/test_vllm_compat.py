"""scripts/vllm-compat, the job that checks kvpeer against vLLM 0.33 and 0.34 (issue 38):
it is part of the test command, it unpacks no compiled part, and a wheel it cannot fetch
fails it by name instead of letting it pass untested."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "scripts" / "vllm_tree.py"


def test_the_test_command_runs_the_compat_job_for_every_pinned_release() -> None:
    assert "bash scripts/vllm-compat" in (ROOT / "scripts" / "test").read_text(encoding="utf-8")
    pins = [line for line in (ROOT / "requirements" / "vllm-compat.txt").read_text(
        encoding="utf-8").splitlines() if line.startswith("vllm==")]  # fmt: skip
    assert pins == ["vllm==0.33.0", "vllm==0.34.0"]


def _run(version: str, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TREE), version, str(cache)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env}, check=False)  # fmt: skip


def test_a_wheel_that_cannot_be_fetched_fails_the_job_by_name(tmp_path: Path) -> None:
    done = _run("0.34.0", tmp_path, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path))
    assert done.returncode == 2
    assert done.stdout == ""
    assert "cannot download the vllm==0.34.0 wheel" in done.stderr
    assert "kvpeer was NOT checked against vLLM 0.34.0" in done.stderr


def test_a_tree_is_unpacked_once_without_compiled_parts(tmp_path: Path) -> None:
    """A cached wheel (here a small stand-in with vLLM's kinds of members) becomes a tree
    of Python modules and data files; its .so files, binaries and CUDA sources stay out,
    and the dependency it adds is unpacked beside it."""
    wheels = tmp_path / "vllm-wheels"
    wheels.mkdir()
    members = {
        "vllm/__init__.py": "", "vllm/_version.py": "__version__ = '9.0.0'\n",
        "vllm/_C.abi3.so": "ELF", "vllm/vllm-rs": "ELF", "vllm/config.json": "{}",
        "vllm/third_party/kernels/a.py": "", "vllm/csrc/k.cu": "",
        "vllm/entrypoints/chat.jinja": "", "vllm-9.0.0.dist-info/METADATA": "Version: 9.0.0\n",
    }
    with zipfile.ZipFile(wheels / "vllm-9.0.0-cp38-abi3-linux_x86_64.whl", "w") as wheel:
        for name, text in members.items():
            wheel.writestr(name, text)
    with zipfile.ZipFile(wheels / "orjson-3.13.0-cp311-cp311-linux_x86_64.whl", "w") as dep:
        dep.writestr("orjson/__init__.py", "")
    done = _run("9.0.0", tmp_path, PIP_NO_INDEX="1")
    assert done.returncode == 0, done.stderr
    tree = Path(done.stdout.strip())
    assert tree == tmp_path / "vllm-trees" / "9.0.0"
    files = {str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file()}
    assert files == {
        "vllm/__init__.py", "vllm/_version.py", "vllm/config.json",
        "vllm/entrypoints/chat.jinja", "vllm-9.0.0.dist-info/METADATA",
        "orjson/__init__.py", ".complete",
    }
    (tree / "vllm" / "config.json").unlink()
    again = _run("9.0.0", tmp_path, PIP_NO_INDEX="1")  # complete: not unpacked again
    assert again.returncode == 0
    assert not (tree / "vllm" / "config.json").exists()
