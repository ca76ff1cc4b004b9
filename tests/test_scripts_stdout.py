"""``scripts/demo --json`` prints only JSON on stdout, on the first run too.

The first run creates ``.venv`` and installs the pinned requirements; all of that output
(our progress lines and whatever pip prints) must go to stderr. The test runs the real
script in a copy of the project whose Python is a stub: it makes a ``.venv`` whose
``python`` prints like pip does (on stdout) and whose ``kvpeer`` prints one JSON object.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VENV_PYTHON = """#!/usr/bin/env bash
# stands in for .venv/bin/python: "pip install" chatter on stdout, like a first install
echo "Collecting msgspec (pip noise on stdout)"
"""
KVPEER = """#!/usr/bin/env bash
echo '{"ok": true, "args": "'"$*"'"}'
"""
BASE_PYTHON = """#!/usr/bin/env bash
# stands in for python3: "-m venv DIR" makes DIR/bin/{python,kvpeer,activate}
if [ "$1" = "--version" ]; then echo "Python 3.11.0"; exit 0; fi
[ "$1" = "-m" ] && [ "$2" = "venv" ] || exit 3
mkdir -p "$3/bin"
cp "{stubs}/python" "$3/bin/python"
cp "{stubs}/kvpeer" "$3/bin/kvpeer"
echo 'export PATH="'"$PWD/$3"'/bin:$PATH"' > "$3/bin/activate"
echo "created virtual environment (venv noise on stdout)"
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_demo_json_on_a_fresh_checkout_prints_only_json(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "scripts" / "lib").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "demo", project / "scripts" / "demo")
    shutil.copy(ROOT / "scripts" / "lib" / "venv.sh", project / "scripts" / "lib" / "venv.sh")
    shutil.copytree(ROOT / "requirements", project / "requirements")
    shutil.copy(ROOT / "pyproject.toml", project / "pyproject.toml")
    shutil.copy(ROOT / "setup.py", project / "setup.py")  # the install's stamp hashes
    (project / "src" / "kvpeer" / "router").mkdir(parents=True)  # these two with the C
    shutil.copy(ROOT / "src/kvpeer/router/_intake.c", project / "src/kvpeer/router/_intake.c")
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    _executable(stubs / "python", VENV_PYTHON)
    _executable(stubs / "kvpeer", KVPEER)
    _executable(stubs / "python3", BASE_PYTHON.replace("{stubs}", str(stubs)))
    env = {**os.environ, "KVPEER_PYTHON": str(stubs / "python3")}
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(["bash", str(project / "scripts" / "demo"), "--json"], cwd=project,
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"ok": True, "args": "demo --json"}
    assert "creating .venv" in done.stderr  # the setup ran, and said so on stderr
    assert "pip noise" in done.stderr
    assert (project / ".venv" / ".kvpeer-installed").exists()
