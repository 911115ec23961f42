//! The console's pages (`/console/…`): server-rendered HTML, no script.
//!
//! Each page is a client of the JSON API, in-process: it calls the same
//! router (`/admin/…`) with the signed-in session's token, so a page and
//! the API can never differ in who may do what, in what is masked, or in
//! what is recorded — a page's refusal is the API's, recorded under the
//! same token. A form that changes something carries the session's
//! anti-forgery value ([`session`]); each action names its CLI equivalent.

use std::sync::Arc;

use askama::Template;
use axum::body::Body;
use axum::extract::{Form, Path, Query, State};
use axum::http::{header, HeaderMap, Method, Request, StatusCode};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::{json, Value};
use tower::ServiceExt;

use super::session::{self, Session, Sessions};
use super::state::Console;
use crate::ops::admin_log::{self, Actor, Entry};

/// What the pages share: the console, its API router, the sessions.
#[derive(Clone)]
pub(super) struct Pages {
    console: Console,
    api: Router,
    sessions: Arc<Sessions>,
    /// Served over TLS: the cookie is `Secure`.
    secure: bool,
}

/// The largest API answer a page reads (a plan of 10,000 letters).
const ANSWER_MAX: usize = 32 * 1024 * 1024;

pub(super) fn router(console: Console, api: Router, secure: bool) -> Router {
    let pages = Pages {
        console,
        api,
        sessions: Arc::new(Sessions::default()),
        secure,
    };
    Router::new()
        .route("/console", get(|| async { Redirect::to("/console/") }))
        .route("/console/", get(overview))
        .route("/console/login", get(login_form).post(login))
        .route("/console/logout", post(logout))
        .route("/console/dead-letters", get(dead_letters))
        .route("/console/dead-letters/{stream}/{seq}", get(dead_letter))
        .route("/console/replay", post(replay))
        .route("/console/delete", post(delete))
        .route("/console/jobs", get(jobs))
        .route("/console/jobs/{id}", get(job))
        .route("/console/jobs/{id}/cancel", post(job_cancel))
        .route("/console/approvals", get(approvals))
        .route("/console/approvals/{id}/{decision}", post(decide))
        .route("/console/consumers", get(consumers))
        .route("/console/consumers/reset", post(consumer_reset))
        .route("/console/integrity", get(integrity))
        .route("/console/log", get(log))
        .route("/console/tokens", get(tokens))
        .route("/console/style.css", get(style))
        .layer(axum::middleware::from_fn(hardened))
        .with_state(pages)
}

/// Every page: not framed, not cached, no script or outside resource, no
/// referrer outside the console. A page
/// fetched by another site's page (an image, a frame, a fetch: not a link
/// followed) is refused: it would read, and be recorded, under the
/// signed-in user's name.
async fn hardened(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let h = req.headers();
    let get = |k: &str| h.get(k).and_then(|v| v.to_str().ok());
    let foreign = matches!(get("sec-fetch-site"), Some("cross-site" | "same-site"));
    let navigation = get("sec-fetch-dest").is_none_or(|d| d == "document");
    if req.method() == Method::GET && foreign && !navigation {
        return (
            StatusCode::FORBIDDEN,
            "refused: a console page is not read from another site's page",
        )
            .into_response();
    }
    let mut resp = next.run(req).await;
    let headers = resp.headers_mut();
    for (name, value) in [
        ("x-frame-options", "DENY"),
        (
            "content-security-policy",
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
        ("cache-control", "no-store"),
        // Not no-referrer: a browser then sends a form's Origin as
        // "null", and the form is refused as another origin's.
        ("referrer-policy", "same-origin"),
        ("x-content-type-options", "nosniff"),
    ] {
        headers.insert(name, axum::http::HeaderValue::from_static(value));
    }
    resp
}

/// The page's header: who is signed in, and what their forms carry.
struct Nav {
    name: String,
    role: String,
    csrf: String,
    /// The request id of the page's last API call (the log's).
    request_id: String,
}

impl Nav {
    fn of(s: &Session) -> Nav {
        Nav {
            name: s.name.clone(),
            role: s.role.clone(),
            csrf: s.csrf.clone(),
            request_id: String::new(),
        }
    }
    fn none() -> Nav {
        Nav {
            name: String::new(),
            role: String::new(),
            csrf: String::new(),
            request_id: String::new(),
        }
    }
    fn signed_in(&self) -> bool {
        !self.name.is_empty()
    }
    fn operator(&self) -> bool {
        matches!(self.role.as_str(), "operator" | "admin")
    }
    fn admin(&self) -> bool {
        self.role == "admin"
    }
}

/// An API answer.
struct Api {
    status: StatusCode,
    body: Value,
    request_id: String,
}

impl Api {
    fn error(&self) -> String {
        self.body["error"]
            .as_str()
            .map_or_else(|| self.body.to_string(), str::to_owned)
    }
    fn field<T: serde::de::DeserializeOwned + Default>(&self, key: &str) -> T {
        serde_json::from_value(self.body[key].clone()).unwrap_or_default()
    }
}

impl Pages {
    /// Call the API as `secret`'s holder.
    async fn call(
        &self,
        secret: &str,
        method: Method,
        path: &str,
        body: Option<Value>,
        key: Option<&str>,
    ) -> Api {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(header::AUTHORIZATION, format!("Bearer {secret}"));
        if let Some(k) = key {
            req = req.header("idempotency-key", k);
        }
        let body = match body {
            Some(b) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                Body::from(b.to_string())
            }
            None => Body::empty(),
        };
        let broken = |why: String| Api {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            body: json!({ "error": why }),
            request_id: String::new(),
        };
        let req = match req.body(body) {
            Ok(r) => r,
            Err(e) => return broken(format!("building the request: {e}")),
        };
        let resp = match self.api.clone().oneshot(req).await {
            Ok(r) => r,
            Err(e) => return broken(format!("the API: {e}")),
        };
        let status = resp.status();
        let request_id = resp
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let bytes = match axum::body::to_bytes(resp.into_body(), ANSWER_MAX).await {
            Ok(b) => b,
            Err(e) => return broken(format!("reading the API's answer: {e}")),
        };
        let body = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
            // axum's own refusals (a bad path, a method) are plain text.
            let text = String::from_utf8_lossy(&bytes);
            json!({ "error": text.chars().take(500).collect::<String>() })
        });
        Api {
            status,
            body,
            request_id,
        }
    }

    /// A page's session and its one read of the API: `Err` is the answer
    /// (sign in, or the API's refusal as a page).
    async fn read(&self, headers: &HeaderMap, path: &str) -> Result<(Nav, Api), Box<Response>> {
        let (_, s) = self.session(headers)?;
        let mut nav = Nav::of(&s);
        let a = self.call(&s.secret, Method::GET, path, None, None).await;
        if a.status != StatusCode::OK {
            return Err(Box::new(self.api_failed(&s, nav, &a)));
        }
        nav.request_id = a.request_id.clone();
        Ok((nav, a))
    }

    /// The request's session, or the answer that sends it to sign in.
    fn session(&self, headers: &HeaderMap) -> Result<(String, Session), Box<Response>> {
        self.sessions
            .of(headers)
            .ok_or_else(|| Box::new(Redirect::to("/console/login").into_response()))
    }

    /// The session of a form that changes something: signed in, from this
    /// console's own pages (the anti-forgery value, the browser's word on
    /// its origin). A refusal is a 403, recorded.
    async fn acting(
        &self,
        headers: &HeaderMap,
        csrf: &str,
        target: &str,
    ) -> Result<Session, Response> {
        let (_, s) = self.session(headers).map_err(|r| *r)?;
        let why = match session::cross_site(headers) {
            Some(why) => why,
            None if session::csrf_holds(&s, csrf) => return Ok(s),
            None => "the form's anti-forgery value is not this session's (an old page, or another site's form)".to_owned(),
        };
        let actor = Actor {
            name: s.actor.clone(),
            role: role_str(&s.role),
            request_id: uuid::Uuid::new_v4().to_string(),
        };
        self.refuse(&actor, target, &why).await;
        Err(failed(
            Nav::of(&s),
            StatusCode::FORBIDDEN,
            &format!("refused: {why}"),
            &actor.request_id,
        ))
    }

    /// A sign-in or sign-out, in the log as every session's start and end.
    async fn record_session(
        &self,
        action: &'static str,
        actor: &str,
        role: &str,
        request_id: &str,
    ) {
        let entry = Entry {
            action,
            target: "/console/".to_owned(),
            selection: json!({}),
            reason: None,
        };
        let actor = Actor {
            name: actor.to_owned(),
            role: role_str(role),
            request_id: request_id.to_owned(),
        };
        if let Err(e) =
            admin_log::record_as(&self.console.0.pool, &entry, Some(&actor), "done").await
        {
            tracing::warn!(error = %e, action, "console: a session's start or end is not recorded");
        }
    }

    async fn refuse(&self, actor: &Actor, target: &str, why: &str) {
        let entry = Entry {
            action: "request",
            target: target.to_owned(),
            selection: json!({}),
            reason: None,
        };
        // A flood of anonymous refusals must not become a flood of rows
        // (as the API's 401s); a signed-in session's always is recorded.
        let mut result = format!("denied: 403 {why}");
        if actor.name == "anonymous" {
            match self.console.admit_denial() {
                None => {
                    metrics::counter!(crate::metrics::ADMIN_ACTIONS, "action" => "request", "result" => "denied")
                        .increment(1);
                    return;
                }
                Some(0) => {}
                Some(n) => result.push_str(&format!(
                    " ({n} refusals before this one were counted, not recorded)"
                )),
            }
        }
        if let Err(e) =
            admin_log::record_as(&self.console.0.pool, &entry, Some(actor), &result).await
        {
            tracing::warn!(error = %e, "console: a refused form is not recorded");
        }
    }
}

fn role_str(role: &str) -> &'static str {
    match role {
        "admin" => "admin",
        "operator" => "operator",
        _ => "viewer",
    }
}

fn page(t: &impl Template) -> Response {
    match t.render() {
        Ok(html) => Html(html).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("rendering the page: {e}"),
        )
            .into_response(),
    }
}

#[derive(Template)]
#[template(path = "error.html")]
struct ErrorPage {
    nav: Nav,
    status: u16,
    error: String,
}

fn failed(mut nav: Nav, status: StatusCode, error: &str, request_id: &str) -> Response {
    nav.request_id = request_id.to_owned();
    let mut resp = page(&ErrorPage {
        nav,
        status: status.as_u16(),
        error: error.to_owned(),
    });
    *resp.status_mut() = status;
    resp
}

impl Pages {
    /// The page for an API answer that is not a success. A 401 is the
    /// session's token refused (revoked, expired): every session of it
    /// ends, and the browser is sent to sign in again.
    fn api_failed(&self, s: &Session, nav: Nav, a: &Api) -> Response {
        if a.status == StatusCode::UNAUTHORIZED {
            self.sessions.close_token(&s.secret);
            return (
                [(header::SET_COOKIE, session::set_cookie(None, self.secure))],
                Redirect::to("/console/login"),
            )
                .into_response();
        }
        failed(nav, a.status, &a.error(), &a.request_id)
    }
}

async fn style() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css")],
        include_str!("templates/style.css"),
    )
        .into_response()
}

// Sign in and out.

#[derive(Template)]
#[template(path = "login.html")]
struct LoginPage {
    nav: Nav,
    error: String,
}

async fn login_form() -> Response {
    page(&LoginPage {
        nav: Nav::none(),
        error: String::new(),
    })
}

#[derive(Deserialize)]
struct LoginForm {
    token: String,
}

async fn login(State(p): State<Pages>, headers: HeaderMap, Form(f): Form<LoginForm>) -> Response {
    if let Some(why) = session::cross_site(&headers) {
        let actor = Actor {
            name: "anonymous".into(),
            role: "anonymous",
            request_id: uuid::Uuid::new_v4().to_string(),
        };
        p.refuse(&actor, "POST /console/login", &why).await;
        return failed(
            Nav::none(),
            StatusCode::FORBIDDEN,
            &format!("refused: {why}"),
            &actor.request_id,
        );
    }
    let secret = f.token.trim().to_owned();
    // The API checks the token, and records a bad one as it would its own.
    let a = p
        .call(&secret, Method::GET, "/admin/whoami", None, None)
        .await;
    if a.status != StatusCode::OK {
        let mut resp = page(&LoginPage {
            nav: Nav::none(),
            error: a.error(),
        });
        *resp.status_mut() = a.status;
        return resp;
    }
    let name = a.body["token"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let role = a.body["token"]["role"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let actor = format!(
        "{}:{name}",
        a.body["token"]["kind"].as_str().unwrap_or("token")
    );
    p.record_session("console.sign_in", &actor, &role, &a.request_id)
        .await;
    let id = p.sessions.open(secret, name, actor, role);
    (
        [(header::SET_COOKIE, session::set_cookie(Some(&id), p.secure))],
        Redirect::to("/console/"),
    )
        .into_response()
}

#[derive(Deserialize)]
struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

async fn logout(State(p): State<Pages>, headers: HeaderMap, Form(f): Form<CsrfForm>) -> Response {
    if let Err(resp) = p.acting(&headers, &f.csrf, "POST /console/logout").await {
        return resp;
    }
    if let Some((id, s)) = p.sessions.of(&headers) {
        p.sessions.close(&id);
        p.record_session(
            "console.sign_out",
            &s.actor,
            &s.role,
            &uuid::Uuid::new_v4().to_string(),
        )
        .await;
    }
    (
        [(header::SET_COOKIE, session::set_cookie(None, p.secure))],
        Redirect::to("/console/login"),
    )
        .into_response()
}

// Read-only pages.

#[derive(Deserialize, Default)]
#[serde(default)]
struct Group {
    count: u64,
    class: String,
    fingerprint: String,
    first_seen: String,
    last_seen: String,
    next_step: String,
    replayable: bool,
    example: Example,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Example {
    stream: String,
    seq: u64,
    id: String,
    reason: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Slot {
    slot: String,
    active: bool,
    lag_bytes: Option<i64>,
    retained_wal_bytes: Option<i64>,
    wal_status: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct JobRow {
    id: String,
    state: String,
    actor: String,
    reason: String,
    created_at: String,
    finished_at: Option<String>,
    plan_id: String,
    /// In a list of jobs.
    total: u64,
    done: u64,
    /// One job's.
    progress: Progress,
    items: Vec<JobItem>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Progress {
    total: u64,
    done: u64,
    replayed: u64,
    already_replayed: u64,
    not_replayable: u64,
    failed: u64,
    cancelled: u64,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct JobItem {
    stream: String,
    seq: u64,
    id: String,
    durable: Option<String>,
    result: Option<String>,
    detail: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct DeletionRow {
    id: String,
    plan_id: String,
    state: String,
    reason: String,
    requested_by: String,
    requested_at: String,
    decided_by: Option<String>,
    result: Value,
    selection: Value,
}

impl DeletionRow {
    fn terms(&self) -> String {
        terms(&self.selection)
    }
}

/// A selection's terms, as an operator reads them: `class=… ids=a,b`.
fn terms(selection: &Value) -> String {
    let Some(o) = selection.as_object() else {
        return selection.to_string();
    };
    let mut out = Vec::new();
    for (k, v) in o {
        let shown = match v {
            Value::Null | Value::Bool(false) => continue,
            Value::Array(a) if a.is_empty() => continue,
            Value::String(s) => s.clone(),
            Value::Array(a) => a
                .iter()
                .map(|x| x.as_str().map_or_else(|| x.to_string(), str::to_owned))
                .collect::<Vec<_>>()
                .join(","),
            other => other.to_string(),
        };
        out.push(format!("{k}={shown}"));
    }
    out.join(" ")
}

#[derive(Template)]
#[template(path = "overview.html")]
struct OverviewPage {
    nav: Nav,
    classes: Vec<Group>,
    total: u64,
    slots: Vec<Slot>,
    slots_error: String,
    /// Parts of the page that could not be read (never shown as none).
    errors: Vec<String>,
    pending_deletions: usize,
    jobs: Vec<JobRow>,
}

async fn overview(State(p): State<Pages>, headers: HeaderMap) -> Response {
    let (_, s) = match p.session(&headers) {
        Ok(s) => s,
        Err(resp) => return *resp,
    };
    let mut nav = Nav::of(&s);
    let letters = p
        .call(
            &s.secret,
            Method::GET,
            "/admin/dead-letters?group_by=class",
            None,
            None,
        )
        .await;
    if letters.status != StatusCode::OK {
        return p.api_failed(&s, nav, &letters);
    }
    let slots = p
        .call(&s.secret, Method::GET, "/admin/slots", None, None)
        .await;
    let approvals = p
        .call(&s.secret, Method::GET, "/admin/approvals", None, None)
        .await;
    let jobs = p
        .call(&s.secret, Method::GET, "/admin/jobs", None, None)
        .await;
    let deletions: Vec<DeletionRow> = approvals.field("requests");
    let mut recent: Vec<JobRow> = jobs.field("jobs");
    recent.truncate(5);
    let errors = [("approvals", &approvals), ("jobs", &jobs)]
        .iter()
        .filter(|(_, a)| a.status != StatusCode::OK)
        .map(|(what, a)| format!("{what}: {}", a.error()))
        .collect();
    nav.request_id = letters.request_id.clone();
    page(&OverviewPage {
        nav,
        classes: letters.field("groups"),
        total: letters.body["total"].as_u64().unwrap_or(0),
        slots_error: if slots.status == StatusCode::OK {
            String::new()
        } else {
            slots.error()
        },
        slots: slots.field("slots"),
        errors,
        pending_deletions: deletions.iter().filter(|d| d.state == "pending").count(),
        jobs: recent,
    })
}

#[derive(Template)]
#[template(path = "dead_letters.html")]
struct DeadLettersPage {
    nav: Nav,
    class: String,
    groups: Vec<Group>,
    total: u64,
    truncated: bool,
}

#[derive(Deserialize)]
struct LettersQuery {
    class: Option<String>,
}

async fn dead_letters(
    State(p): State<Pages>,
    headers: HeaderMap,
    Query(q): Query<LettersQuery>,
) -> Response {
    let class = q.class.filter(|c| !c.is_empty()).unwrap_or_default();
    let mut path = "/admin/dead-letters?group_by=class,fingerprint".to_owned();
    if !class.is_empty() {
        path.push_str("&class=");
        path.push_str(&url::form_urlencoded::byte_serialize(class.as_bytes()).collect::<String>());
    }
    let (nav, a) = match p.read(&headers, &path).await {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    page(&DeadLettersPage {
        nav,
        class,
        groups: a.field("groups"),
        total: a.body["total"].as_u64().unwrap_or(0),
        truncated: a.body["truncated"].as_bool().unwrap_or(false),
    })
}

#[derive(Template)]
#[template(path = "dead_letter.html")]
struct DeadLetterPage {
    nav: Nav,
    stream: String,
    seq: u64,
    id: String,
    subject: String,
    durable: String,
    class: String,
    fingerprint: String,
    next_step: String,
    replayable: bool,
    reason: String,
    detail: String,
    attempts: String,
    time: String,
    headers: Vec<(String, String)>,
    payload: String,
    masked: bool,
    cli: Vec<(String, String)>,
}

async fn dead_letter(
    State(p): State<Pages>,
    headers: HeaderMap,
    Path((stream, seq)): Path<(String, String)>,
) -> Response {
    let enc = |v: &str| {
        percent_encoding::utf8_percent_encode(v, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    let path = format!("/admin/dead-letters/{}/{}", enc(&stream), enc(&seq));
    let (nav, a) = match p.read(&headers, &path).await {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    let b = &a.body;
    let text = |k: &str| b[k].as_str().unwrap_or_default().to_owned();
    let mut shown = Vec::new();
    if let Some(h) = b["headers"].as_object() {
        for (k, vs) in h {
            for v in vs.as_array().into_iter().flatten() {
                shown.push((k.clone(), v.as_str().unwrap_or_default().to_owned()));
            }
        }
    }
    let cli = b["cli"]
        .as_object()
        .map(|o| {
            o.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect()
        })
        .unwrap_or_default();
    let payload = match b["payload"].as_str() {
        Some(text) => serde_json::from_str::<Value>(text)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok())
            .unwrap_or_else(|| text.to_owned()),
        None => String::new(),
    };
    page(&DeadLetterPage {
        nav,
        stream: text("stream"),
        seq: b["seq"].as_u64().unwrap_or(0),
        id: text("id"),
        subject: text("subject"),
        durable: text("durable"),
        class: text("class"),
        fingerprint: text("fingerprint"),
        next_step: text("next_step"),
        replayable: b["replayable"].as_bool().unwrap_or(false),
        reason: text("reason"),
        detail: text("detail"),
        attempts: b["attempts"]
            .as_i64()
            .map(|n| n.to_string())
            .unwrap_or_default(),
        time: text("time"),
        headers: shown,
        payload,
        masked: b["payload_encoding"] == "masked",
        cli,
    })
}

// Replay and deletion: a selection, a dry run, then the plan acted on.

/// A replay's or a deletion's form: a selection's fields (from the
/// letters' pages), or the selection of a plan shown (its JSON), with the
/// plan id and the key the plan's page made.
#[derive(Deserialize, Default)]
#[serde(default)]
struct PlanForm {
    csrf: String,
    reason: String,
    selection: String,
    stream: String,
    class: String,
    fingerprint: String,
    durable: String,
    ids: String,
    /// One letter's id, as it is (a producer's header: never split).
    id: String,
    plan_id: String,
    idempotency_key: String,
}

impl PlanForm {
    fn selection(&self) -> Result<Value, String> {
        if !self.selection.trim().is_empty() {
            return serde_json::from_str(&self.selection)
                .map_err(|e| format!("the plan's selection: {e}"));
        }
        let mut sel = serde_json::Map::new();
        let mut put = |k: &str, v: &str| {
            if !v.trim().is_empty() {
                sel.insert(k.into(), Value::String(v.trim().to_owned()));
            }
        };
        put("stream", &self.stream);
        put("class", &self.class);
        put("fingerprint", &self.fingerprint);
        put("durable", &self.durable);
        let mut ids: Vec<Value> = self
            .ids
            .split([',', ' ', '\n', '\r'])
            .filter(|i| !i.is_empty())
            .map(|i| Value::String(i.to_owned()))
            .collect();
        if !self.id.is_empty() {
            ids.push(Value::String(self.id.clone()));
        }
        if !ids.is_empty() {
            sel.insert("ids".into(), Value::Array(ids));
        }
        Ok(Value::Object(sel))
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct PlanItem {
    stream: String,
    seq: u64,
    id: String,
    durable: Option<String>,
    class: String,
    subject: String,
    skipped: Option<String>,
}

#[derive(Template)]
#[template(path = "plan.html")]
struct PlanPage {
    nav: Nav,
    /// "replay" or "delete".
    kind: &'static str,
    plan_id: String,
    selection: String,
    terms: String,
    reason: String,
    key: String,
    letters: u64,
    to_act: u64,
    items: Vec<PlanItem>,
    cli: String,
    approvals: u64,
}

async fn replay(State(p): State<Pages>, headers: HeaderMap, Form(f): Form<PlanForm>) -> Response {
    plan_or_act(p, headers, f, "replay").await
}

async fn delete(State(p): State<Pages>, headers: HeaderMap, Form(f): Form<PlanForm>) -> Response {
    plan_or_act(p, headers, f, "delete").await
}

/// Without a plan id, a dry run, shown as the plan's page; with one (the
/// plan page's form), the plan acted on under the key that page made: a
/// form sent twice acts once.
async fn plan_or_act(p: Pages, headers: HeaderMap, f: PlanForm, kind: &'static str) -> Response {
    let s = match p
        .acting(&headers, &f.csrf, &format!("POST /console/{kind}"))
        .await
    {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    let mut nav = Nav::of(&s);
    let selection = match f.selection() {
        Ok(sel) => sel,
        Err(why) => return failed(nav, StatusCode::BAD_REQUEST, &why, ""),
    };
    let path = match kind {
        "replay" => "/admin/events/replay",
        _ => "/admin/dead-letters/delete",
    };
    let dry_run = f.plan_id.trim().is_empty();
    let mut body = json!({ "selection": selection, "reason": f.reason, "dry_run": dry_run });
    if !dry_run {
        body["plan_id"] = Value::String(f.plan_id.trim().to_owned());
    }
    let key = (!dry_run).then_some(f.idempotency_key.trim());
    let a = p.call(&s.secret, Method::POST, path, Some(body), key).await;
    if !a.status.is_success() {
        return p.api_failed(&s, nav, &a);
    }
    if !dry_run {
        return match kind {
            "replay" => Redirect::to(&format!(
                "/console/jobs/{}",
                a.body["job"]["id"].as_str().unwrap_or_default()
            ))
            .into_response(),
            _ => Redirect::to("/console/approvals").into_response(),
        };
    }
    nav.request_id = a.request_id.clone();
    let items: Vec<PlanItem> = a.field("items");
    let to_act = a.body["to_replay"]
        .as_u64()
        .unwrap_or_else(|| items.iter().filter(|i| i.skipped.is_none()).count() as u64);
    page(&PlanPage {
        nav,
        kind,
        plan_id: a.body["plan_id"].as_str().unwrap_or_default().to_owned(),
        selection: a.body["selection"].to_string(),
        terms: terms(&a.body["selection"]),
        reason: f.reason.clone(),
        // Made once, with the plan: sending the form again is the same act.
        key: uuid::Uuid::new_v4().to_string(),
        letters: a.body["letters"].as_u64().unwrap_or(0),
        to_act,
        items,
        cli: a.body["cli"].as_str().unwrap_or_default().to_owned(),
        approvals: a.body["approvals"].as_u64().unwrap_or(0),
    })
}

#[derive(Template)]
#[template(path = "jobs.html")]
struct JobsPage {
    nav: Nav,
    jobs: Vec<JobRow>,
}

async fn jobs(State(p): State<Pages>, headers: HeaderMap) -> Response {
    let (nav, a) = match p.read(&headers, "/admin/jobs").await {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    page(&JobsPage {
        nav,
        jobs: a.field("jobs"),
    })
}

#[derive(Template)]
#[template(path = "job.html")]
struct JobPage {
    nav: Nav,
    job: JobRow,
    running: bool,
}

async fn job(State(p): State<Pages>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let (_, s) = match p.session(&headers) {
        Ok(s) => s,
        Err(resp) => return *resp,
    };
    let mut nav = Nav::of(&s);
    let Ok(id) = uuid::Uuid::parse_str(&id) else {
        return failed(nav, StatusCode::BAD_REQUEST, "a job id is a UUID", "");
    };
    let a = p
        .call(
            &s.secret,
            Method::GET,
            &format!("/admin/jobs/{id}"),
            None,
            None,
        )
        .await;
    if a.status != StatusCode::OK {
        return p.api_failed(&s, nav, &a);
    }
    nav.request_id = a.request_id.clone();
    let job: JobRow = a.field("job");
    let running = matches!(job.state.as_str(), "running" | "queued");
    page(&JobPage { nav, job, running })
}

async fn job_cancel(
    State(p): State<Pages>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Response {
    let s = match p
        .acting(&headers, &f.csrf, "POST /console/jobs/cancel")
        .await
    {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    let Ok(id) = uuid::Uuid::parse_str(&id) else {
        return failed(
            Nav::of(&s),
            StatusCode::BAD_REQUEST,
            "a job id is a UUID",
            "",
        );
    };
    let a = p
        .call(
            &s.secret,
            Method::POST,
            &format!("/admin/jobs/{id}/cancel"),
            None,
            None,
        )
        .await;
    if !a.status.is_success() {
        return p.api_failed(&s, Nav::of(&s), &a);
    }
    Redirect::to(&format!("/console/jobs/{id}")).into_response()
}

#[derive(Template)]
#[template(path = "approvals.html")]
struct ApprovalsPage {
    nav: Nav,
    requests: Vec<DeletionRow>,
    approvals: u64,
}

async fn approvals(State(p): State<Pages>, headers: HeaderMap) -> Response {
    let (nav, a) = match p.read(&headers, "/admin/approvals").await {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    page(&ApprovalsPage {
        nav,
        requests: a.field("requests"),
        approvals: a.body["approvals"].as_u64().unwrap_or(2),
    })
}

async fn decide(
    State(p): State<Pages>,
    headers: HeaderMap,
    Path((id, decision)): Path<(String, String)>,
    Form(f): Form<CsrfForm>,
) -> Response {
    let s = match p
        .acting(
            &headers,
            &f.csrf,
            &format!("POST /console/approvals/{decision}"),
        )
        .await
    {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    let Ok(id) = uuid::Uuid::parse_str(&id) else {
        return failed(
            Nav::of(&s),
            StatusCode::BAD_REQUEST,
            "a request id is a UUID",
            "",
        );
    };
    if !matches!(decision.as_str(), "approve" | "reject") {
        return failed(Nav::of(&s), StatusCode::NOT_FOUND, "approve or reject", "");
    }
    let a = p
        .call(
            &s.secret,
            Method::POST,
            &format!("/admin/approvals/{id}/{decision}"),
            None,
            None,
        )
        .await;
    if !a.status.is_success() {
        return p.api_failed(&s, Nav::of(&s), &a);
    }
    Redirect::to("/console/approvals").into_response()
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ConsumerRow {
    stream: String,
    durable: String,
    pending: u64,
    ack_pending: u64,
    redelivered: u64,
    delivered_seq: u64,
    ack_floor_seq: u64,
    cli: Option<String>,
}

#[derive(Template)]
#[template(path = "consumers.html")]
struct ConsumersPage {
    nav: Nav,
    consumers: Vec<ConsumerRow>,
}

async fn consumers(State(p): State<Pages>, headers: HeaderMap) -> Response {
    let (nav, a) = match p.read(&headers, "/admin/consumers").await {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    page(&ConsumersPage {
        nav,
        consumers: a.field("consumers"),
    })
}

/// A reset's form: the consumers page's (a start, a reason: a dry run),
/// or the plan page's (its plan id and the key it made: acting on it).
#[derive(Deserialize, Default)]
#[serde(default)]
struct ResetForm {
    csrf: String,
    stream: String,
    durable: String,
    seq: String,
    time: String,
    /// A checkbox: present ("on") when ticked.
    skip_unacked: String,
    reason: String,
    plan_id: String,
    idempotency_key: String,
}

#[derive(Template)]
#[template(path = "reset.html")]
struct ResetPage {
    nav: Nav,
    stream: String,
    durable: String,
    plan_id: String,
    from_seq: u64,
    messages: u64,
    skipped: u64,
    skip_unacked: bool,
    how: String,
    reason: String,
    key: String,
    cli: String,
    /// Acted on (the page after the reset), or a plan.
    applied: bool,
    before: bool,
}

/// Without a plan id, a dry run shown as the reset's plan; with one, the
/// plan acted on under the key its page made (a form sent twice resets
/// once).
async fn consumer_reset(
    State(p): State<Pages>,
    headers: HeaderMap,
    Form(f): Form<ResetForm>,
) -> Response {
    let s = match p
        .acting(&headers, &f.csrf, "POST /console/consumers/reset")
        .await
    {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    let mut nav = Nav::of(&s);
    let dry_run = f.plan_id.trim().is_empty();
    let mut body = json!({
        "stream": f.stream.trim(),
        "durable": f.durable.trim(),
        "reason": f.reason,
        "skip_unacked": !f.skip_unacked.is_empty(),
        "dry_run": dry_run,
    });
    match (f.seq.trim(), f.time.trim()) {
        ("", "") => {
            return failed(
                nav,
                StatusCode::BAD_REQUEST,
                "give a sequence or a time to start over from",
                "",
            )
        }
        (seq, "") => match seq.parse::<u64>() {
            Ok(n) => body["seq"] = json!(n),
            Err(_) => {
                return failed(
                    nav,
                    StatusCode::BAD_REQUEST,
                    &format!("sequence {seq:?} is not a number"),
                    "",
                )
            }
        },
        ("", time) => body["time"] = json!(time),
        _ => {
            return failed(
                nav,
                StatusCode::BAD_REQUEST,
                "give a sequence or a time, not both",
                "",
            )
        }
    }
    if !dry_run {
        body["plan_id"] = Value::String(f.plan_id.trim().to_owned());
    }
    let key = (!dry_run).then_some(f.idempotency_key.trim());
    let a = p
        .call(
            &s.secret,
            Method::POST,
            "/admin/consumers/reset",
            Some(body),
            key,
        )
        .await;
    if !a.status.is_success() {
        return p.api_failed(&s, nav, &a);
    }
    nav.request_id = a.request_id.clone();
    let before = a.body["reset_before"].as_bool().unwrap_or(false);
    page(&ResetPage {
        nav,
        stream: f.stream.trim().to_owned(),
        durable: f.durable.trim().to_owned(),
        plan_id: a.body["plan_id"].as_str().unwrap_or_default().to_owned(),
        from_seq: a.body["from_seq"].as_u64().unwrap_or(0),
        messages: a.body["messages"].as_u64().unwrap_or(0),
        skipped: a.body["skipped"].as_u64().unwrap_or(0),
        skip_unacked: !f.skip_unacked.is_empty(),
        how: a.body["how"].as_str().unwrap_or_default().to_owned(),
        reason: f.reason.clone(),
        // Made once, with the plan: sending the form again is the same act.
        key: uuid::Uuid::new_v4().to_string(),
        cli: a.body["cli"].as_str().unwrap_or_default().to_owned(),
        applied: !dry_run,
        before,
    })
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct LogRow {
    seq: i64,
    at: String,
    db_role: String,
    actor: String,
    role: String,
    action: String,
    target: String,
    reason: Option<String>,
    result: String,
    request_id: Option<String>,
}

#[derive(Template)]
#[template(path = "integrity.html")]
struct IntegrityPage {
    nav: Nav,
    slots: Vec<Slot>,
    audits: Vec<LogRow>,
    /// The log could not be read: no "no audit".
    log_error: String,
    since: String,
}

async fn integrity(State(p): State<Pages>, headers: HeaderMap) -> Response {
    let (_, s) = match p.session(&headers) {
        Ok(s) => s,
        Err(resp) => return *resp,
    };
    let mut nav = Nav::of(&s);
    let slots = p
        .call(&s.secret, Method::GET, "/admin/slots", None, None)
        .await;
    if slots.status != StatusCode::OK {
        return p.api_failed(&s, nav, &slots);
    }
    let log = p
        .call(&s.secret, Method::GET, "/admin/log?last=500", None, None)
        .await;
    let mut audits: Vec<LogRow> = log.field("rows");
    audits.retain(|r| r.action.starts_with("audit"));
    let log_error = if log.status == StatusCode::OK {
        String::new()
    } else {
        log.error()
    };
    nav.request_id = slots.request_id.clone();
    let since = time::OffsetDateTime::now_utc() - time::Duration::hours(1);
    page(&IntegrityPage {
        nav,
        slots: slots.field("slots"),
        audits,
        log_error,
        since: super_rfc3339(since),
    })
}

fn super_rfc3339(t: time::OffsetDateTime) -> String {
    t.replace_nanosecond(0)
        .unwrap_or(t)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

#[derive(Template)]
#[template(path = "log.html")]
struct LogPage {
    nav: Nav,
    rows: Vec<LogRow>,
    verified: Option<(bool, String)>,
}

#[derive(Deserialize)]
struct LogQuery {
    verify: Option<String>,
}

async fn log(State(p): State<Pages>, headers: HeaderMap, Query(q): Query<LogQuery>) -> Response {
    let (_, s) = match p.session(&headers) {
        Ok(s) => s,
        Err(resp) => return *resp,
    };
    let mut nav = Nav::of(&s);
    let verified = if q.verify.is_some() {
        let v = p
            .call(&s.secret, Method::GET, "/admin/log/verify", None, None)
            .await;
        if v.status != StatusCode::OK {
            return p.api_failed(&s, nav, &v);
        }
        let holds = v.body["holds"].as_bool().unwrap_or(false);
        let what = if holds {
            format!(
                "the chain holds over {} rows (head {})",
                v.body["rows"],
                v.body["head"].as_str().unwrap_or_default()
            )
        } else {
            format!(
                "the chain is broken at row {}: {}",
                v.body["broken"]["seq"],
                v.body["broken"]["why"].as_str().unwrap_or_default()
            )
        };
        Some((holds, what))
    } else {
        None
    };
    let a = p
        .call(&s.secret, Method::GET, "/admin/log?last=200", None, None)
        .await;
    if a.status != StatusCode::OK {
        return p.api_failed(&s, nav, &a);
    }
    nav.request_id = a.request_id.clone();
    page(&LogPage {
        nav,
        rows: a.field("rows"),
        verified,
    })
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct TokenRow {
    name: String,
    role: String,
    state: String,
    created_at: String,
    created_by: String,
    expires_at: String,
}

#[derive(Template)]
#[template(path = "tokens.html")]
struct TokensPage {
    nav: Nav,
    tokens: Vec<TokenRow>,
}

async fn tokens(State(p): State<Pages>, headers: HeaderMap) -> Response {
    let (nav, a) = match p.read(&headers, "/admin/tokens").await {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    page(&TokensPage {
        nav,
        tokens: a.field("tokens"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_selection_reads_as_its_terms() {
        let sel = json!({ "all": false, "class": "handler_rejected", "durable": null,
            "ids": ["a", "b"], "since": null, "stream": "DLQ_X" });
        assert_eq!(terms(&sel), "class=handler_rejected ids=a,b stream=DLQ_X");
        assert_eq!(terms(&json!({ "all": true })), "all=true");
    }
}
