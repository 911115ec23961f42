//! From a decoded pgoutput tuple to an outbox row.
//!
//! Columns are found by name in the latest Relation message, so column order,
//! extra columns and `ALTER TABLE` in the middle of the stream all work. Which
//! column plays which role is `--columns` ([`ColumnMap`], SPEC §13); a role
//! may also come from a top-level key of a json column. Values are decoded
//! by the column's type OID in either tuple format: text (the type's output
//! function, with the session pinned to `DateStyle=ISO` and `TimeZone=UTC`)
//! or binary (its send function).

use std::borrow::Cow;

use bytes::Bytes;
use time::format_description::well_known::Rfc3339;
use uuid::Uuid;

use super::columns::{ColumnMap, Role, Source};
use super::pgoutput::{oid, Relation, Value};

/// Where one role's value is in a tuple: a column, or a key of a json
/// column.
#[derive(Debug, Clone)]
struct Field {
    index: usize,
    key: Option<String>,
}

/// Column positions of the outbox fields in one version of the table.
#[derive(Debug, Clone)]
pub struct OutboxLayout {
    id: Field,
    payload: Field,
    aggregate_type: Option<Field>,
    aggregate_id: Option<Field>,
    event_type: Option<Field>,
    event_version: Option<Field>,
    occurred_at: Option<Field>,
    correlation_id: Option<Field>,
    causation_id: Option<Field>,
    subject: Option<Field>,
    headers: Option<Field>,
    stream: Option<Field>,
    /// The columns a subject template or `--header-columns` name, in the
    /// order of the names given ([`OutboxRow::columns`]).
    extra: Vec<(String, usize)>,
    types: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RowError {
    #[error("outbox table {table}: {detail}")]
    Map { table: String, detail: String },
    #[error("outbox table {table} has no column {column:?}")]
    MissingColumn { table: String, column: String },
    #[error("column {column}: {detail}")]
    BadValue {
        column: Cow<'static, str>,
        detail: String,
    },
    #[error("tuple has {got} values, relation has {want} columns")]
    Arity { got: usize, want: usize },
}

/// One outbox row as the relay publishes it. A role the table has no
/// source for is `None` (its header is left out); one it has is required.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRow {
    /// The id's text form: the message's `Nats-Msg-Id`.
    pub id: String,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
    pub event_version: Option<i64>,
    /// The payload's JSON text, as Postgres renders it.
    pub payload: Bytes,
    /// RFC 3339, UTC.
    pub occurred_at: Option<String>,
    pub correlation_id: Option<String>,
    pub causation_id: Option<String>,
    pub subject: Option<String>,
    /// The stream the row must land in (SPEC §13 multi-stream routing).
    pub stream: Option<String>,
    /// The `headers` JSON text, when set.
    pub headers: Option<Bytes>,
    /// The text form of each column the layout was asked for (`None`:
    /// null), in that order.
    pub columns: Vec<Option<String>>,
}

/// The roles' values read off one tuple: a json column a key is read from
/// is parsed once per row.
struct Reader<'a> {
    layout: &'a OutboxLayout,
    values: &'a [Value],
    docs: Vec<(usize, serde_json::Value)>,
}

impl OutboxLayout {
    /// The layout of `rel` under `map`; `extra`: the columns whose text form
    /// each row carries ([`OutboxRow::columns`]).
    pub fn new(rel: &Relation, map: &ColumnMap, extra: &[String]) -> Result<Self, RowError> {
        let table = format!("{}.{}", rel.namespace, rel.name);
        let columns: Vec<(String, u32)> = rel
            .columns
            .iter()
            .map(|c| (c.name.clone(), c.type_oid))
            .collect();
        let resolved = map
            .resolve(&table, &columns)
            .map_err(|detail| RowError::Map {
                table: table.clone(),
                detail,
            })?;
        let find = |name: &str| rel.columns.iter().position(|c| c.name == name);
        let field = |role: Role| -> Option<Field> {
            let source = resolved.source(role)?;
            Some(Field {
                // `resolve` checked the column exists.
                index: find(source.column())?,
                key: match source {
                    Source::Key { key, .. } => Some(key.clone()),
                    Source::Column(_) => None,
                },
            })
        };
        let need = |role: Role| {
            field(role).ok_or_else(|| RowError::Map {
                table: table.clone(),
                detail: format!("no column plays role {role}"),
            })
        };
        let extra = extra
            .iter()
            .map(|name| {
                find(name)
                    .map(|i| (name.clone(), i))
                    .ok_or_else(|| RowError::MissingColumn {
                        table: table.clone(),
                        column: name.clone(),
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            id: need(Role::Id)?,
            payload: need(Role::Payload)?,
            aggregate_type: field(Role::AggregateType),
            aggregate_id: field(Role::AggregateId),
            event_type: field(Role::EventType),
            event_version: field(Role::EventVersion),
            occurred_at: field(Role::OccurredAt),
            correlation_id: field(Role::CorrelationId),
            causation_id: field(Role::CausationId),
            subject: field(Role::Subject),
            headers: field(Role::Headers),
            stream: field(Role::Stream),
            extra,
            types: rel.columns.iter().map(|c| c.type_oid).collect(),
        })
    }

    /// A layout that reads the id alone, from column `source` of `rel`:
    /// a row of a table that no longer fits the map is still known by it.
    pub fn id_only(rel: &Relation, source: &crate::relay::columns::Source) -> Option<Self> {
        let index = rel.columns.iter().position(|c| c.name == source.column())?;
        let f = Field {
            index,
            key: match source {
                crate::relay::columns::Source::Key { key, .. } => Some(key.clone()),
                crate::relay::columns::Source::Column(_) => None,
            },
        };
        Some(Self {
            id: f.clone(),
            payload: f,
            aggregate_type: None,
            aggregate_id: None,
            event_type: None,
            event_version: None,
            occurred_at: None,
            correlation_id: None,
            causation_id: None,
            subject: None,
            headers: None,
            stream: None,
            extra: Vec::new(),
            types: rel.columns.iter().map(|c| c.type_oid).collect(),
        })
    }

    /// The row id alone, so a row that fails to decode can still be
    /// dead-lettered under its own message id.
    pub fn id(&self, values: &[Value]) -> Option<String> {
        let mut r = Reader::new(self, values);
        r.id(&self.id).ok().flatten()
    }

    pub fn row(&self, values: &[Value]) -> Result<OutboxRow, RowError> {
        if values.len() != self.types.len() {
            return Err(RowError::Arity {
                got: values.len(),
                want: self.types.len(),
            });
        }
        let mut r = Reader::new(self, values);
        let required = |opt: Option<String>, column: &'static str| {
            opt.ok_or(RowError::BadValue {
                column: column.into(),
                detail: "is null".into(),
            })
        };
        // A role the table maps is required, as the columns of SPEC §3 are.
        let text = |r: &mut Reader, f: &Option<Field>, role: &'static str| match f {
            Some(f) => r.text(f, role).and_then(|v| required(v, role)).map(Some),
            None => Ok(None),
        };
        let aggregate_type = text(&mut r, &self.aggregate_type, "aggregate_type")?;
        // A uuid (the common shape) as its text, as the start check allows.
        let aggregate_id = match &self.aggregate_id {
            Some(f) => r
                .uuid_or_text(f, "aggregate_id")
                .and_then(|v| required(v, "aggregate_id"))
                .map(Some)?,
            None => None,
        };
        let event_type = text(&mut r, &self.event_type, "event_type")?;
        let id = r.id(&self.id)?.ok_or(RowError::BadValue {
            column: "id".into(),
            detail: "is null".into(),
        })?;
        let event_version = match &self.event_version {
            Some(f) => Some(r.int(f, "event_version")?.unwrap_or(1)),
            None => None,
        };
        let payload = r.body(&self.payload)?.ok_or(RowError::BadValue {
            column: "payload".into(),
            detail: "is null".into(),
        })?;
        let opt = |r: &mut Reader, f: &Option<Field>, role: &'static str| match f {
            Some(f) => r.text(f, role),
            None => Ok(None),
        };
        let occurred_at = match &self.occurred_at {
            Some(f) => r.timestamp(f, "occurred_at")?,
            None => None,
        };
        let correlation_id = match &self.correlation_id {
            Some(f) => r.uuid_or_text(f, "correlation_id")?,
            None => None,
        };
        let causation_id = match &self.causation_id {
            Some(f) => r.uuid_or_text(f, "causation_id")?,
            None => None,
        };
        let subject = opt(&mut r, &self.subject, "subject")?;
        let stream = text(&mut r, &self.stream, "stream")?;
        let headers = match &self.headers {
            Some(f) => r.json(f, "headers")?,
            None => None,
        };
        let columns = self
            .extra
            .iter()
            .map(|(name, i)| r.any_text(*i, name))
            .collect::<Result<_, _>>()?;
        Ok(OutboxRow {
            id,
            aggregate_type,
            aggregate_id,
            event_type,
            event_version,
            payload,
            occurred_at,
            correlation_id,
            causation_id,
            subject,
            stream,
            headers,
            columns,
        })
    }
}

impl<'a> Reader<'a> {
    fn new(layout: &'a OutboxLayout, values: &'a [Value]) -> Self {
        Reader {
            layout,
            values,
            docs: Vec::new(),
        }
    }

    fn raw(&self, i: usize, column: &'static str) -> Result<Option<Raw<'a>>, RowError> {
        raw_at(self.values, i, column)
    }

    /// The value at a key of the json column `i` (parsed once per row).
    fn key(
        &mut self,
        i: usize,
        key: &str,
        column: &'static str,
    ) -> Result<Option<&serde_json::Value>, RowError> {
        if !self.docs.iter().any(|(j, _)| *j == i) {
            let Some(text) = json_at(self.layout, self.values, i, column)? else {
                return Ok(None);
            };
            let doc: serde_json::Value =
                serde_json::from_slice(&text).map_err(|e| bad(column, format!("not JSON: {e}")))?;
            self.docs.push((i, doc));
        }
        let doc = self.docs.iter().find(|(j, _)| *j == i).map(|(_, d)| d);
        Ok(doc.and_then(|d| d.get(key)).filter(|v| !v.is_null()))
    }

    /// A key's value as text: a string as it is, anything else as JSON.
    fn key_text(
        &mut self,
        i: usize,
        key: &str,
        column: &'static str,
    ) -> Result<Option<String>, RowError> {
        Ok(self.key(i, key, column)?.map(|v| match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        }))
    }

    fn text(&mut self, f: &Field, column: &'static str) -> Result<Option<String>, RowError> {
        if let Some(key) = &f.key {
            return self.key_text(f.index, key, column);
        }
        text_at(self.layout, self.values, f.index, column)
    }

    fn uuid(&mut self, f: &Field, column: &'static str) -> Result<Option<Uuid>, RowError> {
        if let Some(key) = &f.key {
            return self
                .key_text(f.index, key, column)?
                .map(|s| Uuid::parse_str(&s).map_err(|e| bad(column, e)))
                .transpose();
        }
        let i = f.index;
        let Some(raw) = self.raw(i, column)? else {
            return Ok(None);
        };
        match (self.layout.types[i], raw) {
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

    /// The row id's text form, which is its `Nats-Msg-Id`: a uuid's
    /// canonical text, an integer's decimal, a text's own. It must travel
    /// as a header value and come back equal, so it is refused empty, with
    /// a control character, or with space at either end (readers trim it).
    fn id(&mut self, f: &Field) -> Result<Option<String>, RowError> {
        let id = match (&f.key, self.layout.types[f.index]) {
            // Canonical, so always a valid message id.
            (None, oid::UUID) => return Ok(self.uuid(f, "id")?.map(|u| u.to_string())),
            (None, oid::INT2 | oid::INT4 | oid::INT8) => {
                return Ok(self.int(f, "id")?.map(|n| n.to_string()))
            }
            // A text id holding a UUID goes as that UUID's canonical text,
            // as it always did (and as the consumer keys it).
            _ => self.text(f, "id")?.map(|t| match Uuid::parse_str(&t) {
                Ok(u) => u.to_string(),
                Err(_) => t,
            }),
        };
        match id {
            Some(id) if !valid_msg_id(&id) => Err(bad(
                "id",
                format!("{id:?} cannot be a message id (empty, over {MAX_ID_BYTES} bytes, a control character, or space at either end)"),
            )),
            id => Ok(id),
        }
    }

    /// The payload's bytes, as the producer wrote them: json and jsonb as
    /// their text, text as is, bytea's bytes.
    fn body(&mut self, f: &Field) -> Result<Option<Bytes>, RowError> {
        let column = "payload";
        if f.key.is_some() {
            return self.json(f, column);
        }
        let i = f.index;
        match self.layout.types[i] {
            oid::TEXT | oid::VARCHAR => Ok(
                raw_at(self.values, i, column)?.map(|(Raw::Text(b) | Raw::Binary(b))| b.clone())
            ),
            oid::BYTEA => match raw_at(self.values, i, column)? {
                None => Ok(None),
                Some(Raw::Binary(b)) => Ok(Some(b.clone())),
                // bytea's text form is hex (bytea_output's default since 9.0).
                Some(Raw::Text(b)) => match b.strip_prefix(b"\\x") {
                    Some(hex) => decode_hex(hex)
                        .map(|v| Some(Bytes::from(v)))
                        .ok_or_else(|| bad(column, "bytea text is not hex")),
                    None => Err(bad(
                        column,
                        "bytea in escape format: set bytea_output = 'hex' for the relay's role",
                    )),
                },
            },
            _ => json_at(self.layout, self.values, i, column),
        }
    }

    /// A uuid column's canonical text, or a text column's (or key's) text.
    fn uuid_or_text(
        &mut self,
        f: &Field,
        column: &'static str,
    ) -> Result<Option<String>, RowError> {
        match (&f.key, self.layout.types[f.index]) {
            (None, oid::UUID) => Ok(self.uuid(f, column)?.map(|u| u.to_string())),
            _ => self.text(f, column),
        }
    }

    fn int(&mut self, f: &Field, column: &'static str) -> Result<Option<i64>, RowError> {
        if let Some(key) = &f.key {
            return self
                .key_text(f.index, key, column)?
                .map(|s| s.parse::<i64>().map_err(|e| bad(column, e)))
                .transpose();
        }
        int_at(self.layout, self.values, f.index, column)
    }

    fn json(&mut self, f: &Field, column: &'static str) -> Result<Option<Bytes>, RowError> {
        if let Some(key) = &f.key {
            return Ok(self
                .key(f.index, key, column)?
                .map(|v| Bytes::from(v.to_string())));
        }
        json_at(self.layout, self.values, f.index, column)
    }

    fn timestamp(&mut self, f: &Field, column: &'static str) -> Result<Option<String>, RowError> {
        if let Some(key) = &f.key {
            return self
                .key_text(f.index, key, column)?
                .map(|s| {
                    time::OffsetDateTime::parse(&s, &Rfc3339)
                        .map(|_| s.clone())
                        .map_err(|e| bad(column, format!("{s:?} is not RFC 3339: {e}")))
                })
                .transpose();
        }
        let i = f.index;
        let Some(raw) = self.raw(i, column)? else {
            return Ok(None);
        };
        match (self.layout.types[i], raw) {
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

    /// Any column's text form, for a subject template or a header (in
    /// binary tuples, only of the types [`binary_text`] names).
    fn any_text(&mut self, i: usize, name: &str) -> Result<Option<String>, RowError> {
        let named = |e: RowError| match e {
            RowError::BadValue { detail, .. } => RowError::BadValue {
                column: Cow::Owned(name.to_owned()),
                detail,
            },
            other => other,
        };
        let f = Field {
            index: i,
            key: None,
        };
        let ty = self.layout.types[i];
        let v = match ty {
            oid::UUID => self.uuid(&f, "column").map(|u| u.map(|u| u.to_string())),
            oid::INT2 | oid::INT4 | oid::INT8 => {
                self.int(&f, "column").map(|n| n.map(|n| n.to_string()))
            }
            oid::TIMESTAMPTZ | oid::TIMESTAMP => self.timestamp(&f, "column"),
            oid::JSON | oid::JSONB => self
                .json(&f, "column")
                .map(|j| j.map(|j| String::from_utf8_lossy(&j).into_owned())),
            oid::BOOL => match self.raw(i, "column") {
                Ok(Some(Raw::Binary(b))) => Ok(Some((b.first() == Some(&1)).to_string())),
                Ok(Some(Raw::Text(b))) => Ok(Some((&b[..] == b"t").to_string())),
                Ok(None) => Ok(None),
                Err(e) => Err(e),
            },
            oid::TEXT | oid::VARCHAR | oid::BPCHAR => {
                text_at(self.layout, self.values, i, "column")
            }
            // Any other type's text form is its output function's.
            _ => match self.raw(i, "column") {
                Ok(Some(Raw::Text(b))) => std::str::from_utf8(b)
                    .map(|s| Some(s.to_owned()))
                    .map_err(|e| bad("column", e)),
                Ok(Some(Raw::Binary(_))) => Err(bad(
                    "column",
                    format!("type oid {ty} is not read in binary tuples (use --tuple-format text)"),
                )),
                Ok(None) => Ok(None),
                Err(e) => Err(e),
            },
        };
        v.map_err(named)
    }
}

/// Whether a subject-template or header column of this type is read from
/// binary tuples; any other type's text is its output function's, which
/// only text tuples carry.
pub fn binary_text(ty: u32) -> bool {
    [
        oid::UUID,
        oid::INT2,
        oid::INT4,
        oid::INT8,
        oid::TIMESTAMPTZ,
        oid::TIMESTAMP,
        oid::JSON,
        oid::JSONB,
        oid::BOOL,
        oid::TEXT,
        oid::VARCHAR,
        oid::BPCHAR,
    ]
    .contains(&ty)
}

fn text_at(
    l: &OutboxLayout,
    values: &[Value],
    i: usize,
    column: &'static str,
) -> Result<Option<String>, RowError> {
    let Some(raw) = raw_at(values, i, column)? else {
        return Ok(None);
    };
    // text, varchar and bpchar share one wire form in both formats.
    let bytes = match raw {
        Raw::Text(b) | Raw::Binary(b) => b,
    };
    match l.types[i] {
        oid::TEXT | oid::VARCHAR | oid::BPCHAR => {}
        other => return Err(bad_type(column, other)),
    }
    String::from_utf8(bytes.to_vec())
        .map(Some)
        .map_err(|e| bad(column, format!("not UTF-8: {e}")))
}

fn int_at(
    l: &OutboxLayout,
    values: &[Value],
    i: usize,
    column: &'static str,
) -> Result<Option<i64>, RowError> {
    let Some(raw) = raw_at(values, i, column)? else {
        return Ok(None);
    };
    let v = match (l.types[i], raw) {
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

fn json_at(
    l: &OutboxLayout,
    values: &[Value],
    i: usize,
    column: &'static str,
) -> Result<Option<Bytes>, RowError> {
    let Some(raw) = raw_at(values, i, column)? else {
        return Ok(None);
    };
    let slice = |b: &Bytes, from: usize| b.slice(from..);
    match (l.types[i], raw) {
        (oid::JSONB | oid::JSON, Raw::Text(b)) | (oid::JSON, Raw::Binary(b)) => Ok(Some(b.clone())),
        // jsonb's binary form is a version byte followed by the JSON text.
        (oid::JSONB, Raw::Binary(b)) => match b.first() {
            Some(1) => Ok(Some(slice(b, 1))),
            Some(v) => Err(bad(column, format!("unsupported jsonb version {v}"))),
            None => Err(bad(column, "empty jsonb value")),
        },
        (other, _) => Err(bad_type(column, other)),
    }
}

/// The longest row id sent: the publisher's header reserve holds the
/// chain header with an id this long.
pub const MAX_ID_BYTES: usize = 128;

/// Whether a row id can be sent as `Nats-Msg-Id` and read back equal.
pub fn valid_msg_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_BYTES
        && id.trim() == id
        && !id.chars().any(char::is_control)
}

fn decode_hex(hex: &[u8]) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    hex.chunks_exact(2)
        .map(|p| Some(nibble(p[0])? << 4 | nibble(p[1])?))
        .collect()
}

fn raw_at<'v>(
    values: &'v [Value],
    i: usize,
    column: &'static str,
) -> Result<Option<Raw<'v>>, RowError> {
    match values.get(i) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Text(b)) => Ok(Some(Raw::Text(b))),
        Some(Value::Binary(b)) => Ok(Some(Raw::Binary(b))),
        Some(Value::Unchanged) => Err(RowError::BadValue {
            column: column.into(),
            detail: "unchanged TOAST value in an insert".into(),
        }),
    }
}

enum Raw<'v> {
    Text(&'v Bytes),
    Binary(&'v Bytes),
}

fn bad(column: &'static str, e: impl std::fmt::Display) -> RowError {
    RowError::BadValue {
        column: column.into(),
        detail: e.to_string(),
    }
}

fn bad_type(column: &'static str, type_oid: u32) -> RowError {
    RowError::BadValue {
        column: column.into(),
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
        let layout = OutboxLayout::new(&rel, &ColumnMap::default(), &[]).unwrap();
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
        assert_eq!(row.aggregate_id.as_deref(), Some("42"));
        assert_eq!(row.event_version, None, "no event_version column");
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
        let row = OutboxLayout::new(&rel, &ColumnMap::default(), &[])
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
        assert_eq!(row.id, id.to_string());
        assert_eq!(row.event_version, Some(3));
        assert_eq!(row.payload, Bytes::from_static(b"{}"));
        assert_eq!(
            row.occurred_at.as_deref(),
            Some("2000-01-01T00:00:01.000002Z")
        );
    }

    #[test]
    fn missing_required_column_is_reported() {
        let rel = outbox(&[("id", oid::UUID)]);
        let e = OutboxLayout::new(&rel, &ColumnMap::default(), &[]).unwrap_err();
        assert!(e.to_string().contains("role payload"), "{e}");
    }

    /// SPEC §13: roles from other columns and from keys of a json column;
    /// a role with no source is `None`; the columns asked for come along
    /// in their text form.
    #[test]
    fn roles_come_from_mapped_columns_and_json_keys() {
        let rel = outbox(&[
            ("id", oid::UUID),
            ("topic", oid::TEXT),
            ("envelope", oid::JSONB),
            ("tenant_id", oid::UUID),
            ("attempts", oid::INT4),
        ]);
        let map = ColumnMap::parse(
            "payload=envelope,subject=topic,aggregate_id=envelope.partitionKey,event_version=envelope.v,correlation_id=envelope.c",
        )
        .unwrap();
        let extra = ["tenant_id".to_owned(), "attempts".to_owned()];
        let layout = OutboxLayout::new(&rel, &map, &extra).unwrap();
        let row = layout
            .row(&[
                t("0b7e5c3e-8d7f-4f57-9b5a-3f0d9a3c2e11"),
                t("billing.invoice.issued.v1"),
                t(r#"{"partitionKey": "inv-7", "v": 2, "c": "corr-1", "payload": {}}"#),
                Value::Null,
                t("3"),
            ])
            .unwrap();
        assert_eq!(row.subject.as_deref(), Some("billing.invoice.issued.v1"));
        assert_eq!(row.aggregate_id.as_deref(), Some("inv-7"));
        assert_eq!(row.event_version, Some(2));
        assert_eq!(row.correlation_id.as_deref(), Some("corr-1"));
        assert_eq!(
            (row.aggregate_type.as_deref(), row.event_type.as_deref()),
            (None, None)
        );
        assert_eq!(row.columns, vec![None, Some("3".to_owned())]);
        // A mapped role is required: a key the row lacks makes it a bad row.
        let e = layout
            .row(&[
                t("0b7e5c3e-8d7f-4f57-9b5a-3f0d9a3c2e11"),
                t("s"),
                t(r#"{"v": 2}"#),
                Value::Null,
                Value::Null,
            ])
            .unwrap_err();
        assert!(e.to_string().contains("aggregate_id"), "{e}");
    }

    #[test]
    fn ids_of_any_key_type_and_payloads_of_any_body_type() {
        let b = |v: &[u8]| Value::Binary(Bytes::copy_from_slice(v));
        let layout = |id: u32, payload: u32| {
            let rel = outbox(&[("id", id), ("payload", payload), ("subject", oid::TEXT)]);
            OutboxLayout::new(&rel, &ColumnMap::default(), &[]).unwrap()
        };
        let row = |l: &OutboxLayout, id: Value, payload: Value| l.row(&[id, payload, t("s")]);
        // bigint: its decimal, in either tuple format; bytea: its bytes.
        let l = layout(oid::INT8, oid::BYTEA);
        let r = row(&l, t("1160481716839288832"), t("\\x7b7d")).unwrap();
        assert_eq!(
            (r.id.as_str(), &r.payload[..]),
            ("1160481716839288832", &b"{}"[..])
        );
        let r = row(&l, b(&42i64.to_be_bytes()), b(b"\x00\xff")).unwrap();
        assert_eq!((r.id.as_str(), &r.payload[..]), ("42", &b"\x00\xff"[..]));
        for bad in ["\\x7b7", "\\xzz", "{}"] {
            assert!(row(&l, t("1"), t(bad)).is_err(), "{bad}");
        }
        // text: as it is, unless it cannot travel as a header value.
        let l = layout(oid::TEXT, oid::TEXT);
        let r = row(&l, t("order-7"), t("plain text")).unwrap();
        assert_eq!(
            (r.id.as_str(), &r.payload[..]),
            ("order-7", &b"plain text"[..])
        );
        for bad in ["", " a", "a ", "a\r\nNats-Expected-Stream: x"] {
            let e = row(&l, t(bad), t("{}")).unwrap_err();
            assert!(e.to_string().contains("message id"), "{bad:?}: {e}");
            assert_eq!(l.id(&[t(bad), t("{}"), t("s")]), None);
        }
        let long = "x".repeat(MAX_ID_BYTES + 1);
        assert!(
            row(&l, t(&long), t("{}")).is_err(),
            "over the header reserve"
        );
        assert!(row(&l, t(&long[1..]), t("{}")).is_ok());
        // A text id holding a UUID goes as that UUID, as before text ids.
        let r = row(&l, t("{0B7E5C3E-8D7F-4F57-9B5A-3F0D9A3C2E11}"), t("{}")).unwrap();
        assert_eq!(r.id, "0b7e5c3e-8d7f-4f57-9b5a-3f0d9a3c2e11");
        // uuid: its canonical text.
        let l = layout(oid::UUID, oid::JSONB);
        let r = row(&l, t("0B7E5C3E-8D7F-4F57-9B5A-3F0D9A3C2E11"), t("{}")).unwrap();
        assert_eq!(r.id, "0b7e5c3e-8d7f-4f57-9b5a-3f0d9a3c2e11");
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
