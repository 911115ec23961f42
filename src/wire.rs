//! The wire contract (SPEC §3, §4, §6): every header name, the
//! `Outbox-Source` format, commit positions, dead-letter reasons and the
//! default names derived from a context. Defined once, here.
//!
//! The relay writes these and the consumer, the relay's own restart scan and
//! users' services read them; a silent mismatch between two copies would
//! break the resume skip or dedupe, so no other module (nor a test) spells a
//! header name or a derived name itself.

use pgwire_replication::Lsn;

// ---- Headers the relay sets on every event (SPEC §4). ----

/// On a resumed backfill's messages: what earlier runs of that backfill
/// are known to have stored, so a run interrupted in its turn passes it on
/// (`<occurred_at> <id> <xid horizon>`, comma-separated; see
/// `publish::Covered`).
pub const BACKFILL_COVERED: &str = "Outbox-Backfill-Covered";
/// On a backfill's messages: which run published it (a random id) and
/// that run's publish window (`--max-inflight`), `<run> <window>`. A
/// resumed backfill proves what a run stored from that run's own messages
/// alone, under its own window (see `publish::prove`).
pub const BACKFILL_RUN: &str = "Outbox-Backfill-Run";
/// On the last message a backfill run published, once its snapshot was
/// read to the end (`1`): the run finished, so a slot missing after it was
/// lost, not never made.
pub const BACKFILL_END: &str = "Outbox-Backfill-End";
/// On an event written with `outbox_emit()`: it has no outbox row (the
/// audit counts it as not verifiable).
pub const EMITTED: &str = "Outbox-Emitted";
/// On a row `outbox-relay audit --repair` published again: not a relay's
/// message, so never a relay's tail.
pub const REPAIR: &str = "Outbox-Repair";

/// JetStream's dedupe key: the outbox row id.
pub const MSG_ID: &str = "Nats-Msg-Id";
pub const EVENT_TYPE: &str = "Outbox-Event-Type";
pub const EVENT_VERSION: &str = "Outbox-Event-Version";
pub const AGGREGATE_TYPE: &str = "Outbox-Aggregate-Type";
/// The ordering key: a consumer hands one aggregate's messages to its
/// handler one at a time.
pub const AGGREGATE_ID: &str = "Outbox-Aggregate-Id";
pub const OCCURRED_AT: &str = "Outbox-Occurred-At";
pub const CORRELATION_ID: &str = "Outbox-Correlation-Id";
pub const CAUSATION_ID: &str = "Outbox-Causation-Id";
/// With [`TXN_INDEX`], the event's [`Position`] in its source's WAL.
pub const COMMIT_LSN: &str = "Outbox-Commit-Lsn";
pub const TXN_INDEX: &str = "Outbox-Txn-Index";
/// Which WAL history wrote the message ([`source_id`]).
pub const SOURCE: &str = "Outbox-Source";
/// A full transaction id (xid8) below which every transaction had ended
/// before this message's transaction committed: a row of a transaction
/// the stream cannot hold yet has an id at or past it. Streamed messages
/// take it from the relay's periodic samples, backfilled ones from their
/// snapshot. What a resync after a lost slot republishes besides
/// `occurred_at >= T`.
pub const XID_HORIZON: &str = "Outbox-Xid-Horizon";
/// On rows read from a new slot's snapshot rather than streamed: which rows
/// that backfill publishes ([`BACKFILL_UNPUBLISHED`] or `since {time}`,
/// then `; xid {xid8}` when it also republishes rows of transactions from
/// that id on).
/// Their position is (0/0, row number): before anything the slot streams.
pub const BACKFILL: &str = "Outbox-Backfill";
pub const BACKFILL_UNPUBLISHED: &str = "unpublished";
pub const BACKFILL_SINCE: &str = "since ";
pub const BACKFILL_XID: &str = "; xid ";
/// On every message of a transaction too large for one atomic batch: which
/// of its batches (from 1) carried it. The messages of its last batch also
/// carry [`TXN_BATCHES`], the count, so a consumer that reassembles knows the
/// transaction is whole. A transaction that fits one batch has neither.
pub const TXN_BATCH: &str = "Outbox-Txn-Batch";
pub const TXN_BATCHES: &str = "Outbox-Txn-Batches";
/// The schema the payload passed: its path in `--schemas` and
/// `#sha256-` + the file's digest.
pub const SCHEMA: &str = "Outbox-Schema";
/// `1` when the body is the `--envelope` JSON (the payload is its
/// `payload` field), so a consumer checks the payload, not the envelope.
pub const ENVELOPE: &str = "Outbox-Envelope";
/// JetStream atomic batch publish (ADR-50, nats-server 2.12+).
pub const BATCH_ID: &str = "Nats-Batch-Id";
pub const BATCH_SEQUENCE: &str = "Nats-Batch-Sequence";
pub const BATCH_COMMIT: &str = "Nats-Batch-Commit";

/// NATS's own headers (lower-cased prefix): publish expectations, dedupe.
pub const NATS_HEADER_PREFIX: &str = "nats-";
/// Ours (lower-cased prefix).
pub const OUTBOX_HEADER_PREFIX: &str = "outbox-";
/// Name prefixes users may not set through the row's `headers`: they would
/// break dedupe or lie about the event.
pub const RESERVED_PREFIXES: [&str; 2] = [NATS_HEADER_PREFIX, OUTBOX_HEADER_PREFIX];

/// JetStream's optimistic-concurrency header: the publish is refused unless
/// the stream's last message has this id. The relay's order guard.
pub const EXPECTED_LAST_MSG_ID: &str = "Nats-Expected-Last-Msg-Id";
/// Set on a row routed by its `stream` role (SPEC §13): JetStream refuses
/// it unless it lands in that stream.
pub const EXPECTED_STREAM: &str = "Nats-Expected-Stream";

/// W3C trace context, passed from the row's `headers` to the handler.
/// Subjects the processes of one durable talk on (core NATS, outside any
/// stream): `{CREW_PREFIX}.{stream}.{durable}.…` (see `consumer/crew.rs`).
pub const CREW_PREFIX: &str = "_OUTBOX_CREW";
/// The prefix of the logical decoding messages `outbox_emit()` writes
/// (SPEC §12); the version names the content's shape.
pub const EMIT_PREFIX: &str = "outbox-relay:event:v1";
/// What every version of that prefix starts with: a relay that meets a
/// version it cannot read stops instead of confirming past the event.
pub const EMIT_PREFIX_FAMILY: &str = "outbox-relay:event:";
pub const TRACEPARENT: &str = "traceparent";

/// A W3C `traceparent` the consumer passes on: `version-trace-parent-flags`
/// in lowercase hex (2, 32, 16 and 2 digits; a later version may add
/// fields), ids not all zero. Anything else is dropped, as the W3C says a
/// receiver does: sent as it was, a control character in it made every
/// HTTP call fail before it left ("handler unreachable"), for as long as
/// the message was retried.
pub fn traceparent_valid(value: &str) -> bool {
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let mut parts = value.split('-');
    let (Some(version), Some(trace), Some(parent), Some(flags)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let rest_ok = match version {
        "00" => parts.next().is_none(),
        "ff" => false,
        _ => parts.all(|p| p.bytes().all(|b| b.is_ascii_alphanumeric())),
    };
    hex(version, 2)
        && hex(trace, 32)
        && hex(parent, 16)
        && hex(flags, 2)
        && trace.bytes().any(|b| b != b'0')
        && parent.bytes().any(|b| b != b'0')
        && rest_ok
}
/// HTTP header of the handler call: the message id.
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";

// ---- Dead letters (SPEC §4 relay, §6 consumer). ----

pub const DLQ_REASON: &str = "Outbox-Dlq-Reason";
/// The subject the message would have had.
pub const DLQ_ORIGINAL_SUBJECT: &str = "Outbox-Dlq-Original-Subject";
/// The relay's explanation of a row it could not decode.
pub const DLQ_DETAIL: &str = "Outbox-Dlq-Detail";
pub const DLQ_ATTEMPTS: &str = "Outbox-Dlq-Attempts";
/// The dead letter's class, as the playbook triages it (`triage::Class`):
/// `schema_invalid`, `handler_rejected`, `transient_exhausted`, ….
pub const DLQ_CLASS: &str = "Outbox-Dlq-Class";
/// A short digest of the letter's cause: letters of one cause share it
/// (`triage::fingerprint`).
pub const DLQ_FINGERPRINT: &str = "Outbox-Dlq-Fingerprint";
/// Set by consumers on their dead letters; the relay's restart scan skips
/// such messages.
pub const DLQ_CONSUMER: &str = "Outbox-Dlq-Consumer";
/// On a consumer's dead letter: the original `Nats-Msg-Id`. The dead letter's
/// own id is [`consumer_dlq_msg_id`], so two consumers' copies of one
/// message do not deduplicate each other.
pub const DLQ_ORIGINAL_ID: &str = "Outbox-Dlq-Original-Id";
/// Where the dead-lettered message is: its stream and sequence.
pub const DLQ_ORIGINAL_STREAM: &str = "Outbox-Dlq-Original-Stream";
pub const DLQ_ORIGINAL_SEQ: &str = "Outbox-Dlq-Original-Seq";
/// On a dead letter stored without its body (with it, the DLQ would have
/// refused it for its size): the body's length. `dlq replay` reads the body
/// from [`DLQ_ORIGINAL_STREAM`] at [`DLQ_ORIGINAL_SEQ`].
pub const DLQ_PAYLOAD_OMITTED: &str = "Outbox-Dlq-Payload-Omitted";
/// [`DLQ_PAYLOAD_OMITTED`]'s value on the dead letter of a message that
/// left its stream while it waited for a retry: no body is kept anywhere.
pub const EXPIRED: &str = "expired";

// ---- Replayed dead letters (SPEC §9, `outbox-relay dlq replay`). ----

/// On a replayed dead letter: the original message id (the inbox's key and
/// the handler's idempotency key).
pub const REPLAY_OF: &str = "Outbox-Replay-Of";
/// The durable the replay is for; other durables ack it without a call.
pub const REPLAY_FOR: &str = "Outbox-Replay-For";
pub const REPLAYED_BY: &str = "Outbox-Replayed-By";
pub const REPLAYED_AT: &str = "Outbox-Replayed-At";

/// A replay's own `Nats-Msg-Id`: one per dead letter, so a replay sent
/// twice within the duplicate window is stored once.
pub fn replay_msg_id(dlq_stream: &str, dlq_seq: u64) -> String {
    format!("replay:{dlq_stream}:{dlq_seq}")
}

/// Why the relay dead-lettered a row (the `reason` metric label and the
/// `Outbox-Dlq-Reason` header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DlqReason {
    InvalidSubject,
    SubjectOutsideStream,
    /// Longer than the server's control line allows.
    SubjectTooLong,
    InvalidHeader,
    /// A header block JetStream would refuse (over 64 KiB).
    HeadersTooLarge,
    /// Over the server's `max_payload` or the stream's `max_msg_size`.
    TooLarge,
    BadRow,
    /// Refused by the server at publish for a reason of its own (the detail
    /// header has its words).
    Refused,
    /// The payload fails its event type's JSON Schema (the detail header
    /// has where and why).
    SchemaInvalid,
    /// The event type has no schema, and `--schema-missing dead-letter`.
    SchemaMissing,
    /// The row's `stream` names a stream that does not exist, or one the
    /// relay is not given (`--streams`).
    StreamMissing,
    /// The row's routed stream is at its limits (`max_msgs`, `max_bytes`
    /// or `max_msgs_per_subject` with discard new) and refused it.
    StreamFull,
}

impl DlqReason {
    pub const ALL: [DlqReason; 12] = [
        Self::InvalidSubject,
        Self::SubjectOutsideStream,
        Self::SubjectTooLong,
        Self::InvalidHeader,
        Self::HeadersTooLarge,
        Self::TooLarge,
        Self::BadRow,
        Self::Refused,
        Self::SchemaInvalid,
        Self::SchemaMissing,
        Self::StreamMissing,
        Self::StreamFull,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidSubject => "invalid_subject",
            Self::SubjectOutsideStream => "subject_outside_stream",
            Self::SubjectTooLong => "subject_too_long",
            Self::InvalidHeader => "invalid_header",
            Self::HeadersTooLarge => "headers_too_large",
            Self::TooLarge => "too_large",
            Self::BadRow => "bad_row",
            Self::SchemaInvalid => "schema_invalid",
            Self::SchemaMissing => "schema_missing",
            Self::Refused => "refused",
            Self::StreamMissing => "stream_missing",
            Self::StreamFull => "stream_full",
        }
    }
}

// ---- Positions and sources. ----

/// Where an event sits in its source's WAL: the commit LSN of its
/// transaction and its index inside it. Positions of one source are totally
/// ordered, which lets a restarted relay find where the stream ends without
/// relying on the duplicate window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Position {
    pub commit_lsn: Lsn,
    pub index: u32,
}

impl Position {
    /// The position a message's headers state, if both are present and valid.
    pub fn from_headers<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Option<Position> {
        let commit_lsn = Lsn::parse(get(COMMIT_LSN)?).ok()?;
        let index = get(TXN_INDEX)?.parse().ok()?;
        Some(Position { commit_lsn, index })
    }

    /// The message id of a row too broken to have one of its own: unique per
    /// source position, so a replay still dedupes.
    pub fn fallback_msg_id(self) -> String {
        format!("{}-{}", self.commit_lsn, self.index)
    }
}

/// A message id in 16 bytes, for the sets a restart reads back from the
/// stream (up to a million ids): a UUID written as Postgres writes one
/// (lowercase, hyphenated) is its own bytes, any other id the first 16
/// bytes of its SHA-256. Two ids share a key only if they are the same id
/// (or collide in 128 bits). A `String` per id cost ~100 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IdKey([u8; 16]);

impl IdKey {
    pub fn of(id: &str) -> IdKey {
        if id.len() == 36 && !id.bytes().any(|b| b.is_ascii_uppercase()) {
            if let Ok(u) = uuid::Uuid::try_parse(id) {
                return IdKey(*u.as_bytes());
            }
        }
        use sha2::Digest;
        let digest = sha2::Sha256::digest(id.as_bytes());
        let mut key = [0; 16];
        key.copy_from_slice(&digest[..16]);
        IdKey(key)
    }
}

/// The `Outbox-Source` of a relay: `{system id}/{timeline}/{database}/{slot}`.
///
/// LSNs order events only within one WAL history: after a point-in-time
/// restore or a promotion the timeline changes and LSNs can repeat, so a
/// restarted relay must not skip events by comparing against positions from
/// another timeline. With the timeline in the source it does not; at worst it
/// republishes, and `Nats-Msg-Id` and the consumers' inbox dedupe that.
pub fn source_id(system_id: &str, timeline: u32, database: &str, slot: &str) -> String {
    format!("{system_id}/{timeline}/{database}/{slot}")
}

/// The sources whose positions still hold for a relay: its own, and the
/// same system, database and slot on an ancestor timeline for positions
/// before that timeline ended. A promoted standby (a PostgreSQL 17 failover
/// slot carried across) streams the same WAL up to the switch point, so the
/// old primary's last message there is where the new one resumes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lineage {
    pub source: String,
    /// `(timeline, the LSN where it ended)`, from the server's history file.
    ancestors: Vec<(String, Lsn)>,
}

impl Lineage {
    /// From the current source and the text of the timeline's history file
    /// (`TIMELINE_HISTORY`; empty on timeline 1). Lines it cannot read are
    /// ignored: a missing ancestor only costs a replay the duplicate window
    /// and the inboxes absorb.
    pub fn new(system_id: &str, timeline: u32, database: &str, slot: &str, history: &str) -> Self {
        let ancestors = history
            .lines()
            .filter_map(|line| {
                let mut fields = line.split_whitespace();
                let tli: u32 = fields.next()?.parse().ok()?;
                let end = Lsn::parse(fields.next()?).ok()?;
                (tli < timeline).then(|| (source_id(system_id, tli, database, slot), end))
            })
            .collect();
        Lineage {
            source: source_id(system_id, timeline, database, slot),
            ancestors,
        }
    }

    /// Whether a message from `source` at `at` is part of this WAL history.
    pub fn holds(&self, source: &str, at: Position) -> bool {
        source == self.source
            || self
                .ancestors
                .iter()
                .any(|(s, end)| s == source && at.commit_lsn < *end)
    }
}

/// Whether an `Outbox-Source` names this server (system id) and database,
/// on any timeline and through any slot: what tells a lost slot.
pub fn same_database(source: &str, system_id: &str, database: &str) -> bool {
    let mut parts = source.splitn(4, '/');
    let (Some(sys), Some(_timeline), Some(db), Some(_slot)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    sys == system_id && db == database
}

// ---- Names derived from a context (SPEC §3, §4, §6). ----

/// Slot and publication: `outbox_relay_{context}` (a SQL identifier, so `-`
/// becomes `_`).
pub fn slot_name(context: &str) -> String {
    format!("outbox_relay_{}", context.replace('-', "_"))
}

/// The temporary slot a first start reads its snapshot through: the slot's
/// name plus `_init`, so slot names are held to 58 bytes.
pub fn init_slot_name(slot: &str) -> String {
    format!("{slot}_init")
}

pub fn publication_name(context: &str) -> String {
    slot_name(context)
}

/// The events stream: `{CONTEXT}_EVENTS`.
pub fn stream_name(context: &str) -> String {
    format!("{}_EVENTS", context.to_uppercase().replace('-', "_"))
}

/// What the events stream captures: `{context}.>`.
pub fn stream_subjects(context: &str) -> String {
    format!("{context}.>")
}

/// Where the relay dead-letters rows: `{context}.dlq.relay`.
pub fn relay_dlq_subject(context: &str) -> String {
    format!("{context}.dlq.relay")
}

/// Subjects under `{context}.dlq.` are reserved for the relay's dead letters.
pub fn relay_dlq_prefix(context: &str) -> String {
    format!("{context}.dlq.")
}

/// The consumers' default dead-letter prefix: `dlq.{context}`. The context
/// `dlq` is reserved because of it.
pub fn consumer_dlq_prefix(context: &str) -> String {
    format!("dlq.{context}")
}

/// A consumer dead letter's subject: `{prefix}.{original subject}`.
pub fn consumer_dlq_subject(prefix: &str, original: &str) -> String {
    format!("{prefix}.{original}")
}

/// A message id as the inbox and the handler know it: the UUID it is (in
/// its canonical text), or, for a row id of another type (text, bigint:
/// SPEC §13), a UUID derived from it (v5, so every consumer derives the
/// same) while the handler is given the id itself. `None`: not usable as an
/// id (empty, or not one header line).
pub fn message_id(raw: &str) -> Option<(uuid::Uuid, String)> {
    /// Fixed for ever: the inbox rows of text ids are keyed under it.
    const TEXT_IDS: uuid::Uuid = uuid::Uuid::from_u128(0x5c1d_7f2e_9a4b_4e0c_8b6d_2f1a_3e5c_7d90);
    if raw.is_empty() || raw.chars().any(char::is_control) {
        return None;
    }
    Some(match uuid::Uuid::parse_str(raw) {
        Ok(id) => (id, id.to_string()),
        Err(_) => (
            uuid::Uuid::new_v5(&TEXT_IDS, raw.as_bytes()),
            raw.to_owned(),
        ),
    })
}

/// `Nats-Msg-Id` of a consumer's dead letter: `{consumer}:{original id}`.
/// Unique per consumer, so each consumer dead-letters a message once and
/// never swallows another consumer's copy.
///
/// `generation` counts how often the message was opened again (a reset or a
/// replay) before this dead-lettering: the first dead letter keeps the plain
/// `{consumer}:{original}`, a later one `{consumer}:{original}:{generation}`,
/// so the DLQ's duplicate window never swallows it.
pub fn consumer_dlq_msg_id(consumer: &str, original: &str, generation: i32) -> String {
    if generation == 0 {
        format!("{consumer}:{original}")
    } else {
        format!("{consumer}:{original}:{generation}")
    }
}

/// The stream a consumer creates for its dead letters: `dlq.orders` →
/// `DLQ_ORDERS`.
pub fn dlq_stream_name(prefix: &str) -> String {
    prefix
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect()
}

/// `Outbox-` and the column name in Title-Case, `_` as `-` (SPEC §13):
/// `tenant_id` → `Outbox-Tenant-Id`.
pub fn column_header(column: &str) -> String {
    let mut out = String::from("Outbox");
    for word in column.split('_').filter(|w| !w.is_empty()) {
        out.push('-');
        let mut chars = word.chars();
        if let Some(c) = chars.next() {
            out.extend(c.to_uppercase());
            out.push_str(&chars.as_str().to_ascii_lowercase());
        }
    }
    out
}

/// The first line of every NATS header block (`HPUB`, `HMSG`).
pub const HEADER_VERSION_LINE: &str = "NATS/1.0\r\n";

/// A NATS header block's size on the wire with these (name, value) lines:
/// the version line, `name: value\r\n` each, and a closing `\r\n`. What
/// counts against the server's `max_payload` with the body; the one place
/// the relay, the consumer's crew and the publish link size headers.
pub fn header_block_size<'a>(lines: impl IntoIterator<Item = (&'a str, &'a str)>) -> usize {
    HEADER_VERSION_LINE.len()
        + lines
            .into_iter()
            .map(|(k, v)| k.len() + 2 + v.len() + 2)
            .sum::<usize>()
        + 2
}

#[cfg(test)]
mod tests {

    #[test]
    fn an_id_key_tells_ids_apart_as_their_text_does() {
        let u = "0b7e5c3e-8d7f-4f57-9b5a-3f0d9a3c2e11";
        assert_eq!(IdKey::of(u), IdKey::of(u));
        let parsed = uuid::Uuid::parse_str(u).unwrap();
        assert_eq!(
            IdKey::of(u),
            IdKey(*parsed.as_bytes()),
            "a UUID is its bytes"
        );
        // Another spelling of the same UUID is another message id.
        assert_ne!(IdKey::of(u), IdKey::of(&u.to_uppercase()));
        assert_ne!(IdKey::of(u), IdKey::of(&parsed.simple().to_string()));
        for (a, b) in [("order-1", "order-2"), ("1", "01"), ("", " ")] {
            assert_eq!(IdKey::of(a), IdKey::of(a));
            assert_ne!(IdKey::of(a), IdKey::of(b), "{a:?} / {b:?}");
        }
        assert_eq!(std::mem::size_of::<IdKey>(), 16);
    }

    #[test]
    fn a_message_id_is_its_uuid_or_a_uuid_derived_from_its_text() {
        let u = "0b7e5c3e-8d7f-4f57-9b5a-3f0d9a3c2e11";
        let (key, text) = message_id(&u.to_uppercase()).unwrap();
        assert_eq!((key.to_string().as_str(), text.as_str()), (u, u));
        let (a, text) = message_id("order-7").unwrap();
        assert_eq!(text, "order-7");
        assert_eq!(Some(a), message_id("order-7").map(|m| m.0), "stable");
        assert_ne!(Some(a), message_id("order-8").map(|m| m.0));
        assert_eq!(message_id(""), None);
        assert_eq!(message_id("a\nb"), None);
    }

    #[test]
    fn a_traceparent_is_passed_on_only_when_it_is_one() {
        use super::traceparent_valid;
        let good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        assert!(traceparent_valid(good));
        assert!(traceparent_valid(
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future"
        ));
        for bad in [
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\u{1}",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920\u{1}331-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-abc-01",
            "",
        ] {
            assert!(!traceparent_valid(bad), "{bad:?}");
        }
    }
    #[test]
    fn a_lineage_holds_ancestor_positions_before_their_switch_point() {
        use super::{Lineage, Position};
        use pgwire_replication::Lsn;
        let history = "1\t0/3000158\tno recovery target specified\n\n2\t0/5000000\tbefore 2000-01-01\ngarbage\n";
        let l = Lineage::new("7", 3, "db", "s", history);
        let at = |lsn: &str| Position {
            commit_lsn: Lsn::parse(lsn).unwrap(),
            index: 0,
        };
        assert!(l.holds("7/3/db/s", at("0/9000000")));
        assert!(l.holds("7/1/db/s", at("0/3000157")));
        assert!(
            !l.holds("7/1/db/s", at("0/3000158")),
            "the old primary went on past the switch"
        );
        assert!(l.holds("7/2/db/s", at("0/4FFFFFF")));
        assert!(!l.holds("7/2/db/s", at("0/5000000")));
        assert!(!l.holds("7/1/db/other", at("0/1000000")), "another slot");
        assert!(!l.holds("8/1/db/s", at("0/1000000")), "another server");
        assert!(!l.holds("7/4/db/s", at("0/1000000")), "not an ancestor");
        let first = Lineage::new("7", 1, "db", "s", "");
        assert_eq!(first.source, "7/1/db/s");
        assert!(!first.holds("7/0/db/s", at("0/1")));
    }

    use super::*;

    #[test]
    fn names_derive_from_the_context() {
        assert_eq!(slot_name("my-ctx"), "outbox_relay_my_ctx");
        assert_eq!(publication_name("billing"), "outbox_relay_billing");
        assert_eq!(stream_name("my-ctx"), "MY_CTX_EVENTS");
        assert_eq!(stream_subjects("shop"), "shop.>");
        assert_eq!(relay_dlq_subject("shop"), "shop.dlq.relay");
        assert!(relay_dlq_subject("shop").starts_with(&relay_dlq_prefix("shop")));
        assert_eq!(consumer_dlq_prefix("shop"), "dlq.shop");
        assert_eq!(
            consumer_dlq_subject("dlq.shop", "shop.e"),
            "dlq.shop.shop.e"
        );
        assert_eq!(dlq_stream_name("dlq.orders"), "DLQ_ORDERS");
        assert_eq!(dlq_stream_name("dlq.my-ctx"), "DLQ_MY_CTX");
    }

    #[test]
    fn source_names_the_timeline() {
        assert_eq!(
            source_id("7310000000000000000", 3, "app", "outbox_relay_orders"),
            "7310000000000000000/3/app/outbox_relay_orders"
        );
        assert_ne!(
            source_id("1", 1, "app", "s"),
            source_id("1", 2, "app", "s"),
            "a new timeline is a new source"
        );
    }

    #[test]
    fn a_source_names_its_database_on_any_timeline() {
        let s = source_id("731", 3, "app", "outbox_relay_x");
        assert!(same_database(&s, "731", "app"));
        assert!(same_database(
            &source_id("731", 4, "app", "other"),
            "731",
            "app"
        ));
        assert!(!same_database(&s, "731", "other"));
        assert!(!same_database(&s, "732", "app"));
        assert!(!same_database("garbage", "731", "app"));
    }

    #[test]
    fn positions_round_trip_through_headers() {
        let p = Position {
            commit_lsn: Lsn(0x16B3748),
            index: 3,
        };
        let lsn = p.commit_lsn.to_string();
        let idx = p.index.to_string();
        let get = |k: &str| match k {
            COMMIT_LSN => Some(lsn.as_str()),
            TXN_INDEX => Some(idx.as_str()),
            _ => None,
        };
        assert_eq!(Position::from_headers(get), Some(p));
        assert_eq!(Position::from_headers(|_| None), None);
        assert_eq!(p.fallback_msg_id(), "0/16B3748-3");
        assert!(
            p < Position {
                commit_lsn: Lsn(0x16B3748),
                index: 4
            }
        );
    }
}
