//! The dispatcher's pull-stream watchdog. A pull request can vanish with a
//! consumer leader without the pull stream noticing (no error, no missed
//! heartbeat), a delivery can be lost on the way (a pull stream renewed
//! while it travelled), and a pull subscription does not survive its client
//! moving to another server. None of that raises an error; this type keeps
//! what shows it: the numbering of deliveries, when the last one came and
//! the last job settled, the server's own counts of the durable (asked off
//! the dispatcher's loop), and the client's reconnections.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull};
use tokio_util::sync::CancellationToken;

use super::config::JS_REQUEST;

/// How long a pull stream may deliver nothing while messages are pending.
pub(super) const QUIET_PULL: Duration = Duration::from_secs(5);
/// An ack sent when a job settles has reached the server by then, so a
/// count asked later no longer includes it.
pub(super) const ACK_LANDS: Duration = Duration::from_secs(1);

type Consumer = jetstream::consumer::Consumer<pull::Config>;

pub(super) struct Watchdog {
    durable_now: Arc<Mutex<Option<DurableState>>>,
    pending_task: tokio::task::JoinHandle<()>,
    last_arrival: Instant,
    last_settled: Instant,
    rewound_at: Instant,
    /// Deliveries to the only puller are numbered without gaps; a gap is a
    /// delivery lost on the way (a consumer leader died with it), which
    /// would come back only after ack_wait, behind later messages.
    last_delivery: Option<u64>,
    /// Each new connection gets a new pull subscription.
    stats: Arc<async_nats::Statistics>,
    connects: u64,
}

impl Watchdog {
    /// Watch `consumer` until `stop`; `stats` are the client's.
    pub fn start(
        consumer: &Consumer,
        stats: Arc<async_nats::Statistics>,
        stop: &CancellationToken,
    ) -> Watchdog {
        let durable_now = Arc::new(Mutex::new(None));
        let pending_task = tokio::spawn(watch_pending(
            consumer.clone(),
            durable_now.clone(),
            stop.clone(),
        ));
        let connects = stats.connects.load(Ordering::Relaxed);
        let now = Instant::now();
        Watchdog {
            durable_now,
            pending_task,
            last_arrival: now,
            last_settled: now,
            rewound_at: now,
            last_delivery: None,
            stats,
            connects,
        }
    }

    /// What the server last said of the durable.
    pub fn durable(&self) -> Option<DurableState> {
        self.durable_now.lock().ok().and_then(|d| *d)
    }

    /// The client connected again since last asked: the pull subscription
    /// is gone with the old connection.
    pub fn reconnected(&mut self) -> bool {
        let now = self.stats.connects.load(Ordering::Relaxed);
        let moved = now != self.connects;
        self.connects = now;
        moved
    }

    /// Delivery number `delivery` arrived; `Err(last)` when it does not
    /// follow the last one (a delivery was lost on the way).
    pub fn arrived(&mut self, delivery: u64) -> Result<(), u64> {
        if let Some(last) = self.last_delivery {
            if delivery != last + 1 {
                return Err(last);
            }
        }
        self.last_delivery = Some(delivery);
        self.last_arrival = Instant::now();
        Ok(())
    }

    /// A job settled (its ack, if any, is on its way).
    pub fn settled(&mut self) {
        self.last_settled = Instant::now();
    }

    /// The durable was rewound to its ack floor (or is about to be).
    pub fn rewound(&mut self) {
        self.rewound_at = Instant::now();
    }

    /// A new pull stream numbers its deliveries afresh.
    pub fn renumbered(&mut self) {
        self.last_delivery = None;
    }

    /// Quiet is measured from now on (the stream was just renewed).
    pub fn heard(&mut self) {
        self.last_arrival = Instant::now();
    }

    pub fn quiet_for(&self) -> Duration {
        self.last_arrival.elapsed()
    }

    /// A parked head held back for the pull to come back to it, while
    /// JetStream has nothing left to deliver since: its message left the
    /// stream, and it may go on.
    pub fn held_head_left(&self) -> bool {
        let since = self.last_arrival.max(self.rewound_at);
        self.durable()
            .is_some_and(|d| d.num_pending == 0 && d.asked > since + ACK_LANDS)
    }

    /// Why the pull stream should be given up for one from the ack floor:
    /// it stayed quiet while `pulling` (room to pull, a stream open), and
    /// the server has messages pending, or counts deliveries unacked that
    /// never arrived (`holds_no_delivery`: the scheduler holds none).
    pub fn lost(&self, pulling: bool, holds_no_delivery: bool) -> Option<&'static str> {
        if !pulling || self.last_arrival.elapsed() <= QUIET_PULL {
            return None;
        }
        let d = self.durable()?;
        if d.num_pending > 0 && !d.ack_pending_full {
            Some("nothing delivered while messages are pending")
        } else if d.num_ack_pending > 0
            && holds_no_delivery
            && d.asked > self.last_settled + ACK_LANDS
        {
            Some("JetStream counts deliveries unacked that never arrived")
        } else {
            None
        }
    }

    pub fn stop(&self) {
        self.pending_task.abort();
    }
}

/// What the server last said of the durable, and when it was asked.
#[derive(Debug, Clone, Copy)]
pub(super) struct DurableState {
    pub asked: Instant,
    pub num_pending: u64,
    pub num_ack_pending: u64,
    /// JetStream holds back at max_ack_pending: quiet then is not a lost
    /// pull request.
    pub ack_pending_full: bool,
    /// The durable's max_ack_pending.
    pub limit: i64,
}

/// [`DurableState`], kept off the dispatcher: during an election the info
/// request waits out its timeout. (The pending gauge is every process's,
/// `super::watch_lag`.)
async fn watch_pending(
    mut consumer: Consumer,
    now: Arc<std::sync::Mutex<Option<DurableState>>>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let asked = Instant::now();
        if let Ok(Ok(info)) = tokio::time::timeout(JS_REQUEST, consumer.info()).await {
            let limit = info.config.max_ack_pending;
            let state = DurableState {
                asked,
                num_pending: info.num_pending,
                num_ack_pending: info.num_ack_pending as u64,
                ack_pending_full: limit > 0 && info.num_ack_pending as i64 >= limit,
                limit,
            };
            if let Ok(mut d) = now.lock() {
                *d = Some(state);
            }
        }
    }
}
