//! Publishing to JetStream in commit order, pipelined.
//!
//! Up to `max_inflight` publishes await their ack at once. Order in the
//! stream is kept by the server, not by hope: every publish carries
//! `Nats-Expected-Last-Msg-Id` = the previous event's id in the same stream,
//! so if one message is lost (a connection drop with later messages still
//! queued in the client, a rejected publish), every message after it is
//! refused too, instead of being stored ahead of it. The refusals the
//! session can settle (another writer, a message the server will never take,
//! no leader for a while: [`Publisher::next_ack`]) are settled in it; any
//! other failed ack ends the session, and the relay reconnects, finds its
//! last message in the stream ([`stored_tail`]) and resumes.
//!
//! The first publish of a session has nothing to chain from (the stream's
//! last message may not be ours), so it goes alone, unconditionally, and the
//! pipeline opens once it is answered. Its `Nats-Msg-Id` still dedupes it if
//! an earlier session stored it; but a duplicate does not become the
//! stream's last message, so nothing can chain from it either: while solo
//! publishes come back as duplicates (a backfill republishing what the
//! stream holds), each next one of that stream goes solo too.
//!
//! By job, one file each:
//! - [`streams`]: the streams the relay writes to, made or checked at start,
//!   the routed ones looked up, a missing one watched;
//! - [`tail`]: the last message this source stored, read back at a restart;
//! - [`resume`]: an interrupted backfill's resume: what earlier runs stored
//!   and the bound they prove;
//! - [`chains`]: per stream, the id the next publish must follow;
//! - [`publisher`]: the window: each message handed to the link and kept
//!   until it is answered;
//! - [`answers`]: the answers, in publish order: acks, the refusals settled
//!   in the session, an outage ridden out by probes;
//! - [`refusal`]: what a failed publish means (no leader, refused, a full
//!   stream, denied).

mod answers;
mod chains;
mod publisher;
mod refusal;
mod resume;
mod streams;
mod tail;

pub use publisher::{Ack, Publisher, Refusals};
pub use resume::{backfill_resume, BackfillResume, Covered, IdKind};
pub(crate) use streams::stream_not_found;
pub use streams::{
    ensure_stream, routed_streams, server_batches, watch_missing, StreamSettings, HEADER_RESERVE,
};
pub(crate) use tail::lineage_position;
pub use tail::{last_event_of_database, stored_tail, Tail, TailEvent};
