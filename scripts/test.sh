#!/usr/bin/env bash
# The whole test suite: unit and property tests, then the integration tests
# against a throwaway Postgres + NATS stack (scripts/stack.sh) that this
# script starts and always stops, then the version matrix (SPEC §15).
#   scripts/test.sh                  everything
#   scripts/test.sh --matrix         the version matrix only
#   scripts/test.sh CARGO-TEST-ARGS  those tests, on the default stack
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

STACK_DIR="$(mktemp -d -t outbox-relay-test.XXXXXX)"
MATRIX_DIR=""
cleanup() {
  scripts/stack.sh down "$STACK_DIR" || true
  rm -rf "$STACK_DIR"
  if [ -n "$MATRIX_DIR" ]; then scripts/stack.sh down "$MATRIX_DIR" || true; rm -rf "$MATRIX_DIR"; fi
}
trap cleanup EXIT INT TERM

# "PostgreSQL 15.18 and nats-server 2.15.1", from the binaries an env names.
versions() {
  local pg nats
  pg="$("$PG_BINDIR/postgres" --version | awk '{print $3}')"
  nats="$("$NATS_SERVER_BIN" --version | awk '{print $NF}')"
  echo "PostgreSQL $pg and nats-server ${nats#v}"
}

scripts/stack.sh up "$STACK_DIR" >/dev/null
# shellcheck disable=SC1091
. "$STACK_DIR/env"
echo "stack: $DATABASE_URL $NATS_URL ($(versions))"

# promtool checks the alert rules; without it (no apt) the rules test still
# parses them and checks every metric they name.
if PROMTOOL_BIN="$(scripts/stack.sh promtool)"; then
  export PROMTOOL_BIN
else
  echo "test.sh: promtool unavailable; alert rules get the parse-only check" >&2
fi

# The console's browser test drives Debian's Chromium through chromedriver;
# without them it fails and says how to get them.
if CHROMEDRIVER_BIN="$(scripts/stack.sh chromium)"; then
  export CHROMEDRIVER_BIN
else
  echo "test.sh: chromium and chromium-driver unavailable; the browser test will fail" >&2
fi

# Integration tests are few and heavy; two at a time suit a 2-core machine.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-2}"
MATRIX_ONLY=0
if [ "${1:-}" = --matrix ]; then
  MATRIX_ONLY=1
elif [ $# -gt 0 ]; then
  timeout --signal=TERM 1500 cargo test --locked "$@"
  exit $?
fi
if [ "$MATRIX_ONLY" = 0 ]; then
# Tests that run a 3-node NATS cluster or move hundreds of MB go last, one at
# a time: next to another heavy test on 2 cores, a starved cluster can fail
# its own elections, which tests nothing of ours.
SERIAL=(3_node_cluster five_megabyte)
skips=()
for t in "${SERIAL[@]}"; do skips+=(--skip "$t"); done
# Built first, so the time limit below is the tests' own.
timeout --signal=TERM 1500 cargo test --locked --no-run
timeout --signal=TERM 1500 cargo test --locked -- "${skips[@]}"
timeout --signal=TERM 900 cargo test --locked --test integration -- --test-threads=1 "${SERIAL[@]}"
fi

# SPEC §15: every other supported release runs a subset of the suite on a
# stack of its own. Each pair is one PostgreSQL and one nats-server release
# the run above did not test (it ran 15 and 2.15).
MATRIX_PAIRS=("14 2.10.26" "16 2.11.11" "17 2.12.8" "18 2.14.6")
# The default stack's servers would only take CPU from the matrix's.
scripts/stack.sh down "$STACK_DIR" || true
MATRIX_TESTS=(
  relay::kill_9_under_load_loses_nothing_and_duplicates_nothing
  relay::nats_restart_under_load_loses_nothing_and_keeps_order
  lifecycle::first_start_backfills_unpublished_rows_then_streams_under_concurrent_inserts
  emitted::kill_9_under_an_emitting_load_loses_nothing_and_duplicates_nothing
  consumer::unreachable_handler_is_retried_then_dead_lettered
  consumer::consumer_reset_replays_from_a_sequence_and_only_then
  consumer::a_reset_reaches_an_aggregate_that_has_a_parked_message
  versions::the_publish_mode_follows_the_servers_release
  tables::a_table_dropped_from_the_publication_while_streaming_loses_no_row
  tables::a_slot_older_than_the_kept_publication_streams_through_it_once_past_its_making
  world::a_foreign_writer_in_a_routed_stream_costs_that_stream_alone_a_resend
)
for pair in "${MATRIX_PAIRS[@]}"; do
  read -r pg nats <<<"$pair"
  tests=("${MATRIX_TESTS[@]}")
  # Failover slots: 17 ran above (its pair is 17 whatever the stack's).
  if [ "$pg" -ge 18 ]; then
    tests+=(lifecycle::a_failover_slot_carries_the_relay_across_a_promotion)
  fi
  # Decoding on a standby: 16 ran above (its pair is 16 at the least).
  if [ "$pg" -ge 17 ]; then
    tests+=(versions::a_relay_on_a_standby_streams_as_on_the_primary_across_kill_9_idleness_and_promotion)
  fi
  MATRIX_DIR="$(mktemp -d -t outbox-relay-matrix.XXXXXX)"
  env -u NATS_SERVER_BIN -u PG_BINDIR STACK_PG_MAJOR="$pg" NATS_SERVER_VERSION="$nats" \
    scripts/stack.sh up "$MATRIX_DIR" >/dev/null
  (
    unset NATS_SERVER_BIN PG_BINDIR
    # shellcheck disable=SC1091
    . "$MATRIX_DIR/env"
    echo "matrix: $(versions): ${#tests[@]} tests"
    STACK_PG_MAJOR="$pg" timeout --signal=TERM 900 \
      cargo test --locked --test integration -- --exact "${tests[@]}"
  )
  scripts/stack.sh down "$MATRIX_DIR"
  rm -rf "$MATRIX_DIR"
  MATRIX_DIR=""
done
