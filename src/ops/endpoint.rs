//! The operator endpoint on `--metrics-addr`: `/metrics`, `/healthz`
//! (the process answers) and `/readyz` (connected and working).
//!
//! Readiness ([`Readiness`], kept below the components) is checked when
//! asked: NATS from the client's own connection state, the service's phase
//! (for the relay: streaming from its slot) from what it last reported, and
//! Postgres with a bounded, shared `SELECT 1`. A 503 body says what is missing,
//! so a failing probe explains itself. The endpoint bounds its connections
//! ([`CONNECTIONS_MAX`], closed after [`IDLE_READ`] of silence) and a
//! request's time ([`REQUEST_TIME`]).

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;

use super::slot_monitor::SlotMetrics;
use crate::error::{Error, Result};
pub use crate::readiness::Readiness;

/// Connections open at once; more wait in the listen backlog. High: a
/// client that trickles a byte now and then holds one, and the probes
/// (`/healthz` restarts the process when it goes unanswered) must find
/// one free; the bound is against running out of descriptors.
const CONNECTIONS_MAX: usize = 1024;
/// A connection that sends nothing this long is closed.
const IDLE_READ: Duration = Duration::from_secs(30);
/// A request that takes longer is answered 503.
const REQUEST_TIME: Duration = Duration::from_secs(10);

#[derive(Clone)]
struct Served {
    metrics: PrometheusHandle,
    slots: Option<SlotMetrics>,
    ready: Readiness,
}

/// The running endpoint; stop it after the service has drained, so the last
/// figures of a graceful shutdown can still be scraped.
pub struct Endpoint {
    pub addr: SocketAddr,
    stop: CancellationToken,
}

impl Endpoint {
    /// Bind `addr` (port 0 picks a free one) and serve until [`Endpoint::stop`].
    pub async fn start(
        addr: SocketAddr,
        metrics: PrometheusHandle,
        slots: Option<SlotMetrics>,
        ready: Readiness,
    ) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            Error::Config(format!(
                "cannot serve metrics on {addr}: {e} (choose another --metrics-addr)"
            ))
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::Config(format!("metrics listener: {e}")))?;
        let stop = CancellationToken::new();
        tokio::spawn(crate::metrics::upkeep(metrics.clone(), stop.clone()));
        let app = axum::Router::new()
            .route("/metrics", get(scrape))
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(readyz))
            .fallback(|| async {
                (
                    StatusCode::NOT_FOUND,
                    "not found; try /metrics, /healthz or /readyz\n",
                )
            })
            .with_state(Served {
                metrics,
                slots,
                ready,
            })
            .layer(axum::middleware::from_fn(bounded));
        let listener = super::listener::Limited::new(listener, CONNECTIONS_MAX, IDLE_READ);
        let stopped = stop.clone();
        tokio::spawn(async move {
            let serve = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stopped.cancelled().await });
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "metrics endpoint failed");
            }
        });
        tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
        Ok(Self { addr, stop })
    }

    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// At most [`REQUEST_TIME`] a request.
async fn bounded(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    match tokio::time::timeout(REQUEST_TIME, next.run(req)).await {
        Ok(resp) => resp,
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the request took too long\n",
        )
            .into_response(),
    }
}

async fn scrape(State(s): State<Served>) -> impl IntoResponse {
    let mut body = s.metrics.render();
    if let Some(slots) = &s.slots {
        slots.render(&mut body);
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
}

async fn readyz(State(s): State<Served>) -> impl IntoResponse {
    let problems = s.ready.problems().await;
    if problems.is_empty() {
        match s.ready.noted() {
            Some(note) => (StatusCode::OK, format!("ready: {note}\n")),
            None => (StatusCode::OK, "ready\n".to_owned()),
        }
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", problems.join("; ")),
        )
    }
}
