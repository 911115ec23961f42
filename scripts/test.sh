#!/usr/bin/env bash
# The whole test suite: unit and property tests, then the integration tests
# against a throwaway Postgres + NATS stack (scripts/stack.sh) that this
# script starts and always stops.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

STACK_DIR="$(mktemp -d -t outbox-relay-test.XXXXXX)"
cleanup() { scripts/stack.sh down "$STACK_DIR" || true; rm -rf "$STACK_DIR"; }
trap cleanup EXIT INT TERM

scripts/stack.sh up "$STACK_DIR" >/dev/null
# shellcheck disable=SC1091
. "$STACK_DIR/env"
echo "stack: $DATABASE_URL $NATS_URL"

# Integration tests are few and heavy; two at a time suit a 2-core machine.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-2}"
timeout --signal=TERM 1500 cargo test --locked "$@"
