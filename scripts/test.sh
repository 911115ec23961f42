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

# promtool checks the alert rules; without it (no apt) the rules test still
# parses them and checks every metric they name.
if PROMTOOL_BIN="$(scripts/stack.sh promtool)"; then
  export PROMTOOL_BIN
else
  echo "test.sh: promtool unavailable; alert rules get the parse-only check" >&2
fi

# Integration tests are few and heavy; two at a time suit a 2-core machine.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-2}"
if [ $# -gt 0 ]; then
  timeout --signal=TERM 1500 cargo test --locked "$@"
  exit $?
fi
# Tests that run a 3-node NATS cluster or move hundreds of MB go last, one at
# a time: next to another heavy test on 2 cores, a starved cluster can fail
# its own elections, which tests nothing of ours.
SERIAL=(3_node_cluster five_megabyte)
skips=()
for t in "${SERIAL[@]}"; do skips+=(--skip "$t"); done
timeout --signal=TERM 1500 cargo test --locked -- "${skips[@]}"
timeout --signal=TERM 900 cargo test --locked --test integration -- --test-threads=1 "${SERIAL[@]}"
