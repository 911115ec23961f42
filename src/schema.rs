//! Event schemas (SPEC §10): the JSON Schema of event type `a.b.c` version
//! N is the file `DIR/a/b/c/vN.json`. Every file is compiled once, at
//! start; a file that is not JSON or not a valid schema stops the process
//! with one line naming it, before anything is published.
//!
//! SIGHUP compiles the folder again ([`Schemas::reload`]) and swaps the new
//! set in whole, so an event is checked against one consistent set. A
//! reload that finds a broken file keeps the set in force and says which
//! file: a typo in a new version must not stop a running relay.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::metrics as m;

/// What a type without a schema gets (`--schema-missing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Missing {
    Allow,
    DeadLetter,
}

struct Schema {
    /// `a/b/c/vN.json#sha256-<hex>`: the `Outbox-Schema` header.
    id: String,
    validator: jsonschema::Validator,
}

/// The compiled schemas of one folder.
pub struct Registry {
    /// By event type, then version: a lookup borrows the row's type.
    schemas: HashMap<String, HashMap<i64, Schema>>,
    missing: Missing,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("schemas", &self.len())
            .field("missing", &self.missing)
            .finish()
    }
}

/// What a payload is, against its type's schema.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict<'a> {
    /// It passes the schema with this id.
    Valid(&'a str),
    /// It fails: the schema's id, and where and why (JSON pointer, the
    /// keyword, the validator's words).
    Invalid(&'a str, String),
    /// Its type has no schema, and `--schema-missing allow`.
    Unchecked,
    /// Its type has no schema, and `--schema-missing dead-letter`.
    Missing,
}

impl Schemas {
    /// Whether this is the first word about `event_type` `version` lacking
    /// a schema (a warning at start counts).
    pub fn first_note(&self, event_type: &str, version: i64) -> bool {
        let Ok(mut seen) = self.unchecked.lock() else {
            return false;
        };
        seen.len() < MAX_NOTED && seen.insert((event_type.to_owned(), version))
    }

    pub fn missing(&self) -> Missing {
        self.missing
    }
}

/// Types without a schema remembered for [`Schemas::note_unchecked`]: a
/// bound, so a writer inventing types cannot grow the set without end.
const MAX_NOTED: usize = 1024;

/// The schemas in force, swapped whole by a reload.
#[derive(Debug)]
pub struct Schemas {
    dir: PathBuf,
    missing: Missing,
    current: RwLock<Arc<Registry>>,
    /// Types seen without a schema, each logged once.
    unchecked: std::sync::Mutex<std::collections::HashSet<(String, i64)>>,
}

impl Schemas {
    /// Compile `dir`; a broken file is a configuration error naming it.
    pub fn load(dir: &Path, missing: Missing) -> Result<Schemas> {
        let registry = Registry::load(dir, missing)?;
        tracing::info!(dir = %dir.display(), schemas = registry.len(), "loaded event schemas");
        Ok(Schemas {
            dir: dir.to_owned(),
            missing,
            current: RwLock::new(Arc::new(registry)),
            unchecked: Default::default(),
        })
    }

    /// Say once per type and version that events of it pass unchecked
    /// (`--schema-missing allow`): a schema that was meant to exist and
    /// does not should not go unnoticed.
    pub fn note_unchecked(&self, stage: &str, event_type: &str, version: i64) {
        if self.first_note(event_type, version) {
            tracing::warn!(
                stage,
                event_type,
                version,
                dir = %self.dir.display(),
                "no schema for this event type and version: its events pass unchecked (--schema-missing allow)"
            );
        }
    }

    /// The set in force. Cheap (a read lock and a reference count): the
    /// hot paths call it per event, so a reload takes effect at the next one.
    pub fn current(&self) -> Arc<Registry> {
        match self.current.read() {
            Ok(r) => Arc::clone(&r),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    /// Compile the folder again and put it in force; on an error the set in
    /// force stays, and the error names the file. Counted in
    /// `outbox_schema_reloads_total{result}`.
    pub fn reload(&self) -> Result<usize> {
        match Registry::load(&self.dir, self.missing) {
            Ok(registry) => {
                let n = registry.len();
                let was = {
                    let mut cur = match self.current.write() {
                        Ok(c) => c,
                        Err(poisoned) => poisoned.into_inner(),
                    };
                    std::mem::replace(&mut *cur, Arc::new(registry)).len()
                };
                tracing::info!(dir = %self.dir.display(), schemas = n, was, "reloaded event schemas");
                metrics::counter!(m::SCHEMA_RELOADS, "result" => "ok").increment(1);
                Ok(n)
            }
            Err(e) => {
                tracing::error!(dir = %self.dir.display(), error = %e, "schema reload failed; the schemas in force stay");
                metrics::counter!(m::SCHEMA_RELOADS, "result" => "failed").increment(1);
                Err(e)
            }
        }
    }
}

impl Registry {
    /// Whether `event_type` version `version` has a schema.
    pub fn has(&self, event_type: &str, version: i64) -> bool {
        self.schemas
            .get(event_type)
            .is_some_and(|v| v.contains_key(&version))
    }

    /// Compile every `vN.json` under `dir`.
    pub fn load(dir: &Path, missing: Missing) -> Result<Registry> {
        let mut files = Vec::new();
        collect(dir, &mut files)
            .map_err(|e| Error::Config(format!("--schemas {}: {e}", dir.display())))?;
        files.sort();
        let mut schemas = HashMap::new();
        for path in files {
            let rel = path.strip_prefix(dir).unwrap_or(&path);
            let Some((event_type, version)) = type_of(rel) else {
                tracing::warn!(file = %path.display(), "not a schema file name (event/type/vN.json); ignored");
                continue;
            };
            let text = std::fs::read(&path)
                .map_err(|e| Error::Config(format!("schema {}: {e}", path.display())))?;
            let json: serde_json::Value = serde_json::from_slice(&text).map_err(|e| {
                Error::Config(format!("schema {}: not valid JSON: {e}", path.display()))
            })?;
            let validator = jsonschema::validator_for(&json).map_err(|e| {
                Error::Config(format!(
                    "schema {}: not a valid JSON Schema: {} (at {})",
                    path.display(),
                    one_line(&e.to_string()),
                    e.schema_path
                ))
            })?;
            let digest = Sha256::digest(&text);
            let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            let id = format!("{}#sha256-{hex}", slash_path(rel));
            schemas
                .entry(event_type)
                .or_insert_with(HashMap::new)
                .insert(version, Schema { id, validator });
        }
        Ok(Registry { schemas, missing })
    }

    pub fn len(&self) -> usize {
        self.schemas.values().map(HashMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.schemas.is_empty()
    }

    /// Check a payload (JSON text) against its type's schema.
    pub fn check(&self, event_type: &str, version: i64, payload: &[u8]) -> Verdict<'_> {
        self.check_with(event_type, version, || {
            serde_json::from_slice(payload).map_err(|e| format!("not JSON: {e}"))
        })
    }

    /// [`Self::check`] for a message whose body is the `--envelope` JSON:
    /// the schema is the payload's, so its `payload` field is checked.
    pub fn check_enveloped(&self, event_type: &str, version: i64, body: &[u8]) -> Verdict<'_> {
        self.check_with(event_type, version, || {
            let mut envelope: serde_json::Value =
                serde_json::from_slice(body).map_err(|e| format!("envelope not JSON: {e}"))?;
            match envelope.get_mut("payload") {
                Some(p) => Ok(p.take()),
                None => Err("envelope without a payload field".to_owned()),
            }
        })
    }

    /// Parsing is left to `instance`, so a type without a schema costs no parse.
    fn check_with(
        &self,
        event_type: &str,
        version: i64,
        instance: impl FnOnce() -> std::result::Result<serde_json::Value, String>,
    ) -> Verdict<'_> {
        let Some(schema) = self.schemas.get(event_type).and_then(|v| v.get(&version)) else {
            return match self.missing {
                Missing::Allow => Verdict::Unchecked,
                Missing::DeadLetter => Verdict::Missing,
            };
        };
        let instance = match instance() {
            Ok(v) => v,
            Err(e) => return Verdict::Invalid(&schema.id, e),
        };
        if schema.validator.is_valid(&instance) {
            return Verdict::Valid(&schema.id);
        }
        let detail = match schema.validator.validate(&instance) {
            Ok(()) => "invalid".to_owned(),
            Err(e) => {
                let keyword = e
                    .schema_path
                    .as_str()
                    .rsplit('/')
                    .next()
                    .unwrap_or_default()
                    .to_owned();
                let pointer = e.instance_path.as_str();
                let pointer = if pointer.is_empty() { "/" } else { pointer };
                format!("{pointer}: {keyword}: {}", one_line(&e.to_string()))
            }
        };
        Verdict::Invalid(&schema.id, detail)
    }
}

/// `a/b/c/v3.json` → (`a.b.c`, 3).
fn type_of(rel: &Path) -> Option<(String, i64)> {
    let file = rel.file_name()?.to_str()?;
    let version: i64 = file
        .strip_prefix('v')?
        .strip_suffix(".json")?
        .parse()
        .ok()?;
    let parts: Vec<&str> = rel
        .parent()?
        .components()
        .map(|c| c.as_os_str().to_str())
        .collect::<Option<_>>()?;
    // The path becomes the schema's id, an `Outbox-Schema` header value.
    if parts.is_empty()
        || parts
            .iter()
            .any(|p| p.is_empty() || p.chars().any(char::is_control))
    {
        return None;
    }
    Some((parts.join("."), version))
}

fn slash_path(rel: &Path) -> String {
    rel.components()
        .map(|c| c.as_os_str().to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "json") {
            out.push(path);
        }
    }
    Ok(())
}

fn one_line(s: &str) -> String {
    s.replace(['\r', '\n'], " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry(files: &[(&str, &str)], missing: Missing) -> Result<Registry> {
        let dir = std::env::temp_dir().join(format!(
            "outbox-relay-schemas-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        for (path, text) in files {
            let p = dir.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        let r = Registry::load(&dir, missing);
        std::fs::remove_dir_all(&dir).unwrap();
        r
    }

    const ORDER: &str = r#"{"type":"object","required":["amount"],"properties":{"amount":{"type":"integer","minimum":0}}}"#;

    #[test]
    fn the_folder_layout_names_type_and_version() {
        assert_eq!(
            type_of(Path::new("shop/order/placed/v3.json")),
            Some(("shop.order.placed".into(), 3))
        );
        assert_eq!(
            type_of(Path::new("placed/v1.json")),
            Some(("placed".into(), 1))
        );
        assert_eq!(type_of(Path::new("v1.json")), None);
        assert_eq!(type_of(Path::new("a/b/schema.json")), None);
        assert_eq!(type_of(Path::new("a/b/vx.json")), None);
        // The path is the schema's id, sent as the `Outbox-Schema` header:
        // a line break there would end the header block (async-nats panics).
        assert_eq!(type_of(Path::new("shop/order\nplaced/v1.json")), None);
        assert_eq!(type_of(Path::new("shop\r/placed/v1.json")), None);
    }

    #[test]
    fn a_payload_is_valid_invalid_with_pointer_and_keyword_or_unchecked() {
        let r = registry(&[("shop/order/placed/v1.json", ORDER)], Missing::Allow).unwrap();
        let Verdict::Valid(id) = r.check("shop.order.placed", 1, br#"{"amount":3}"#) else {
            panic!("valid")
        };
        assert!(id.starts_with("shop/order/placed/v1.json#sha256-"), "{id}");
        assert_eq!(id.len(), "shop/order/placed/v1.json#sha256-".len() + 64);
        match r.check("shop.order.placed", 1, br#"{"amount":-1}"#) {
            Verdict::Invalid(_, detail) => {
                assert_eq!(detail, "/amount: minimum: -1 is less than the minimum of 0")
            }
            v => panic!("{v:?}"),
        }
        match r.check("shop.order.placed", 1, br#"{}"#) {
            Verdict::Invalid(_, detail) => assert!(detail.starts_with("/: required: "), "{detail}"),
            v => panic!("{v:?}"),
        }
        assert_eq!(r.check("shop.order.placed", 2, b"{}"), Verdict::Unchecked);
        let r = registry(&[("shop/order/placed/v1.json", ORDER)], Missing::DeadLetter).unwrap();
        assert_eq!(r.check("shop.order.shipped", 1, b"{}"), Verdict::Missing);
    }

    /// The relay bench's schema folder takes the bench's payloads (else a
    /// run with `OUTBOX_SCHEMAS=benches/schemas` would measure dead letters).
    #[test]
    fn the_bench_schemas_take_the_bench_payloads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/schemas");
        let r = Registry::load(&dir, Missing::DeadLetter).unwrap();
        let payload = serde_json::json!({"p": 1, "s": 42, "pad": "x".repeat(216)}).to_string();
        assert!(matches!(
            r.check("tick", 1, payload.as_bytes()),
            Verdict::Valid(_)
        ));
    }

    #[test]
    fn a_reload_puts_a_new_version_in_force_and_a_broken_one_keeps_the_old() {
        let dir = std::env::temp_dir().join(format!(
            "outbox-relay-schemas-reload-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(dir.join("shop/order/placed")).unwrap();
        std::fs::write(dir.join("shop/order/placed/v1.json"), ORDER).unwrap();
        let s = Schemas::load(&dir, Missing::DeadLetter).unwrap();
        let before = s.current();
        assert_eq!(
            before.check("shop.order.placed", 2, b"{}"),
            Verdict::Missing
        );

        std::fs::write(dir.join("shop/order/placed/v2.json"), "{}").unwrap();
        assert_eq!(s.reload().unwrap(), 2);
        assert!(matches!(
            s.current().check("shop.order.placed", 2, b"{}"),
            Verdict::Valid(_)
        ));
        assert_eq!(
            before.check("shop.order.placed", 2, b"{}"),
            Verdict::Missing,
            "a check already under way keeps the set it started with"
        );

        std::fs::write(dir.join("shop/order/placed/v3.json"), "{").unwrap();
        let e = s.reload().unwrap_err().to_string();
        assert!(e.contains("shop/order/placed/v3.json"), "{e}");
        assert!(
            s.current().has("shop.order.placed", 2),
            "the set in force stays"
        );
        assert!(!s.current().has("shop.order.placed", 3));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_broken_schema_file_is_refused_naming_it() {
        let e = registry(&[("a/b/v1.json", "{not json")], Missing::Allow)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("a/b/v1.json") && e.contains("not valid JSON"),
            "{e}"
        );
        let e = registry(&[("a/b/v2.json", r#"{"type":"nope"}"#)], Missing::Allow)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("a/b/v2.json") && e.contains("not a valid JSON Schema"),
            "{e}"
        );
    }

    /// A schema stands alone: a `$ref` inside the file resolves, while one
    /// to another file or a URL is not fetched (no file or network access
    /// from a schema, and the digest covers one file), so the schema is
    /// refused at start naming the file, not accepted and failed later.
    #[test]
    fn a_reference_outside_the_file_is_refused_naming_it() {
        let inside = r##"{"$defs":{"money":{"type":"integer","minimum":0}},
            "properties":{"amount":{"$ref":"#/$defs/money"}}}"##;
        let r = registry(&[("a/b/v1.json", inside)], Missing::Allow).unwrap();
        assert!(matches!(
            r.check("a.b", 1, br#"{"amount":3}"#),
            Verdict::Valid(_)
        ));
        match r.check("a.b", 1, br#"{"amount":-3}"#) {
            Verdict::Invalid(_, detail) => {
                assert!(detail.starts_with("/amount: minimum"), "{detail}")
            }
            v => panic!("{v:?}"),
        }
        for target in ["../common/money.json", "https://example.com/money.json"] {
            let text = format!(r#"{{"properties":{{"amount":{{"$ref":"{target}"}}}}}}"#);
            let e = registry(&[("a/b/v1.json", &text)], Missing::Allow)
                .err()
                .map(|e| e.to_string());
            assert!(
                e.as_deref().is_some_and(|e| e.contains("a/b/v1.json")),
                "{target}: {e:?}"
            );
        }
    }
}
