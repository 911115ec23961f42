#!/usr/bin/env bash
# End-to-end load run on a throwaway local stack with a release relay.
#   scripts/bench.sh [--events N] [--rate EV_PER_S|0] [--txn-size N] [--payload BYTES] [--producers N]
# Against your own deployment, run `cargo bench --bench relay_e2e -- …` with
# DATABASE_URL, NATS_URL, RELAY_PID and RELAY_METRICS set instead.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

cargo build --release --quiet --bin outbox-relay
cargo bench --no-run --quiet --bench relay_e2e 2>/dev/null
STACK_DIR="$(mktemp -d -t outbox-relay-bench.XXXXXX)"
cleanup() { scripts/stack.sh down "$STACK_DIR" || true; rm -rf "$STACK_DIR"; }
trap cleanup EXIT INT TERM

scripts/stack.sh up "$STACK_DIR" >/dev/null
# shellcheck disable=SC1091
. "$STACK_DIR/env"
target/release/outbox-relay migrate 2>/dev/null
METRICS_PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
RELAY_PID="$(scripts/stack.sh relay "$STACK_DIR" target/release/outbox-relay --context bench --metrics-addr "127.0.0.1:$METRICS_PORT")"
export RELAY_PID RELAY_METRICS="127.0.0.1:$METRICS_PORT"
timeout 600 cargo bench --quiet --bench relay_e2e -- "$@"
