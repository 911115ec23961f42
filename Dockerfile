# outbox-relay: build with the Rust toolchain, run on a slim Debian as a
# non-root user. The image runs any subcommand: relay, consume, migrate, slot.
#
#   docker build -t outbox-relay .
#   docker run --rm outbox-relay relay --help

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY migrations migrations
COPY benches benches
COPY examples examples
RUN cargo build --release --locked --bin outbox-relay --example sample_handler \
 && strip target/release/outbox-relay target/release/examples/sample_handler

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin outbox
COPY --from=build /src/target/release/outbox-relay /usr/local/bin/outbox-relay
# The demo's HTTP handler, for docker-compose.yml; a real service brings its own.
COPY --from=build /src/target/release/examples/sample_handler /usr/local/bin/sample-handler
USER 10001:10001
# Metrics, /healthz and /readyz; bind 0.0.0.0 inside a container (--metrics-addr).
# relay 9187, consume 9188, console 9191 (and its --admin-addr 9190)
EXPOSE 9187 9188 9190 9191
ENTRYPOINT ["/usr/local/bin/outbox-relay"]
CMD ["--help"]
