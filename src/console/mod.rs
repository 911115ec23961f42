//! The operator console (SPEC §16): seed 001's dead-letter playbook as an
//! authenticated, audited JSON API under `/admin/` on an address of its
//! own (`outbox-relay console --admin-addr`), never the metrics port.
//!
//! Above the operations commands: it reads what `dlq list` reads
//! (`ops::dlq`), classes letters as the relay and the consumer do
//! (`triage`), and records in `outbox_admin_log` (`ops::admin_log`) every
//! request refused (401, 403) and every action, under the token's name.
//!
//! Every request names a bearer token ([`tokens`]); each route asks for a
//! least role. The server bounds what a client can hold: request bodies
//! ([`BODY_MAX`]), a request's time ([`REQUEST_TIME`]), requests at once
//! ([`REQUESTS_MAX`]), connections ([`CONNECTIONS_MAX`]) and a connection
//! that sends nothing ([`IDLE_READ`]: a slow client's half-sent headers).

pub mod tokens;

pub mod delete;
pub mod oidc;
pub mod replay;
pub mod tls;

mod api;
mod pages;
mod session;
mod state;

pub use state::Settings;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sqlx::PgPool;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use state::Console;

/// The largest request body read.
pub const BODY_MAX: usize = 64 * 1024;
/// A request that takes longer is answered 503.
pub const REQUEST_TIME: Duration = Duration::from_secs(30);
/// Requests handled at once; more are answered 503 at once.
pub const REQUESTS_MAX: usize = 64;
/// Connections open at once; more wait in the listen backlog.
pub const CONNECTIONS_MAX: usize = 256;
/// A connection that sends nothing this long is closed.
pub const IDLE_READ: Duration = Duration::from_secs(30);

/// A running console.
pub struct Server {
    pub addr: SocketAddr,
    pub done: tokio::task::JoinHandle<()>,
}

/// Serve the console on `addr` until `stop`.
pub async fn serve(
    addr: SocketAddr,
    pool: PgPool,
    js: jetstream::Context,
    settings: Settings,
    stop: CancellationToken,
) -> Result<Server> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        Error::Config(format!(
            "cannot serve the console on {addr}: {e} (choose another --admin-addr)"
        ))
    })?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::Config(format!("console listener: {e}")))?;
    match replay::interrupted(&pool).await {
        Ok(0) => {}
        Ok(n) => tracing::warn!(jobs = n, "replay jobs a console left running when it stopped are marked interrupted: each letter's result so far stands; a new job (a new Idempotency-Key) replays the rest, and none twice"),
        Err(e) => return Err(Error::pg("reading outbox_admin_jobs (run `outbox-relay migrate`)")(e)),
    }
    match delete::interrupted(&pool).await {
        Ok(0) => {}
        Ok(n) => tracing::warn!(requests = n, "deletions a console left half done are marked interrupted: see each request's letters in GET /admin/approvals and dlq list"),
        Err(e) => return Err(Error::pg("reading outbox_admin_deletions (run `outbox-relay migrate`)")(e)),
    }
    let tls = settings
        .tls
        .as_ref()
        .map(tls::Config::server_config)
        .transpose()?;
    let console = Console::new(pool, js, settings, Arc::new(Semaphore::new(REQUESTS_MAX)))?;
    let api = api::router()
        .layer(axum::middleware::from_fn_with_state(
            console.clone(),
            bounded,
        ))
        // Outside the bound: a request without a valid token takes no
        // place among the requests at once, and its body is never read.
        .layer(axum::middleware::from_fn_with_state(
            console.clone(),
            api::authenticate,
        ))
        .layer(DefaultBodyLimit::max(BODY_MAX))
        .with_state(console.clone());
    // The pages call the API in-process (each call bounded as a client's
    // is); a page itself is bounded in time and body as well.
    let pages = pages::router(console.clone(), api.clone(), tls.is_some())
        .layer(axum::middleware::from_fn_with_state(console, timed))
        .layer(DefaultBodyLimit::max(BODY_MAX));
    let app = api.merge(pages);
    let listener = crate::ops::listener::Limited::new(listener, CONNECTIONS_MAX, IDLE_READ);
    let scheme = if tls.is_some() { "https" } else { "http" };
    let done = match tls {
        None => tokio::spawn(async move {
            let serve = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.cancelled().await });
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "the console failed");
            }
        }),
        Some(config) => {
            let listener = tls::TlsListener::new(listener, config)
                .map_err(|e| Error::Config(format!("console listener: {e}")))?;
            tokio::spawn(async move {
                let serve = axum::serve(
                    listener,
                    app.into_make_service_with_connect_info::<tls::Peer>(),
                )
                .with_graceful_shutdown(async move { stop.cancelled().await });
                if let Err(e) = serve.await {
                    tracing::error!(error = %e, "the console failed");
                }
            })
        }
    };
    tracing::info!(%addr, scheme, "serving the operator console: JSON under /admin/, pages under /console/");
    Ok(Server { addr, done })
}

/// At most [`REQUESTS_MAX`] at once, each at most [`REQUEST_TIME`].
async fn bounded(State(c): State<Console>, req: Request, next: Next) -> Response {
    let Ok(_permit) = c.0.busy.clone().try_acquire_owned() else {
        return api::problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "busy: too many requests at once; retry",
        )
        .into_response();
    };
    match tokio::time::timeout(REQUEST_TIME, next.run(req)).await {
        Ok(resp) => resp,
        Err(_) => api::problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "the request took too long (NATS or Postgres slow?); retry",
        )
        .into_response(),
    }
}

/// A page takes at most [`REQUEST_TIME`] (its API calls take places among
/// the requests at once).
async fn timed(State(_): State<Console>, req: Request, next: Next) -> Response {
    match tokio::time::timeout(REQUEST_TIME, next.run(req)).await {
        Ok(resp) => resp,
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the page took too long (NATS or Postgres slow?); reload it",
        )
            .into_response(),
    }
}

/// The console beside a relay or a consumer (`--admin-addr`), on a thread
/// and a runtime of its own, with its own pool and NATS connection: a
/// listing of many letters or a replay job never waits behind the
/// process's own work (the relay's publish path is one thread), nor holds
/// it up. Returns once it serves, or with why it cannot.
pub async fn beside(
    addr: SocketAddr,
    dsn: crate::postgres::Dsn,
    nats: crate::nats::NatsArgs,
    settings: Settings,
) -> Result<SocketAddr> {
    let (told, started) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("console".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = told.send(Err(Error::Config(format!(
                        "cannot start the console's runtime: {e}"
                    ))));
                    return;
                }
            };
            runtime.block_on(async move {
                let up = async {
                    let pool = dsn.pool(4).await?;
                    tokens::list(&pool).await?;
                    crate::ops::admin_log::ensure(&pool, "the console").await?;
                    let client = crate::nats::connect(&nats, "outbox-console".into()).await?;
                    let js = async_nats::jetstream::new(client);
                    serve(addr, pool, js, settings, CancellationToken::new()).await
                };
                match up.await {
                    Ok(server) => {
                        let _ = told.send(Ok(server.addr));
                        let _ = server.done.await;
                    }
                    Err(e) => {
                        let _ = told.send(Err(e));
                    }
                }
            });
        })
        .map_err(|e| Error::Config(format!("cannot start the console's thread: {e}")))?;
    started
        .await
        .map_err(|_| Error::Config("the console's thread ended before it served".into()))?
}

impl Settings {
    /// A relay's or a consumer's console: the defaults of `outbox-relay
    /// console`, reading `streams`.
    pub fn beside(streams: Vec<String>) -> Settings {
        Settings {
            streams,
            operator_classes: Vec::new(),
            replay_rate: 20.0,
            delete_approvals: 2,
            oidc: None,
            tls: None,
        }
    }
}
