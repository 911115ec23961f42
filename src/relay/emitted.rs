//! An event `outbox_emit()` wrote into the WAL (SPEC §12), read back into
//! the same [`OutboxRow`] a table row becomes, so routing, headers, schema
//! checks and dead letters cannot tell the two apart. Pure: no I/O.
//!
//! The content (`migrations/0010_outbox_emit.sql`) is three lines: the
//! fields as a JSON array (by position, so no key names go into the WAL),
//! the headers' JSON (empty when there are none), and the payload's JSON.
//! JSON text never holds a raw newline, and keeping payload and headers out
//! of the array keeps them the very text Postgres renders for a row's
//! columns: no number loses precision, no byte changes.

use bytes::Bytes;
use serde::Deserialize;
use uuid::Uuid;

use super::outbox_row::{micros_to_rfc3339, OutboxRow, PG_EPOCH_UNIX_MICROS};

/// id, aggregate_type, aggregate_id, event_type, event_version,
/// occurred_at (Unix µs), correlation_id, causation_id, subject.
#[derive(Deserialize)]
struct Fields(
    Uuid,
    String,
    String,
    String,
    i64,
    Option<i64>,
    Option<Uuid>,
    Option<Uuid>,
    Option<String>,
);

/// The three lines, split.
fn lines(content: &Bytes) -> Option<(Bytes, Bytes, Bytes)> {
    let first = content.iter().position(|&b| b == b'\n')?;
    let rest = content.slice(first + 1..);
    let second = rest.iter().position(|&b| b == b'\n')?;
    Some((
        content.slice(..first),
        rest.slice(..second),
        rest.slice(second + 1..),
    ))
}

/// The id alone, so content that fails to read can still be dead-lettered
/// under its own message id.
pub fn id(content: &Bytes) -> Option<Uuid> {
    let (fields, _, _) = lines(content)?;
    let fields: Vec<serde_json::Value> = serde_json::from_slice(&fields).ok()?;
    Uuid::parse_str(fields.first()?.as_str()?).ok()
}

/// The row an emitted event stands for.
pub fn row(content: &Bytes) -> Result<OutboxRow, String> {
    let shape = "emitted event content is not what outbox_emit() writes";
    let (fields, headers, payload) =
        lines(content).ok_or_else(|| format!("{shape}: not three lines"))?;
    let Fields(
        id,
        aggregate_type,
        aggregate_id,
        event_type,
        event_version,
        occurred_at_us,
        correlation_id,
        causation_id,
        subject,
    ) = serde_json::from_slice(&fields).map_err(|e| format!("{shape}: {e}"))?;
    if payload.is_empty() {
        return Err(format!("{shape}: no payload"));
    }
    let occurred_at = match occurred_at_us {
        Some(unix) => Some(
            unix.checked_sub(PG_EPOCH_UNIX_MICROS)
                .and_then(micros_to_rfc3339)
                .ok_or_else(|| format!("occurred_at_us {unix} is out of range"))?,
        ),
        None => None,
    };
    Ok(OutboxRow {
        id: id.to_string(),
        aggregate_type: Some(aggregate_type),
        aggregate_id: Some(aggregate_id),
        event_type: Some(event_type),
        event_version: Some(event_version),
        payload,
        occurred_at,
        correlation_id: correlation_id.map(|u| u.to_string()),
        causation_id: causation_id.map(|u| u.to_string()),
        subject,
        stream: None,
        headers: (!headers.is_empty()).then_some(headers),
        // An emitted event has no table columns: a template that names
        // one needs the event's own subject.
        columns: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn content(text: &str) -> Bytes {
        Bytes::copy_from_slice(text.as_bytes())
    }

    #[test]
    fn what_outbox_emit_writes_reads_back_as_a_row() {
        // As Postgres renders it.
        let c = content(concat!(
            r#"["0b9f6e5a-8c1d-4f5e-9a3b-2c7d1e0f4a6b", "order", "o-1", "placed", 2, 1764000000123456, "7e57d004-2b97-4e7a-b45f-5387367791cd", null, null]"#,
            "\n",
            r#"{"tenant": "acme"}"#,
            "\n",
            r#"{"total": 12.50, "big": 123456789012345678901234567890, "s": "a\nb"}"#,
        ));
        let row = row(&c).unwrap();
        assert_eq!(row.id.to_string(), "0b9f6e5a-8c1d-4f5e-9a3b-2c7d1e0f4a6b");
        assert_eq!(
            &row.payload[..],
            br#"{"total": 12.50, "big": 123456789012345678901234567890, "s": "a\nb"}"#
        );
        assert_eq!(row.headers.as_deref(), Some(&br#"{"tenant": "acme"}"#[..]));
        assert_eq!(row.event_version, Some(2));
        assert_eq!(row.subject, None);
        assert_eq!(row.causation_id, None);
        assert_eq!(
            row.occurred_at.as_deref(),
            Some("2025-11-24T16:00:00.123456Z")
        );
        assert_eq!(id(&c).map(|u| u.to_string()), Some(row.id));
    }

    #[test]
    fn content_of_another_shape_is_refused_with_its_id_kept() {
        let c = content("[\"0b9f6e5a-8c1d-4f5e-9a3b-2c7d1e0f4a6b\"]\n\n{}");
        assert!(row(&c)
            .unwrap_err()
            .contains("not what outbox_emit() writes"));
        assert!(id(&c).is_some());
        assert!(row(&content("not json")).is_err());
        assert_eq!(id(&content("not json")), None);
        let no_payload = content(concat!(
            r#"["0b9f6e5a-8c1d-4f5e-9a3b-2c7d1e0f4a6b", "t", "a", "e", 1, null, null, null, null]"#,
            "\n\n"
        ));
        assert!(row(&no_payload).unwrap_err().contains("no payload"));
    }

    proptest! {
        #[test]
        fn any_payload_text_comes_back_byte_for_byte(
            n in any::<i64>(), s in "[a-z \\\\\"é]{0,20}", v in 1i64..1000
        ) {
            let payload = serde_json::json!({"n": n, "s": s}).to_string();
            let c = content(&format!(
                "[\"{}\", \"t\", \"a\", \"e\", {v}, null, null, null, \"x.y\"]\n\n{payload}",
                Uuid::new_v4()
            ));
            let row = row(&c).unwrap();
            prop_assert_eq!(&row.payload[..], payload.as_bytes());
            prop_assert_eq!(row.event_version, Some(v));
            prop_assert_eq!(row.headers, None);
            prop_assert_eq!(row.subject.as_deref(), Some("x.y"));
        }
    }

    #[test]
    fn a_forged_time_is_refused_not_overflowed() {
        let c = content(concat!(
            r#"["0b9f6e5a-8c1d-4f5e-9a3b-2c7d1e0f4a6b", "t", "a", "e", 1, -9223372036854775808, null, null, null]"#,
            "\n\n{}"
        ));
        assert!(row(&c).unwrap_err().contains("out of range"));
    }
}
