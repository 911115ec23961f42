//! The pages' sessions and their protection from cross-site requests.
//!
//! A session is made by signing in with a token: the browser keeps only
//! a random session id (an `HttpOnly`, `SameSite=Strict` cookie scoped to
//! `/console`); the token stays in this process, and every page's API
//! call presents it, so a token revoked or expired ends its sessions at
//! once. A form that changes something carries the session's own random
//! anti-forgery value, and is refused when the browser says it came from
//! another site (`Sec-Fetch-Site`) or another origin (`Origin`).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::{header, HeaderMap};

/// The cookie naming a session.
pub const COOKIE: &str = "oxr_console";
/// A session ends this long after sign-in (or with its token, sooner).
pub const LIFETIME: Duration = Duration::from_secs(8 * 3600);
/// Sessions kept at once; past it the oldest is ended.
const SESSIONS_MAX: usize = 1024;
/// Sessions of one token; past it that token's oldest is ended (one
/// token's holder cannot sign everyone else out).
const PER_TOKEN_MAX: usize = 16;

/// A signed-in browser.
#[derive(Clone)]
pub struct Session {
    /// The token it signed in with (never sent back to the browser).
    pub secret: String,
    pub name: String,
    /// How the log names it (`token:<name>`, `oidc:<sub>`).
    pub actor: String,
    pub role: String,
    /// The anti-forgery value its forms carry.
    pub csrf: String,
    made: Instant,
    /// Sessions opened before this one (the oldest is ended first).
    order: u64,
}

/// The sessions of one console.
#[derive(Default)]
pub struct Sessions(Mutex<(u64, HashMap<String, Session>)>);

/// 244 random bits as hex (two v4 UUIDs, from the OS's generator).
fn random() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

impl Sessions {
    /// A new session for the token; its id (the cookie's value).
    pub fn open(&self, secret: String, name: String, actor: String, role: String) -> String {
        let id = random();
        let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let (opened, all) = &mut *guard;
        *opened += 1;
        let now = Instant::now();
        all.retain(|_, s| now.duration_since(s.made) < LIFETIME);
        let oldest = |all: &HashMap<String, Session>, of: Option<&str>| {
            all.iter()
                .filter(|(_, s)| of.is_none_or(|t| s.secret == t))
                .min_by_key(|(_, s)| s.order)
                .map(|(k, _)| k.clone())
        };
        let its = all.values().filter(|s| s.secret == secret).count();
        let evict = if its >= PER_TOKEN_MAX {
            oldest(all, Some(&secret))
        } else if all.len() >= SESSIONS_MAX {
            oldest(all, None)
        } else {
            None
        };
        if let Some(k) = evict {
            all.remove(&k);
        }
        all.insert(
            id.clone(),
            Session {
                secret,
                name,
                actor,
                role,
                csrf: random(),
                made: now,
                order: *opened,
            },
        );
        id
    }

    /// The live session the request's cookie names, and its id.
    pub fn of(&self, headers: &HeaderMap) -> Option<(String, Session)> {
        let id = cookie(headers, COOKIE)?;
        let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let all = &mut guard.1;
        let s = all.get(&id)?;
        if s.made.elapsed() >= LIFETIME {
            all.remove(&id);
            return None;
        }
        Some((id, s.clone()))
    }

    pub fn close(&self, id: &str) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .remove(id);
    }

    /// End every session of a token (the API refused it: revoked, expired).
    pub fn close_token(&self, secret: &str) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .retain(|_, s| s.secret != secret);
    }
}

/// The value of cookie `name` in the request's `Cookie` headers.
pub fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
}

/// The `Set-Cookie` value that opens (`Some(id)`) or ends a session.
pub fn set_cookie(id: Option<&str>, secure: bool) -> String {
    // Over TLS the browser must never send it in the clear.
    let secure = if secure { "; Secure" } else { "" };
    match id {
        Some(id) => format!(
            "{COOKIE}={id}; Path=/console; HttpOnly; SameSite=Strict; Max-Age={}{secure}",
            LIFETIME.as_secs()
        ),
        None => format!("{COOKIE}=; Path=/console; HttpOnly; SameSite=Strict; Max-Age=0{secure}"),
    }
}

/// Why a form post is refused as cross-site, if it is: the browser says
/// it came from another site or origin (`Sec-Fetch-Site`, `Origin`). A
/// client that sends neither (curl) is judged by the anti-forgery value
/// alone.
pub fn cross_site(headers: &HeaderMap) -> Option<String> {
    let get = |h: &str| headers.get(h).and_then(|v| v.to_str().ok());
    match get("sec-fetch-site") {
        None | Some("same-origin") | Some("none") => {}
        // "same-site" is another port or host of the same site: another
        // origin, as far as a form that acts is concerned.
        Some(other) => return Some(format!("the form came from another origin ({other})")),
    }
    if let Some(origin) = get("origin") {
        let host = get("host").unwrap_or_default();
        let ours = ["http://", "https://"]
            .iter()
            .any(|scheme| origin.strip_prefix(scheme) == Some(host));
        if host.is_empty() || !ours {
            return Some(format!("the form came from {origin}, not this console"));
        }
    }
    None
}

/// Whether `given` is the session's anti-forgery value, compared in time
/// that does not depend on where they differ.
pub fn csrf_holds(session: &Session, given: &str) -> bool {
    let (a, b) = (session.csrf.as_bytes(), given.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn a_form_from_another_site_or_origin_is_refused() {
        let ours = [("host", "127.0.0.1:9190")];
        assert!(cross_site(&headers(&ours)).is_none(), "curl sends neither");
        assert!(cross_site(&headers(&[
            ("host", "127.0.0.1:9190"),
            ("sec-fetch-site", "same-origin"),
            ("origin", "http://127.0.0.1:9190"),
        ]))
        .is_none());
        for (site, origin) in [
            ("cross-site", "http://evil.example"),
            ("same-site", "http://127.0.0.1:8080"),
        ] {
            let h = headers(&[
                ("host", "127.0.0.1:9190"),
                ("sec-fetch-site", site),
                ("origin", origin),
            ]);
            assert!(cross_site(&h).is_some(), "{site}");
        }
        // An older browser: no Sec-Fetch-Site, an Origin of another port.
        let h = headers(&[("host", "127.0.0.1:9190"), ("origin", "http://127.0.0.1:9")]);
        assert!(cross_site(&h).is_some());
        let h = headers(&[("origin", "http://127.0.0.1:9190")]);
        assert!(cross_site(&h).is_some(), "no Host: nothing to match");
    }

    #[test]
    fn a_session_is_found_by_its_cookie_and_ends_when_closed() {
        let s = Sessions::default();
        let id = s.open(
            "oxr_x".into(),
            "ann".into(),
            "token:t".into(),
            "viewer".into(),
        );
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_str(&format!("a=b; {COOKIE}={id}; c=d")).unwrap(),
        );
        let (found, session) = s.of(&h).expect("the session");
        assert_eq!(found, id);
        assert!(csrf_holds(&session, &session.csrf.clone()));
        assert!(!csrf_holds(&session, ""));
        assert!(!csrf_holds(&session, &"0".repeat(session.csrf.len())));
        s.close(&id);
        assert!(s.of(&h).is_none());
        assert!(set_cookie(Some(&id), false).contains("HttpOnly; SameSite=Strict"));
        assert!(set_cookie(Some(&id), true).ends_with("; Secure"));
    }

    #[test]
    fn sessions_are_bounded_in_all_and_by_token() {
        let s = Sessions::default();
        let admin = s.open("admin".into(), "a".into(), "token:t".into(), "admin".into());
        // One token's many sign-ins end its own oldest, not another's.
        let first = s.open("b".into(), "b".into(), "token:t".into(), "viewer".into());
        for _ in 0..SESSIONS_MAX {
            s.open("b".into(), "b".into(), "token:t".into(), "viewer".into());
        }
        {
            let all = &s.0.lock().unwrap().1;
            assert_eq!(all.len(), PER_TOKEN_MAX + 1);
            assert!(all.contains_key(&admin) && !all.contains_key(&first));
        }
        for i in 0..SESSIONS_MAX {
            s.open(
                format!("t{i}"),
                "t".into(),
                "token:t".into(),
                "viewer".into(),
            );
        }
        {
            let all = &s.0.lock().unwrap().1;
            assert_eq!(all.len(), SESSIONS_MAX);
            assert!(!all.contains_key(&admin), "the oldest went first");
        }
        s.close_token("t5");
        assert_eq!(s.0.lock().unwrap().1.len(), SESSIONS_MAX - 1);
    }
}
