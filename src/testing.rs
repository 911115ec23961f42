//! Test support: pgoutput encoders and an outbox relation fixture, shared
//! by the unit tests and the benchmarks (the publish link, so that a bench
//! measures the code that ships). Compiled only for tests
//! and with the `testing` feature (which the crate's own dev-dependency
//! turns on); never part of the product.

pub use crate::consumer::inbox::{BatchError, Batcher, Claim};
pub use crate::nats::NatsArgs;
pub use crate::relay::columns::ColumnMap;
pub use crate::relay::link::{encode_message, Dialer, Heard, Link, Reply};
pub use crate::relay::outbox_row::OutboxLayout;
pub use crate::relay::pgoutput::{decode, oid, Column, Message, Relation, Value};
pub use crate::relay::route::{OutMessage, Router, Template};
pub use crate::wire::Position;

/// The columns of `outbox_events` as migrations/0001_outbox.sql creates them.
pub const OUTBOX_COLUMNS: &[(&str, u32)] = &[
    ("id", oid::UUID),
    ("aggregate_type", oid::TEXT),
    ("aggregate_id", oid::TEXT),
    ("event_type", oid::TEXT),
    ("event_version", oid::INT4),
    ("payload", oid::JSONB),
    ("occurred_at", oid::TIMESTAMPTZ),
    ("correlation_id", oid::UUID),
    ("causation_id", oid::UUID),
    ("subject", oid::TEXT),
    ("headers", oid::JSONB),
    ("published_at", oid::TIMESTAMPTZ),
    ("publish_attempts", oid::INT4),
    ("publish_error", oid::TEXT),
];

/// A Relation message for `namespace.name` with these columns (`id` is the key).
pub fn relation(id: u32, namespace: &str, name: &str, columns: &[(&str, u32)]) -> Relation {
    Relation {
        id,
        namespace: namespace.into(),
        name: name.into(),
        replica_identity: b'd',
        columns: columns
            .iter()
            .map(|&(name, type_oid)| Column {
                key: name == "id",
                name: name.into(),
                type_oid,
                type_modifier: -1,
            })
            .collect(),
    }
}

/// `public.outbox_events`, every column.
pub fn outbox_relation(id: u32) -> Relation {
    relation(id, "public", "outbox_events", OUTBOX_COLUMNS)
}

/// Encoders for the same messages: the inverse of [`decode`], used by the
/// property tests and the decoder benchmark to build realistic input.
pub mod encode {
    use crate::relay::pgoutput::{Relation, Value};

    pub fn relation(rel: &Relation) -> Vec<u8> {
        let mut out = vec![b'R'];
        out.extend_from_slice(&rel.id.to_be_bytes());
        cstring(&mut out, &rel.namespace);
        cstring(&mut out, &rel.name);
        out.push(rel.replica_identity);
        out.extend_from_slice(&(rel.columns.len() as i16).to_be_bytes());
        for c in &rel.columns {
            out.push(u8::from(c.key));
            cstring(&mut out, &c.name);
            out.extend_from_slice(&c.type_oid.to_be_bytes());
            out.extend_from_slice(&c.type_modifier.to_be_bytes());
        }
        out
    }

    pub fn insert(relation_id: u32, values: &[Value]) -> Vec<u8> {
        let mut out = vec![b'I'];
        out.extend_from_slice(&relation_id.to_be_bytes());
        out.push(b'N');
        out.extend_from_slice(&(values.len() as i16).to_be_bytes());
        for v in values {
            match v {
                Value::Null => out.push(b'n'),
                Value::Unchanged => out.push(b'u'),
                Value::Text(b) | Value::Binary(b) => {
                    out.push(if matches!(v, Value::Text(_)) {
                        b't'
                    } else {
                        b'b'
                    });
                    out.extend_from_slice(&(b.len() as i32).to_be_bytes());
                    out.extend_from_slice(b);
                }
            }
        }
        out
    }

    fn cstring(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(s.as_bytes());
        out.push(0);
    }
}
