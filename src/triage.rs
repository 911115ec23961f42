//! Dead letters by cause (SPEC §16): seed 001's playbook triages by class
//! (schema-invalid goes to the producer team, a consumer bug is fixed and
//! replayed, a transient failure drains by itself, poison is deleted with
//! sign-off), so every dead letter says its class and a fingerprint of its
//! cause in headers ([`wire::DLQ_CLASS`], [`wire::DLQ_FINGERPRINT`]), and
//! letters written before those headers are classed from their reason
//! text. Pure: the relay, the consumer and the console ask it alike.

use sha2::{Digest, Sha256};

use crate::wire::{self, DlqReason};

/// Why a message was dead-lettered, as the playbook groups it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Class {
    /// The payload fails its event type's JSON Schema.
    SchemaInvalid,
    /// No schema for the event type and version (`--schema-missing
    /// dead-letter`).
    SchemaMissing,
    /// The handler refused it (HTTP 422, a Rust handler's `Reject`).
    HandlerRejected,
    /// The handler failed on every try in a way that is not the network's
    /// or a dependency's (a 500, a panic): a consumer bug.
    HandlerFailed,
    /// Retries ran out on failures that pass by themselves (timeouts, an
    /// unreachable handler, 408/429/502/503/504).
    TransientExhausted,
    /// It left the stream while it waited for a retry: no body is kept.
    Expired,
    /// A message no handler can take (no id, not JSON).
    BadMessage,
    /// The relay could not make a message of the row (a column it could not
    /// decode, a subject or header it cannot send).
    BadRow,
    /// Over a size limit (the server's, the stream's, the header block's).
    TooLarge,
    /// The server refused it for a reason of its own.
    Refused,
    /// Routed to a stream that does not exist, or is not the relay's.
    StreamMissing,
    /// Routed to a stream at its limits.
    StreamFull,
    /// A reason this version does not know (a newer writer's, or a hand's).
    Other,
}

impl Class {
    pub const ALL: [Class; 13] = [
        Class::SchemaInvalid,
        Class::SchemaMissing,
        Class::HandlerRejected,
        Class::HandlerFailed,
        Class::TransientExhausted,
        Class::Expired,
        Class::BadMessage,
        Class::BadRow,
        Class::TooLarge,
        Class::Refused,
        Class::StreamMissing,
        Class::StreamFull,
        Class::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Class::SchemaInvalid => "schema_invalid",
            Class::SchemaMissing => "schema_missing",
            Class::HandlerRejected => "handler_rejected",
            Class::HandlerFailed => "handler_failed",
            Class::TransientExhausted => "transient_exhausted",
            Class::Expired => "expired",
            Class::BadMessage => "bad_message",
            Class::BadRow => "bad_row",
            Class::TooLarge => "too_large",
            Class::Refused => "refused",
            Class::StreamMissing => "stream_missing",
            Class::StreamFull => "stream_full",
            Class::Other => "other",
        }
    }

    pub fn parse(s: &str) -> Option<Class> {
        Class::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// The class of a relay dead letter's reason.
    pub fn of_relay(reason: DlqReason) -> Class {
        match reason {
            DlqReason::InvalidSubject
            | DlqReason::SubjectOutsideStream
            | DlqReason::SubjectTooLong
            | DlqReason::InvalidHeader
            | DlqReason::BadRow => Class::BadRow,
            DlqReason::HeadersTooLarge | DlqReason::TooLarge => Class::TooLarge,
            DlqReason::Refused => Class::Refused,
            DlqReason::SchemaInvalid => Class::SchemaInvalid,
            DlqReason::SchemaMissing => Class::SchemaMissing,
            DlqReason::StreamMissing => Class::StreamMissing,
            DlqReason::StreamFull => Class::StreamFull,
        }
    }

    /// The class of a consumer dead letter's reason text (as
    /// `consumer::delivery` writes it).
    pub fn of_consumer(reason: &str) -> Class {
        let starts = |p: &str| reason.starts_with(p);
        if starts(DlqReason::SchemaInvalid.as_str()) {
            Class::SchemaInvalid
        } else if starts(DlqReason::SchemaMissing.as_str()) {
            Class::SchemaMissing
        } else if starts("expired:") {
            Class::Expired
        } else if starts("message has no ")
            || reason.ends_with(" is not a message id")
            || reason == "body is not JSON"
        {
            Class::BadMessage
        } else if let Some(last) = last_failure(reason) {
            if transient(last) {
                Class::TransientExhausted
            } else {
                Class::HandlerFailed
            }
        } else {
            // A 422, or a Rust handler's own words for a refusal.
            Class::HandlerRejected
        }
    }

    /// The class of a letter written before the class header: a
    /// consumer's (`consumer` set) by its reason text, the relay's by its
    /// reason word.
    pub fn of_reason(reason: &str, consumer: bool) -> Class {
        if consumer {
            return Class::of_consumer(reason);
        }
        DlqReason::ALL
            .into_iter()
            .find(|r| r.as_str() == reason)
            .map_or(Class::Other, Class::of_relay)
    }

    /// Whether `dlq replay` (and the console) can send it back through its
    /// consumer: a consumer's letter with a body to send. The relay's are
    /// rows: fixed and inserted again, or republished by `audit --repair`.
    pub fn replayable(self) -> bool {
        matches!(
            self,
            Class::SchemaInvalid
                | Class::SchemaMissing
                | Class::HandlerRejected
                | Class::HandlerFailed
                | Class::TransientExhausted
        )
    }

    /// The playbook's next step (seed 001).
    pub fn next_step(self) -> &'static str {
        match self {
            Class::SchemaInvalid => "Producer team: the payload fails its schema. Fix the producer (or the schema); replay once the payload or schema is fixed, or delete with sign-off.",
            Class::SchemaMissing => "Deploy the schema for this event type and version, then replay.",
            Class::HandlerRejected => "Poison for this consumer: the handler refused it. Ask the owning team; delete with sign-off, or replay once the handler accepts it.",
            Class::HandlerFailed => "A consumer bug: fix the handler and deploy, then replay the class.",
            Class::TransientExhausted => "Retries ran out on a passing failure (timeouts, an unreachable handler, 429/5xx). Replay once the dependency is healthy.",
            Class::Expired => "The message left its stream before its retry; no body is kept. Republish its window from the outbox (`outbox-relay audit --repair`), then delete the letter with sign-off.",
            Class::BadMessage => "No handler can take it (no message id, or not JSON): a producer bug. Fix the producer; delete with sign-off.",
            Class::BadRow => "The relay could not make a message of the row: fix the row's columns and insert it again as a new row; delete the letter with sign-off.",
            Class::TooLarge => "Over a size limit: shrink the event (or raise the stream's max_msg_size / the server's max_payload) and insert it again as a new row.",
            Class::Refused => "The server refused it (see the detail): fix the cause and insert the row again as a new row.",
            Class::StreamMissing => "Routed to a stream that does not exist or is not the relay's (--streams): create or add the stream, then insert the row again.",
            Class::StreamFull => "The routed stream is at its limits: raise them or let it drain, then insert the row again.",
            Class::Other => "An unknown cause: read the reason and detail.",
        }
    }
}

/// The failure that used the last delivery up, from a consumer's reason
/// "last delivery (N) failed: …".
fn last_failure(reason: &str) -> Option<&str> {
    let rest = reason.strip_prefix("last delivery (")?;
    let (_, failure) = rest.split_once(") failed: ")?;
    Some(failure)
}

/// Whether a handler call's failure passes by itself.
fn transient(failure: &str) -> bool {
    if failure.starts_with("handler timed out") || failure.starts_with("handler unreachable") {
        return true;
    }
    failure
        .strip_prefix("handler answered ")
        .and_then(|r| r.get(..3))
        .is_some_and(|code| matches!(code, "408" | "429" | "502" | "503" | "504"))
}

/// A short digest of a letter's cause: its class and its reason and detail
/// with what differs between letters of one cause taken out (ids, numbers,
/// quoted values), so letters of one cause share it.
pub fn fingerprint(class: Class, reason: &str, detail: Option<&str>) -> String {
    let mut h = Sha256::new();
    h.update(class.as_str().as_bytes());
    h.update([0]);
    h.update(normalize(reason).as_bytes());
    h.update([0]);
    h.update(normalize(detail.unwrap_or_default()).as_bytes());
    h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `text` with runs of digits, hex and quoted values replaced by a mark,
/// whitespace collapsed, at most 256 characters.
fn normalize(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(256));
    let mut chars = text.chars().peekable();
    let mut space = false;
    while let Some(c) = chars.next() {
        if out.chars().count() >= 256 {
            break;
        }
        if c.is_whitespace() {
            space = true;
            continue;
        }
        if space && !out.is_empty() {
            out.push(' ');
        }
        space = false;
        if c == '"' {
            // A quoted value: its content varies, its place does not.
            for q in chars.by_ref() {
                if q == '"' {
                    break;
                }
            }
            out.push_str("\"…\"");
        } else if c.is_ascii_hexdigit() {
            // Numbers, ids and hashes (a word of hex digits and dashes that
            // holds a digit); a word of letters (`bad`, `face`) stays.
            let mut word = String::from(c);
            while let Some(&n) = chars.peek() {
                if n.is_ascii_hexdigit() || n == '-' {
                    word.push(n);
                    chars.next();
                } else {
                    break;
                }
            }
            let follows_letter = chars
                .peek()
                .is_some_and(|n| n.is_alphanumeric() || *n == '_');
            if word.chars().any(|w| w.is_ascii_digit()) && !follows_letter {
                out.push('#');
            } else {
                out.push_str(&word);
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A letter's class and fingerprint: from its headers when it has them,
/// else from its reason (and detail) as written before they were.
pub fn of_letter(
    class: Option<&str>,
    fingerprint_header: Option<&str>,
    reason: &str,
    detail: Option<&str>,
    consumer: bool,
) -> (Class, String) {
    let class = class
        .and_then(Class::parse)
        .unwrap_or_else(|| Class::of_reason(reason, consumer));
    let fp = fingerprint_header
        .filter(|f| !f.is_empty() && f.len() <= 64)
        .map(str::to_owned)
        .unwrap_or_else(|| fingerprint(class, reason, detail));
    (class, fp)
}

/// The two headers a dead letter carries for its cause.
pub fn headers(class: Class, reason: &str, detail: Option<&str>) -> [(&'static str, String); 2] {
    [
        (wire::DLQ_CLASS, class.as_str().to_owned()),
        (wire::DLQ_FINGERPRINT, fingerprint(class, reason, detail)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumer_reasons_are_classed_as_the_playbook_triages_them() {
        let cases = [
            (
                "schema_invalid: /amount: \"x\" is not of type \"number\"",
                Class::SchemaInvalid,
            ),
            (
                "schema_missing: no schema for order.placed version 2",
                Class::SchemaMissing,
            ),
            (
                "handler answered 422: {\"error\":\"unknown sku\"}",
                Class::HandlerRejected,
            ),
            ("the sku is retired", Class::HandlerRejected),
            (
                "last delivery (5) failed: handler answered 500: boom",
                Class::HandlerFailed,
            ),
            (
                "last delivery (5) failed: the handler panicked: index out of bounds",
                Class::HandlerFailed,
            ),
            (
                "last delivery (5) failed: handler answered 503: busy",
                Class::TransientExhausted,
            ),
            (
                "last delivery (5) failed: handler answered 429: slow down",
                Class::TransientExhausted,
            ),
            (
                "last delivery (5) failed: handler timed out",
                Class::TransientExhausted,
            ),
            (
                "last delivery (5) failed: handler unreachable (http://h): connection refused",
                Class::TransientExhausted,
            ),
            (
                "expired: left the stream before its retry (max age or limits); last error: none",
                Class::Expired,
            ),
            ("message has no Nats-Msg-Id", Class::BadMessage),
            ("Nats-Msg-Id \"x\" is not a message id", Class::BadMessage),
            ("body is not JSON", Class::BadMessage),
        ];
        for (reason, class) in cases {
            assert_eq!(Class::of_consumer(reason), class, "{reason}");
            assert_eq!(Class::of_reason(reason, true), class, "{reason}");
        }
    }

    #[test]
    fn every_relay_reason_has_a_class_and_every_class_a_name_and_a_step() {
        for r in DlqReason::ALL {
            assert_ne!(Class::of_reason(r.as_str(), false), Class::Other, "{r:?}");
        }
        assert_eq!(Class::of_reason("something new", false), Class::Other);
        for c in Class::ALL {
            assert_eq!(Class::parse(c.as_str()), Some(c));
            assert!(!c.next_step().is_empty());
        }
    }

    #[test]
    fn letters_of_one_cause_share_a_fingerprint_and_other_causes_do_not() {
        let fp = |r: &str| fingerprint(Class::of_consumer(r), r, None);
        assert_eq!(
            fp("handler answered 422: {\"sku\":\"A-1\",\"order\":17}"),
            fp("handler answered 422: {\"sku\":\"B-22\",\"order\":90210}"),
        );
        assert_eq!(
            fp("last delivery (5) failed: handler answered 500: order 7f3c2a1e-0b9d-4c5e-8f6a-1b2c3d4e5f60 failed"),
            fp("last delivery (12) failed: handler answered 500: order 00000000-1111-4222-8333-444444444444 failed"),
        );
        assert_ne!(
            fp("last delivery (5) failed: handler answered 500: boom"),
            fp("last delivery (5) failed: handler answered 500: bang"),
        );
        assert_ne!(
            fp("last delivery (5) failed: handler answered 503: x"),
            fp("last delivery (5) failed: handler answered 500: x"),
            "the class is part of it"
        );
        // Words of hex letters are words, not ids.
        assert_ne!(normalize("bad face"), normalize("dead beef"));
        assert_eq!(normalize("a  b\n c"), "a b c");
    }

    #[test]
    fn headers_win_over_the_reason_and_old_letters_are_classed_from_it() {
        let (c, fp) = of_letter(
            Some("handler_failed"),
            Some("abc"),
            "body is not JSON",
            None,
            true,
        );
        assert_eq!((c, fp.as_str()), (Class::HandlerFailed, "abc"));
        let (c, fp) = of_letter(None, None, "body is not JSON", None, true);
        assert_eq!(c, Class::BadMessage);
        assert_eq!(fp, fingerprint(Class::BadMessage, "body is not JSON", None));
        // An unknown class word (a newer writer's) falls back to the reason.
        let (c, _) = of_letter(Some("from_the_future"), None, "too_large", None, false);
        assert_eq!(c, Class::TooLarge);
    }

    proptest::proptest! {
        #[test]
        fn any_reason_has_one_class_and_a_short_fingerprint(reason in ".{0,400}", detail in proptest::option::of(".{0,200}")) {
            let c = Class::of_consumer(&reason);
            let fp = fingerprint(c, &reason, detail.as_deref());
            proptest::prop_assert_eq!(fp.len(), 16);
            proptest::prop_assert!(normalize(&reason).chars().count() <= 256 + 3);
        }
    }
}
