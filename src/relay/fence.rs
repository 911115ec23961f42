//! A relay that was paused (SIGSTOP, a VM pause, a stuck host) for longer
//! than its walsender waits for it may thaw to find its slot taken over:
//! the server ended the walsender after `wal_sender_timeout`, another relay
//! streamed from the slot's confirmed position and published what this one
//! still held unacked. Sent now, alone and perhaps past the duplicate
//! window, those stale copies would be stored twice, out of order.
//!
//! The fence tells a pause from the inside: a task beats every
//! [`BEAT`]; a gap longer than the limit between two beats, or since the
//! last beat when the publisher is about to send, means the process did
//! not run meanwhile. Either way the fence breaks for good, nothing more is
//! sent, and the session ends: the next one starts over from the slot, or
//! waits as a standby if another relay holds it now. A pause shorter than
//! the limit (half of `wal_sender_timeout`) cannot have lost the slot.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};

/// How often the fence's task beats.
const BEAT: Duration = Duration::from_millis(250);

/// The longest pause told from a busy process: half the walsender's
/// timeout, at most this (the default 60 s timeout gives 10 s).
const MAX_LIMIT: Duration = Duration::from_secs(10);

/// The shortest limit: a busy host's scheduling delay is not a pause.
const MIN_LIMIT: Duration = Duration::from_secs(1);

/// The pause after which the slot may be lost: half of `wal_sender_timeout`
/// (`None`: 0, no timeout), at most [`MAX_LIMIT`], at least [`MIN_LIMIT`].
pub fn limit(wal_sender_timeout: Option<Duration>) -> Duration {
    wal_sender_timeout
        .filter(|t| !t.is_zero())
        .map_or(MAX_LIMIT, |t| (t / 2).min(MAX_LIMIT))
        .max(MIN_LIMIT)
}

struct Inner {
    base: Instant,
    /// Milliseconds from `base` to the last beat.
    last: AtomicU64,
    /// The longest gap seen, once one passed the limit.
    paused_ms: AtomicU64,
    broken: AtomicBool,
    limit: Duration,
    broke: Notify,
}

impl Inner {
    fn since_last(&self, now: Instant) -> Duration {
        let last = self.base + Duration::from_millis(self.last.load(Ordering::Relaxed));
        now.saturating_duration_since(last)
    }

    fn hold_or_break(&self, now: Instant) -> bool {
        if self.broken.load(Ordering::Relaxed) {
            return false;
        }
        let gap = self.since_last(now);
        if gap <= self.limit {
            return true;
        }
        self.paused_ms.store(
            u64::try_from(gap.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        self.broken.store(true, Ordering::Relaxed);
        self.broke.notify_waiters();
        self.broke.notify_one();
        false
    }
}

/// See the module. Cloned into the publisher; the beat stops with the last
/// clone.
#[derive(Clone)]
pub struct Fence {
    inner: Arc<Inner>,
    _beat: Arc<DropGuard>,
}

impl Fence {
    pub fn start(limit: Duration) -> Fence {
        let base = Instant::now();
        let inner = Arc::new(Inner {
            base,
            last: AtomicU64::new(0),
            paused_ms: AtomicU64::new(0),
            broken: AtomicBool::new(false),
            limit,
            broke: Notify::new(),
        });
        let stop = CancellationToken::new();
        let beat = inner.clone();
        let stopped = stop.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stopped.cancelled() => return,
                    _ = tokio::time::sleep(BEAT) => {}
                }
                let now = Instant::now();
                // The gap is judged before the beat moves on: whichever
                // runs first after a pause, this or a send, sees it.
                if !beat.hold_or_break(now) {
                    return;
                }
                let ms = now.saturating_duration_since(beat.base).as_millis();
                beat.last
                    .store(u64::try_from(ms).unwrap_or(u64::MAX), Ordering::Relaxed);
            }
        });
        Fence {
            inner,
            _beat: Arc::new(stop.drop_guard()),
        }
    }

    /// Whether the process has run without a pause past the limit, so far
    /// as of `now`: nothing may be sent once it has not.
    pub fn holds(&self, now: Instant) -> bool {
        self.inner.hold_or_break(now)
    }

    /// Once the fence broke: how long the pause was.
    pub async fn broken(&self) -> Duration {
        loop {
            let notified = self.inner.broke.notified();
            if self.inner.broken.load(Ordering::Relaxed) {
                return self.paused();
            }
            notified.await;
        }
    }

    pub fn paused(&self) -> Duration {
        Duration::from_millis(self.inner.paused_ms.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_is_half_the_walsender_timeout_within_bounds() {
        let s = Duration::from_secs;
        assert_eq!(limit(Some(s(60))), s(10));
        assert_eq!(limit(Some(s(6))), s(3));
        assert_eq!(limit(Some(Duration::ZERO)), s(10));
        assert_eq!(limit(None), s(10));
        assert_eq!(limit(Some(Duration::from_millis(100))), MIN_LIMIT);
    }

    #[tokio::test(start_paused = true)]
    async fn a_pause_past_the_limit_breaks_the_fence_for_good() {
        let fence = Fence::start(Duration::from_secs(2));
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(fence.holds(Instant::now()), "the beat kept it");
        // A pause: time passes and no task runs (the clock jumps).
        let frozen = Instant::now() + Duration::from_secs(3);
        assert!(!fence.holds(frozen), "a send after the pause is refused");
        assert!(!fence.holds(Instant::now()), "for good");
        assert_eq!(
            tokio::time::timeout(Duration::from_secs(1), fence.broken())
                .await
                .map(|d| d >= Duration::from_secs(3)),
            Ok(true)
        );
    }
}
