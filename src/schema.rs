//! Event schemas (SPEC §10): the JSON Schema of event type `a.b.c` version
//! N is the file `DIR/a/b/c/vN.json`. Every file is compiled once, at
//! start; a file that is not JSON or not a valid schema stops the process
//! with one line naming it, before anything is published.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

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

impl Registry {
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
        let registry = Registry { schemas, missing };
        tracing::info!(dir = %dir.display(), schemas = registry.len(), "loaded event schemas");
        Ok(registry)
    }

    pub fn len(&self) -> usize {
        self.schemas.values().map(HashMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.schemas.is_empty()
    }

    /// Check a payload (JSON text) against its type's schema.
    pub fn check(&self, event_type: &str, version: i64, payload: &[u8]) -> Verdict<'_> {
        let Some(schema) = self.schemas.get(event_type).and_then(|v| v.get(&version)) else {
            return match self.missing {
                Missing::Allow => Verdict::Unchecked,
                Missing::DeadLetter => Verdict::Missing,
            };
        };
        let instance: serde_json::Value = match serde_json::from_slice(payload) {
            Ok(v) => v,
            Err(e) => return Verdict::Invalid(&schema.id, format!("not JSON: {e}")),
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
    if parts.is_empty() || parts.iter().any(|p| p.is_empty()) {
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
}
