//! The crew: every process of one durable works (SPEC §11).
//!
//! Per-aggregate order needs one place that sees a durable's messages in
//! stream order, so one process of the crew, the **dispatcher** (it holds the
//! [`lease`](super::lease)), pulls and schedules exactly as a lone process
//! does. What it cannot run itself (its own `--concurrency` is busy) it hands,
//! job by job, to another process of the crew with room. A job is the unit
//! the scheduler runs anyway (a delivery, or a parked message's retry) and
//! runs there through the same code, `delivery::run_job`: claim, handler,
//! inbox, ack. The helper acks the JetStream message itself: an ack is a
//! publish to the message's reply subject, from any connection. The key
//! stays busy in the dispatcher's scheduler until the helper says how the
//! job ended, so order, no overlap and no head-of-line blocking are the
//! scheduler's, unchanged.
//!
//! The one rule everything below keeps: **a job is run again only once its
//! first run has stopped.** So:
//!
//! - Every process serves one dispatcher at a time. A new dispatcher first
//!   *syncs* every live process, and every one it heard running jobs in the
//!   last [`OVERHEARD`] (each process hears every beat, all along: after a
//!   Postgres stall every member lock is gone at once, and a process cut
//!   off from both may still be running its calls). A process honours a sync only from the
//!   member that holds the lease *now* (the lease's connection also holds a
//!   tag lock keyed by the holder's member id, see `lease::held_by`), so an
//!   old dispatcher that has not noticed it lost the lease cannot take a
//!   process back. From then on that process refuses jobs from anyone else,
//!   and its answer lists what it runs, which the new dispatcher adopts
//!   (their keys stay busy until each reports). A live process that does
//!   not answer is waited for until it must have stopped its jobs (below).
//!   Only then does the new dispatcher reset the durable to its ack floor.
//! - A job request expires: it names the helper's beat after which it must
//!   be refused, so a request that arrives late cannot start a job the
//!   dispatcher has already given up on; and it names the dispatcher's
//!   period, so one sent before the same process took the lease back is
//!   refused too.
//! - Who is alive is Postgres's word: each process holds a session advisory
//!   lock (its member lock) on a session Postgres ends after
//!   [`LEASE_TTL`](super::lease::LEASE_TTL) of silence, and a kill -9 frees
//!   it at once. A helper checks its lock every [`BEAT`] (bounded by
//!   [`PING`]), and the dispatcher acknowledges every beat it hears from a
//!   process serving it, naming the beat. A helper's *proof* holds while it
//!   is heard (its newest acknowledged beat sent less than [`FENCE`] ago)
//!   or holds its lock (its last good check less than `LEASE_TTL` ago), and
//!   never past `FENCE_LOCKED` unheard; every call reads it first. So a
//!   Postgres outage, a stalled path or a paused dispatcher costs no call.
//!   Once it lapses the helper offers no room, refuses jobs and cuts its
//!   calls in flight, and nothing it held calls again (a lapse is a fence);
//!   a job past its call is never cut (it records its outcome). A lock
//!   whose connection failed is taken back under the same id. The
//!   dispatcher takes a job for lost only later, by the rule in `rule.rs`
//!   (neither heard nor holding its lock, or not heard for long), or when
//!   a beat past the job's start no longer lists it. A lost job is handled
//!   as one that panicked here: what the inbox holds decides, and a reset
//!   to the ack floor brings back an unacked message, in order. A
//!   dispatcher's own process cut off the same way ends its period (its
//!   calls in flight cut) when others could take over; alone, it cuts
//!   nothing.
//!
//! A call already on the wire when its process froze (SIGSTOP, a VM pause)
//! may be answered by the handler during the freeze; the new dispatcher,
//! which cannot know, makes it again. Nothing else of a frozen process runs
//! once it thaws: its proof has lapsed.
//!
//! Subjects (core NATS, outside any stream): `_OUTBOX_CREW.{stream}.{durable}`
//! `.s.hello` and `.s.done` (one subscription, so a job's end is never read
//! after a beat that no longer lists it), `.job.{member}` (requests),
//! `.sync.{member}` and `.ack.{member}` (the dispatcher heard this member).
//!
//! By job: [`member`] (the member lock, who holds one), [`messages`] (what
//! travels between processes), [`dispatch`] (the dispatcher's period:
//! sync, adopt, hand out, await), [`helper`] (every process: beats, jobs
//! run for the dispatcher, the cut at a lapse), and `rule.rs` (who may
//! start a job and when one is lost, pure).

pub(super) use rule::BEAT;
#[cfg(test)]
pub(super) use rule::GRACE;

mod dispatch;
mod helper;
mod member;
mod messages;
mod rule;

pub(super) use dispatch::{await_end, register, Crew, Sent};
pub(super) use helper::{run_caught, work, Worker};
pub(super) use member::Member;
pub(super) use messages::{new_job_id, record_subject, report, roster, Registry, Running};
