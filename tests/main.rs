//! The integration suite: one binary, one module per area, all against the
//! real stack that `scripts/test.sh` starts (Postgres with wal_level=logical
//! and nats-server with JetStream, on loopback).

mod audit;
mod browser;
mod common;
mod console;
mod consumer;
mod deploy;
mod docs;
mod emitted;
mod hardening;
mod layout;
mod lifecycle;
mod observability;
mod operations;
mod pauses;
mod relay;
mod schemas;
mod secure;
mod tables;
mod versions;
mod world;
