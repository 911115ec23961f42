//! An interrupted backfill's resume: what earlier runs stored (read back
//! from the streams), and the bound on the outbox's ids they prove covered,
//! carried from run to run in a header.

use std::collections::HashMap;
use std::time::Instant;

use async_nats::jetstream::Context;

use super::streams::stream_not_found;
use super::tail::{read_headers, TAIL_SCAN_BUDGET};
use crate::error::{Error, Result};
use crate::wire;

/// The kind of id a bound can be put on: one whose order the SQL and this
/// process agree on (uuid bytes; integers; text by its UTF-8 bytes, which
/// the backfill orders by `convert_to(id, 'UTF8')`, whatever the
/// collation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdKind {
    Uuid,
    Int,
    Text,
}

/// An id, ordered as the backfill's SQL orders it. A table's ids are of
/// one kind, so the variants are never compared with each other.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum OrderId {
    Uuid(uuid::Uuid),
    Int(i64),
    Text(String),
}

impl OrderId {
    /// The id a message carries (`Nats-Msg-Id`), read as `kind`.
    pub fn parse(kind: IdKind, msg_id: &str) -> Option<OrderId> {
        match kind {
            IdKind::Uuid => msg_id.parse().ok().map(OrderId::Uuid),
            IdKind::Int => msg_id.parse().ok().map(OrderId::Int),
            // A text id in a UUID's shape goes out in the UUID's canonical
            // text, whatever form the column holds (`A5FF…`, braces): its
            // order here may not be the column's.
            IdKind::Text if uuid::Uuid::parse_str(msg_id).is_ok() => None,
            IdKind::Text => Some(OrderId::Text(msg_id.to_owned())),
        }
    }

    pub fn kind(&self) -> IdKind {
        match self {
            OrderId::Uuid(_) => IdKind::Uuid,
            OrderId::Int(_) => IdKind::Int,
            OrderId::Text(_) => IdKind::Text,
        }
    }

    /// As a SQL value compared with the backfill's order expression for
    /// the id: never quoted text (a text id goes as its bytes).
    pub fn sql(&self) -> String {
        match self {
            OrderId::Uuid(u) => format!("'{u}'::uuid"),
            // Quoted: `-9223372036854775808::int8` is out of range.
            OrderId::Int(n) => format!("'{n}'::int8"),
            OrderId::Text(t) => format!("'\\x{}'::bytea", hex(t.as_bytes())),
        }
    }

    /// In [`wire::BACKFILL_COVERED`]: a uuid as itself (as before other
    /// kinds had bounds), `i:` and the number, `t:` and the hex of the
    /// text (which may hold spaces and commas).
    fn encode(&self) -> String {
        match self {
            OrderId::Uuid(u) => u.to_string(),
            OrderId::Int(n) => format!("i:{n}"),
            OrderId::Text(t) => format!("t:{}", hex(t.as_bytes())),
        }
    }

    fn decode(s: &str) -> Option<OrderId> {
        if let Some(n) = s.strip_prefix("i:") {
            return n.parse().ok().map(OrderId::Int);
        }
        if let Some(h) = s.strip_prefix("t:") {
            // As `parse`: a text id in a UUID's shape has no place in the
            // column's order (an older relay may have passed one on).
            let text = String::from_utf8(unhex(h)?).ok()?;
            return uuid::Uuid::parse_str(&text)
                .is_err()
                .then_some(OrderId::Text(text));
        }
        s.parse().ok().map(OrderId::Uuid)
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Every row of a backfill run's snapshot ordered before `(at, id)` whose
/// transaction ended before `horizon` (the run's snapshot horizon: such a
/// transaction's rows were all in that snapshot) is in the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Covered {
    pub at: time::OffsetDateTime,
    pub id: OrderId,
    pub horizon: u64,
}

impl Covered {
    /// At most this many are passed on: one per interrupted run that
    /// proved its own, less those another one covers. Dropping one costs
    /// repeats, never a loss.
    const MAX: usize = 4;

    fn covers(&self, other: &Covered) -> bool {
        (self.at, &self.id) >= (other.at, &other.id) && self.horizon >= other.horizon
    }

    /// Without those another one covers; the newest horizons first.
    pub fn merge(mut all: Vec<Covered>) -> Vec<Covered> {
        all.sort_by(|a, b| (b.horizon, b.at, &b.id).cmp(&(a.horizon, a.at, &a.id)));
        let mut kept: Vec<Covered> = Vec::new();
        for c in all {
            if !kept.iter().any(|k| k.covers(&c)) {
                kept.push(c);
            }
        }
        kept.truncate(Self::MAX);
        kept
    }

    /// The [`wire::BACKFILL_COVERED`] value.
    pub fn header(list: &[Covered]) -> String {
        list.iter()
            .filter_map(|c| {
                let at =
                    c.at.format(&time::format_description::well_known::Rfc3339)
                        .ok()?;
                Some(format!("{at} {} {}", c.id.encode(), c.horizon))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Read back: an item it cannot read is left out (a repeat, not a loss).
    pub fn parse_header(value: &str) -> Vec<Covered> {
        value
            .split(',')
            .filter_map(|item| {
                let mut f = item.split_whitespace();
                let at = time::OffsetDateTime::parse(
                    f.next()?,
                    &time::format_description::well_known::Rfc3339,
                )
                .ok()?;
                Some(Covered {
                    at,
                    id: OrderId::decode(f.next()?)?,
                    horizon: f.next()?.parse().ok()?,
                })
            })
            .collect()
    }
}

/// What an interrupted backfill left in the streams, read back so the next
/// one resumes instead of publishing every row again (the duplicate window
/// is long gone after a backfill of hours).
#[derive(Debug, Default)]
pub struct BackfillResume {
    /// Ids of the backfill's messages read back: stored, skip them.
    pub stored: std::collections::HashSet<wire::IdKey>,
    /// What the interrupted runs are known to have stored, beyond `stored`.
    pub covered: Vec<Covered>,
}

impl BackfillResume {
    /// What every listed stream showed, together.
    pub fn of(reads: Vec<StreamRead>) -> Self {
        let mut covered: Vec<Covered> = reads.iter().flat_map(|r| r.inherited.clone()).collect();
        covered.extend(prove(&reads));
        BackfillResume {
            stored: reads.into_iter().flat_map(|r| r.stored).collect(),
            covered: Covered::merge(covered),
        }
    }
}

/// One run of a backfill, as its messages name it: its snapshot's horizon
/// and, from [`wire::BACKFILL_RUN`], its own id (absent on messages of
/// relays before it: runs are then told apart by their horizon alone,
/// which two runs may share).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct RunId {
    horizon: u64,
    run: Option<String>,
}

/// What one stream showed of one run.
#[derive(Debug, Default, Clone)]
struct RunSeen {
    /// The (time, id) of each of its messages read that has both; a row
    /// stored twice counts once.
    keys: std::collections::BTreeSet<(time::OffsetDateTime, OrderId)>,
    /// Its publish window: its own, from [`wire::BACKFILL_RUN`], else the
    /// current `--max-inflight`.
    window: usize,
}

/// What one stream showed of an interrupted backfill, read back from its
/// end.
#[derive(Debug, Default)]
pub struct StreamRead {
    /// Ids of the backfill's messages read.
    pub stored: std::collections::HashSet<wire::IdKey>,
    /// What the newest message read said the runs before it proved.
    pub inherited: Vec<Covered>,
    runs: HashMap<RunId, RunSeen>,
    /// The oldest run read (the smallest horizon), and whether a message of
    /// the database's older history was (another backfill, streamed
    /// events): past it, a run's messages in this stream are all read.
    oldest_run: Option<u64>,
    history: bool,
    /// Read from the stream's first message.
    whole: bool,
    /// Stopped by the time budget: the newest part of its last chunk may be
    /// unread, so it proves nothing.
    cut: bool,
}

impl StreamRead {
    /// Whether every message run `horizon` has in this stream was read.
    fn passed(&self, horizon: u64) -> bool {
        self.whole || self.history || self.oldest_run.is_some_and(|o| o < horizon)
    }

    /// Whether some run shows two windows of its own here.
    fn shows_a_run(&self) -> bool {
        self.runs
            .values()
            .any(|r| r.keys.len() as u64 >= (r.window as u64).saturating_mul(2))
    }
}

/// The bounds the runs read back prove. A run published in its rows'
/// order, and a message lost in flight had at most a window published
/// after it (the window is counted from the oldest unanswered message):
/// with the newest two windows of a run's messages read, in every stream,
/// everything it published before the oldest of them was acked. Those
/// messages are the run's newest across the streams (each stream keeps its
/// own order, the window is shared), so the bound holds only where every
/// stream was read back that far, or past the run's start. A message
/// without its time (an undecodable row's dead letter) counts for nothing.
///
/// One run's messages alone, under its own window: an older relay's runs
/// (no [`wire::BACKFILL_RUN`]) prove nothing, since runs sharing a horizon
/// cannot be told apart (across several streams, a row lost in one at
/// each of them would have other runs' messages counted past it) and
/// their window is not known (a restart with a smaller one would count
/// too few).
fn prove(reads: &[StreamRead]) -> Vec<Covered> {
    if reads.iter().any(|r| r.cut) || reads.iter().all(|r| r.whole) {
        // Read whole, the ids alone say what is stored.
        return Vec::new();
    }
    let runs: std::collections::BTreeSet<&RunId> =
        reads.iter().flat_map(|r| r.runs.keys()).collect();
    runs.into_iter()
        .filter(|run| run.run.is_some())
        .filter_map(|run| {
            let seen: Vec<&RunSeen> = reads.iter().filter_map(|r| r.runs.get(run)).collect();
            let window = seen.iter().map(|s| s.window).max()?;
            let nth = window.checked_mul(2)?.checked_sub(1)?;
            let mut keys: Vec<&(time::OffsetDateTime, OrderId)> =
                seen.iter().flat_map(|s| s.keys.iter()).collect();
            keys.sort_unstable_by(|a, b| b.cmp(a));
            keys.dedup();
            let bound = *keys.get(nth)?;
            let reached = reads.iter().all(|r| {
                r.passed(run.horizon)
                    || r.runs
                        .get(run)
                        .and_then(|s| s.keys.first())
                        .is_some_and(|oldest| oldest <= bound)
            });
            reached.then(|| Covered {
                at: bound.0,
                id: bound.1.clone(),
                horizon: run.horizon,
            })
        })
        .collect()
}

/// Read back, headers only, the newest messages of this database's
/// interrupted backfill (`header` is its `Outbox-Backfill`) in one stream.
/// `window`: the publisher's in-flight limit. Bounded by
/// [`TAIL_SCAN_BUDGET`]; what is not read is published again (repeats,
/// never a loss).
///
/// Runs are told apart by their snapshot's horizon (`Outbox-Xid-Horizon`).
/// The stream is read back from its end, four windows at a time, until a
/// run shows two windows of its own, the start is reached, or a message of
/// the database's older history is: every message of the runs after that
/// one is read, so their ids say what they stored, and [`prove`] finds
/// their bounds. The newest run also passes on what the runs before it
/// proved ([`wire::BACKFILL_COVERED`]): a run interrupted before it stored
/// two windows proves nothing itself and must not make the next one
/// forget. `ids`: the kind of the table's ids, where a bound can be put on
/// them (none: the ids read back alone say what is stored).
pub async fn backfill_resume(
    js: &Context,
    stream_name: &str,
    database: (&str, &str),
    header: &str,
    window: usize,
    ids: Option<IdKind>,
) -> Result<StreamRead> {
    let context = "reading back the interrupted backfill";
    let mut read = StreamRead::default();
    let mut stream = match js.get_stream(stream_name).await {
        Ok(s) => s,
        // A listed stream not created yet holds nothing of it.
        Err(e) if stream_not_found(&e) => {
            read.whole = true;
            return Ok(read);
        }
        Err(e) => return Err(Error::nats(context)(e)),
    };
    let state = stream
        .info()
        .await
        .map_err(Error::nats(context))?
        .state
        .clone();
    if state.messages == 0 {
        read.whole = true;
        return Ok(read);
    }
    let want = window.saturating_mul(2) as u64;
    // Other sources may interleave: four windows at a time for two of ours.
    let chunk = want.saturating_mul(2).max(1);
    let deadline = Instant::now() + TAIL_SCAN_BUDGET;
    // The newest message's of this backfill, and the chunk it was read in.
    let mut inherited: Option<(usize, String)> = None;
    let mut end = state.last_sequence;
    for n in 0.. {
        let start = end
            .saturating_sub(chunk - 1)
            .max(state.first_sequence)
            .max(1);
        read.whole = start <= state.first_sequence;
        let complete = read_headers(&stream, start, end, deadline, context, |h| {
            let get = |name: &str| h.get(name).map(|v| v.as_str());
            let database_ours = get(wire::SOURCE)
                .is_some_and(|s| wire::same_database(s, database.0, database.1))
                && get(wire::DLQ_CONSUMER).is_none();
            if !database_ours {
                return;
            }
            if get(wire::BACKFILL) != Some(header) {
                // Older than every run of this backfill.
                read.history = true;
                return;
            }
            let Some(msg_id) = get(wire::MSG_ID) else {
                return;
            };
            read.stored.insert(wire::IdKey::of(msg_id));
            if inherited.as_ref().is_none_or(|(i, _)| *i == n) {
                inherited = Some((n, get(wire::BACKFILL_COVERED).unwrap_or("").to_owned()));
            }
            // A bound is a place in (occurred_at, id) order, which the SQL
            // and this process agree on for some kinds of ids only.
            let Some(id) = ids.and_then(|kind| OrderId::parse(kind, msg_id)) else {
                return;
            };
            let Some(horizon) = get(wire::XID_HORIZON).and_then(|x| x.parse().ok()) else {
                return;
            };
            read.oldest_run = Some(read.oldest_run.map_or(horizon, |o| o.min(horizon)));
            let at = get(wire::OCCURRED_AT).and_then(|t| {
                time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()
            });
            let Some(at) = at else {
                return;
            };
            // `<run> <window>`; without it (an older relay's), the run is
            // its horizon and the window today's.
            let named = get(wire::BACKFILL_RUN).and_then(|v| {
                let (run, w) = v.split_once(' ')?;
                Some((run.to_owned(), w.parse::<usize>().ok()?))
            });
            let (run, run_window) = match named {
                Some((run, w)) => (Some(run), w),
                None => (None, window),
            };
            let seen = read.runs.entry(RunId { horizon, run }).or_default();
            seen.window = run_window.max(1);
            seen.keys.insert((at, id));
        })
        .await?;
        read.cut = !complete;
        if read.cut || read.whole || read.history || read.shows_a_run() {
            break;
        }
        end = start - 1;
    }
    // What the runs before proved holds however little of the last was read.
    read.inherited = inherited
        .map(|(_, h)| Covered::parse_header(&h))
        .unwrap_or_default();
    if read.cut {
        tracing::warn!(
            stream = stream_name,
            read = read.stored.len(),
            "stopped reading back the interrupted backfill after {TAIL_SCAN_BUDGET:?}: its rows not read back are published again (the inboxes drop repeats)"
        );
    }
    Ok(read)
}

#[cfg(test)]
mod tests {
    use super::{hex, prove, Covered, IdKind, OrderId, RunId, StreamRead};

    fn covered(at: &str, id: u128, horizon: u64) -> Covered {
        Covered {
            at: time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339)
                .unwrap(),
            id: OrderId::Uuid(uuid::Uuid::from_u128(id)),
            horizon,
        }
    }

    #[test]
    fn a_bound_on_any_kind_of_id_survives_its_header() {
        let at = "2026-01-01T00:00:00Z";
        let with = |id: OrderId| Covered {
            id,
            ..covered(at, 0, 9)
        };
        let list = vec![
            with(OrderId::Int(-42)),
            with(OrderId::Text("ord 1, \"two\" é".into())),
            with(OrderId::Text(String::new())),
            with(OrderId::Uuid(uuid::Uuid::from_u128(7))),
        ];
        for c in list {
            let header = Covered::header(std::slice::from_ref(&c));
            assert_eq!(Covered::parse_header(&header), vec![c], "{header}");
        }
        // A uuid reads as it did before other kinds had bounds.
        let old = format!("{at} {} 9", uuid::Uuid::from_u128(7));
        assert_eq!(
            Covered::parse_header(&old)[0].id,
            OrderId::Uuid(uuid::Uuid::from_u128(7))
        );
        assert!(Covered::parse_header(&format!("{at} t:4 9")).is_empty());
        let shaped = hex(b"A5FFFFFF-0000-4000-8000-000000000000");
        assert!(
            Covered::parse_header(&format!("{at} t:{shaped} 9")).is_empty(),
            "a UUID-shaped text id passed on by an older relay"
        );
        assert!(Covered::parse_header(&format!("{at} i:x 9")).is_empty());
    }

    #[test]
    fn ids_order_as_the_backfill_sql_orders_them() {
        let int = |s| OrderId::parse(IdKind::Int, s).unwrap();
        assert!(int("9") < int("10"), "numbers, not their text");
        let text = |s| OrderId::parse(IdKind::Text, s).unwrap();
        // By UTF-8 bytes (convert_to(id, 'UTF8')), not by a collation.
        assert!(text("ord-10") < text("ord-9"));
        assert!(text("Z") < text("a"));
        assert!(text("z") < text("é"));
        assert_eq!(OrderId::parse(IdKind::Uuid, "not a uuid"), None);
        // Sent in canonical form whatever the column holds: no place in
        // the column's order.
        assert_eq!(
            OrderId::parse(IdKind::Text, "A5FFFFFF-0000-4000-8000-000000000000"),
            None
        );
        assert_eq!(
            int(&i64::MIN.to_string()).sql(),
            "'-9223372036854775808'::int8"
        );
        assert_eq!(
            text("it's").sql(),
            "'\\x69742773'::bytea",
            "text goes as its bytes, never quoted"
        );
    }

    #[test]
    fn what_earlier_backfill_runs_stored_survives_its_header_and_keeps_what_nothing_covers() {
        let a = covered("2026-01-01T00:00:00Z", 1, 100);
        let b = covered("2026-01-02T00:00:00Z", 2, 200);
        // Later and with a newer horizon: b covers a.
        assert_eq!(Covered::merge(vec![a.clone(), b.clone()]), vec![b.clone()]);
        // Earlier but newer horizon: neither covers the other.
        let c = covered("2025-12-31T00:00:00Z", 3, 300);
        assert_eq!(
            Covered::merge(vec![a.clone(), b.clone(), c.clone()]),
            vec![c.clone(), b.clone()]
        );
        let list = Covered::merge(vec![a, b.clone(), c]);
        assert_eq!(Covered::parse_header(&Covered::header(&list)), list);
        // An item it cannot read is left out, not the rest.
        let text = format!("nonsense, {}", Covered::header(std::slice::from_ref(&b)));
        assert_eq!(Covered::parse_header(&text), vec![b]);
        // Bounded: the newest horizons stay.
        let many: Vec<Covered> = (0..10)
            .map(|i| {
                covered(
                    &format!("2026-01-{:02}T00:00:00Z", 20 - i),
                    i as u128,
                    100 + i,
                )
            })
            .collect();
        let kept = Covered::merge(many);
        assert_eq!(kept.len(), Covered::MAX);
        assert_eq!(kept[0].horizon, 109);
    }

    /// A stream read back: for each (run, window, keys), that run's
    /// messages (horizon 7, time 0, int ids).
    fn read_of(runs: &[(Option<&str>, usize, Vec<i64>)]) -> StreamRead {
        let at = time::OffsetDateTime::UNIX_EPOCH;
        let mut r = StreamRead::default();
        for (run, window, keys) in runs {
            let seen = r
                .runs
                .entry(RunId {
                    horizon: 7,
                    run: run.map(str::to_owned),
                })
                .or_default();
            seen.window = *window;
            seen.keys
                .extend(keys.iter().map(|&k| (at, OrderId::Int(k))));
            r.oldest_run = Some(7);
        }
        r
    }

    fn bound(c: &[Covered]) -> Vec<(i64, u64)> {
        c.iter()
            .map(|c| match c.id {
                OrderId::Int(k) => (k, c.horizon),
                _ => unreachable!(),
            })
            .collect()
    }

    const A: Option<&str> = Some("a");

    #[test]
    fn a_run_proves_its_bound_only_with_two_windows_of_timed_messages() {
        assert!(prove(&[read_of(&[(A, 5, (1..=9).collect())])]).is_empty());
        // The tenth newest: every message before it was acked.
        assert_eq!(
            bound(&prove(&[read_of(&[(A, 5, (1..=25).collect())])])),
            [(16, 7)]
        );
        // Under its own window, not today's.
        assert!(prove(&[read_of(&[(A, 20, (1..=25).collect())])]).is_empty());
        let mut whole = read_of(&[(A, 5, (1..=25).collect())]);
        whole.whole = true;
        assert!(prove(&[whole]).is_empty(), "read whole: ids say it all");
        let mut cut = read_of(&[(A, 5, (1..=25).collect())]);
        cut.cut = true;
        assert!(prove(&[cut]).is_empty(), "a cut read proves nothing");
        // Runs sharing a horizon are not counted together.
        let two = read_of(&[
            (A, 5, (1..=6).collect()),
            (Some("b"), 5, (7..=12).collect()),
        ]);
        assert!(prove(&[two]).is_empty());
    }

    #[test]
    fn a_run_over_several_streams_proves_a_bound_only_where_each_was_read_back_that_far() {
        // Keys 1..=30, odd ones to stream a, even ones to b; a read back to
        // 21, b only to 28: the tenth newest overall is 21, but b may hold
        // unread messages from 22 to 26, lost in flight or not.
        let odd = |lo: i64| read_of(&[(A, 5, (lo..=30).filter(|k| k % 2 == 1).collect())]);
        let even = |lo: i64| read_of(&[(A, 5, (lo..=30).filter(|k| k % 2 == 0).collect())]);
        assert!(prove(&[odd(1), even(28)]).is_empty());
        assert_eq!(bound(&prove(&[odd(1), even(20)])), [(21, 7)]);
        // A stream read past the run's start (an older run there) holds
        // nothing more of it: the tenth newest of what both hold.
        let mut past = even(28);
        past.oldest_run = Some(6);
        assert_eq!(bound(&prove(&[odd(1), past])), [(15, 7)]);
        let mut history = even(28);
        history.history = true;
        assert_eq!(bound(&prove(&[odd(1), history])), [(15, 7)]);
        // A stream none of whose messages of the run was read proves
        // nothing for it, unless read whole.
        let small = |lo: i64| read_of(&[(A, 2, (lo..=30).filter(|k| k % 2 == 1).collect())]);
        assert!(prove(&[small(1), read_of(&[])]).is_empty());
        let mut none = read_of(&[]);
        none.whole = true;
        assert_eq!(bound(&prove(&[small(1), none])), [(23, 7)]);
        // An older relay's runs (no run id, no window) prove nothing.
        let legacy =
            |lo: i64, odd: i64| read_of(&[(None, 5, (lo..=30).filter(|k| k % 2 == odd).collect())]);
        assert!(prove(&[legacy(1, 1), legacy(1, 0)]).is_empty());
        assert!(prove(&[legacy(1, 1)]).is_empty());
    }
}
