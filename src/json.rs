//! A JSON object written straight into bytes, with one member embedded raw.
//!
//! The relay's `--envelope` and the consumer's HTTP body both wrap a payload
//! that Postgres already rendered as valid JSON. Parsing it into a
//! `serde_json::Value` only to print it again would cost more than the rest
//! of the per-event path, so the wrapper is written by hand, here, once.

/// Members are written in call order; keys are trusted constants.
pub struct JsonObject {
    out: Vec<u8>,
}

impl JsonObject {
    pub fn with_capacity(capacity: usize) -> Self {
        let mut out = Vec::with_capacity(capacity + 2);
        out.push(b'{');
        Self { out }
    }

    fn key(&mut self, key: &str) {
        if self.out.len() > 1 {
            self.out.push(b',');
        }
        self.out.push(b'"');
        self.out.extend_from_slice(key.as_bytes());
        self.out.extend_from_slice(b"\":");
    }

    pub fn str(mut self, key: &str, value: &str) -> Self {
        self.key(key);
        // Serialising a &str into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut self.out, value);
        self
    }

    /// A string, or `null`.
    pub fn opt_str(self, key: &str, value: Option<&str>) -> Self {
        match value {
            Some(v) => self.str(key, v),
            None => self.raw(key, b"null"),
        }
    }

    pub fn int(self, key: &str, value: i64) -> Self {
        self.raw(key, value.to_string().as_bytes())
    }

    /// A number, or `null`.
    pub fn opt_int(self, key: &str, value: Option<i64>) -> Self {
        match value {
            Some(v) => self.int(key, v),
            None => self.raw(key, b"null"),
        }
    }

    /// `json` must already be valid JSON (the caller's guarantee).
    pub fn raw(mut self, key: &str, json: &[u8]) -> Self {
        self.key(key);
        self.out.extend_from_slice(json);
        self
    }

    pub fn finish(mut self) -> Vec<u8> {
        self.out.push(b'}');
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_valid_json_with_escapes_nulls_and_raw_members() {
        let bytes = JsonObject::with_capacity(16)
            .str("a", "x\"y\n")
            .opt_str("b", None)
            .int("c", -3)
            .opt_int("d", None)
            .raw("e", br#"{"k": [1, 2]}"#)
            .finish();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["a"], "x\"y\n");
        assert!(v["b"].is_null() && v["d"].is_null());
        assert_eq!(v["c"], -3);
        assert_eq!(v["e"]["k"][1], 2);
        assert_eq!(JsonObject::with_capacity(0).finish(), b"{}");
    }
}
