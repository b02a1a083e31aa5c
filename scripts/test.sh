#!/usr/bin/env bash
# Runs the whole ibid test suite: formatting, lints, and every test (engine model and crash
# tests, protocol tests with real clients over loopback). Installs the clients first if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-test-tools.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --profile ci -- -D warnings
cargo test --workspace --profile ci
