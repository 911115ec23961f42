//! What crew processes say to each other over core NATS: beats (`Hello`),
//! job requests and their ends, syncs; each in JSON, read back tolerantly
//! of what earlier versions send. With them the names every side shares:
//! the subjects, a running job (`Running`) and the roster of them.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use serde::{Deserialize, Serialize};

use super::rule;
use crate::consumer::scheduler::{Finished, Job};

/// How long a helper may take to answer a request or a sync.
pub(super) const SEND_TIMEOUT: Duration = Duration::from_millis(500);

pub(super) fn base(stream: &str, durable: &str) -> String {
    format!("{}.{stream}.{durable}", crate::wire::CREW_PREFIX)
}

/// Where a helper cut off from Postgres asks the crew to record a success
/// (see [`crate::consumer::delivery::Recorder`]); every process listens, and each that finds
/// the row processed (one of them by its own write) answers.
pub(crate) fn record_subject(stream: &str, durable: &str) -> String {
    format!("{}.record", base(stream, durable))
}

/// A job as a process reports it while it runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Running {
    pub id: u64,
    pub key: String,
    /// The parked message's sequence, for a retry; none for a delivery.
    #[serde(default)]
    pub retry: Option<u64>,
    /// Run by this process as dispatcher (not sent to it).
    #[serde(default)]
    pub mine: bool,
}

/// What a process runs, and the dispatcher it serves (see [`rule::Roster`]).
pub(crate) type Roster = rule::Roster<Running>;

pub(crate) type Registry = Arc<Mutex<Roster>>;

pub(crate) fn roster(registry: &Registry) -> std::sync::MutexGuard<'_, Roster> {
    registry
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Hello {
    pub(super) member: i32,
    pub(super) capacity: usize,
    pub(super) leaving: bool,
    pub(super) beat: u64,
    pub(super) running: Vec<Running>,
    #[serde(default)]
    pub(super) serving: Option<i32>,
    #[serde(default)]
    pub(super) period: u64,
    /// It refused a sync since it was last synced: sync it again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) fenced: bool,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Done {
    pub(super) id: u64,
    pub(super) how: Ended,
    pub(super) panicked: bool,
    /// Stopped unfinished (the helper could not be heard, or lost its
    /// lock): the dispatcher handles it as lost.
    #[serde(default)]
    pub(super) lost: bool,
}

/// How a job a helper ran ended, for its report.
pub(super) struct JobDone {
    pub(super) id: u64,
    pub(super) how: Finished<Instant>,
    pub(super) panicked: bool,
}

/// A sync refused by a process that cannot ask Postgres who holds the
/// lease, with its beat then (the takeover adopts its jobs from a later
/// beat: [`rule::Takeover::adopts_from`]).
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct SyncRefusal {
    pub(super) refused_at_beat: u64,
}

/// How a process answered a sync.
pub(super) enum SyncReply {
    /// It serves the asker now; what it runs.
    Joined(Hello),
    /// It cannot tell whether the asker holds the lease.
    Refused { beat: u64 },
    /// No answer, or "not the dispatcher".
    Silent,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Sync {
    pub(super) from: i32,
    /// Drawn anew each period as dispatcher.
    #[serde(default)]
    pub(super) period: u64,
}

/// [`Finished`] on the wire: a due time travels as a delay.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "t", rename_all = "snake_case")]
pub(super) enum Ended {
    Done,
    Parked { seq: u64, due_ms: u64 },
    Retried { next: Option<u64> },
    Spilled { seq: Option<u64> },
}

impl Ended {
    pub(super) fn from(how: Finished<Instant>) -> Self {
        match how {
            Finished::Done => Ended::Done,
            Finished::Parked { seq, due } => Ended::Parked {
                seq,
                due_ms: due.saturating_duration_since(Instant::now()).as_millis() as u64,
            },
            Finished::Retried { next } => Ended::Retried { next },
            Finished::Spilled { seq } => Ended::Spilled { seq },
        }
    }

    pub(super) fn into_finished(self) -> Finished<Instant> {
        match self {
            Ended::Done => Finished::Done,
            Ended::Parked { seq, due_ms } => Finished::Parked {
                seq,
                due: Instant::now() + Duration::from_millis(due_ms),
            },
            Ended::Retried { next } => Finished::Retried { next },
            Ended::Spilled { seq } => Finished::Spilled { seq },
        }
    }
}

/// What travels ahead of a job's message body.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct JobHead {
    pub(super) id: u64,
    pub(super) key: String,
    #[serde(default)]
    pub(super) retry: Option<u64>,
    /// A [`Job::Check`]: its key may be parked in the inbox only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) check: bool,
    #[serde(default)]
    pub(super) subject: String,
    #[serde(default)]
    pub(super) reply: Option<String>,
    /// The dispatcher that sends it, and its period.
    pub(super) from: i32,
    #[serde(default)]
    pub(super) period: u64,
    /// The helper's last beat at which it may still start the job.
    pub(super) until: u64,
}

/// A job id unique across the crew: a random base drawn once per process,
/// then a counter. Not a random per job: that was a `getrandom` system call
/// on every delivery (seen in the consumer's profile).
pub(crate) fn new_job_id() -> u64 {
    use std::sync::atomic::AtomicU64;
    use std::sync::OnceLock;
    static BASE: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let base = *BASE.get_or_init(|| uuid::Uuid::new_v4().as_u128() as u64);
    base.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Tell the dispatcher how a job ended (a process that ran it, or that ran
/// it as dispatcher and handed the lease on meanwhile).
pub(crate) async fn report(
    client: &async_nats::Client,
    stream: &str,
    durable: &str,
    id: u64,
    how: Finished<Instant>,
    panicked: bool,
) {
    let done = JobDone { id, how, panicked };
    publish_done(client, &base(stream, durable), done).await;
}

pub(super) async fn publish_done(client: &async_nats::Client, base: &str, job: JobDone) {
    let done = Done {
        id: job.id,
        how: Ended::from(job.how),
        panicked: job.panicked,
        // A job cut short is now reported as panicked (see `stop_jobs`);
        // the field stays for what helpers of earlier versions send.
        lost: false,
    };
    if let Ok(body) = serde_json::to_vec(&done) {
        // Bounded: with NATS gone the client's queue may be full, and the
        // dispatcher takes a silent helper's jobs for lost anyway.
        let _ = tokio::time::timeout(
            SEND_TIMEOUT,
            client.publish(format!("{base}.s.done"), body.into()),
        )
        .await;
    }
}

/// A job request back into the scheduler's job.
pub(super) fn decode(
    req: &async_nats::Message,
    js: &jetstream::Context,
) -> Option<(JobHead, Job<jetstream::Message>)> {
    let split = req.payload.iter().position(|b| *b == b'\n')?;
    let head: JobHead = serde_json::from_slice(&req.payload[..split]).ok()?;
    let body = req.payload.slice(split + 1..);
    let job = match head.retry {
        Some(seq) => Job::Retry { seq },
        None => {
            let message = async_nats::Message {
                subject: head.subject.as_str().into(),
                reply: Some(head.reply.clone()?.into()),
                length: body.len(),
                payload: body,
                headers: req.headers.clone(),
                status: None,
                description: None,
            };
            let msg = jetstream::Message {
                message,
                context: js.clone(),
            };
            match head.check {
                true => Job::Check(msg),
                false => Job::Deliver(msg),
            }
        }
    };
    Some((head, job))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jobs_end_survives_the_wire() {
        for ended in [
            Ended::Done,
            Ended::Parked { seq: 7, due_ms: 0 },
            Ended::Retried { next: Some(9) },
            Ended::Retried { next: None },
            Ended::Spilled { seq: Some(3) },
        ] {
            let back: Ended = serde_json::from_slice(&serde_json::to_vec(&ended).unwrap()).unwrap();
            assert_eq!(back, ended);
        }
        let parked = Ended::from(Finished::Parked {
            seq: 4,
            due: Instant::now() + Duration::from_secs(10),
        });
        assert!(
            matches!(parked, Ended::Parked { seq: 4, due_ms } if due_ms > 9_000 && due_ms <= 10_000)
        );
    }

    #[test]
    fn job_ids_do_not_repeat_across_threads() {
        let ids: Vec<u64> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| s.spawn(|| (0..10_000).map(|_| new_job_id()).collect::<Vec<_>>()))
                .collect();
            hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        let distinct: std::collections::HashSet<_> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len());
    }
}
