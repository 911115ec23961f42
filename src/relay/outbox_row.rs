//! From a decoded pgoutput tuple to an outbox row.
//!
//! Columns are found by name in the latest Relation message, so column order,
//! extra columns and `ALTER TABLE` in the middle of the stream all work. Values
//! are decoded by the column's type OID in either tuple format: text (the
//! type's output function, with the session pinned to `DateStyle=ISO` and
//! `TimeZone=UTC`) or binary (its send function).

use bytes::Bytes;
use time::format_description::well_known::Rfc3339;
use uuid::Uuid;

use super::pgoutput::{oid, Relation, Value};

/// Column positions of the outbox fields in one version of the table.
#[derive(Debug, Clone)]
pub struct OutboxLayout {
    id: usize,
    aggregate_type: usize,
    aggregate_id: usize,
    event_type: usize,
    event_version: Option<usize>,
    payload: usize,
    occurred_at: Option<usize>,
    correlation_id: Option<usize>,
    causation_id: Option<usize>,
    subject: Option<usize>,
    headers: Option<usize>,
    types: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RowError {
    #[error("outbox table {table} has no column {column:?}")]
    MissingColumn { table: String, column: &'static str },
    #[error("column {column}: {detail}")]
    BadValue {
        column: &'static str,
        detail: String,
    },
    #[error("tuple has {got} values, relation has {want} columns")]
    Arity { got: usize, want: usize },
}

/// One outbox row as the relay publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRow {
    pub id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub event_version: i64,
    /// The payload's JSON text, as Postgres renders it.
    pub payload: Bytes,
    /// RFC 3339, UTC.
    pub occurred_at: Option<String>,
    pub correlation_id: Option<Uuid>,
    pub causation_id: Option<Uuid>,
    pub subject: Option<String>,
    /// The `headers` JSON text, when set.
    pub headers: Option<Bytes>,
}

impl OutboxLayout {
    pub fn new(rel: &Relation) -> Result<Self, RowError> {
        let find = |name: &str| rel.columns.iter().position(|c| c.name == name);
        let table = format!("{}.{}", rel.namespace, rel.name);
        let need = |column: &'static str| {
            find(column).ok_or_else(|| RowError::MissingColumn {
                table: table.clone(),
                column,
            })
        };
        Ok(Self {
            id: need("id")?,
            aggregate_type: need("aggregate_type")?,
            aggregate_id: need("aggregate_id")?,
            event_type: need("event_type")?,
            payload: need("payload")?,
            event_version: find("event_version"),
            occurred_at: find("occurred_at"),
            correlation_id: find("correlation_id"),
            causation_id: find("causation_id"),
            subject: find("subject"),
            headers: find("headers"),
            types: rel.columns.iter().map(|c| c.type_oid).collect(),
        })
    }

    /// The row id alone, so a row that fails to decode can still be
    /// dead-lettered under its own message id.
    pub fn id(&self, values: &[Value]) -> Option<Uuid> {
        self.uuid(values, self.id, "id").ok().flatten()
    }

    pub fn row(&self, values: &[Value]) -> Result<OutboxRow, RowError> {
        if values.len() != self.types.len() {
            return Err(RowError::Arity {
                got: values.len(),
                want: self.types.len(),
            });
        }
        let required = |opt: Option<String>, column: &'static str| {
            opt.ok_or(RowError::BadValue {
                column,
                detail: "is null".into(),
            })
        };
        Ok(OutboxRow {
            id: self
                .uuid(values, self.id, "id")?
                .ok_or(RowError::BadValue {
                    column: "id",
                    detail: "is null".into(),
                })?,
            aggregate_type: required(
                self.text(values, self.aggregate_type, "aggregate_type")?,
                "aggregate_type",
            )?,
            aggregate_id: required(
                self.text(values, self.aggregate_id, "aggregate_id")?,
                "aggregate_id",
            )?,
            event_type: required(
                self.text(values, self.event_type, "event_type")?,
                "event_type",
            )?,
            event_version: match self.event_version {
                Some(i) => self.int(values, i, "event_version")?.unwrap_or(1),
                None => 1,
            },
            payload: self
                .json(values, self.payload, "payload")?
                .ok_or(RowError::BadValue {
                    column: "payload",
                    detail: "is null".into(),
                })?,
            occurred_at: self.opt(self.occurred_at, |i| {
                self.timestamp(values, i, "occurred_at")
            })?,
            correlation_id: self.opt(self.correlation_id, |i| {
                self.uuid(values, i, "correlation_id")
            })?,
            causation_id: self.opt(self.causation_id, |i| self.uuid(values, i, "causation_id"))?,
            subject: self.opt(self.subject, |i| self.text(values, i, "subject"))?,
            headers: self.opt(self.headers, |i| self.json(values, i, "headers"))?,
        })
    }

    fn opt<T>(
        &self,
        index: Option<usize>,
        f: impl FnOnce(usize) -> Result<Option<T>, RowError>,
    ) -> Result<Option<T>, RowError> {
        index.map_or(Ok(None), f)
    }

    fn raw<'v>(
        &self,
        values: &'v [Value],
        i: usize,
        column: &'static str,
    ) -> Result<Option<Raw<'v>>, RowError> {
        match values.get(i) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Text(b)) => Ok(Some(Raw::Text(b))),
            Some(Value::Binary(b)) => Ok(Some(Raw::Binary(b))),
            Some(Value::Unchanged) => Err(RowError::BadValue {
                column,
                detail: "unchanged TOAST value in an insert".into(),
            }),
        }
    }

    fn text(
        &self,
        values: &[Value],
        i: usize,
        column: &'static str,
    ) -> Result<Option<String>, RowError> {
        let Some(raw) = self.raw(values, i, column)? else {
            return Ok(None);
        };
        // text, varchar and bpchar share one wire form in both formats.
        let bytes = match raw {
            Raw::Text(b) | Raw::Binary(b) => b,
        };
        match self.types[i] {
            oid::TEXT | oid::VARCHAR | oid::BPCHAR => {}
            other => return Err(bad_type(column, other)),
        }
        String::from_utf8(bytes.to_vec())
            .map(Some)
            .map_err(|e| bad(column, format!("not UTF-8: {e}")))
    }

    fn uuid(
        &self,
        values: &[Value],
        i: usize,
        column: &'static str,
    ) -> Result<Option<Uuid>, RowError> {
        let Some(raw) = self.raw(values, i, column)? else {
            return Ok(None);
        };
        match (self.types[i], raw) {
            (oid::UUID, Raw::Binary(b)) => {
                Uuid::from_slice(b).map(Some).map_err(|e| bad(column, e))
            }
            (oid::UUID | oid::TEXT | oid::VARCHAR, Raw::Text(b))
            | (oid::TEXT | oid::VARCHAR, Raw::Binary(b)) => std::str::from_utf8(b)
                .map_err(|e| bad(column, e))
                .and_then(|s| Uuid::parse_str(s).map_err(|e| bad(column, e)))
                .map(Some),
            (other, _) => Err(bad_type(column, other)),
        }
    }

    fn int(
        &self,
        values: &[Value],
        i: usize,
        column: &'static str,
    ) -> Result<Option<i64>, RowError> {
        let Some(raw) = self.raw(values, i, column)? else {
            return Ok(None);
        };
        let v = match (self.types[i], raw) {
            (oid::INT2 | oid::INT4 | oid::INT8, Raw::Text(b)) => std::str::from_utf8(b)
                .map_err(|e| bad(column, e))?
                .parse::<i64>()
                .map_err(|e| bad(column, e))?,
            (oid::INT2, Raw::Binary(b)) => {
                i64::from(postgres_protocol::types::int2_from_sql(b).map_err(|e| bad(column, e))?)
            }
            (oid::INT4, Raw::Binary(b)) => {
                i64::from(postgres_protocol::types::int4_from_sql(b).map_err(|e| bad(column, e))?)
            }
            (oid::INT8, Raw::Binary(b)) => {
                postgres_protocol::types::int8_from_sql(b).map_err(|e| bad(column, e))?
            }
            (other, _) => return Err(bad_type(column, other)),
        };
        Ok(Some(v))
    }

    fn json(
        &self,
        values: &[Value],
        i: usize,
        column: &'static str,
    ) -> Result<Option<Bytes>, RowError> {
        let Some(raw) = self.raw(values, i, column)? else {
            return Ok(None);
        };
        let slice = |b: &Bytes, from: usize| b.slice(from..);
        match (self.types[i], raw) {
            (oid::JSONB | oid::JSON, Raw::Text(b)) | (oid::JSON, Raw::Binary(b)) => {
                Ok(Some(b.clone()))
            }
            // jsonb's binary form is a version byte followed by the JSON text.
            (oid::JSONB, Raw::Binary(b)) => match b.first() {
                Some(1) => Ok(Some(slice(b, 1))),
                Some(v) => Err(bad(column, format!("unsupported jsonb version {v}"))),
                None => Err(bad(column, "empty jsonb value")),
            },
            (other, _) => Err(bad_type(column, other)),
        }
    }

    fn timestamp(
        &self,
        values: &[Value],
        i: usize,
        column: &'static str,
    ) -> Result<Option<String>, RowError> {
        let Some(raw) = self.raw(values, i, column)? else {
            return Ok(None);
        };
        match (self.types[i], raw) {
            (oid::TIMESTAMPTZ | oid::TIMESTAMP, Raw::Binary(b)) => {
                let micros =
                    postgres_protocol::types::timestamp_from_sql(b).map_err(|e| bad(column, e))?;
                micros_to_rfc3339(micros)
                    .map(Some)
                    .ok_or_else(|| bad(column, format!("{micros} µs is out of range")))
            }
            (oid::TIMESTAMPTZ | oid::TIMESTAMP, Raw::Text(b)) => {
                let s = std::str::from_utf8(b).map_err(|e| bad(column, e))?;
                iso_text_to_rfc3339(s)
                    .map(Some)
                    .ok_or_else(|| bad(column, format!("unrecognised timestamp {s:?}")))
            }
            (other, _) => Err(bad_type(column, other)),
        }
    }
}

enum Raw<'v> {
    Text(&'v Bytes),
    Binary(&'v Bytes),
}

fn bad(column: &'static str, e: impl std::fmt::Display) -> RowError {
    RowError::BadValue {
        column,
        detail: e.to_string(),
    }
}

fn bad_type(column: &'static str, type_oid: u32) -> RowError {
    RowError::BadValue {
        column,
        detail: format!("unsupported column type oid {type_oid}"),
    }
}

/// Postgres epoch (2000-01-01) in Unix microseconds.
pub const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

/// Microseconds since 2000-01-01 UTC (the binary timestamp form) as RFC 3339.
pub fn micros_to_rfc3339(micros: i64) -> Option<String> {
    let nanos = (i128::from(micros) + i128::from(PG_EPOCH_UNIX_MICROS)) * 1000;
    time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
        .ok()?
        .format(&Rfc3339)
        .ok()
}

/// `2026-11-21 21:31:42.123456+00` (DateStyle ISO, TimeZone UTC) as RFC 3339.
/// A timestamp without time zone is taken as UTC.
pub fn iso_text_to_rfc3339(s: &str) -> Option<String> {
    let (date, rest) = s.split_once(' ')?;
    // Offset: the last '+' or '-' after the time part, if any.
    let (clock, offset) = match rest.rfind(['+', '-']) {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "+00"),
    };
    let offset = match offset.len() {
        3 => format!("{offset}:00"),
        6 => offset.to_owned(),
        _ => return None,
    };
    let offset = if offset == "+00:00" { "Z" } else { &offset };
    let out = format!("{date}T{clock}{offset}");
    // Validate rather than trust: BC dates and years past 9999 are not RFC 3339.
    time::OffsetDateTime::parse(&out, &Rfc3339).ok()?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing;

    fn outbox(columns: &[(&str, u32)]) -> Relation {
        testing::relation(1, "public", "outbox_events", columns)
    }

    fn t(s: &str) -> Value {
        Value::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn columns_resolved_by_name_in_any_order_with_extras() {
        let rel = outbox(&[
            ("extra", oid::TEXT),
            ("payload", oid::JSONB),
            ("event_type", oid::TEXT),
            ("aggregate_id", oid::TEXT),
            ("id", oid::UUID),
            ("aggregate_type", oid::TEXT),
            ("occurred_at", oid::TIMESTAMPTZ),
        ]);
        let layout = OutboxLayout::new(&rel).unwrap();
        let row = layout
            .row(&[
                t("x"),
                t(r#"{"a": 1}"#),
                t("created"),
                t("42"),
                t("0b7e5c3e-8d7f-4f57-9b5a-3f0d9a3c2e11"),
                t("order"),
                t("2026-11-21 21:31:42.5+00"),
            ])
            .unwrap();
        assert_eq!(row.aggregate_id, "42");
        assert_eq!(row.event_version, 1);
        assert_eq!(row.payload, Bytes::from_static(br#"{"a": 1}"#));
        assert_eq!(row.occurred_at.as_deref(), Some("2026-11-21T21:31:42.5Z"));
        assert_eq!(row.subject, None);
    }

    #[test]
    fn binary_values() {
        // The table's first seven columns: id … occurred_at.
        let rel = outbox(&testing::OUTBOX_COLUMNS[..7]);
        let id = Uuid::new_v4();
        let b = |v: &[u8]| Value::Binary(Bytes::copy_from_slice(v));
        let mut jsonb = vec![1u8];
        jsonb.extend_from_slice(b"{}");
        let row = OutboxLayout::new(&rel)
            .unwrap()
            .row(&[
                b(id.as_bytes()),
                b(b"order"),
                b(b"7"),
                b(b"placed"),
                b(&3i32.to_be_bytes()),
                b(&jsonb),
                // 2000-01-01T00:00:01.000002Z
                b(&1_000_002i64.to_be_bytes()),
            ])
            .unwrap();
        assert_eq!(row.id, id);
        assert_eq!(row.event_version, 3);
        assert_eq!(row.payload, Bytes::from_static(b"{}"));
        assert_eq!(
            row.occurred_at.as_deref(),
            Some("2000-01-01T00:00:01.000002Z")
        );
    }

    #[test]
    fn missing_required_column_is_reported() {
        let rel = outbox(&[("id", oid::UUID)]);
        assert_eq!(
            OutboxLayout::new(&rel).unwrap_err(),
            RowError::MissingColumn {
                table: "public.outbox_events".into(),
                column: "aggregate_type"
            }
        );
    }

    #[test]
    fn iso_text_conversion() {
        assert_eq!(
            iso_text_to_rfc3339("2026-11-21 21:31:42+00").as_deref(),
            Some("2026-11-21T21:31:42Z")
        );
        assert_eq!(
            iso_text_to_rfc3339("2026-11-21 21:31:42.123456+05:30").as_deref(),
            Some("2026-11-21T21:31:42.123456+05:30")
        );
        assert_eq!(iso_text_to_rfc3339("infinity"), None);
        assert_eq!(iso_text_to_rfc3339("0001-01-01 00:00:00+00 BC"), None);
    }
}
