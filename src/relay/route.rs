//! Routing: an outbox row becomes a NATS message (subject, headers, body).
//!
//! Pure: no I/O. A row that cannot be routed is not an error of the relay; it
//! becomes a dead-letter message on `{context}.dlq.relay` with a reason, and
//! the stream carries on (SPEC §4).

use std::borrow::Cow;
use std::fmt::Write as _;
use std::sync::Arc;

use bytes::Bytes;

use super::outbox_row::OutboxRow;
use crate::json::JsonObject;
use crate::schema::{Schemas, Verdict};
use crate::wire::{self, DlqReason, Position};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutMessage {
    pub subject: String,
    pub msg_id: String,
    /// In order; `Nats-Msg-Id` is among them. Our own names are static, so
    /// the per-event path allocates only values.
    pub headers: Vec<(Cow<'static, str>, String)>,
    pub body: Bytes,
    /// Set on dead letters.
    pub dlq_reason: Option<DlqReason>,
    /// The stream a row's `stream` role routes it to (then the message
    /// carries [`wire::EXPECTED_STREAM`] too); `None`: the relay's own.
    pub stream: Option<Arc<str>>,
}

impl OutMessage {
    /// Bytes counted against the server's `max_payload`: header block plus body.
    pub fn wire_size(&self) -> usize {
        self.header_size() + self.body.len()
    }

    /// The header block's size ([`wire::header_block_size`]).
    pub fn header_size(&self) -> usize {
        wire::header_block_size(self.headers.iter().map(|(k, v)| (k.as_ref(), v.as_str())))
    }

    #[cfg(any(test, feature = "testing"))]
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("placeholder {{{0}}} in subject template is neither a role (context, aggregate_type, aggregate_id, event_type, event_version, partition) nor a column name")]
    Unknown(String),
    #[error("unclosed '{{' in subject template")]
    Unclosed,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    AggregateType,
    AggregateId,
    EventType,
    EventVersion,
    Partition,
    /// Any other column of the table, by name (SPEC §13).
    Column(String),
}

/// A parsed `--subject-template`; `{context}` is substituted at parse time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template(Vec<Part>);

impl Template {
    pub fn parse(template: &str, context: &str) -> Result<Self, TemplateError> {
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut rest = template;
        while let Some(open) = rest.find('{') {
            literal.push_str(&rest[..open]);
            let close = rest[open..].find('}').ok_or(TemplateError::Unclosed)? + open;
            let name = &rest[open + 1..close];
            let part = match name {
                "context" => {
                    literal.push_str(context);
                    None
                }
                "aggregate_type" => Some(Part::AggregateType),
                "aggregate_id" => Some(Part::AggregateId),
                "event_type" => Some(Part::EventType),
                "event_version" => Some(Part::EventVersion),
                "partition" => Some(Part::Partition),
                other if is_identifier(other) => Some(Part::Column(other.to_owned())),
                other => return Err(TemplateError::Unknown(other.to_owned())),
            };
            if let Some(p) = part {
                if !literal.is_empty() {
                    parts.push(Part::Literal(std::mem::take(&mut literal)));
                }
                parts.push(p);
            }
            rest = &rest[close + 1..];
        }
        literal.push_str(rest);
        if !literal.is_empty() {
            parts.push(Part::Literal(literal));
        }
        Ok(Self(parts))
    }

    /// The subject for `row`; `columns` names its [`OutboxRow::columns`].
    /// `Err`: what the row lacks for it (a role the table has no source
    /// for, or a null column).
    fn render(
        &self,
        row: &OutboxRow,
        partitions: u32,
        columns: &[String],
    ) -> Result<String, String> {
        let mut out = String::with_capacity(64);
        // Borrowed: this runs once per event.
        fn need<'r>(v: &'r Option<String>, name: &str) -> Result<&'r str, String> {
            v.as_deref().ok_or_else(|| name.to_owned())
        }
        for p in &self.0 {
            match p {
                Part::Literal(s) => out.push_str(s),
                Part::AggregateType => out.push_str(need(&row.aggregate_type, "aggregate_type")?),
                Part::AggregateId => out.push_str(need(&row.aggregate_id, "aggregate_id")?),
                Part::EventType => out.push_str(need(&row.event_type, "event_type")?),
                Part::EventVersion => {
                    let v = row.event_version.ok_or("event_version")?;
                    let _ = write!(out, "{v}");
                }
                Part::Partition => {
                    let id = need(&row.aggregate_id, "aggregate_id")?;
                    let _ = write!(out, "{}", partition(id, partitions));
                }
                Part::Column(name) => {
                    let value = columns
                        .iter()
                        .position(|c| c == name)
                        .and_then(|i| row.columns.get(i).cloned().flatten())
                        .ok_or_else(|| name.clone())?;
                    out.push_str(&value);
                }
            }
        }
        Ok(out)
    }

    /// The columns it names beyond the roles.
    pub fn columns(&self) -> Vec<String> {
        self.0
            .iter()
            .filter_map(|p| match p {
                Part::Column(c) => Some(c.clone()),
                _ => None,
            })
            .collect()
    }

    /// The roles it needs a value of.
    pub fn roles(&self) -> Vec<&'static str> {
        self.0
            .iter()
            .filter_map(|p| match p {
                Part::AggregateType => Some("aggregate_type"),
                Part::AggregateId | Part::Partition => Some("aggregate_id"),
                Part::EventType => Some("event_type"),
                Part::EventVersion => Some("event_version"),
                _ => None,
            })
            .collect()
    }
}

fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Stable partition of an aggregate: FNV-1a 64 of its id, modulo `partitions`.
/// FNV because it is fixed forever (a std hasher may change between releases),
/// and any language can compute it to subscribe to one partition.
pub fn partition(aggregate_id: &str, partitions: u32) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in aggregate_id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h % u64::from(partitions.max(1))) as u32
}

/// Why a subject is not a valid NATS publish subject.
pub fn subject_problem(subject: &str) -> Option<&'static str> {
    if subject.is_empty() {
        return Some("empty subject");
    }
    for token in subject.split('.') {
        if token.is_empty() {
            return Some("empty token");
        }
    }
    for c in subject.chars() {
        if c == '*' || c == '>' {
            return Some("wildcard in a publish subject");
        }
        if c.is_whitespace() {
            return Some("whitespace in subject");
        }
        if c.is_control() {
            return Some("control character in subject");
        }
    }
    None
}

fn header_name_ok(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_graphic() && b != b':')
}

fn header_value_ok(value: &str) -> bool {
    !value.bytes().any(|b| b == b'\r' || b == b'\n')
}

#[derive(Debug, Clone)]
pub struct Router {
    pub template: Template,
    pub partitions: u32,
    pub envelope: bool,
    /// The stream's subject filters: every subject must fall inside one.
    captures: Vec<String>,
    /// `{context}.dlq.`: inside the stream's subjects but reserved for dead letters.
    dlq_prefix: String,
    dlq_subject: String,
    /// `--context`, the envelope's `sourceContext`.
    context: String,
    source: String,
    /// `--schemas`: payloads are checked against their type's schema.
    schemas: Option<Arc<Schemas>>,
    /// [`wire::XID_HORIZON`] of the messages routed now.
    xid_horizon: Option<u64>,
    /// The names of [`OutboxRow::columns`], in order.
    columns: Vec<String>,
    /// `--header-columns`: each header's name and its index in `columns`.
    column_headers: Vec<(String, usize)>,
    /// `--streams`: where the `stream` role may route a row.
    streams: Option<Arc<Streams>>,
}

/// The streams a row's `stream` role may name (SPEC §13), as the session
/// found them: each one's subject filters, and those given that do not
/// exist.
#[derive(Debug, Clone, Default)]
pub struct Streams {
    pub found: Vec<(Arc<str>, Vec<String>)>,
    pub missing: Vec<String>,
    /// The relay's own stream (`--stream`), where dead letters go: a row
    /// naming it chains with them, as one of its messages.
    pub own: String,
}

impl Streams {
    /// The stream `name` and its filters, or why a row may not go there.
    fn get(&self, name: &str) -> Result<&(Arc<str>, Vec<String>), String> {
        if let Some(s) = self.found.iter().find(|(n, _)| &**n == name) {
            return Ok(s);
        }
        Err(if self.missing.iter().any(|m| m == name) {
            format!("the row names stream {name:?}, which does not exist")
        } else {
            format!("the row names stream {name:?}, which is not one of --streams")
        })
    }
}

impl Router {
    pub fn new(
        context: &str,
        template: Template,
        partitions: u32,
        envelope: bool,
        source: String,
        captures: Vec<String>,
    ) -> Self {
        Self {
            template,
            partitions,
            envelope,
            captures,
            dlq_prefix: wire::relay_dlq_prefix(context),
            dlq_subject: wire::relay_dlq_subject(context),
            context: context.to_owned(),
            source,
            schemas: None,
            xid_horizon: None,
            columns: Vec::new(),
            column_headers: Vec::new(),
            streams: None,
        }
    }

    /// Route each row to the stream its `stream` role names (`--streams`).
    pub fn with_streams(mut self, streams: Arc<Streams>) -> Self {
        self.streams = Some(streams);
        self
    }

    /// The columns rows carry (the template's and `header_columns`), and
    /// those of them that travel as headers.
    pub fn with_columns(mut self, columns: Vec<String>, header_columns: &[String]) -> Self {
        self.column_headers = header_columns
            .iter()
            .filter_map(|h| Some((wire::column_header(h), columns.iter().position(|c| c == h)?)))
            .collect();
        self.columns = columns;
        self
    }

    /// The columns a row must carry, in order.
    pub fn columns(&self) -> &[String] {
        &self.columns
    }

    /// Check every payload against `--schemas`.
    pub fn with_schemas(mut self, schemas: Option<Arc<Schemas>>) -> Self {
        self.schemas = schemas;
        self
    }

    /// Route a row. `max_payload` is the server's limit; an oversized message
    /// is dead-lettered with an empty body.
    #[cfg(any(test, feature = "testing"))]
    pub fn route(&self, row: &OutboxRow, pos: Position, max_payload: usize) -> OutMessage {
        self.route_committed(row.clone(), pos, None, max_payload)
    }

    /// [`Self::route`] for a row read from the WAL, whose transaction
    /// committed at `commit_micros` (Postgres epoch): the envelope's
    /// `ingestedAt`. The row's strings move into the headers: this runs
    /// once per event.
    pub fn route_committed(
        &self,
        row: OutboxRow,
        pos: Position,
        commit_micros: Option<i64>,
        max_payload: usize,
    ) -> OutMessage {
        let (subject, lacking) = match &row.subject {
            Some(s) => (s.clone(), None),
            None => match self.template.render(&row, self.partitions, &self.columns) {
                Ok(s) => (s, None),
                // Dead-lettered below, under the template as its subject.
                Err(what) => (String::new(), Some(what)),
            },
        };
        // Multi-stream routing: the stream the row names, its filters.
        let (stream, captures, missing) = match (&self.streams, &row.stream) {
            (Some(streams), Some(name)) => match streams.get(name) {
                Ok((name, captures)) if **name == *streams.own => (None, &captures[..], None),
                Ok((name, captures)) => (Some(name.clone()), &captures[..], None),
                Err(why) => (None, &self.captures[..], Some(why)),
            },
            _ => (None, &self.captures[..], None),
        };
        let mut reason = if lacking.is_some() || subject_problem(&subject).is_some() {
            Some(DlqReason::InvalidSubject)
        } else if subject.len() > MAX_SUBJECT_BYTES {
            Some(DlqReason::SubjectTooLong)
        } else if missing.is_some() {
            Some(DlqReason::StreamMissing)
        } else if !captures.iter().any(|f| subject_matches(f, &subject))
            || subject.starts_with(&self.dlq_prefix)
        {
            Some(DlqReason::SubjectOutsideStream)
        } else {
            None
        };
        let extra = row.headers.as_deref().map(user_headers);
        let mut schema_id = None;
        let mut schema_problem = None;
        if let Some(live) = &self.schemas {
            let schemas = live.current();
            let event_type = row.event_type.as_deref().unwrap_or("");
            let event_version = row.event_version.unwrap_or(1);
            match schemas.check(event_type, event_version, &row.payload) {
                Verdict::Valid(id) => schema_id = Some(id.to_owned()),
                Verdict::Invalid(id, detail) => {
                    schema_id = Some(id.to_owned());
                    schema_problem = Some((DlqReason::SchemaInvalid, detail));
                }
                Verdict::Missing => {
                    schema_problem = Some((
                        DlqReason::SchemaMissing,
                        format!("no schema for {event_type:?} version {event_version}"),
                    ));
                }
                Verdict::Unchecked => live.note_unchecked("relay", event_type, event_version),
            }
        }
        let body = if self.envelope {
            let ingested_at = commit_micros.and_then(super::outbox_row::micros_to_rfc3339);
            envelope(
                &row,
                &Provenance {
                    context: &self.context,
                    schema_uri: schema_id.as_deref(),
                    ingested_at: ingested_at.as_deref(),
                },
            )
        } else {
            row.payload.clone()
        };
        // Taken, not copied: the envelope above was the id's last reader.
        let mut row = row;
        let msg_id = std::mem::take(&mut row.id);
        let mut headers = self.standard_headers(row, &msg_id, pos);
        if headers.iter().any(|(_, v)| !header_value_ok(v)) {
            reason.get_or_insert(DlqReason::InvalidHeader);
        }
        match extra {
            Some(Ok(extra)) => headers.extend(extra),
            Some(Err(())) => {
                reason.get_or_insert(DlqReason::InvalidHeader);
            }
            None => {}
        }
        if let Some(id) = schema_id {
            headers.push((Cow::Borrowed(wire::SCHEMA), id));
        }
        if let Some(stream) = &stream {
            headers.push((Cow::Borrowed(wire::EXPECTED_STREAM), stream.to_string()));
        }
        let msg = OutMessage {
            subject,
            msg_id,
            headers,
            body,
            dlq_reason: None,
            stream,
        };
        if let Some(what) = lacking {
            let detail = format!("the row has no subject and no {what} for the subject template");
            return dead_letter(
                msg,
                &self.dlq_subject,
                DlqReason::InvalidSubject,
                Some(&detail),
                max_payload,
            );
        }
        if let Some(why) = missing {
            return dead_letter(
                msg,
                &self.dlq_subject,
                DlqReason::StreamMissing,
                Some(&why),
                max_payload,
            );
        }
        if let (None, Some((r, detail))) = (reason, schema_problem) {
            return dead_letter(msg, &self.dlq_subject, r, Some(&detail), max_payload);
        }
        match reason {
            None if msg.header_size() > MAX_HEADER_BYTES => {
                self.dead_letter(msg, DlqReason::HeadersTooLarge, max_payload)
            }
            None if msg.wire_size() <= max_payload => msg,
            None => self.dead_letter(msg, DlqReason::TooLarge, max_payload),
            Some(r) => self.dead_letter(msg, r, max_payload),
        }
    }

    /// A row whose columns could not be decoded. Its message id is the row id
    /// when that much was readable, else derived from its WAL position, so a
    /// replay dedupes it either way.
    pub fn bad_row(&self, id: Option<String>, pos: Position, detail: &str) -> OutMessage {
        let msg_id = id.unwrap_or_else(|| pos.fallback_msg_id());
        let mut headers = vec![(Cow::Borrowed(wire::MSG_ID), msg_id.clone())];
        self.position_headers(&mut headers, pos);
        headers.push((
            Cow::Borrowed(wire::DLQ_DETAIL),
            detail.replace(['\r', '\n'], " "),
        ));
        headers.push((
            Cow::Borrowed(wire::DLQ_REASON),
            DlqReason::BadRow.as_str().to_owned(),
        ));
        let class = crate::triage::Class::of_relay(DlqReason::BadRow);
        for (k, v) in crate::triage::headers(class, DlqReason::BadRow.as_str(), Some(detail)) {
            headers.push((Cow::Borrowed(k), v));
        }
        OutMessage {
            subject: self.dlq_subject.clone(),
            msg_id,
            headers,
            body: Bytes::new(),
            dlq_reason: Some(DlqReason::BadRow),
            stream: None,
        }
    }

    fn dead_letter(&self, msg: OutMessage, reason: DlqReason, max_payload: usize) -> OutMessage {
        dead_letter(msg, &self.dlq_subject, reason, None, max_payload)
    }

    fn standard_headers(
        &self,
        row: OutboxRow,
        msg_id: &str,
        pos: Position,
    ) -> Vec<(Cow<'static, str>, String)> {
        let mut h = Vec::with_capacity(12);
        let mut push = |name: &'static str, value: Option<String>| {
            if let Some(v) = value {
                h.push((Cow::Borrowed(name), v));
            }
        };
        push(wire::MSG_ID, Some(msg_id.to_owned()));
        push(wire::EVENT_TYPE, row.event_type);
        push(
            wire::EVENT_VERSION,
            row.event_version.map(|v| v.to_string()),
        );
        push(wire::AGGREGATE_TYPE, row.aggregate_type);
        push(wire::AGGREGATE_ID, row.aggregate_id);
        push(wire::OCCURRED_AT, row.occurred_at);
        push(wire::CORRELATION_ID, row.correlation_id);
        push(wire::CAUSATION_ID, row.causation_id);
        if self.envelope {
            push(wire::ENVELOPE, Some("1".to_owned()));
        }
        for (name, i) in &self.column_headers {
            if let Some(Some(v)) = row.columns.get(*i) {
                h.push((Cow::Owned(name.clone()), v.clone()));
            }
        }
        self.position_headers(&mut h, pos);
        h
    }

    fn position_headers(&self, h: &mut Vec<(Cow<'static, str>, String)>, pos: Position) {
        h.push((Cow::Borrowed(wire::COMMIT_LSN), pos.commit_lsn.to_string()));
        h.push((Cow::Borrowed(wire::TXN_INDEX), pos.index.to_string()));
        h.push((Cow::Borrowed(wire::SOURCE), self.source.clone()));
        if let Some(x) = self.xid_horizon {
            h.push((Cow::Borrowed(wire::XID_HORIZON), x.to_string()));
        }
    }

    /// The [`wire::XID_HORIZON`] of what is routed from now on.
    pub fn set_xid_horizon(&mut self, xid: Option<u64>) {
        self.xid_horizon = xid;
    }
}

/// Every string entry of the row's `headers` object. Names we set ourselves
/// (`Nats-*`, `Outbox-*`) may not be overridden: that would break dedupe or lie
/// about the event.
fn user_headers(json: &[u8]) -> Result<Vec<(Cow<'static, str>, String)>, ()> {
    let v: serde_json::Value = serde_json::from_slice(json).map_err(|_| ())?;
    let Some(map) = v.as_object() else {
        return if v.is_null() { Ok(Vec::new()) } else { Err(()) };
    };
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in map {
        let Some(s) = v.as_str() else { continue };
        if !header_name_ok(k) || !header_value_ok(s) || is_reserved(k) {
            return Err(());
        }
        out.push((Cow::Owned(k.clone()), s.to_owned()));
    }
    Ok(out)
}

/// The longest subject routed. The server closes a connection whose
/// control line (`HPUB <subject> <reply> <sizes>`) passes `max_control_line`,
/// 4 KiB by default and not announced in INFO: the rest is kept for the
/// reply inbox and sizes.
pub const MAX_SUBJECT_BYTES: usize = 3 * 1024;

/// The largest header block routed. JetStream stores its length in 16 bits
/// and refuses a longer one; the publisher's own order header needs room.
pub const MAX_HEADER_BYTES: usize = 65_535 - 256;

/// `msg` as a dead letter on `dlq_subject`: the original subject and the
/// reason (and `detail`, the server's words for a refusal) in headers, and
/// only what can still be sent: headers the protocol cannot carry dropped,
/// user headers dropped when the header block is still too large, and the
/// body emptied when it does not fit.
pub fn dead_letter(
    mut msg: OutMessage,
    dlq_subject: &str,
    reason: DlqReason,
    detail: Option<&str>,
    max_payload: usize,
) -> OutMessage {
    let one_line = |s: &str| {
        let s = s.replace(['\r', '\n'], " ");
        // A subject is the one value that may be long (too long to route).
        s.chars().take(1024).collect::<String>()
    };
    msg.headers
        .retain(|(k, v)| header_name_ok(k) && header_value_ok(v));
    msg.headers
        .push((Cow::Borrowed(wire::DLQ_REASON), reason.as_str().to_owned()));
    msg.headers.push((
        Cow::Borrowed(wire::DLQ_ORIGINAL_SUBJECT),
        one_line(&msg.subject),
    ));
    if let Some(d) = detail {
        msg.headers
            .push((Cow::Borrowed(wire::DLQ_DETAIL), one_line(d)));
    }
    let class = crate::triage::Class::of_relay(reason);
    for (k, v) in crate::triage::headers(class, reason.as_str(), detail) {
        msg.headers.push((Cow::Borrowed(k), v));
    }
    msg.subject = dlq_subject.to_owned();
    msg.dlq_reason = Some(reason);
    // A dead letter goes to the relay's own stream.
    if msg.stream.take().is_some() {
        msg.headers.retain(|(k, _)| k != wire::EXPECTED_STREAM);
    }
    if msg.header_size() > MAX_HEADER_BYTES || msg.header_size() > max_payload {
        // Huge user headers, or values that were routable but are too long
        // together: keep ours only.
        msg.headers.retain(|(k, _)| is_reserved(k));
        for (_, v) in msg.headers.iter_mut() {
            if v.len() > 1024 {
                *v = v.chars().take(1024).collect();
            }
        }
    }
    if msg.wire_size() > max_payload {
        msg.body = Bytes::new();
    }
    msg
}

/// Whether a subject falls inside a stream's subject filter (`*` one
/// token, `>` one or more trailing tokens).
pub fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut f = filter.split('.');
    let mut s = subject.split('.');
    loop {
        match (f.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// Names only the relay sets (`Nats-*`, `Outbox-*`), any case.
fn is_reserved(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    wire::RESERVED_PREFIXES.iter().any(|p| lower.starts_with(p))
}

/// `--envelope`: the payload wrapped with the event's metadata. The payload is
/// embedded as Postgres rendered it (already valid JSON), not re-serialised.
/// What the envelope says about where an event comes from, beyond its row.
pub struct Provenance<'a> {
    /// `--context`.
    pub context: &'a str,
    /// The schema the payload passed (`Outbox-Schema`), with `--schemas`.
    pub schema_uri: Option<&'a str>,
    /// The transaction's commit time, RFC 3339; none for a row read from a
    /// snapshot (backfill, resync), whose commit time the snapshot does not
    /// carry.
    pub ingested_at: Option<&'a str>,
}

/// `--envelope`: the seeds' envelope fields the row supports, in the order
/// docs/guide/relay.md lists them. Unknown values are null, as the first envelope had them.
pub fn envelope(row: &OutboxRow, from: &Provenance<'_>) -> Bytes {
    let id = row.id.to_string();
    JsonObject::with_capacity(row.payload.len() + 480)
        .str("eventId", &id)
        .opt_str("eventType", row.event_type.as_deref())
        .opt_int("eventVersion", row.event_version)
        .opt_str("schemaUri", from.schema_uri)
        .opt_str("aggregateType", row.aggregate_type.as_deref())
        .opt_str("aggregateId", row.aggregate_id.as_deref())
        .opt_str("partitionKey", row.aggregate_id.as_deref())
        .opt_str("occurredAt", row.occurred_at.as_deref())
        .opt_str("ingestedAt", from.ingested_at)
        .opt_str("correlationId", row.correlation_id.as_deref())
        .opt_str("causationId", row.causation_id.as_deref())
        .str("outboxId", &id)
        .str("sourceContext", from.context)
        .raw("payload", &row.payload)
        .finish()
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgwire_replication::Lsn;

    fn row() -> OutboxRow {
        OutboxRow {
            id: "0b7e5c3e-8d7f-4f57-9b5a-3f0d9a3c2e11".into(),
            aggregate_type: Some("order".into()),
            aggregate_id: Some("42".into()),
            event_type: Some("placed".into()),
            event_version: Some(2),
            payload: Bytes::from_static(br#"{"total": 10}"#),
            occurred_at: Some("2026-11-21T21:31:42Z".into()),
            correlation_id: None,
            causation_id: None,
            subject: None,
            stream: None,
            headers: None,
            columns: Vec::new(),
        }
    }

    fn router(template: &str) -> Router {
        Router::new(
            "shop",
            Template::parse(template, "shop").unwrap(),
            8,
            false,
            "1/db/slot".into(),
            vec![wire::stream_subjects("shop")],
        )
    }

    const POS: Position = Position {
        commit_lsn: Lsn(0x16B3748),
        index: 3,
    };

    /// SPEC §13 multi-stream routing: a row lands in the stream it names,
    /// which must be one found and capture its subject; a dead letter goes
    /// to the relay's own stream, without the expected-stream header.
    #[test]
    fn a_row_goes_to_the_stream_it_names_or_is_dead_lettered_saying_why() {
        let streams = Streams {
            found: vec![
                (Arc::from("ORDERS"), vec!["orders.>".into()]),
                (
                    Arc::from("SHOP_EVENTS"),
                    vec![wire::stream_subjects("shop")],
                ),
            ],
            missing: vec!["PAYMENTS".into()],
            own: "SHOP_EVENTS".into(),
        };
        let r = router("{aggregate_type}.{event_type}").with_streams(Arc::new(streams));
        let route = |stream: Option<&str>, subject: &str| {
            let row = OutboxRow {
                stream: stream.map(str::to_owned),
                subject: Some(subject.into()),
                ..row()
            };
            r.route_committed(row, POS, None, 1 << 20)
        };
        let m = route(Some("ORDERS"), "orders.placed");
        assert_eq!((m.dlq_reason, m.stream.as_deref()), (None, Some("ORDERS")));
        assert_eq!(m.header(wire::EXPECTED_STREAM), Some("ORDERS"));
        for (stream, subject, reason, why) in [
            (
                Some("PAYMENTS"),
                "payments.paid",
                DlqReason::StreamMissing,
                "does not exist",
            ),
            (
                Some("ELSEWHERE"),
                "orders.placed",
                DlqReason::StreamMissing,
                "not one of --streams",
            ),
            (
                Some("ORDERS"),
                "shop.placed",
                DlqReason::SubjectOutsideStream,
                "",
            ),
        ] {
            let m = route(stream, subject);
            assert_eq!(m.dlq_reason, Some(reason), "{stream:?} {subject}");
            assert_eq!(
                (m.subject.as_str(), m.stream.as_deref()),
                ("shop.dlq.relay", None)
            );
            assert_eq!(m.header(wire::EXPECTED_STREAM), None);
            assert!(m.header(wire::DLQ_DETAIL).unwrap_or("").contains(why));
        }
        // Without a stream role a row goes where it always did; naming the
        // relay's own stream, it chains with its dead letters.
        for stream in [None, Some("SHOP_EVENTS")] {
            let m = route(stream, "shop.placed");
            assert_eq!((m.dlq_reason, m.stream.clone()), (None, None), "{stream:?}");
            assert_eq!(m.header(wire::EXPECTED_STREAM), None);
        }
    }

    #[test]
    fn default_template_and_headers() {
        let m = router("{context}.event.{event_type}.v{event_version}").route(&row(), POS, 1 << 20);
        assert_eq!(m.subject, "shop.event.placed.v2");
        assert_eq!(m.dlq_reason, None);
        assert_eq!(
            m.header(wire::MSG_ID),
            Some("0b7e5c3e-8d7f-4f57-9b5a-3f0d9a3c2e11")
        );
        assert_eq!(m.header(wire::COMMIT_LSN), Some("0/16B3748"));
        assert_eq!(m.header(wire::EVENT_VERSION), Some("2"));
        assert_eq!(m.header(wire::OCCURRED_AT), Some("2026-11-21T21:31:42Z"));
        assert_eq!(m.header(wire::CORRELATION_ID), None);
        assert_eq!(m.body, row().payload);
    }

    #[test]
    fn partition_placeholder_is_stable() {
        let r = router("{context}.{aggregate_type}.{partition}");
        let m = r.route(&row(), POS, 1 << 20);
        assert_eq!(m.subject, format!("shop.order.{}", partition("42", 8)));
        // FNV-1a 64 of "a" is the published test vector 0xaf63dc4c8601ec8c;
        // this mapping must never change between releases.
        assert_eq!(
            partition("a", u32::MAX),
            (0xaf63_dc4c_8601_ec8c_u64 % u64::from(u32::MAX)) as u32
        );
        assert!(partition("anything", 8) < 8);
    }

    #[test]
    fn row_subject_overrides_template() {
        let mut r = row();
        r.subject = Some("shop.custom.x".into());
        assert_eq!(
            router("{context}.e").route(&r, POS, 1 << 20).subject,
            "shop.custom.x"
        );
    }

    #[test]
    fn bad_subjects_are_dead_lettered() {
        for (subject, reason) in [
            ("shop.a b", DlqReason::InvalidSubject),
            ("shop.*", DlqReason::InvalidSubject),
            ("shop.>", DlqReason::InvalidSubject),
            ("shop..x", DlqReason::InvalidSubject),
            ("other.x", DlqReason::SubjectOutsideStream),
            ("shop.dlq.relay", DlqReason::SubjectOutsideStream),
        ] {
            let mut r = row();
            r.subject = Some(subject.into());
            let m = router("{context}.e").route(&r, POS, 1 << 20);
            assert_eq!(m.dlq_reason, Some(reason), "{subject}");
            assert_eq!(m.subject, "shop.dlq.relay");
            assert_eq!(m.header(wire::DLQ_REASON), Some(reason.as_str()));
            assert_eq!(m.header(wire::MSG_ID), Some(r.id.to_string().as_str()));
            assert_eq!(m.body, r.payload, "body kept when it fits");
        }
    }

    #[test]
    fn subjects_match_nats_filters() {
        assert!(subject_matches("shop.>", "shop.a.b"));
        assert!(!subject_matches("shop.>", "shop"));
        assert!(subject_matches("shop.*.v1", "shop.placed.v1"));
        assert!(!subject_matches("shop.*.v1", "shop.placed.x.v1"));
        assert!(subject_matches("a.b", "a.b"));
        assert!(!subject_matches("a.b", "a.b.c"));
        assert!(!subject_matches("a.b.c", "a.b"));
    }

    #[test]
    fn rows_the_server_would_refuse_are_dead_lettered_with_their_reason() {
        let mut r = row();
        r.subject = Some(format!("shop.{}", "x".repeat(MAX_SUBJECT_BYTES)));
        let m = router("{context}.e").route(&r, POS, 1 << 20);
        assert_eq!(m.dlq_reason, Some(DlqReason::SubjectTooLong));
        assert!(m.header_size() < 4096, "the dead letter itself is sendable");

        let mut r = row();
        r.aggregate_id = Some("a".repeat(70_000));
        let m = router("{context}.e").route(&r, POS, 1 << 20);
        assert_eq!(m.dlq_reason, Some(DlqReason::HeadersTooLarge));
        assert!(m.header_size() <= MAX_HEADER_BYTES);
        assert_eq!(m.header(wire::MSG_ID), Some(r.id.to_string().as_str()));

        // A stream that captures only some of the context's subjects.
        let narrow = Router::new(
            "shop",
            Template::parse("{context}.e", "shop").unwrap(),
            8,
            false,
            "1/db/slot".into(),
            vec!["shop.orders.>".into(), wire::relay_dlq_subject("shop")],
        );
        let mut r = row();
        r.subject = Some("shop.orders.placed".into());
        assert_eq!(narrow.route(&r, POS, 1 << 20).dlq_reason, None);
        r.subject = Some("shop.billing.paid".into());
        assert_eq!(
            narrow.route(&r, POS, 1 << 20).dlq_reason,
            Some(DlqReason::SubjectOutsideStream)
        );
    }

    #[test]
    fn a_refused_message_becomes_a_dead_letter_that_fits() {
        let m = router("{context}.e").route(&row(), POS, 1 << 20);
        let id = m.msg_id.clone();
        let dl = dead_letter(
            m,
            &wire::relay_dlq_subject("shop"),
            DlqReason::Refused,
            Some("message size exceeds maximum allowed"),
            100,
        );
        assert_eq!(dl.subject, wire::relay_dlq_subject("shop"));
        assert_eq!(dl.header(wire::DLQ_REASON), Some("refused"));
        assert_eq!(dl.header(wire::MSG_ID), Some(id.as_str()));
        assert!(dl.header(wire::DLQ_DETAIL).is_some());
        assert!(dl.body.is_empty(), "the body did not fit in 100 bytes");
    }

    #[test]
    fn oversized_is_dead_lettered_with_empty_body() {
        let mut r = row();
        r.payload = Bytes::from(vec![b'1'; 2000]);
        let m = router("{context}.e").route(&r, POS, 1000);
        assert_eq!(m.dlq_reason, Some(DlqReason::TooLarge));
        assert!(m.body.is_empty());
        assert!(m.wire_size() <= 1000);
    }

    #[test]
    fn user_headers_pass_and_reserved_ones_are_refused() {
        let mut r = row();
        r.headers = Some(Bytes::from_static(
            br#"{"traceparent": "00-abc-01", "n": 5}"#,
        ));
        let m = router("{context}.e").route(&r, POS, 1 << 20);
        assert_eq!(m.header(wire::TRACEPARENT), Some("00-abc-01"));
        assert_eq!(m.header("n"), None, "non-string entries are skipped");
        r.headers = Some(Bytes::from_static(br#"{"Nats-Msg-Id": "x"}"#));
        let m = router("{context}.e").route(&r, POS, 1 << 20);
        assert_eq!(m.dlq_reason, Some(DlqReason::InvalidHeader));
        assert_eq!(m.header(wire::MSG_ID), Some(r.id.to_string().as_str()));
    }

    #[test]
    fn envelope_is_valid_json_with_raw_payload() {
        let mut r = row();
        r.aggregate_id = Some("a\"b".into());
        let from = Provenance {
            context: "shop",
            schema_uri: None,
            ingested_at: None,
        };
        let v: serde_json::Value = serde_json::from_slice(&envelope(&r, &from)).unwrap();
        assert_eq!(v["aggregateId"], "a\"b");
        assert_eq!(v["partitionKey"], "a\"b");
        assert_eq!(v["eventVersion"], 2);
        assert_eq!(v["payload"]["total"], 10);
        assert_eq!(v["sourceContext"], "shop");
        for unknown in ["correlationId", "causationId", "schemaUri", "ingestedAt"] {
            assert!(v[unknown].is_null(), "{unknown} is null when unknown");
        }
    }

    #[test]
    fn the_envelope_carries_the_commit_time_and_the_source_context() {
        let r = row();
        let mut router = router("{context}.event.{event_type}.v{event_version}");
        router.envelope = true;
        let pos = POS;
        // 2026-11-21T21:31:43.5Z in Postgres-epoch microseconds.
        let commit = 1_795_296_703_500_000 - super::super::outbox_row::PG_EPOCH_UNIX_MICROS;
        let msg = router.route_committed(r.clone(), pos, Some(commit), 1 << 20);
        assert!(msg
            .headers
            .iter()
            .any(|(k, v)| k == wire::ENVELOPE && v == "1"));
        let v: serde_json::Value = serde_json::from_slice(&msg.body).unwrap();
        assert_eq!(v["eventId"], r.id.to_string());
        assert_eq!(v["outboxId"], r.id.to_string());
        assert_eq!(v["occurredAt"], "2026-11-21T21:31:42Z");
        assert_eq!(v["ingestedAt"], "2026-11-21T21:31:43.5Z");
        assert_eq!(v["sourceContext"], "shop");
        let from_snapshot = router.route(&r, pos, 1 << 20);
        let v: serde_json::Value = serde_json::from_slice(&from_snapshot.body).unwrap();
        assert!(v["ingestedAt"].is_null());
    }

    #[test]
    fn template_errors() {
        assert_eq!(
            Template::parse("{context}.{no pe}", "x"),
            Err(TemplateError::Unknown("no pe".into()))
        );
        // Any other name is a column of the table (checked at start).
        let t = Template::parse("{namespace}.{topic}", "x").unwrap();
        assert_eq!(t.columns(), ["namespace", "topic"]);
        assert!(t.roles().is_empty());
        assert_eq!(
            Template::parse("{context", "x"),
            Err(TemplateError::Unclosed)
        );
    }

    #[test]
    fn wire_size_matches_nats_header_encoding() {
        let m = OutMessage {
            subject: "a".into(),
            msg_id: "1".into(),
            headers: vec![("A".into(), "b".into())],
            body: Bytes::from_static(b"xyz"),
            dlq_reason: None,
            stream: None,
        };
        assert_eq!(m.wire_size(), "NATS/1.0\r\nA: b\r\n\r\n".len() + 3);
    }

    /// SPEC §13: a template may name any column; `--header-columns` travel
    /// as `Outbox-<Column-Name>`; a role with no source leaves its header
    /// out; a row lacking what the template needs is dead-lettered.
    #[test]
    fn columns_feed_the_template_and_headers() {
        let router = Router::new(
            "mk",
            Template::parse("{namespace}.{topic}", "mk").unwrap(),
            16,
            false,
            "src".into(),
            vec![wire::stream_subjects("mk")],
        )
        .with_columns(
            vec!["namespace".into(), "topic".into(), "tenant_id".into()],
            &["tenant_id".into()],
        );
        let mut r = row();
        r.aggregate_type = None;
        r.columns = vec![
            Some("mk".into()),
            Some("user.created".into()),
            Some("t-1".into()),
        ];
        let m = router.route(&r, POS, 1 << 20);
        assert_eq!(m.subject, "mk.user.created");
        assert_eq!(m.header("Outbox-Tenant-Id"), Some("t-1"));
        assert_eq!(m.header(wire::AGGREGATE_TYPE), None);
        r.columns[1] = None;
        let m = router.route(&r, POS, 1 << 20);
        assert_eq!(m.dlq_reason, Some(DlqReason::InvalidSubject));
        assert_eq!(wire::column_header("dedupe_key"), "Outbox-Dedupe-Key");
    }
}
