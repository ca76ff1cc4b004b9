# Shared helpers for scripts/*: create .venv once and keep it in sync with
# the pinned requirement files (re-installs only when a file changed).
step() { printf '\n==> %s\n' "$*"; }

ensure_venv() {
    local py="${KVPEER_PYTHON:-python3}"
    if [ ! -x .venv/bin/python ]; then
        step "creating .venv with $($py --version)"
        "$py" -m venv .venv
        .venv/bin/python -m pip install --quiet --upgrade pip
    fi
    # shellcheck disable=SC1091
    . .venv/bin/activate
    local stamp=.venv/.kvpeer-installed want
    want=$(cat "$@" pyproject.toml | sha256sum | cut -d' ' -f1)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        local f
        for f in "$@"; do
            step "installing $f"
            python -m pip install --quiet -r "$f"
        done
        step "installing kvpeer (editable)"
        python -m pip install --quiet --no-deps -e .
        echo "$want" > "$stamp"
    fi
}
