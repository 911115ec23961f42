//! Optional OIDC for the console (SPEC §16): a bearer that is a JWT is
//! checked against the keys its issuer publishes (discovery, then
//! `jwks_uri`), for the issuer, the audience and the time the console is
//! given, and its role read from a claim (`roles`, or a dotted path such
//! as `realm_access.roles`). The log names it `oidc:<sub>`.
//!
//! The keys are fetched when first needed, again at most once a
//! [`REFETCH_MIN`] when a token names a key not among them (an issuer
//! rotating its keys), and again after [`KEYS_MAX_AGE`]. Only asymmetric
//! algorithms are taken: a symmetric one would make the published key the
//! secret.

use std::time::{Duration, Instant};

use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::Value;
use tokio::sync::Mutex;

use super::tokens::{Role, Token};
use crate::error::{Error, Result};

/// An unknown key fetches the issuer's keys again at most this often.
const REFETCH_MIN: Duration = Duration::from_secs(30);
/// Keys older than this are fetched again before use.
const KEYS_MAX_AGE: Duration = Duration::from_secs(3600);
/// A fetch from the issuer, at most.
const FETCH_TIME: Duration = Duration::from_secs(5);
/// Clock skew allowed on `exp` and `nbf`.
const LEEWAY_SECONDS: u64 = 60;

/// What `outbox-relay console` is told (`--oidc-*`).
#[derive(Debug, Clone)]
pub struct Config {
    /// The issuer URL, exactly as tokens name it (`iss`).
    pub issuer: String,
    /// The audience tokens must be for (`aud`): the console's client id.
    pub audience: String,
    /// Where the roles are: a claim, or a dotted path to one.
    pub roles_claim: String,
    /// A claim value and the role it gives; empty: the values `viewer`,
    /// `operator` and `admin` themselves.
    pub roles: Vec<(String, Role)>,
}

impl Config {
    /// `--oidc-role` values (`admin=platform-admins`): the role a claim
    /// value gives.
    pub fn parse_roles(items: &[String]) -> Result<Vec<(String, Role)>> {
        super::tokens::parse_role_map("--oidc-role", items)
    }

    /// The issuer must be https (a token's keys fetched in the clear could
    /// be anyone's), but for a loopback address.
    pub fn check(&self) -> Result<()> {
        let url = url::Url::parse(&self.issuer)
            .map_err(|e| Error::Config(format!("--oidc-issuer {:?}: {e}", self.issuer)))?;
        let loopback = matches!(
            url.host(),
            Some(url::Host::Ipv4(ip)) if ip.is_loopback()
        ) || matches!(url.host(), Some(url::Host::Ipv6(ip)) if ip.is_loopback())
            || url.host_str() == Some("localhost");
        if url.scheme() != "https" && !(url.scheme() == "http" && loopback) {
            return Err(Error::Config(format!(
                "--oidc-issuer {}: must be https (http only on a loopback address)",
                self.issuer
            )));
        }
        if self.audience.trim().is_empty() {
            return Err(Error::Config(
                "--oidc-issuer needs --oidc-audience (the console's client id, as tokens' aud name it)"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// A bearer value that is a JWT (three base64url parts, a JSON header).
pub fn looks_like_jwt(bearer: &str) -> bool {
    bearer.starts_with("eyJ") && bearer.split('.').count() == 3 && bearer.len() <= 16 * 1024
}

/// What a JWT came to.
#[derive(Debug)]
pub enum Verdict {
    Valid(Token),
    /// Refused: why, in one line (a 401).
    Refused(String),
}

/// The issuer's keys, as last fetched.
#[derive(Default)]
struct Keys {
    set: Option<JwkSet>,
    fetched: Option<Instant>,
    /// The last fetch tried, whatever came of it: an issuer that is down
    /// is asked again at most once a [`REFETCH_MIN`], however many
    /// tokens (made-up ones too) arrive meanwhile.
    tried: Option<Instant>,
}

/// The console's OIDC checker.
pub struct Oidc {
    config: Config,
    http: reqwest::Client,
    keys: std::sync::Mutex<Keys>,
    /// Held while the keys are fetched: one fetch at a time, and a check
    /// that has keys to use never waits for it.
    fetching: Mutex<()>,
}

impl Oidc {
    pub fn new(config: Config) -> Result<Oidc> {
        config.check()?;
        let http = reqwest::Client::builder()
            .timeout(FETCH_TIME)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| Error::Config(format!("OIDC HTTP client: {e}")))?;
        Ok(Oidc {
            config,
            http,
            keys: std::sync::Mutex::new(Keys::default()),
            fetching: Mutex::new(()),
        })
    }

    /// Check `jwt`. `Err`: the issuer's keys cannot be read (a 503: not
    /// the caller's fault, and not a refusal to record as one).
    pub async fn check(&self, jwt: &str) -> Result<Verdict> {
        let header = match jsonwebtoken::decode_header(jwt) {
            Ok(h) => h,
            Err(e) => return Ok(Verdict::Refused(format!("not a JWT: {e}"))),
        };
        if matches!(
            header.alg,
            Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512
        ) {
            return Ok(Verdict::Refused(format!(
                "JWT signed with {:?}: only an issuer's public keys are taken",
                header.alg
            )));
        }
        let key = match self.key(header.kid.as_deref(), header.alg).await? {
            Some(k) => k,
            None => {
                return Ok(Verdict::Refused(format!(
                    "JWT signed by a key the issuer does not publish (kid {:?})",
                    header.kid.unwrap_or_default()
                )))
            }
        };
        let mut validation = Validation::new(header.alg);
        validation.set_issuer(&[&self.config.issuer]);
        validation.set_audience(&[&self.config.audience]);
        validation.leeway = LEEWAY_SECONDS;
        validation.validate_nbf = true;
        validation.required_spec_claims = ["exp", "iss", "aud", "sub"]
            .into_iter()
            .map(str::to_owned)
            .collect();
        let claims = match jsonwebtoken::decode::<Value>(jwt, &key, &validation) {
            Ok(t) => t.claims,
            Err(e) => return Ok(Verdict::Refused(format!("JWT refused: {e}"))),
        };
        Ok(self.token_of(&claims))
    }

    /// The token a JWT's verified claims stand for, or why none.
    fn token_of(&self, claims: &Value) -> Verdict {
        let sub = claims["sub"].as_str().unwrap_or_default();
        if sub.is_empty() || sub.len() > 255 || sub.chars().any(char::is_control) {
            return Verdict::Refused("JWT's sub is empty, too long or not plain text".into());
        }
        let values = claim_values(claims, &self.config.roles_claim);
        let role = values
            .iter()
            .filter_map(|v| {
                if self.config.roles.is_empty() {
                    Role::parse(v)
                } else {
                    self.config
                        .roles
                        .iter()
                        .find(|(value, _)| value == v)
                        .map(|(_, r)| *r)
                }
            })
            .max();
        let Some(role) = role else {
            return Verdict::Refused(format!(
                "JWT of {sub} gives no console role: claim {} holds {values:?} (--oidc-role maps a value to a role)",
                self.config.roles_claim
            ));
        };
        let at = |claim: &str| {
            claims[claim]
                .as_i64()
                .and_then(|s| time::OffsetDateTime::from_unix_timestamp(s).ok())
                .and_then(|t| {
                    t.format(&time::format_description::well_known::Rfc3339)
                        .ok()
                })
                .unwrap_or_default()
        };
        Verdict::Valid(Token {
            name: sub.to_owned(),
            role,
            created_at: at("iat"),
            created_by: self.config.issuer.clone(),
            expires_at: at("exp"),
            revoked_at: None,
            state: "active",
            kind: "oidc",
        })
    }

    /// The key `kid` names (or, without one, the only key for `alg`),
    /// fetching the issuer's keys when none are held, they are old, or
    /// they lack it: at most once a [`REFETCH_MIN`], one fetch at a time,
    /// old keys serving meanwhile. `Err` only while no key was ever read.
    async fn key(&self, kid: Option<&str>, alg: Algorithm) -> Result<Option<DecodingKey>> {
        let (found, stale, may_fetch, held) = self.look(kid, alg);
        if found.is_some() && !stale {
            return Ok(found);
        }
        if may_fetch {
            if let Ok(_one) = self.fetching.try_lock() {
                // Another fetch may have ended while this one waited.
                let (found, stale, may_fetch, held) = self.look(kid, alg);
                if (found.is_some() && !stale) || !may_fetch {
                    return self.held(found, held);
                }
                self.keys_mut().tried = Some(Instant::now());
                match self.fetch().await {
                    Ok(set) => {
                        let mut keys = self.keys_mut();
                        keys.set = Some(set);
                        keys.fetched = Some(Instant::now());
                        return Ok(find(keys.set.as_ref(), kid, alg));
                    }
                    Err(e) if held => {
                        tracing::warn!(error = %e, "console: cannot fetch the OIDC issuer's keys again; using those fetched before");
                    }
                    Err(e) => return Err(e),
                }
                return Ok(found);
            }
            if !held {
                // The first fetch is under way: its keys, once it ends.
                let _wait = self.fetching.lock().await;
                let (found, _, _, held) = self.look(kid, alg);
                return self.held(found, held);
            }
        }
        self.held(found, held)
    }

    /// The key found, if any keys are held at all.
    fn held(&self, found: Option<DecodingKey>, held: bool) -> Result<Option<DecodingKey>> {
        if held {
            Ok(found)
        } else {
            Err(Error::Http {
                context: "OIDC".into(),
                source: "the issuer's keys could not be read (asked again at most every 30 s)"
                    .into(),
            })
        }
    }

    /// The key, whether the keys are old, whether a fetch may be tried,
    /// and whether any keys are held.
    fn look(&self, kid: Option<&str>, alg: Algorithm) -> (Option<DecodingKey>, bool, bool, bool) {
        let keys = self.keys_mut();
        (
            find(keys.set.as_ref(), kid, alg),
            keys.fetched.is_none_or(|at| at.elapsed() > KEYS_MAX_AGE),
            keys.tried.is_none_or(|at| at.elapsed() >= REFETCH_MIN),
            keys.set.is_some(),
        )
    }

    fn keys_mut(&self) -> std::sync::MutexGuard<'_, Keys> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Discovery, then the key set it names.
    async fn fetch(&self) -> Result<JwkSet> {
        let issuer = self.config.issuer.trim_end_matches('/');
        let discovery = format!("{issuer}/.well-known/openid-configuration");
        let doc: Value = self.get(&discovery).await?;
        if doc["issuer"].as_str() != Some(self.config.issuer.as_str()) {
            return Err(Error::setup(format!(
                "OIDC: {discovery} names issuer {} (not --oidc-issuer {}): tokens would name it too; give that exact issuer",
                doc["issuer"], self.config.issuer
            )));
        }
        let Some(jwks_uri) = doc["jwks_uri"].as_str() else {
            return Err(Error::setup(format!("OIDC: {discovery} names no jwks_uri")));
        };
        let set: JwkSet = serde_json::from_value(self.get(jwks_uri).await?)
            .map_err(|e| Error::setup(format!("OIDC: {jwks_uri} is not a JWK set: {e}")))?;
        Ok(set)
    }

    async fn get(&self, url: &str) -> Result<Value> {
        let failed = |e: String| Error::Http {
            context: format!("OIDC: reading {url}"),
            source: e.into(),
        };
        let resp = self
            .http
            .get(url)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(|e| failed(e.without_url().to_string()))?;
        let body = resp
            .bytes()
            .await
            .map_err(|e| failed(e.without_url().to_string()))?;
        serde_json::from_slice(&body).map_err(|e| failed(format!("not JSON: {e}")))
    }
}

fn find(set: Option<&JwkSet>, kid: Option<&str>, alg: Algorithm) -> Option<DecodingKey> {
    let set = set?;
    let jwk = match kid {
        Some(kid) => set.find(kid)?,
        None => {
            let mut fits = set.keys.iter().filter(|k| {
                k.common
                    .key_algorithm
                    .is_none_or(|a| a.to_string() == format!("{alg:?}"))
            });
            let one = fits.next()?;
            if fits.next().is_some() {
                return None;
            }
            one
        }
    };
    DecodingKey::from_jwk(jwk).ok()
}

/// The values of the roles claim (a dotted path): an array of strings, or
/// one string of values separated by spaces or commas.
fn claim_values(claims: &Value, path: &str) -> Vec<String> {
    let mut at = claims;
    for part in path.split('.') {
        at = &at[part];
    }
    match at {
        Value::Array(items) => items
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect(),
        Value::String(s) => s
            .split([' ', ','])
            .filter(|v| !v.is_empty())
            .map(str::to_owned)
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn oidc(roles: Vec<(String, Role)>, claim: &str) -> Oidc {
        Oidc::new(Config {
            issuer: "https://id.example.com/realms/ops".into(),
            audience: "outbox-console".into(),
            roles_claim: claim.into(),
            roles,
        })
        .unwrap()
    }

    #[test]
    fn roles_come_from_a_claim_path_and_the_highest_wins() {
        let o = oidc(Vec::new(), "realm_access.roles");
        let claims =
            json!({"sub": "u-1", "realm_access": {"roles": ["offline", "viewer", "operator"]}});
        match o.token_of(&claims) {
            Verdict::Valid(t) => {
                assert_eq!(
                    (t.name.as_str(), t.role, t.kind),
                    ("u-1", Role::Operator, "oidc")
                );
                assert_eq!(t.actor(), "oidc:u-1");
            }
            v => panic!("{v:?}"),
        }
        let o = oidc(
            Config::parse_roles(&["admin=platform-admins".into(), "viewer=eng".into()]).unwrap(),
            "groups",
        );
        let t = o.token_of(&json!({"sub": "u-2", "groups": "eng platform-admins"}));
        assert!(
            matches!(t, Verdict::Valid(ref t) if t.role == Role::Admin),
            "{t:?}"
        );
        // Mapped: the bare role names give nothing.
        let t = o.token_of(&json!({"sub": "u-3", "groups": ["admin"]}));
        assert!(
            matches!(t, Verdict::Refused(ref why) if why.contains("no console role")),
            "{t:?}"
        );
        let t = o.token_of(&json!({"groups": ["eng"]}));
        assert!(
            matches!(t, Verdict::Refused(ref why) if why.contains("sub")),
            "{t:?}"
        );
    }

    #[test]
    fn bad_settings_are_refused_in_one_line() {
        assert!(Config::parse_roles(&["root=x".into()]).is_err());
        assert!(Config::parse_roles(&["admin".into()]).is_err());
        let cfg = |issuer: &str, audience: &str| Config {
            issuer: issuer.into(),
            audience: audience.into(),
            roles_claim: "roles".into(),
            roles: Vec::new(),
        };
        assert!(cfg("http://id.example.com", "a").check().is_err(), "http");
        assert!(cfg("http://127.0.0.1:8080/realms/x", "a").check().is_ok());
        assert!(
            cfg("https://id.example.com", "").check().is_err(),
            "no audience"
        );
    }

    #[test]
    fn only_jwts_look_like_jwts() {
        assert!(looks_like_jwt("eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJ4In0.c2ln"));
        assert!(!looks_like_jwt(&format!("oxr_{}", "0".repeat(64))));
        assert!(!looks_like_jwt("eyJ.only-two"));
    }

    /// Review: an issuer that is down was asked again for every token (a
    /// flood of made-up ones held every token check behind its fetches).
    #[tokio::test]
    async fn an_issuer_that_is_down_is_asked_at_most_once_a_while() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        let hits = Arc::new(AtomicUsize::new(0));
        let counted = hits.clone();
        let app = axum::Router::new().fallback(move || {
            let counted = counted.clone();
            async move {
                counted.fetch_add(1, Ordering::SeqCst);
                axum::http::StatusCode::INTERNAL_SERVER_ERROR
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let issuer = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let o = Oidc::new(Config {
            issuer,
            audience: "a".into(),
            roles_claim: "roles".into(),
            roles: Vec::new(),
        })
        .unwrap();
        // ES256, kid "k".
        let jwt = "eyJhbGciOiJFUzI1NiIsImtpZCI6ImsifQ.eyJzdWIiOiJ4In0.c2ln";
        for _ in 0..20 {
            assert!(
                o.check(jwt).await.is_err(),
                "no keys: the caller is told to retry"
            );
        }
        assert_eq!(
            hits.load(Ordering::SeqCst),
            1,
            "one discovery read, not one per token"
        );
    }

    #[tokio::test]
    async fn a_symmetric_or_unknown_key_is_refused_without_a_fetch() {
        let o = oidc(Vec::new(), "roles");
        // HS256 header; the issuer (example.com) is never asked.
        let hs = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiJ4In0.c2ln";
        assert!(
            matches!(o.check(hs).await, Ok(Verdict::Refused(ref why)) if why.contains("HS256")),
        );
        assert!(matches!(
            o.check("eyJnope.x.y").await,
            Ok(Verdict::Refused(_))
        ));
    }
}
