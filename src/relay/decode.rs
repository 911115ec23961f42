//! From replication events to what the relay does next, without I/O.
//!
//! Tracks the transaction being read (its commit LSN and the index of each
//! outbox row in it), the outbox table's column layout from Relation
//! messages, and the resume point: events the stream already holds at their
//! position are skipped, not republished. Everything that reaches
//! the stream goes through [`Router`], so a bad row becomes a dead letter here.

use std::collections::{BTreeMap, HashMap, VecDeque};

use pgwire_replication::{Lsn, ReplicationEvent};

use super::columns::ColumnMap;
use super::outbox_row::{OutboxLayout, RowError};
use super::pgoutput::{self, DecodeError, Insert, Message, Relation};
use super::route::{OutMessage, Router};
use super::watermark::{Ticket, Watermark};
use crate::error::{Error, Result};
use crate::metrics as m;
use crate::wire::{self, DlqReason, Position};

/// What the loop must do after one event.
#[derive(Debug)]
pub enum Step {
    Nothing,
    /// Confirm this LSN to the slot.
    Confirm(Lsn),
    /// A transaction ended (the publisher may close its batch); confirm
    /// the LSN if one is given.
    Commit(Option<Lsn>),
    /// Publish; ack the watermark with `ticket` once JetStream acks it.
    Publish {
        ticket: Ticket,
        /// Postgres commit time (µs since 2000-01-01), for the latency metric.
        commit_micros: i64,
        /// Where the row is in the WAL.
        pos: Position,
        msg: OutMessage,
    },
}

struct Txn {
    commit_lsn: Lsn,
    commit_time_micros: i64,
    next_index: u32,
}

/// Per relation id: `None` for tables other than the outbox (a shared
/// publication), else its layout or why it cannot be read.
type Layouts = HashMap<u32, Option<std::result::Result<OutboxLayout, RowError>>>;

pub struct Stage {
    schema: String,
    table: String,
    /// The outbox's partitions (schema, name): rows must reach us under the
    /// outbox's name, never theirs (see [`Stage::on_event`]).
    partitions: Vec<(String, String)>,
    /// Relation ids pgoutput gave those partitions, with their names.
    partition_ids: HashMap<u32, String>,
    /// The outbox's oid, as the session found it (pgoutput's relation id).
    outbox_oid: Option<u32>,
    router: Router,
    max_payload: usize,
    layouts: Layouts,
    txn: Option<Txn>,
    resume: Option<Resume>,
    horizons: Horizons,
    /// Publish what `outbox_emit()` writes (SPEC §12).
    emitted: bool,
    /// `--columns`: which column plays which role (SPEC §13).
    map: ColumnMap,
    /// See [`Stage::with_binary`].
    binary: bool,
    /// For each relation whose layout does not fit the map, one that reads
    /// the id alone ([`Stage::skip_stored`]).
    id_layouts: HashMap<u32, OutboxLayout>,
    /// The columns each row carries for the router ([`Router::columns`]).
    extra: Vec<String>,
}

/// Samples of the oldest transaction still running, each with the WAL
/// insert position read just after it: a transaction that commits at or
/// past that position sees every transaction below the sample ended before
/// it, so it is the horizon its messages carry ([`wire::XID_HORIZON`]).
#[derive(Debug, Default)]
pub struct Horizons {
    samples: VecDeque<(Lsn, u64)>,
}

impl Horizons {
    /// Samples a relay far behind the WAL still needs: beyond this many,
    /// every other one is dropped (an older sample stays true, only coarser).
    const MAX: usize = 64;

    pub fn add(&mut self, at: Lsn, xid: u64) {
        if self.samples.back().is_some_and(|&(l, x)| at < l || xid < x) {
            return;
        }
        if self.samples.len() >= Self::MAX {
            let mut i = 0;
            self.samples.retain(|_| {
                i += 1;
                i % 2 == 1
            });
        }
        self.samples.push_back((at, xid));
    }

    /// The horizon of a transaction committing at `commit`: the newest
    /// sample taken before it. Commits only grow, so older samples go.
    pub fn at(&mut self, commit: Lsn) -> Option<u64> {
        while self.samples.get(1).is_some_and(|&(l, _)| l <= commit) {
            self.samples.pop_front();
        }
        self.samples
            .front()
            .filter(|&&(l, _)| l <= commit)
            .map(|&(_, x)| x)
    }
}

/// Where a restarted relay stands against the stream: its last event of
/// this source (`tail`) and, read back at the replay's pace, the events the
/// stream holds since the slot's confirmed position, by WAL position. A
/// replayed event at or before the tail is skipped only when the stream has
/// that very event at its position: after a disk snapshot restore (same
/// system id, same timeline) new transactions reuse LSNs the tail passed,
/// and skipping by position alone lost them.
///
/// Reading all of it before streaming capped the read (a million messages,
/// ten seconds) and held every id at once; what lay past the cap was stored
/// again once the duplicate window had passed. The session reads ahead of
/// the replay only as far as its next event ([`Resume::wants`]), so the
/// entries held are the few between the replay and the read.
#[derive(Debug, Clone)]
pub struct Resume {
    pub tail: Position,
    /// Read back and not yet passed by the replay.
    stored: BTreeMap<Position, wire::IdKey>,
    /// The stream has been read through this position: an event at or
    /// before it that `stored` lacks is not held (or was not read: it is
    /// published again, a repeat, never a loss).
    read_to: Option<Position>,
}

impl Resume {
    /// At most this many entries are held; past it, what is read is
    /// dropped (published again). Only a stream whose messages are far out
    /// of position order gets there.
    pub const HELD_MAX: usize = 1 << 16;

    pub fn new(tail: Position) -> Self {
        Self {
            tail,
            stored: BTreeMap::new(),
            read_to: None,
        }
    }

    /// Whether the stream must be read further before the event at `pos`
    /// can be told stored or not.
    pub fn wants(&self, pos: Position) -> bool {
        pos <= self.tail && self.read_to.is_none_or(|r| pos > r)
    }

    /// A message of this source the stream holds at `at`.
    pub fn found(&mut self, at: Position, id: wire::IdKey) {
        if at <= self.tail && self.stored.len() < Self::HELD_MAX {
            self.stored.insert(at, id);
        }
    }

    /// The stream has been read through `at`.
    pub fn read_through(&mut self, at: Position) {
        self.read_to = Some(self.read_to.map_or(at, |r| r.max(at)));
    }

    /// Nothing will be read any more: events past what was read are
    /// published again.
    pub fn read_no_further(&mut self) {
        let read = self.read_to.unwrap_or(Position {
            commit_lsn: Lsn(0),
            index: 0,
        });
        self.tail = self.tail.min(read);
        self.read_to = Some(self.tail);
    }

    /// How many entries are held now.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.stored.len()
    }

    /// The id the stream holds at `pos`, if read; entries before `pos` go,
    /// as the replay's positions only grow.
    fn take(&mut self, pos: Position) -> Option<wire::IdKey> {
        while let Some(e) = self.stored.first_entry() {
            if *e.key() >= pos {
                break;
            }
            e.remove();
        }
        if self.read_to.is_none_or(|r| pos > r) {
            return None;
        }
        self.stored.remove(&pos)
    }
}

impl Stage {
    /// `resume`: what of this source the stream already holds.
    pub fn new(
        schema: &str,
        table: &str,
        partitions: Vec<(String, String)>,
        router: Router,
        max_payload: usize,
        resume: Option<Resume>,
    ) -> Self {
        let extra = router.columns().to_vec();
        Self {
            schema: schema.to_owned(),
            table: table.to_owned(),
            partitions,
            partition_ids: HashMap::new(),
            outbox_oid: None,
            router,
            max_payload,
            layouts: HashMap::new(),
            txn: None,
            resume,
            horizons: Horizons::default(),
            emitted: true,
            map: ColumnMap::default(),
            extra,
            binary: false,
            id_layouts: HashMap::new(),
        }
    }

    /// `--columns`: which column plays which role.
    pub fn with_columns(mut self, map: ColumnMap) -> Self {
        self.map = map;
        self
    }

    /// Whether the session streams binary tuples: a template or header
    /// column retyped while it runs to a type they carry in a form of its
    /// own no longer fits.
    /// The outbox's oid: its rows are read under another name too (renamed
    /// or moved while the relay streamed, they were skipped as another
    /// table's, and the slot confirmed past them; `guard` stops the relay
    /// on a rename, and a start once the name is fixed reads them).
    pub fn with_outbox_oid(mut self, oid: u32) -> Self {
        self.outbox_oid = Some(oid);
        self
    }

    pub fn with_binary(mut self, binary: bool) -> Self {
        self.binary = binary;
        self
    }

    /// Whether events `outbox_emit()` writes are published (`--emitted-events`).
    pub fn with_emitted(mut self, on: bool) -> Self {
        self.emitted = on;
        self
    }

    /// A sample for [`wire::XID_HORIZON`]: transaction ids below `xid` had
    /// all ended when the WAL's insert position was `at`.
    /// The position the next event of the open transaction takes, when the
    /// stream must be read further to tell whether it holds it.
    pub fn resume_wants(&self) -> Option<Position> {
        let txn = self.txn.as_ref()?;
        let pos = Position {
            commit_lsn: txn.commit_lsn,
            index: txn.next_index,
        };
        self.resume.as_ref()?.wants(pos).then_some(pos)
    }

    /// What the replay compares against, while it does.
    pub fn resume_mut(&mut self) -> Option<&mut Resume> {
        self.resume.as_mut()
    }

    pub fn add_horizon(&mut self, at: Lsn, xid: u64) {
        self.horizons.add(at, xid);
    }

    pub fn on_event(&mut self, event: ReplicationEvent, wm: &mut Watermark) -> Result<Step> {
        let confirm = |lsn: Option<Lsn>| Ok(lsn.map_or(Step::Nothing, Step::Confirm));
        match event {
            ReplicationEvent::Begin {
                final_lsn,
                commit_time_micros,
                ..
            } => {
                wm.begin(commit_time_micros);
                self.router.set_xid_horizon(self.horizons.at(final_lsn));
                self.txn = Some(Txn {
                    commit_lsn: final_lsn,
                    commit_time_micros,
                    next_index: 0,
                });
                Ok(Step::Nothing)
            }
            ReplicationEvent::Commit { end_lsn, .. } => {
                self.txn = None;
                Ok(Step::Commit(wm.commit(end_lsn)))
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => confirm(wm.keepalive(wal_end)),
            ReplicationEvent::XLogData { data, .. } => match pgoutput::decode(&data)? {
                Message::Relation(rel) => {
                    // pgoutput describes a partition too (after its root,
                    // even when publishing via the root): remember it, so an
                    // Insert under its id is caught, not skipped.
                    if self
                        .partitions
                        .iter()
                        .any(|(s, t)| *s == rel.namespace && *t == rel.name)
                    {
                        self.partition_ids
                            .insert(rel.id, format!("{}.{}", rel.namespace, rel.name));
                        self.layouts.insert(rel.id, None);
                        return Ok(Step::Nothing);
                    }
                    let layout = self.layout_for(&rel);
                    if let Some(Err(_)) = &layout {
                        let id = self.map.given(super::columns::Role::Id);
                        if let Some(l) = id.and_then(|id| OutboxLayout::id_only(&rel, id)) {
                            self.id_layouts.insert(rel.id, l);
                        }
                    } else {
                        self.id_layouts.remove(&rel.id);
                    }
                    self.layouts.insert(rel.id, layout);
                    Ok(Step::Nothing)
                }
                Message::Insert(ins) => self.on_insert(ins, wm),
                Message::Other(_) => Ok(Step::Nothing),
            },
            ReplicationEvent::Message {
                transactional,
                prefix,
                content,
                ..
            } if prefix == wire::EMIT_PREFIX && self.emitted => {
                if !transactional {
                    // outbox_emit() never writes one: not ours to publish
                    // outside a transaction's order.
                    tracing::warn!(
                        prefix,
                        "a non-transactional logical message with the outbox prefix: skipped"
                    );
                    return Ok(Step::Nothing);
                }
                self.on_emitted(&content, wm)
            }
            ReplicationEvent::Message { prefix, .. }
                if prefix.starts_with(wire::EMIT_PREFIX_FAMILY) && prefix != wire::EMIT_PREFIX =>
            {
                Err(Error::setup(format!(
                    "the WAL holds an event written by a newer outbox_emit() (message prefix {prefix}) that this relay cannot read; upgrade the relay (nothing past it was confirmed, so the new one publishes it)"
                )))
            }
            _ => Ok(Step::Nothing),
        }
    }

    fn on_insert(&mut self, ins: Insert, wm: &mut Watermark) -> Result<Step> {
        let invalid = |detail: String| {
            Error::Decode(DecodeError::Invalid {
                message: "Insert",
                detail,
            })
        };
        if let Some(partition) = self.partition_ids.get(&ins.relation_id) {
            // A row under its partition's name: the publication stopped
            // publishing via the root. Skipping it as another table's row
            // would lose it; stop instead, with nothing confirmed past it.
            return Err(Error::setup(format!(
                "the replication stream carries a row of {partition}, a partition of the outbox {}.{}, under the partition's name: the publication no longer publishes via the partition root; run ALTER PUBLICATION <publication> SET (publish_via_partition_root = true); then restart the relay",
                self.schema, self.table
            )));
        }
        let layout = self
            .layouts
            .get(&ins.relation_id)
            .ok_or_else(|| invalid(format!("relation {} was never described", ins.relation_id)))?;
        let Some(layout) = layout else {
            return Ok(Step::Nothing);
        };
        let row = match layout {
            Ok(l) => Ok(l
                .row(&ins.values)
                .map_err(|e| (l.id(&ins.values), e.to_string()))),
            Err(e) => Err(e.to_string()),
        };
        // The table changed under the relay (a mapped column dropped,
        // renamed or retyped) since the checks at start: stop before this
        // row is confirmed; a restart with the map fixed publishes it.
        let row = match row {
            Ok(row) => row,
            Err(e) => {
                // A replay from before the change (a restart with the map
                // fixed for the table as it is now): rows the stream holds
                // already are read with the old columns, and skipped as they
                // would be.
                let id = self
                    .id_layouts
                    .get(&ins.relation_id)
                    .and_then(|l| l.id(&ins.values));
                if let Some(step) = self.skip_stored(id, wm) {
                    return step;
                }
                return Err(Error::setup(format!(
                "the outbox table {}.{} changed while the relay ran, and its rows no longer fit the flags: {e}; fix --columns, --subject-template or --header-columns (or the table), then restart the relay: nothing past the last published row was confirmed",
                self.schema, self.table
            )));
            }
        };
        self.next_event(row, wm, "Insert")
    }

    /// An event `outbox_emit()` wrote: the next event of the transaction,
    /// exactly as a row there would be.
    fn on_emitted(&mut self, content: &bytes::Bytes, wm: &mut Watermark) -> Result<Step> {
        let row = super::emitted::row(content)
            .map_err(|e| (super::emitted::id(content).map(|u| u.to_string()), e));
        metrics::counter!(m::EMITTED_EVENTS).increment(1);
        self.next_event(row, wm, "Message")
    }

    /// The transaction's next event, by its place in it: routed, or
    /// dead-lettered when it cannot be read; skipped when the stream holds
    /// it already.
    fn next_event(
        &mut self,
        row: std::result::Result<super::outbox_row::OutboxRow, (Option<String>, String)>,
        wm: &mut Watermark,
        what: &'static str,
    ) -> Result<Step> {
        let txn = self.txn.as_mut().ok_or_else(|| {
            Error::Decode(DecodeError::Invalid {
                message: what,
                detail: "outside a transaction".into(),
            })
        })?;
        let pos = Position {
            commit_lsn: txn.commit_lsn,
            index: txn.next_index,
        };
        txn.next_index += 1;
        let ticket = wm.register();
        let msg = match row {
            Ok(row) => self.router.route_committed(
                row,
                pos,
                Some(txn.commit_time_micros),
                self.max_payload,
            ),
            Err((id, detail)) => self.router.bad_row(id, pos, &detail),
        };
        let mut msg = msg;
        if what == "Message" {
            msg.headers
                .push((std::borrow::Cow::Borrowed(wire::EMITTED), "1".to_owned()));
        }
        if already_stored(&mut self.resume, pos, &msg.msg_id) {
            metrics::counter!(m::EVENTS_SKIPPED).increment(1);
            return Ok(wm.ack(ticket).map_or(Step::Nothing, Step::Confirm));
        }
        if let Some(reason) = msg.dlq_reason {
            log_dead_letter(&msg, reason);
        }
        Ok(Step::Publish {
            ticket,
            commit_micros: txn.commit_time_micros,
            pos,
            msg,
        })
    }

    /// Skip the transaction's next event if the stream holds it already:
    /// the event at its WAL position has its id (read alone: the rest of
    /// its row does not fit the map).
    fn skip_stored(&mut self, id: Option<String>, wm: &mut Watermark) -> Option<Result<Step>> {
        let id = id?;
        let txn = self.txn.as_mut()?;
        let pos = Position {
            commit_lsn: txn.commit_lsn,
            index: txn.next_index,
        };
        if !already_stored(&mut self.resume, pos, &id) {
            return None;
        }
        txn.next_index += 1;
        let ticket = wm.register();
        metrics::counter!(m::EVENTS_SKIPPED).increment(1);
        Some(Ok(wm.ack(ticket).map_or(Step::Nothing, Step::Confirm)))
    }

    fn layout_for(&self, rel: &Relation) -> Option<std::result::Result<OutboxLayout, RowError>> {
        let named = rel.namespace == self.schema && rel.name == self.table;
        if !named && self.outbox_oid != Some(rel.id) {
            return None;
        }
        let layout = OutboxLayout::new(rel, &self.map, &self.extra).and_then(|l| {
            // Read from binary tuples only as the types it was checked
            // for at start (a column retyped to an enum, say, is not).
            let retyped = self.extra.iter().find_map(|name| {
                let c = rel.columns.iter().find(|c| &c.name == name)?;
                (self.binary && !super::outbox_row::binary_text(c.type_oid))
                    .then(|| (name.clone(), c.type_oid))
            });
            match retyped {
                Some((name, ty)) => Err(RowError::Map {
                    table: format!("{}.{}", rel.namespace, rel.name),
                    detail: format!(
                        "column {name} is now of type oid {ty}, which binary tuples carry in a form of its own (a restart streams text tuples for it)"
                    ),
                }),
                None => Ok(l),
            }
        });
        if let Err(e) = &layout {
            tracing::error!(error = %e, "the outbox table changed while the relay ran: the relay stops at its next row, before confirming it");
        }
        Some(layout)
    }
}

/// Whether the stream holds this very event, so the replay skips it.
fn already_stored(resume: &mut Option<Resume>, pos: Position, msg_id: &str) -> bool {
    let Some(r) = resume else {
        return false;
    };
    if pos > r.tail {
        // Positions only grow: once past the tail, stop comparing.
        *resume = None;
        return false;
    }
    match r.take(pos) {
        Some(id) if id == wire::IdKey::of(msg_id) => true,
        Some(_) => {
            tracing::warn!(
                position = %format!("{}#{}", pos.commit_lsn, pos.index),
                replayed = %msg_id,
                "the stream holds another event at this WAL position: this database's WAL is not the one the stream was written from (was it restored from a disk snapshot?); publishing every event from here on"
            );
            *resume = None;
            false
        }
        // Not read back (or dead-lettered elsewhere, or dropped as a
        // duplicate): publishing again costs at most a repeat.
        None => false,
    }
}

pub(super) fn log_dead_letter(msg: &OutMessage, reason: DlqReason) {
    tracing::warn!(id = %msg.msg_id, reason = reason.as_str(), "dead-lettering row");
    metrics::counter!(m::EVENTS_DEAD_LETTERED, "reason" => reason.as_str()).increment(1);
    let event_type = match reason {
        DlqReason::SchemaInvalid => msg
            .headers
            .iter()
            .find(|(k, _)| k == wire::EVENT_TYPE)
            .map_or_else(String::new, |(_, v)| v.clone()),
        DlqReason::SchemaMissing => m::NO_SCHEMA_TYPE.to_owned(),
        _ => return,
    };
    metrics::counter!(m::SCHEMA_FAILURES, "stage" => "relay", "event_type" => event_type)
        .increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::relay::route::Template;
    use crate::testing::{self, encode, oid, Value};
    use crate::wire;
    use bytes::Bytes;

    /// The outbox's required columns only, in the order `insert` fills them.
    fn relation(id: u32, name: &str) -> ReplicationEvent {
        let columns = [
            ("id", oid::UUID),
            ("aggregate_type", oid::TEXT),
            ("aggregate_id", oid::TEXT),
            ("event_type", oid::TEXT),
            ("payload", oid::JSONB),
        ];
        xlog(encode::relation(&testing::relation(
            id, "public", name, &columns,
        )))
    }

    fn insert(rel: u32, id: &str) -> ReplicationEvent {
        let t = |s: &str| Value::Text(Bytes::copy_from_slice(s.as_bytes()));
        xlog(encode::insert(
            rel,
            &[t(id), t("order"), t("1"), t("placed"), t("{}")],
        ))
    }

    fn xlog(data: Vec<u8>) -> ReplicationEvent {
        ReplicationEvent::XLogData {
            wal_start: Lsn(0),
            wal_end: Lsn(0),
            server_time_micros: 0,
            data: data.into(),
        }
    }

    fn begin(lsn: u64) -> ReplicationEvent {
        ReplicationEvent::Begin {
            final_lsn: Lsn(lsn),
            xid: 1,
            commit_time_micros: 0,
        }
    }

    fn commit(lsn: u64) -> ReplicationEvent {
        ReplicationEvent::Commit {
            lsn: Lsn(lsn),
            end_lsn: Lsn(lsn + 8),
            commit_time_micros: 0,
        }
    }

    fn stage(resume: Option<Resume>) -> Stage {
        let router = Router::new(
            "ctx",
            Template::parse("{context}.e", "ctx").unwrap(),
            1,
            false,
            "src".into(),
            vec![wire::stream_subjects("ctx")],
        );
        let partitions = vec![("public".into(), "outbox_events_p1".into())];
        Stage::new(
            "public",
            "outbox_events",
            partitions,
            router,
            1 << 20,
            resume,
        )
    }

    const ID1: &str = "00000000-0000-4000-8000-000000000001";
    const ID2: &str = "00000000-0000-4000-8000-000000000002";

    fn published(step: Step) -> Option<OutMessage> {
        match step {
            Step::Publish { msg, .. } => Some(msg),
            _ => None,
        }
    }

    #[test]
    fn rows_get_their_position_in_the_transaction() {
        let mut s = stage(None);
        let mut wm = Watermark::new(Lsn(0));
        s.on_event(relation(7, "outbox_events"), &mut wm).unwrap();
        s.on_event(begin(100), &mut wm).unwrap();
        let a = published(s.on_event(insert(7, ID1), &mut wm).unwrap()).unwrap();
        let b = published(s.on_event(insert(7, ID2), &mut wm).unwrap()).unwrap();
        assert_eq!(a.header(wire::TXN_INDEX), Some("0"));
        assert_eq!(b.header(wire::TXN_INDEX), Some("1"));
        assert_eq!(b.header(wire::COMMIT_LSN), Some("0/64"));
        assert!(matches!(
            s.on_event(commit(100), &mut wm).unwrap(),
            Step::Commit(None)
        ));
        assert_eq!(wm.in_flight(), 2, "commit waits for both acks");
    }

    #[test]
    fn events_up_to_the_resume_point_are_skipped_and_confirmed() {
        let resume = resume_at(100, 0, &[(100, 0, ID1)]);
        let mut s = stage(Some(resume));
        let mut wm = Watermark::new(Lsn(0));
        s.on_event(relation(7, "outbox_events"), &mut wm).unwrap();
        s.on_event(begin(100), &mut wm).unwrap();
        assert!(published(s.on_event(insert(7, ID1), &mut wm).unwrap()).is_none());
        let second = published(s.on_event(insert(7, ID2), &mut wm).unwrap()).unwrap();
        assert_eq!(
            second.msg_id, ID2,
            "the row after the stream's last one is published"
        );
        assert_eq!(wm.in_flight(), 1);
    }

    #[test]
    fn whole_skipped_transaction_confirms_at_commit() {
        let mut s = stage(Some(resume_at(200, 5, &[(100, 0, ID1)])));
        let mut wm = Watermark::new(Lsn(0));
        s.on_event(relation(7, "outbox_events"), &mut wm).unwrap();
        s.on_event(begin(100), &mut wm).unwrap();
        s.on_event(insert(7, ID1), &mut wm).unwrap();
        assert!(matches!(
            s.on_event(commit(100), &mut wm).unwrap(),
            Step::Commit(Some(Lsn(108)))
        ));
    }

    fn resume_at(lsn: u64, index: u32, stored: &[(u64, u32, &str)]) -> Resume {
        let pos = |lsn, index| Position {
            commit_lsn: Lsn(lsn),
            index,
        };
        let mut r = Resume::new(pos(lsn, index));
        for &(l, i, id) in stored {
            r.found(pos(l, i), wire::IdKey::of(id));
        }
        r.read_through(pos(lsn, index));
        r
    }

    const ID3: &str = "00000000-0000-4000-8000-000000000003";

    #[test]
    fn a_transaction_carries_the_newest_horizon_sampled_before_its_commit() {
        let mut s = stage(None);
        let mut wm = Watermark::new(Lsn(0));
        s.on_event(relation(7, "outbox_events"), &mut wm).unwrap();
        s.add_horizon(Lsn(150), 700);
        s.add_horizon(Lsn(250), 900);
        s.on_event(begin(100), &mut wm).unwrap();
        let m = published(s.on_event(insert(7, ID1), &mut wm).unwrap()).unwrap();
        assert_eq!(m.header(wire::XID_HORIZON), None, "no sample before it");
        s.on_event(commit(100), &mut wm).unwrap();
        s.on_event(begin(200), &mut wm).unwrap();
        let m = published(s.on_event(insert(7, ID2), &mut wm).unwrap()).unwrap();
        assert_eq!(m.header(wire::XID_HORIZON), Some("700"));
        s.on_event(commit(200), &mut wm).unwrap();
        s.on_event(begin(250), &mut wm).unwrap();
        let m = published(s.on_event(insert(7, ID3), &mut wm).unwrap()).unwrap();
        assert_eq!(m.header(wire::XID_HORIZON), Some("900"));
    }

    proptest::proptest! {
        /// Whatever the samples and however many, the horizon given a
        /// commit is one sampled at or before it, and none newer than the
        /// newest such sample.
        #[test]
        fn a_horizon_is_never_one_sampled_after_the_commit(
            steps in proptest::collection::vec((1u64..50, 0u64..5), 1..300),
            commits in proptest::collection::vec(0u64..20_000, 1..50),
        ) {
            let mut h = Horizons::default();
            let mut all = Vec::new();
            let (mut at, mut xid) = (0u64, 0u64);
            for (dl, dx) in steps {
                at += dl;
                xid += dx;
                h.add(Lsn(at), xid);
                all.push((at, xid));
            }
            let mut commits = commits;
            commits.sort_unstable();
            for c in commits {
                let best = all.iter().filter(|&&(l, _)| l <= c).map(|&(_, x)| x).max();
                match h.at(Lsn(c)) {
                    Some(x) => {
                        proptest::prop_assert!(all.iter().any(|&(l, y)| l <= c && y == x));
                        proptest::prop_assert!(Some(x) <= best);
                    }
                    None => proptest::prop_assert!(best.is_none()),
                }
            }
        }
    }

    fn uuid_of(n: u64) -> String {
        format!("00000000-0000-4000-8000-{n:012}")
    }

    proptest::proptest! {
        /// A replay against a stream read back at its pace (the session's
        /// loop, with the stream in memory): an event is skipped only when
        /// the stream holds it at its position; in a stream in position
        /// order every held one is skipped; and what is held at once is a
        /// couple of entries, however long the replay.
        #[test]
        fn a_replay_read_back_as_it_goes_skips_exactly_what_the_stream_holds(
            txns in proptest::collection::vec(0u32..40, 1..12),
            kept in proptest::collection::vec(proptest::bool::ANY, 0..400),
            foreign in proptest::collection::vec(0usize..400, 0..20),
            repeat in proptest::option::of((0usize..400, 1usize..30)),
            gives_up_at in proptest::option::of(0usize..400),
        ) {
            use crate::relay::readback::{settle, Cursor};
            let pos = |l: u64, i: u32| Position { commit_lsn: Lsn(l), index: i };
            // Every event of the replay, in order, and whether a run before
            // stored it.
            let mut events = Vec::new();
            let mut n = 0u64;
            for (t, &k) in txns.iter().enumerate() {
                let lsn = 1000 * (t as u64 + 1);
                for i in 0..k {
                    n += 1;
                    let stored = kept.get(n as usize).copied().unwrap_or(false);
                    events.push((pos(lsn, i), uuid_of(n), stored));
                }
            }
            // The stream: what was stored, in order, other writers'
            // messages among it, perhaps a range stored twice (out of
            // order past it).
            let mut stream: Vec<Option<(Position, wire::IdKey)>> = events
                .iter()
                .filter(|e| e.2)
                .map(|(p, id, _)| Some((*p, wire::IdKey::of(id))))
                .collect();
            for f in &foreign {
                let at = (*f).min(stream.len());
                stream.insert(at, None);
            }
            let in_order = repeat.is_none();
            if let Some((at, len)) = repeat {
                let at = at.min(stream.len());
                let again: Vec<_> = stream[at..(at + len).min(stream.len())].to_vec();
                stream.extend(again);
            }
            let Some(tail) = stream.iter().flatten().map(|e| e.0).max() else {
                return Ok(());
            };
            let held: std::collections::HashSet<(Position, wire::IdKey)> =
                stream.iter().flatten().copied().collect();
            let mut s = stage(Some(Resume::new(tail)));
            let mut cursor = Cursor::new(stream.len() as u64);
            let mut next = 0usize;
            let mut wm = Watermark::new(Lsn(0));
            let mut most_held = 0;
            // The session's loop: before each event, read as far as it needs.
            let mut feed = |s: &mut Stage, cursor: &mut Cursor| {
                if let Some(want) = s.resume_wants() {
                    let r = s.resume_mut().unwrap();
                    while cursor.short_of(want) {
                        if gives_up_at == Some(next) || next >= stream.len() {
                            cursor.give_up();
                            break;
                        }
                        next += 1;
                        cursor.read(r, want, next as u64, stream[next - 1]);
                    }
                    settle(r, &[&*cursor]);
                    most_held = most_held.max(r.held());
                }
            };
            feed(&mut s, &mut cursor);
            s.on_event(relation(7, "outbox_events"), &mut wm).unwrap();
            let mut at = 0;
            for (t, &k) in txns.iter().enumerate() {
                let lsn = 1000 * (t as u64 + 1);
                feed(&mut s, &mut cursor);
                s.on_event(begin(lsn), &mut wm).unwrap();
                for _ in 0..k {
                    let (p, id, stored) = &events[at];
                    at += 1;
                    feed(&mut s, &mut cursor);
                    let step = s.on_event(insert(7, id), &mut wm).unwrap();
                    let skipped = published(step).is_none();
                    if skipped {
                        proptest::prop_assert!(*stored, "skipped an event the stream lacks: {p:?}");
                        proptest::prop_assert!(held.contains(&(*p, wire::IdKey::of(id))));
                    } else if *stored && in_order && gives_up_at.is_none() {
                        proptest::prop_assert!(false, "published again an event read back: {p:?}");
                    }
                }
                feed(&mut s, &mut cursor);
                s.on_event(commit(lsn), &mut wm).unwrap();
            }
            if in_order {
                proptest::prop_assert!(most_held <= 2, "held {most_held} at once");
            }
        }
    }

    /// A disk snapshot restore: the WAL replayed below the tail is not the
    /// one the stream was written from.
    #[test]
    fn an_event_the_stream_does_not_hold_at_its_position_is_published() {
        let mut s = stage(Some(resume_at(300, 0, &[(300, 0, ID1)])));
        let mut wm = Watermark::new(Lsn(0));
        s.on_event(relation(7, "outbox_events"), &mut wm).unwrap();
        s.on_event(begin(100), &mut wm).unwrap();
        let unknown = published(s.on_event(insert(7, ID2), &mut wm).unwrap());
        assert_eq!(unknown.unwrap().msg_id, ID2, "a position the stream lacks");
        s.on_event(commit(100), &mut wm).unwrap();
        s.on_event(begin(300), &mut wm).unwrap();
        let other = published(s.on_event(insert(7, ID3), &mut wm).unwrap());
        assert_eq!(
            other.unwrap().msg_id,
            ID3,
            "another event at a held position"
        );
    }

    #[test]
    fn after_one_mismatch_nothing_more_is_skipped() {
        let stored = [(100, 0, ID1), (200, 0, ID2)];
        let mut s = stage(Some(resume_at(200, 0, &stored)));
        let mut wm = Watermark::new(Lsn(0));
        s.on_event(relation(7, "outbox_events"), &mut wm).unwrap();
        s.on_event(begin(100), &mut wm).unwrap();
        assert!(published(s.on_event(insert(7, ID3), &mut wm).unwrap()).is_some());
        s.on_event(commit(100), &mut wm).unwrap();
        s.on_event(begin(200), &mut wm).unwrap();
        assert!(
            published(s.on_event(insert(7, ID2), &mut wm).unwrap()).is_some(),
            "a history that diverged once is not trusted again"
        );
    }

    #[test]
    fn other_tables_are_ignored_and_unknown_relations_are_errors() {
        let mut s = stage(None);
        let mut wm = Watermark::new(Lsn(0));
        s.on_event(relation(8, "orders"), &mut wm).unwrap();
        s.on_event(begin(100), &mut wm).unwrap();
        assert!(matches!(
            s.on_event(insert(8, ID1), &mut wm).unwrap(),
            Step::Nothing
        ));
        assert!(matches!(
            s.on_event(insert(9, ID1), &mut wm),
            Err(Error::Decode(_))
        ));
    }

    #[test]
    fn a_row_under_a_partitions_name_stops_the_relay_instead_of_skipping() {
        let mut s = stage(None);
        let mut wm = Watermark::new(Lsn(0));
        // Via the root: the root's description, the partition's, then the
        // row under the root's id.
        s.on_event(relation(7, "outbox_events"), &mut wm).unwrap();
        s.on_event(relation(9, "outbox_events_p1"), &mut wm)
            .unwrap();
        s.on_event(begin(100), &mut wm).unwrap();
        assert!(published(s.on_event(insert(7, ID1), &mut wm).unwrap()).is_some());
        // Not via the root: the row under the partition's id.
        assert!(matches!(
            s.on_event(insert(9, ID2), &mut wm),
            Err(Error::Setup { .. })
        ));
    }

    /// Issue 57, item 6: the outbox renamed (or moved to another schema)
    /// while streaming: pgoutput names its rows under the new name, and
    /// they were skipped as another table's while the slot moved past them.
    #[test]
    fn the_outbox_renamed_while_streaming_keeps_its_rows() {
        let mut s = stage(None).with_outbox_oid(7);
        let mut wm = Watermark::new(Lsn(0));
        s.on_event(relation(7, "outbox_events"), &mut wm).unwrap();
        s.on_event(relation(8, "another_table"), &mut wm).unwrap();
        s.on_event(relation(7, "outbox_events_old"), &mut wm)
            .unwrap();
        s.on_event(begin(100), &mut wm).unwrap();
        assert!(published(s.on_event(insert(7, ID1), &mut wm).unwrap()).is_some());
        assert!(published(s.on_event(insert(8, ID2), &mut wm).unwrap()).is_none());
    }

    #[test]
    fn undecodable_row_is_dead_lettered_under_its_position() {
        let mut s = stage(None);
        let mut wm = Watermark::new(Lsn(0));
        s.on_event(relation(7, "outbox_events"), &mut wm).unwrap();
        s.on_event(begin(100), &mut wm).unwrap();
        let msg = published(s.on_event(insert(7, "not-a-uuid"), &mut wm).unwrap()).unwrap();
        assert_eq!(msg.dlq_reason, Some(DlqReason::BadRow));
        assert_eq!(msg.msg_id, "0/64-0");
        assert_eq!(msg.subject, wire::relay_dlq_subject("ctx"));
    }

    fn message(prefix: &str, content: &str) -> ReplicationEvent {
        ReplicationEvent::Message {
            transactional: true,
            lsn: Lsn(0),
            prefix: prefix.into(),
            content: Bytes::copy_from_slice(content.as_bytes()),
        }
    }

    const EMITTED: &str = "[\"00000000-0000-4000-8000-000000000003\", \"order\", \"1\", \"placed\", 1, null, null, null, null]\n\n{}";

    #[test]
    fn an_emitted_event_takes_its_place_among_the_rows() {
        let mut s = stage(None);
        let mut wm = Watermark::new(Lsn(0));
        s.on_event(relation(7, "outbox_events"), &mut wm).unwrap();
        s.on_event(begin(100), &mut wm).unwrap();
        let a = published(s.on_event(insert(7, ID1), &mut wm).unwrap()).unwrap();
        let e = published(
            s.on_event(message(wire::EMIT_PREFIX, EMITTED), &mut wm)
                .unwrap(),
        )
        .unwrap();
        assert_eq!(a.header(wire::TXN_INDEX), Some("0"));
        assert_eq!(e.header(wire::TXN_INDEX), Some("1"));
        assert_eq!(e.msg_id, "00000000-0000-4000-8000-000000000003");
    }

    /// A later version of outbox_emit() writes a prefix this relay does not
    /// read: skipping it would confirm the slot past an event for good.
    #[test]
    fn an_emitted_event_of_an_unknown_version_stops_the_relay_instead_of_passing_it() {
        let mut s = stage(None);
        let mut wm = Watermark::new(Lsn(0));
        s.on_event(begin(100), &mut wm).unwrap();
        let err = s
            .on_event(message("outbox-relay:event:v2", EMITTED), &mut wm)
            .unwrap_err()
            .to_string();
        assert!(err.contains("outbox-relay:event:v2"), "{err}");
        // Another application's messages pass untouched.
        assert!(matches!(
            s.on_event(message("someone-else", "x"), &mut wm).unwrap(),
            Step::Nothing
        ));
    }

    /// `--emitted-events off` skips them, and counts each one it skips.
    #[test]
    fn emitted_events_off_skips_them_without_a_place() {
        let mut s = stage(None).with_emitted(false);
        let mut wm = Watermark::new(Lsn(0));
        s.on_event(relation(7, "outbox_events"), &mut wm).unwrap();
        s.on_event(begin(100), &mut wm).unwrap();
        assert!(matches!(
            s.on_event(message(wire::EMIT_PREFIX, EMITTED), &mut wm)
                .unwrap(),
            Step::Nothing
        ));
        let a = published(s.on_event(insert(7, ID1), &mut wm).unwrap()).unwrap();
        assert_eq!(a.header(wire::TXN_INDEX), Some("0"));
    }
}
