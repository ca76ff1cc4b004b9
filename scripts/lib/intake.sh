# Shared by scripts/sanitize and scripts/fuzz-intake: the router's C extension
# (src/kvpeer/router/_intake.c) built with extra flags into a directory of its own, beside
# a copy of the Python package, so that PYTHONPATH=DIR imports that build; and the
# toolchain they need, installed when missing. The normal build (src/kvpeer/router/
# _intake*.so, made by the editable install) is left as it was.
#
# Nothing here skips: a toolchain that cannot be installed fails the script, loudly (CI
# runs both through scripts/test on a fresh machine; a silent skip would pass it).

# Debian 12's (bookworm's) packages, pinned by their major version, which their names
# carry (an exact revision would fail the day a point release or security update replaces
# it in the archive): gcc 12's AddressSanitizer runtime and the unversioned libasan.so the
# link needs (gcc 12 pulls both in; a bare system may not), and clang 14 with its sanitizer
# and libFuzzer runtimes for the fuzzer's build.
APT_LIBASAN=(libasan8 libgcc-12-dev)
APT_CLANG=(clang-14 libclang-rt-14-dev)
APT_OPENSSL=(libssl-dev) # the extension's SHA-256 (libcrypto; its headers to build)

intake_die() {
    echo "$(basename "$0"): FAILED: $*" >&2
    exit 1
}

# apt_install PKG...: install Debian packages (root, or sudo), or fail.
apt_install() {
    local sudo=""
    if [ "$(id -u)" != 0 ]; then
        command -v sudo >/dev/null || intake_die "need root or sudo to apt-get install $*"
        sudo="sudo -n"
    fi
    command -v apt-get >/dev/null || intake_die "no apt-get to install $* (not Debian?)"
    step "installing $* (apt-get)"
    $sudo apt-get update -qq >&2 || intake_die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" \
        >&2 || intake_die "apt-get install $* failed (see above)"
}

# libasan_of CC: the ASan runtime CC links against, installed if missing (gcc only; clang's
# comes with APT_CLANG).
libasan_of() {
    local cc=$1 lib
    lib=$("$cc" -print-file-name=libasan.so)
    if [ ! -f "$lib" ]; then
        apt_install "${APT_LIBASAN[@]}"
        lib=$("$cc" -print-file-name=libasan.so)
        [ -f "$lib" ] || intake_die "$cc has no libasan.so after installing ${APT_LIBASAN[*]}"
    fi
    echo "$lib"
}

# ensure_clang: clang-14 with its sanitizer runtimes, installed if missing.
ensure_clang() {
    if ! command -v clang-14 >/dev/null \
        || [ ! -d "$(clang-14 -print-resource-dir)/lib/linux" ]; then
        apt_install "${APT_CLANG[@]}"
    fi
    command -v clang-14 >/dev/null || intake_die "no clang-14 after installing ${APT_CLANG[*]}"
}

# ensure_fuzz_requirements: requirements/fuzz.txt (atheris) in the venv, wheels only. Kept
# out of ensure_venv's list, whose stamp hashes the files it is given (every script gives
# it the same three); its own stamp beside it instead.
ensure_fuzz_requirements() {
    local stamp=.venv/.kvpeer-fuzz-installed want
    want=$(sha256sum requirements/fuzz.txt | cut -d' ' -f1)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        step "installing requirements/fuzz.txt"
        python -m pip install --quiet --only-binary :all: -r requirements/fuzz.txt >&2 \
            || intake_die "pip install -r requirements/fuzz.txt failed (see above)"
        echo "$want" > "$stamp"
    fi
}

# build_intake CC DIR FLAGS...: DIR/kvpeer with DIR/kvpeer/router/_intake built by CC.
build_intake() {
    local cc=$1 dir=$2 include suffix
    shift 2
    if ! echo '#include <openssl/evp.h>' | "$cc" -E -x c - >/dev/null 2>&1; then
        apt_install "${APT_OPENSSL[@]}"
    fi
    include=$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    suffix=$(python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    mkdir -p "$dir"
    (cd src && tar --exclude='*.so' --exclude=__pycache__ -cf - kvpeer) | tar -xf - -C "$dir"
    # -O1 and frame pointers: the sanitizers' advice for reports with whole stacks.
    "$cc" -shared -fPIC -g -O1 -fno-omit-frame-pointer -Wall -Wextra \
        -Werror=implicit-function-declaration -I"$include" "$@" \
        src/kvpeer/router/_intake.c -lcrypto -o "$dir/kvpeer/router/_intake$suffix" \
        || intake_die "$cc could not build _intake.c with $*"
}

# imports_build DIR: fail unless Python (with the environment as exported) imports
# kvpeer.router._intake from DIR, not the normal build.
imports_build() {
    local found
    found=$(python -c 'import kvpeer.router._intake as m; print(m.__file__)') \
        || intake_die "the sanitized build of kvpeer.router._intake does not import"
    case "$found" in
        "$1"/*) ;;
        *) intake_die "expected kvpeer.router._intake from $1, Python imported $found" ;;
    esac
}

# The sanitizers' settings for both scripts. Python is not built with ASan: the runtime
# goes first into the process (LD_PRELOAD, set by each script). PYTHONMALLOC=malloc: every
# Python object its own malloc, so ASan's red zones surround each buffer the C reads
# (pymalloc would hand out neighbours in one arena: a one-byte over-read of a small bytes
# object would read its neighbour unseen). No leak check: the interpreter keeps memory to
# its exit by design, and the extension's own references and memory are pinned by its
# tests (test_no_reference_is_leaked, test_decoding_in_c_leaks_nothing_on_any_path).
sanitizer_environment() {
    export PYTHONMALLOC=malloc
    export ASAN_OPTIONS=halt_on_error=1:abort_on_error=0:detect_leaks=0:strict_string_checks=1
    export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
}
