#!/bin/sh
# kvpeer's install steps for its image (deploy/Dockerfile runs them; CI runs them too, into a
# temporary environment: tests/test_deploy_install.py). Two steps, one per build stage:
#
#   deploy/install.sh wheel SOURCE_DIR WHEEL_DIR
#       Builder stage (it has a C compiler): build kvpeer's wheel from SOURCE_DIR (the
#       repository root) into WHEEL_DIR. Fails unless the wheel holds the router's C
#       extension (kvpeer.router._intake): setup.py marks it optional, so without this
#       check a missing compiler or header would quietly ship the Python loops.
#
#   deploy/install.sh install WHEEL_DIR [NODEPS_FILE]
#       Runtime stage (no compiler): install the wheel into the environment of $PYTHON,
#       with every package that environment already has as a constraint: vLLM's own pins
#       (msgspec, pyzmq, aiohttp, ...) are kept, never re-pinned; pip adds only what is
#       missing. NIXL (pins from NODEPS_FILE, requirements/nodeps.txt) is installed with
#       --no-deps unless the environment already has it. Then checks that kvpeer is
#       importable from that environment, its extension loads and the CLI runs.
#
# PYTHON: the interpreter whose environment is built (default python3).
# KVPEER_OFFLINE=1: pip may not use an index (CI: everything else is already installed).
set -eu

PYTHON=${PYTHON:-python3}
PIP_FLAGS="--no-cache-dir --disable-pip-version-check"
BUILD_FLAGS=""  # the builder stage fetches setuptools for the build (pyproject.toml's)
if [ "${KVPEER_OFFLINE:-0}" = 1 ]; then
    PIP_FLAGS="$PIP_FLAGS --no-index"
    BUILD_FLAGS="--no-build-isolation"  # offline: the environment's setuptools builds it
fi

die() {
    echo "deploy/install.sh: $*" >&2
    exit 1
}

build_wheel() {
    source_dir=$1
    wheel_dir=$2
    [ -f "$source_dir/setup.py" ] || die "$source_dir: no setup.py (give the repository root)"
    "$PYTHON" -c 'import sysconfig, os, sys; h = sysconfig.get_paths()["include"]; sys.exit(0 if os.path.exists(os.path.join(h, "Python.h")) else 1)' \
        || die "no Python.h for $PYTHON: install the Python development headers"
    # Build from a copy: the build writes build/ and *.egg-info next to the sources.
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    cp -R "$source_dir/pyproject.toml" "$source_dir/setup.py" "$source_dir/README.md" \
        "$source_dir/src" "$work/"
    mkdir -p "$wheel_dir"
    # shellcheck disable=SC2086
    "$PYTHON" -m pip wheel $PIP_FLAGS $BUILD_FLAGS --no-deps -w "$wheel_dir" "$work"
    wheel=$(ls "$wheel_dir"/kvpeer-*.whl 2>/dev/null | head -n 1)
    [ -n "$wheel" ] || die "no kvpeer wheel in $wheel_dir"
    "$PYTHON" - "$wheel" <<'EOF' || die "$wheel has no kvpeer.router._intake: the C extension did not build (see the compiler's output above)"
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
built = [n for n in names
         if n.startswith("kvpeer/router/_intake") and n.endswith((".so", ".pyd"))]
print("C extension:", ", ".join(built) or "missing")
sys.exit(0 if built else 1)
EOF
}

install_wheel() {
    wheel_dir=$1
    nodeps=${2:-}
    constraints=$(mktemp)
    trap 'rm -f "$constraints"' EXIT
    # What the environment already has, as exact constraints (kvpeer itself left out).
    "$PYTHON" -m pip list --format=freeze --exclude-editable --disable-pip-version-check \
        | grep -v -i '^kvpeer==' > "$constraints" || true
    # shellcheck disable=SC2086
    "$PYTHON" -m pip install $PIP_FLAGS --find-links "$wheel_dir" --constraint "$constraints" \
        --only-binary kvpeer kvpeer
    if [ -n "$nodeps" ]; then
        if "$PYTHON" -c 'import nixl' 2>/dev/null; then
            echo "NIXL: the environment's own"
        else
            # shellcheck disable=SC2086
            "$PYTHON" -m pip install $PIP_FLAGS --no-deps -r "$nodeps"
        fi
    fi
    "$PYTHON" - <<'EOF' || die "kvpeer does not import with its C extension from this environment"
import sys
import kvpeer
from kvpeer.router.index import PrefixIndex
print("kvpeer", kvpeer.__version__, "from", kvpeer.__file__)
if not PrefixIndex().native:
    sys.exit("kvpeer.router._intake did not load")
print("router KV event intake: C loops")
EOF
    "$PYTHON" -m kvpeer check-config --help > /dev/null
}

case "${1:-}" in
    wheel)
        [ $# -eq 3 ] || die "usage: install.sh wheel SOURCE_DIR WHEEL_DIR"
        build_wheel "$2" "$3"
        ;;
    install)
        [ $# -ge 2 ] && [ $# -le 3 ] || die "usage: install.sh install WHEEL_DIR [NODEPS_FILE]"
        install_wheel "$2" "${3:-}"
        ;;
    *)
        die "usage: install.sh wheel SOURCE_DIR WHEEL_DIR | install WHEEL_DIR [NODEPS_FILE]"
        ;;
esac
