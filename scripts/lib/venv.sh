# Shared helpers for scripts/*: create .venv once and keep it in sync with
# the pinned requirement files (re-installs only when a file changed).
# Files named *nodeps*.txt are installed with --no-deps (pip cannot say that
# per package inside a requirements file; nixl needs it).
# Progress goes to stderr: a command's stdout stays its own (`scripts/demo --json`).
step() { printf '\n==> %s\n' "$*" >&2; }

ensure_venv() {
    local py="${KVPEER_PYTHON:-python3}"
    if [ ! -x .venv/bin/python ]; then
        step "creating .venv with $($py --version)"
        "$py" -m venv .venv
        .venv/bin/python -m pip install --quiet --upgrade pip
    fi
    # shellcheck disable=SC1091
    . .venv/bin/activate
    local stamp=.venv/.kvpeer-installed want f
    # The C extension's source too: pip builds it into src/ at the editable install.
    want=$(cat "$@" pyproject.toml setup.py src/kvpeer/router/_intake.c | sha256sum | cut -d' ' -f1)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        # One resolver run for every normal file, so their pins hold together.
        local normal=() nodeps=()
        for f in "$@"; do
            case "$f" in
                *nodeps*) nodeps+=(-r "$f") ;;
                *) normal+=(-r "$f") ;;
            esac
        done
        step "installing $* (the first time takes a few minutes)"
        python -m pip install --quiet "${normal[@]}"
        if python -m pip show --quiet torchvision >/dev/null 2>&1; then
            python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
        fi
        if [ ${#nodeps[@]} -gt 0 ]; then
            python -m pip install --quiet --no-deps "${nodeps[@]}"
        fi
        step "installing kvpeer (editable)"
        python -m pip install --quiet --no-deps -e .
        # setup.py marks the router's C extension optional: say so when it was not built.
        if ! python -c 'import kvpeer.router._intake' 2>/dev/null; then
            echo "warning: kvpeer's C extension was not built (needs a C compiler and" \
                "OpenSSL's headers: Debian's gcc and libssl-dev); the router runs its" \
                "Python loops (docs/scale.md)" >&2
        fi
        echo "$want" > "$stamp"
    fi
}
