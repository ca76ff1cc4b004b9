"""deploy/install.sh, the image's install steps, run as the Dockerfile runs them but into a
temporary environment, offline (no base image can be pulled here).

The stand-in for vLLM's image is a fresh venv that sees this environment's packages
(vLLM, its pins, kvpeer's dependencies) except kvpeer itself, through a ``.pth`` file
naming a folder of links: what the script finds installed is what a base image has.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "install.sh"

pytestmark = pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX shell")


def base_environment(tmp_path: Path) -> Path:
    """A venv whose site-packages see this one's packages but not kvpeer; its python."""
    view = tmp_path / "base-site-packages"
    view.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if "kvpeer" not in entry.name.lower():
            (view / entry.name).symlink_to(entry)
    env_dir = tmp_path / "env"
    # No pip of its own: the "image's" pip and setuptools (this one's) do the work.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)],
                   check=True, timeout=600)  # fmt: skip
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=600, env=isolated_env(),
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "zz_base_image.pth").write_text(f"{view}\n", encoding="utf-8")
    return python


def isolated_env() -> dict[str, str]:
    """This environment without PYTHONPATH: the script must see only the target's
    packages (a PYTHONPATH naming a checkout would shadow the installed kvpeer)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def install_sh(python: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(SCRIPT), *args],
        env={**isolated_env(), "PYTHON": str(python), "KVPEER_OFFLINE": "1", **env},
        capture_output=True, text=True, timeout=600, check=False, cwd=ROOT,
    )  # fmt: skip


def pip_list(python: Path) -> dict[str, str]:
    out = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
        check=True, capture_output=True, text=True, timeout=600, env=isolated_env(),
    ).stdout  # fmt: skip
    return dict(line.lower().split("==", 1) for line in out.splitlines() if "==" in line)


def test_the_image_steps_build_the_extension_and_install_without_re_pinning(
    tmp_path: Path,
) -> None:
    python = base_environment(tmp_path)
    before = pip_list(python)
    assert "kvpeer" not in before
    assert "msgspec" in before

    wheels = tmp_path / "wheels"
    had_build_dir = (ROOT / "build").exists()
    built = install_sh(python, "wheel", str(ROOT), str(wheels))
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("kvpeer-*.whl")
    assert any(n.startswith("kvpeer/router/_intake") and n.endswith(".so")
               for n in zipfile.ZipFile(wheel).namelist())  # fmt: skip
    assert (ROOT / "build").exists() == had_build_dir  # built from a copy, not in the checkout

    installed = install_sh(python, "install", str(wheels), str(ROOT / "requirements/nodeps.txt"))
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "router KV event intake: C loops" in installed.stdout
    assert f"from {tmp_path}" in installed.stdout  # the wheel's kvpeer, not this checkout's
    after = pip_list(python)
    # Only kvpeer was added; every package the "image" had keeps its version.
    assert {k: v for k, v in after.items() if before.get(k) != v} == {"kvpeer": "0.1.0"}
    product_only(python, wheel)


def product_only(python: Path, wheel: Path) -> None:
    """The wheel is the product: no lab, no simulation; ``kvpeer serve`` imports no lab,
    bench or router module; a lab command says it is not installed, in one line."""
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith(("kvpeer/lab/", "kvpeer/sim/"))]
    assert "kvpeer/testing/__init__.py" in names  # the test kit ships (trio.testing-like)
    probe = ("import sys\nfrom kvpeer.cli import main\n"
             "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in sys.modules if m.startswith(('kvpeer.lab', "
             "'kvpeer.router', 'kvpeer.commands.bench'))), file=sys.stderr)")
    served = subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                            timeout=600, env=isolated_env(), check=False)  # fmt: skip
    assert served.returncode == 0, served.stderr
    assert served.stderr.strip().splitlines()[-1] == "[]"
    lab = subprocess.run([str(python), "-m", "kvpeer", "bench", "serve", "--quick"],
                         capture_output=True, text=True, timeout=600, env=isolated_env(),
                         check=False)  # fmt: skip
    assert lab.returncode == 2
    assert lab.stderr.strip() == (
        "kvpeer: bench serve is a lab tool, and this installation has no lab (kvpeer's "
        "wheel carries the product only): run it from a checkout of kvpeer (pip install -e .)"
    )


def test_the_build_fails_when_the_c_extension_does_not_build(tmp_path: Path) -> None:
    python = base_environment(tmp_path)
    # A compiler that fails: setup.py's optional extension is skipped with a warning, and
    # the wheel step must refuse the wheel it got.
    failed = install_sh(python, "wheel", str(ROOT), str(tmp_path / "wheels"), CC="false")
    assert failed.returncode != 0
    assert "the C extension did not build" in failed.stderr


def test_usage_errors_name_the_usage() -> None:
    result = subprocess.run(["sh", str(SCRIPT), "bogus"], capture_output=True, text=True,
                            timeout=600, check=False)  # fmt: skip
    assert result.returncode == 1
    assert "usage: install.sh wheel" in result.stderr
