//! What a restarted relay reads back from its streams to skip the events
//! they already hold, at the replay's pace.
//!
//! The replay starts at the slot's confirmed position, which can lie a
//! whole huge transaction (or a failover slot's sync lag) behind what the
//! stream holds. Each listed stream gets a [`Cursor`]: an ordered,
//! headers-only consumer from about where the replay starts, read forward
//! only as far as the replay's next event ([`ReadBack::advance`]). No cap
//! on how much is verified, no time budget for all of it, and what is held
//! is what lies between the replay and the read.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull::Ordered, stream, Context};
use async_nats::HeaderMap;
use futures::StreamExt;
use pgwire_replication::Lsn;

use super::decode::Resume;
use super::publish::{lineage_position, Tail};
use crate::error::{Error, Result};
use crate::wire::{self, IdKey, Position};

/// How long one message of the read-back may take before that stream is
/// read no further (its later events are then published again: repeats
/// the duplicate window and the inboxes absorb, never a loss).
const READ_WAIT: Duration = Duration::from_secs(10);

/// Where one stream's read stands, without its I/O.
#[derive(Debug)]
pub struct Cursor {
    /// The stream sequence of this source's last message: read through it.
    last: u64,
    /// The newest position read so far.
    frontier: Option<Position>,
    state: Read,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Read {
    Reading,
    /// Read through `last`: the stream holds nothing more of this source.
    Whole,
    /// Stopped (an error, a stream that did not answer): nothing past the
    /// frontier is known.
    GaveUp,
}

impl Cursor {
    pub fn new(last: u64) -> Self {
        Self {
            last,
            frontier: None,
            state: Read::Reading,
        }
    }

    /// Whether this stream must be read further for an event at `want`.
    pub(super) fn short_of(&self, want: Position) -> bool {
        self.state == Read::Reading && self.frontier.is_none_or(|f| f < want)
    }

    /// One message read at `seq`, and this source's event in it, if any.
    /// Events the replay has passed (before `want`) are not kept.
    pub fn read(
        &mut self,
        resume: &mut Resume,
        want: Position,
        seq: u64,
        event: Option<(Position, IdKey)>,
    ) {
        if let Some((at, id)) = event {
            if at >= want {
                resume.found(at, id);
            }
            self.frontier = Some(self.frontier.map_or(at, |f| f.max(at)));
        }
        if seq >= self.last {
            self.state = Read::Whole;
        }
    }

    pub(super) fn give_up(&mut self) {
        self.state = Read::GaveUp;
    }

    /// What this stream has been read through: everything, once whole.
    fn read_to(&self) -> Option<Position> {
        match self.state {
            Read::Whole => Some(Position {
                commit_lsn: Lsn(u64::MAX),
                index: u32::MAX,
            }),
            _ => self.frontier,
        }
    }
}

/// After cursors moved: what every stream has been read through, and
/// whether reading is over.
pub fn settle(resume: &mut Resume, cursors: &[&Cursor]) {
    let read_to = cursors.iter().map(|c| c.read_to()).min().flatten();
    if let Some(at) = read_to {
        resume.read_through(at);
    }
    if cursors.iter().all(|c| c.state != Read::Reading) {
        resume.read_no_further();
    }
}

struct Reader {
    name: String,
    cursor: Cursor,
    stream: stream::Stream,
    /// Where its read starts.
    start: u64,
    /// Made at the first read, not before: the replay may decode for
    /// minutes before its first event, and a consumer nobody pulls from is
    /// forgotten by the server, then made again from the stream's start.
    messages: Option<Ordered>,
}

impl Reader {
    async fn open(&mut self) -> std::result::Result<(), String> {
        let consumer = self
            .stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                headers_only: true,
                deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: self.start,
                },
                ..Default::default()
            })
            .await
            .map_err(|e| e.to_string())?;
        self.messages = Some(consumer.messages().await.map_err(|e| e.to_string())?);
        Ok(())
    }
}

/// The read-back of every listed stream that holds events of the replay.
pub struct ReadBack {
    readers: Vec<Reader>,
    lineage: wire::Lineage,
    from: Lsn,
}

impl ReadBack {
    /// `tails`: each listed stream's last message of this source. Streams
    /// whose last one is before `from` (the slot's confirmed position) hold
    /// none of the replay.
    pub async fn open(
        js: &Context,
        tails: &[(String, Tail)],
        lineage: &wire::Lineage,
        from: Lsn,
    ) -> Result<(Option<Resume>, ReadBack)> {
        let mut readers = Vec::new();
        let mut newest: Option<Position> = None;
        for (name, tail) in tails {
            newest = newest.max(Some(tail.at));
            if tail.at.commit_lsn < from {
                continue;
            }
            let context = "reading back what the stream holds since the slot's position";
            let stream = js.get_stream(name).await.map_err(Error::nats(context))?;
            let start = start_of(&stream, lineage, tail, from, context).await?;
            tracing::debug!(stream = %name, from = start, through = tail.seq, "reading back at the replay's pace");
            readers.push(Reader {
                name: name.clone(),
                cursor: Cursor::new(tail.seq),
                stream,
                start,
                messages: None,
            });
        }
        let mut resume = newest.map(Resume::new);
        let back = ReadBack {
            readers,
            lineage: lineage.clone(),
            from,
        };
        if let Some(r) = &mut resume {
            back.settle(r);
        }
        Ok((resume, back))
    }

    /// Read every stream short of `want` until it is read past it, or to
    /// this source's last message in it.
    pub async fn advance(&mut self, resume: &mut Resume, want: Position) {
        let (lineage, from) = (&self.lineage, self.from);
        for reader in &mut self.readers {
            if reader.cursor.short_of(want) && reader.messages.is_none() {
                let opened = tokio::time::timeout(READ_WAIT, reader.open()).await;
                if let Err(why) =
                    opened.unwrap_or_else(|_| Err(format!("no answer within {READ_WAIT:?}")))
                {
                    tracing::warn!(
                        stream = %reader.name,
                        "cannot read the stream back ({why}): events replayed from here are published again (the duplicate window and the inboxes absorb repeats)"
                    );
                    reader.cursor.give_up();
                }
            }
            while reader.cursor.short_of(want) {
                let Some(messages) = reader.messages.as_mut() else {
                    reader.cursor.give_up();
                    break;
                };
                let next = tokio::time::timeout(READ_WAIT, messages.next()).await;
                let msg = match next {
                    Ok(Some(Ok(msg))) => msg,
                    failed => {
                        let why = match failed {
                            Ok(Some(Err(e))) => e.to_string(),
                            Ok(None) => "the read ended".into(),
                            _ => format!("no message within {READ_WAIT:?}"),
                        };
                        tracing::warn!(
                            stream = %reader.name,
                            read_through = ?reader.cursor.frontier.map(|p| format!("{}#{}", p.commit_lsn, p.index)),
                            "stopped reading the stream back ({why}): events replayed past what was read are published again (the duplicate window and the inboxes absorb repeats)"
                        );
                        reader.cursor.give_up();
                        reader.messages = None;
                        break;
                    }
                };
                let Ok(info) = msg.info() else {
                    continue;
                };
                let seq = info.stream_sequence;
                let event = msg.headers.as_ref().and_then(|h| event(h, lineage, from));
                reader.cursor.read(resume, want, seq, event);
            }
            if reader.cursor.state != Read::Reading {
                // Its consumer goes with it (ordered consumers are
                // ephemeral: the server forgets it).
                reader.messages = None;
            }
        }
        self.settle(resume);
    }

    fn settle(&self, resume: &mut Resume) {
        let cursors: Vec<&Cursor> = self.readers.iter().map(|r| &r.cursor).collect();
        settle(resume, &cursors);
    }
}

/// This source's event in a message, from `from` on.
fn event(h: &HeaderMap, lineage: &wire::Lineage, from: Lsn) -> Option<(Position, IdKey)> {
    let at = lineage_position(h, lineage)?;
    if at.commit_lsn < from {
        return None;
    }
    Some((at, IdKey::of(h.get(wire::MSG_ID)?.as_str())))
}

/// Where to start reading: a sequence at or before the stream's first
/// message of this source at or after `from`. Probes back from the tail in
/// doubling steps for a message of ours before `from`, then halves the gap
/// to the nearest one at or after it; a probe that finds a gap or another
/// writer's message stops the halving (reading from the lower bound costs
/// messages read and skipped, nothing else).
async fn start_of(
    stream: &stream::Stream,
    lineage: &wire::Lineage,
    tail: &Tail,
    from: Lsn,
    context: &str,
) -> Result<u64> {
    let first = stream.cached_info().state.first_sequence;
    // Whether the message at `seq` is ours and before `from`; None: not ours.
    let before = |seq: u64| async move {
        match stream.get_raw_message(seq).await {
            Ok(m) => Ok(lineage_position(&m.headers, lineage).map(|at| at.commit_lsn < from)),
            Err(e) if matches!(e.kind(), stream::RawMessageErrorKind::NoMessageFound) => Ok(None),
            Err(e) => Err(Error::nats(context)(e)),
        }
    };
    let (mut lo, mut hi) = (first, tail.seq);
    let mut step = 1u64;
    while step <= tail.seq.saturating_sub(first) {
        let probe = tail.seq - step;
        match before(probe).await? {
            Some(true) => {
                lo = probe;
                break;
            }
            Some(false) => hi = probe,
            None => {}
        }
        step = step.saturating_mul(2);
    }
    // The gap [lo, hi]: lo is before `from` (or the stream's first), hi at
    // or after it. Halving it saves reading a doubling step's worth.
    while hi.saturating_sub(lo) > 1024 {
        let mid = lo + (hi - lo) / 2;
        match before(mid).await? {
            Some(true) => lo = mid,
            Some(false) => hi = mid,
            None => break,
        }
    }
    Ok(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pos(lsn: u64, index: u32) -> Position {
        Position {
            commit_lsn: Lsn(lsn),
            index,
        }
    }

    fn key(n: u64) -> IdKey {
        IdKey::of(&format!("id-{n}"))
    }

    #[test]
    fn a_cursor_reads_only_as_far_as_the_replay_needs() {
        let mut resume = Resume::new(pos(100, 9));
        let mut c = Cursor::new(10);
        // The stream: seq n holds the event at (100, n-1).
        let mut seq = 0;
        let want = pos(100, 3);
        while c.short_of(want) {
            seq += 1;
            c.read(
                &mut resume,
                want,
                seq,
                Some((pos(100, seq as u32 - 1), key(seq))),
            );
        }
        settle(&mut resume, &[&c]);
        assert_eq!(seq, 4, "read up to the event wanted, no further");
        assert!(!resume.wants(want));
        assert!(resume.wants(pos(100, 4)));
        assert_eq!(
            resume.held(),
            1,
            "the events before the replay are not kept"
        );
    }

    #[test]
    fn a_stream_that_gave_up_ends_the_comparison_where_it_stopped() {
        let mut resume = Resume::new(pos(100, 9));
        let (mut a, mut b) = (Cursor::new(10), Cursor::new(10));
        a.read(&mut resume, pos(100, 0), 1, Some((pos(100, 5), key(1))));
        b.read(&mut resume, pos(100, 0), 1, Some((pos(100, 2), key(2))));
        b.give_up();
        settle(&mut resume, &[&a, &b]);
        assert!(!resume.wants(pos(100, 2)));
        assert!(resume.wants(pos(100, 3)), "a is still reading");
        a.read(&mut resume, pos(100, 3), 10, None);
        settle(&mut resume, &[&a, &b]);
        assert!(!resume.wants(pos(100, 3)), "nothing more will be read");
        assert_eq!(resume.tail, pos(100, 2));
    }
}
