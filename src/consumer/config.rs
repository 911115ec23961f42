//! The consumer's settings: the ones `consume` validates from its flags,
//! the durable they make, and the fixed timings the dispatcher and the crew
//! share. A leaf, so that the parts of the consumer need not see each other
//! (or the loop in `mod.rs` that runs them) to read them.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull};

/// Validated consumer settings.
#[derive(Debug, Clone)]
pub struct ConsumeConfig {
    pub stream: String,
    pub durable: String,
    pub filter: Option<String>,
    pub ack_wait: Duration,
    pub max_deliver: i64,
    pub max_ack_pending: i64,
    pub concurrency: usize,
    /// NAK delay for delivery n is `backoff[min(n, len) - 1]`.
    pub backoff: Vec<Duration>,
    /// Failing aggregates whose parked state the dispatcher holds in
    /// memory; the rest wait in the inbox and are read back as room frees.
    pub max_parked_keys: usize,
    pub dlq_prefix: String,
    pub dlq_replicas: u8,
    /// Monitoring URLs of the NATS servers (`--nats-monitor-url`).
    pub nats_monitor_url: Vec<String>,
    pub require_durable: bool,
    pub shutdown_timeout: Duration,
    /// `--schemas`: payloads are checked before the handler is called; one
    /// that fails is dead-lettered without a call. SIGHUP reloads them.
    pub schemas: Option<std::sync::Arc<crate::schema::Schemas>>,
}

/// The durable, with `window` deliveries unacked at most. The dispatcher
/// sizes the window from the crew: `--max-ack-pending` for each process it
/// dispatches for ([`window`]), so every process's `--concurrency` can be
/// busy at the defaults; a window of one process's size left the others
/// about two jobs between them.
pub(super) fn durable_config(cfg: &ConsumeConfig, window: i64) -> pull::Config {
    pull::Config {
        durable_name: Some(cfg.durable.clone()),
        filter_subject: cfg.filter.clone().unwrap_or_default(),
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait: cfg.ack_wait,
        // Attempts are counted in the inbox (`--max-deliver`); JetStream
        // redelivers only what a crash or a reset left unacked, and must
        // never give up on it.
        max_deliver: -1,
        max_ack_pending: window,
        ..Default::default()
    }
}

/// The durable's ack-pending window for a crew of `processes`: each
/// process's share (`--max-ack-pending`), or no limit when there is none.
pub(super) fn window(per_process: i64, processes: usize) -> i64 {
    if per_process <= 0 {
        return per_process;
    }
    per_process.saturating_mul(i64::try_from(processes.max(1)).unwrap_or(i64::MAX))
}

/// The longest pause between attempts to rebuild a failed pull stream.
pub(super) const MAX_RESUBSCRIBE_BACKOFF: Duration = Duration::from_secs(1);

/// How long the dispatcher waits on one JetStream request.
pub(super) const JS_REQUEST: Duration = Duration::from_secs(2);
/// The pause before a parked message whose retry panicked is tried again.
pub(super) const PANIC_PAUSE: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::window;

    #[test]
    fn the_window_grows_with_the_crew_and_keeps_no_limit_unlimited() {
        assert_eq!(window(50, 1), 50);
        assert_eq!(window(50, 4), 200);
        assert_eq!(window(50, 0), 50, "the dispatcher counts itself");
        assert_eq!(window(-1, 4), -1, "no limit stays none");
        assert_eq!(window(i64::MAX, 3), i64::MAX);
    }
}
