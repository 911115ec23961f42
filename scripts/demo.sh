#!/usr/bin/env bash
# Demo: local Postgres + NATS, migrate, run the relay, insert sample events in
# a few transactions, and show them arriving in the JetStream stream. Bounded:
# everything it started is stopped on exit.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

cargo build --quiet --bin outbox-relay --example tail_stream
BIN="$ROOT/target/debug/outbox-relay"
STACK_DIR="$(mktemp -d -t outbox-relay-demo.XXXXXX)"
cleanup() { scripts/stack.sh down "$STACK_DIR" || true; rm -rf "$STACK_DIR"; }
trap cleanup EXIT INT TERM

echo "== starting Postgres (wal_level=logical) and nats-server -js on loopback"
scripts/stack.sh up "$STACK_DIR"
# shellcheck disable=SC1091
. "$STACK_DIR/env"

echo "== outbox-relay migrate"
"$BIN" migrate

echo "== outbox-relay relay --context demo   (log: $STACK_DIR/relay.log)"
scripts/stack.sh relay "$STACK_DIR" "$BIN" --context demo >/dev/null

echo "== inserting sample events: an order, its items, a payment (three transactions)"
psql -q "$DATABASE_URL" <<'SQL'
BEGIN;
INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, headers)
VALUES (gen_random_uuid(), 'order', 'o-1001', 'order_placed', '{"orderId": "o-1001", "total": 42.5}',
        '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}');
COMMIT;
BEGIN;
INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload)
SELECT gen_random_uuid(), 'order', 'o-1001', 'item_added', jsonb_build_object('orderId', 'o-1001', 'sku', 'SKU-' || g)
FROM generate_series(1, 3) g;
COMMIT;
INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, event_version, payload)
VALUES (gen_random_uuid(), 'payment', 'p-77', 'payment_captured', 2, '{"orderId": "o-1001", "amount": 42.5}');
SQL

echo "== events in stream DEMO_EVENTS:"
"$ROOT/target/debug/examples/tail_stream" DEMO_EVENTS 5

echo "== slot after the relay confirmed them:"
sleep 1.5
"$BIN" slot status --context demo
