#!/usr/bin/env bash
# Demo: local Postgres + NATS, migrate, run the relay and the consumer with a
# sample HTTP handler, insert sample events in a few transactions, and show
# them arriving in the stream, reaching the handler, and one poison event
# reaching the dead-letter stream. Bounded: everything it started is stopped
# on exit.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

cargo build --quiet --bin outbox-relay --example tail_stream --example sample_handler
BIN="$ROOT/target/debug/outbox-relay"
STACK_DIR="$(mktemp -d -t outbox-relay-demo.XXXXXX)"
HANDLER_PID=""
CONSUMER_PID=""
cleanup() {
  for pid in $CONSUMER_PID $HANDLER_PID; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  scripts/stack.sh down "$STACK_DIR" || true
  rm -rf "$STACK_DIR"
}
trap cleanup EXIT INT TERM

echo "== starting Postgres (wal_level=logical) and nats-server -js on loopback"
scripts/stack.sh up "$STACK_DIR"
# shellcheck disable=SC1091
. "$STACK_DIR/env"

echo "== outbox-relay migrate"
"$BIN" migrate

free_port() { scripts/stack.sh free-port; }
get() { python3 -c 'import sys, urllib.request, urllib.error
try: r = urllib.request.urlopen(sys.argv[1], timeout=5); print(r.status, r.read().decode().strip())
except urllib.error.HTTPError as e: print(e.code, e.read().decode().strip())' "$1"; }

RELAY_METRICS="127.0.0.1:$(free_port)"
echo "== outbox-relay relay --context demo --metrics-addr $RELAY_METRICS   (log: $STACK_DIR/relay.log)"
scripts/stack.sh relay "$STACK_DIR" "$BIN" --context demo --metrics-addr "$RELAY_METRICS" \
  --slot-metrics-interval 1s >/dev/null

HANDLER_PORT="$(free_port)"
echo "== sample HTTP handler on 127.0.0.1:$HANDLER_PORT (answers 200, or 422 for a poison event)"
"$ROOT/target/debug/examples/sample_handler" "127.0.0.1:$HANDLER_PORT" &
HANDLER_PID=$!

echo "== outbox-relay consume --durable billing   (log: $STACK_DIR/consumer.log)"
"$BIN" consume --context demo --durable billing --handler-url "http://127.0.0.1:$HANDLER_PORT/events" \
  --metrics-addr 127.0.0.1:0 >"$STACK_DIR/consumer.log" 2>&1 &
CONSUMER_PID=$!
for _ in $(seq 1 100); do
  grep -q consuming "$STACK_DIR/consumer.log" && break
  kill -0 "$CONSUMER_PID" 2>/dev/null || { cat "$STACK_DIR/consumer.log"; exit 1; }
  sleep 0.1
done

echo "== inserting sample events: an order, its items, a payment, a shipment emitted without a row (outbox_emit), and a poison event"
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
-- The table-less outbox: the same event, written into the WAL alone.
SELECT outbox_emit(aggregate_type => 'order', aggregate_id => 'o-1001', event_type => 'order_shipped',
                   payload => '{"orderId": "o-1001", "carrier": "dhl"}') AS emitted_id \gset
INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload)
VALUES (gen_random_uuid(), 'order', 'o-1002', 'order_placed', '{"orderId": "o-1002", "poison": true}');
SQL

sleep 1  # let the handler's lines print before the listings
echo "== events in stream DEMO_EVENTS:"
"$ROOT/target/debug/examples/tail_stream" DEMO_EVENTS 7

echo "== dead-letter stream DLQ_DEMO (the poison event, with its reason):"
"$ROOT/target/debug/examples/tail_stream" DLQ_DEMO 1

echo "== inbox of consumer billing:"
psql -q "$DATABASE_URL" -c "SELECT message_id, subject, attempts, processed_at IS NOT NULL AS processed, last_error FROM inbox_messages ORDER BY received_at"

echo "== slot after the relay confirmed them:"
sleep 1.5
"$BIN" slot status --context demo

echo "== relay endpoint: /healthz, /readyz, and a few lines of /metrics"
echo "GET /healthz -> $(get "http://$RELAY_METRICS/healthz")"
echo "GET /readyz  -> $(get "http://$RELAY_METRICS/readyz")"
get "http://$RELAY_METRICS/metrics" | grep -E '^(outbox_relay_events_published_total|outbox_relay_events_dead_lettered_total\{reason="bad_row"\}|outbox_relay_commit_to_ack_seconds_count|pg_replication_slot_(lag_bytes|active|safe_wal_size_bytes)|pg_replication_slot_wal_status\{.*\} 1)' || true
