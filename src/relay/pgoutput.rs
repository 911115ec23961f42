//! Decoder for the pgoutput logical replication messages the relay needs.
//!
//! `pgwire-replication` parses the transport and the Begin/Commit/Message
//! boundaries; every other pgoutput message reaches us as raw `XLogData`
//! bytes. We decode Relation (the table's column names and types, resent after
//! every `ALTER TABLE` and on each new session) and Insert (the new tuple).
//! Everything else is reported as [`Message::Other`] so a publication that
//! grows to include updates or truncates never stops the relay.
//!
//! Values are returned as zero-copy slices of the message buffer. This module
//! does no I/O and allocates only the column list of a Relation.
//!
//! Wire format: <https://www.postgresql.org/docs/15/protocol-logicalrep-message-formats.html>
//! (protocol version 1; the relay does not request streaming of in-progress
//! transactions, so no xid prefixes appear).

use bytes::Bytes;

/// Postgres type OIDs the outbox columns may use.
pub mod oid {
    pub const BOOL: u32 = 16;
    pub const BYTEA: u32 = 17;
    pub const INT8: u32 = 20;
    pub const INT2: u32 = 21;
    pub const INT4: u32 = 23;
    pub const TEXT: u32 = 25;
    pub const JSON: u32 = 114;
    pub const BPCHAR: u32 = 1042;
    pub const VARCHAR: u32 = 1043;
    pub const TIMESTAMP: u32 = 1114;
    pub const TIMESTAMPTZ: u32 = 1184;
    pub const UUID: u32 = 2950;
    pub const JSONB: u32 = 3802;
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("pgoutput {message}: truncated at byte {offset} (needed {needed} more)")]
    Truncated {
        message: &'static str,
        offset: usize,
        needed: usize,
    },
    #[error("pgoutput {message}: {detail}")]
    Invalid {
        message: &'static str,
        detail: String,
    },
    #[error("pgoutput: empty XLogData payload")]
    Empty,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Part of the replica identity (key) — informational only.
    pub key: bool,
    pub name: String,
    pub type_oid: u32,
    pub type_modifier: i32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub id: u32,
    pub namespace: String,
    pub name: String,
    pub replica_identity: u8,
    pub columns: Vec<Column>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Null,
    /// An unchanged TOASTed value; cannot occur in an Insert, but the format allows it.
    Unchanged,
    Text(Bytes),
    Binary(Bytes),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    pub relation_id: u32,
    pub values: Vec<Value>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Relation(Relation),
    Insert(Insert),
    /// Any other pgoutput message (Update, Delete, Truncate, Type, Origin, …), by tag.
    Other(u8),
}

/// Decode one pgoutput message (the payload of an `XLogData`).
pub fn decode(data: &Bytes) -> Result<Message, DecodeError> {
    let (&tag, _) = data.split_first().ok_or(DecodeError::Empty)?;
    match tag {
        b'R' => decode_relation(data).map(Message::Relation),
        b'I' => decode_insert(data).map(Message::Insert),
        other => Ok(Message::Other(other)),
    }
}

struct Reader<'a> {
    buf: &'a Bytes,
    pos: usize,
    message: &'static str,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a Bytes, message: &'static str) -> Self {
        // Skip the tag byte.
        Self {
            buf,
            pos: 1,
            message,
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let remaining = self.buf.len() - self.pos;
        if remaining < n {
            return Err(DecodeError::Truncated {
                message: self.message,
                offset: self.pos,
                needed: n - remaining,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn i16(&mut self) -> Result<i16, DecodeError> {
        let b = self.take(2)?;
        Ok(i16::from_be_bytes([b[0], b[1]]))
    }

    fn i32(&mut self) -> Result<i32, DecodeError> {
        let b = self.take(4)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn cstring(&mut self) -> Result<String, DecodeError> {
        let rest = &self.buf[self.pos..];
        let len = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| self.invalid("string without NUL terminator".into()))?;
        let s = std::str::from_utf8(&rest[..len])
            .map_err(|e| self.invalid(format!("string is not UTF-8: {e}")))?
            .to_owned();
        self.pos += len + 1;
        Ok(s)
    }

    fn bytes(&mut self, n: usize) -> Result<Bytes, DecodeError> {
        let start = self.pos;
        self.take(n)?;
        Ok(self.buf.slice(start..start + n))
    }

    fn invalid(&self, detail: String) -> DecodeError {
        DecodeError::Invalid {
            message: self.message,
            detail,
        }
    }

    fn finish(&self) -> Result<(), DecodeError> {
        if self.pos != self.buf.len() {
            return Err(self.invalid(format!("{} trailing bytes", self.buf.len() - self.pos)));
        }
        Ok(())
    }
}

fn decode_relation(data: &Bytes) -> Result<Relation, DecodeError> {
    let mut r = Reader::new(data, "Relation");
    let id = r.u32()?;
    let namespace = r.cstring()?;
    let name = r.cstring()?;
    let replica_identity = r.u8()?;
    let ncols = r.i16()?;
    let ncols = usize::try_from(ncols).map_err(|_| r.invalid(format!("{ncols} columns")))?;
    // Each column takes at least 10 bytes; refuse counts the buffer cannot hold
    // before allocating for them.
    if ncols > data.len() / 10 + 1 {
        return Err(r.invalid(format!("{ncols} columns in {} bytes", data.len())));
    }
    let mut columns = Vec::with_capacity(ncols);
    for _ in 0..ncols {
        let flags = r.u8()?;
        let name = r.cstring()?;
        let type_oid = r.u32()?;
        let type_modifier = r.i32()?;
        columns.push(Column {
            key: flags & 1 == 1,
            name,
            type_oid,
            type_modifier,
        });
    }
    r.finish()?;
    Ok(Relation {
        id,
        namespace,
        name,
        replica_identity,
        columns,
    })
}

fn decode_insert(data: &Bytes) -> Result<Insert, DecodeError> {
    let mut r = Reader::new(data, "Insert");
    let relation_id = r.u32()?;
    let marker = r.u8()?;
    if marker != b'N' {
        return Err(r.invalid(format!("expected new-tuple marker 'N', got {marker:#04x}")));
    }
    let values = decode_tuple(&mut r)?;
    r.finish()?;
    Ok(Insert {
        relation_id,
        values,
    })
}

fn decode_tuple(r: &mut Reader<'_>) -> Result<Vec<Value>, DecodeError> {
    let ncols = r.i16()?;
    let ncols = usize::try_from(ncols).map_err(|_| r.invalid(format!("{ncols} tuple columns")))?;
    if ncols > r.buf.len() {
        return Err(r.invalid(format!("{ncols} tuple columns in {} bytes", r.buf.len())));
    }
    let mut values = Vec::with_capacity(ncols);
    for _ in 0..ncols {
        let kind = r.u8()?;
        let value = match kind {
            b'n' => Value::Null,
            b'u' => Value::Unchanged,
            b't' | b'b' => {
                let len = r.i32()?;
                let len = usize::try_from(len)
                    .map_err(|_| r.invalid(format!("negative value length {len}")))?;
                let bytes = r.bytes(len)?;
                if kind == b't' {
                    Value::Text(bytes)
                } else {
                    Value::Binary(bytes)
                }
            }
            other => return Err(r.invalid(format!("unknown tuple value kind {other:#04x}"))),
        };
        values.push(value);
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{self, encode};
    use proptest::prelude::*;

    fn rel() -> Relation {
        testing::outbox_relation(16384)
    }

    #[test]
    fn relation_round_trips() {
        let r = rel();
        let bytes = Bytes::from(encode::relation(&r));
        assert_eq!(decode(&bytes).unwrap(), Message::Relation(r));
    }

    #[test]
    fn insert_with_text_binary_and_null() {
        let values = vec![
            Value::Text(Bytes::from_static(b"abc")),
            Value::Binary(Bytes::from_static(&[1, 2, 3])),
            Value::Null,
            Value::Text(Bytes::new()),
        ];
        let bytes = Bytes::from(encode::insert(7, &values));
        assert_eq!(
            decode(&bytes).unwrap(),
            Message::Insert(Insert {
                relation_id: 7,
                values
            })
        );
    }

    #[test]
    fn insert_bytes_laid_out_by_hand() {
        // Written byte by byte from the protocol docs, independent of `encode`.
        let raw: &[u8] = b"I\x00\x00\x40\x06N\x00\x02t\x00\x00\x00\x011n";
        let m = decode(&Bytes::from_static(raw)).unwrap();
        assert_eq!(
            m,
            Message::Insert(Insert {
                relation_id: 0x4006,
                values: vec![Value::Text(Bytes::from_static(b"1")), Value::Null]
            })
        );
    }

    #[test]
    fn other_messages_are_reported_not_rejected() {
        for tag in [b'U', b'D', b'T', b'Y', b'O'] {
            let bytes = Bytes::from(vec![tag, 0, 0]);
            assert_eq!(decode(&bytes).unwrap(), Message::Other(tag));
        }
    }

    #[test]
    fn errors_are_typed() {
        assert_eq!(decode(&Bytes::new()), Err(DecodeError::Empty));
        let truncated = Bytes::from_static(b"I\x00\x00");
        assert!(matches!(
            decode(&truncated),
            Err(DecodeError::Truncated {
                message: "Insert",
                ..
            })
        ));
        let bad_marker = Bytes::from_static(b"I\x00\x00\x00\x01K\x00\x00");
        assert!(matches!(
            decode(&bad_marker),
            Err(DecodeError::Invalid {
                message: "Insert",
                ..
            })
        ));
        let negative_len = Bytes::from_static(b"I\x00\x00\x00\x01N\x00\x01t\xff\xff\xff\xff");
        assert!(matches!(
            decode(&negative_len),
            Err(DecodeError::Invalid { .. })
        ));
        let trailing = Bytes::from_static(b"I\x00\x00\x00\x01N\x00\x00X");
        assert!(matches!(
            decode(&trailing),
            Err(DecodeError::Invalid { .. })
        ));
    }

    fn value_strategy() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            Just(Value::Unchanged),
            proptest::collection::vec(any::<u8>(), 0..64).prop_map(|v| Value::Text(v.into())),
            proptest::collection::vec(any::<u8>(), 0..64).prop_map(|v| Value::Binary(v.into())),
        ]
    }

    fn relation_strategy() -> impl Strategy<Value = Relation> {
        let column = (
            "[a-z_][a-z0-9_]{0,20}",
            any::<u32>(),
            any::<i32>(),
            any::<bool>(),
        )
            .prop_map(|(name, type_oid, type_modifier, key)| Column {
                key,
                name,
                type_oid,
                type_modifier,
            });
        (
            any::<u32>(),
            "[a-z]{1,10}",
            "[a-z_]{1,20}",
            prop_oneof![Just(b'd'), Just(b'f'), Just(b'i'), Just(b'n')],
            proptest::collection::vec(column, 0..20),
        )
            .prop_map(
                |(id, namespace, name, replica_identity, columns)| Relation {
                    id,
                    namespace,
                    name,
                    replica_identity,
                    columns,
                },
            )
    }

    proptest! {
        #[test]
        fn insert_round_trips(rel_id in any::<u32>(), values in proptest::collection::vec(value_strategy(), 0..30)) {
            let bytes = Bytes::from(encode::insert(rel_id, &values));
            prop_assert_eq!(decode(&bytes).unwrap(), Message::Insert(Insert { relation_id: rel_id, values }));
        }

        #[test]
        fn relation_round_trips_prop(r in relation_strategy()) {
            let bytes = Bytes::from(encode::relation(&r));
            prop_assert_eq!(decode(&bytes).unwrap(), Message::Relation(r));
        }

        /// Any prefix of a valid message is an error, never a panic or a wrong value.
        #[test]
        fn truncation_is_an_error(values in proptest::collection::vec(value_strategy(), 1..10), cut in any::<prop::sample::Index>()) {
            let full = encode::insert(1, &values);
            let cut = 1 + cut.index(full.len() - 1);
            let bytes = Bytes::from(full[..cut].to_vec());
            prop_assert!(decode(&bytes).is_err());
        }

        /// Arbitrary bytes never panic the decoder.
        #[test]
        fn garbage_never_panics(tag in prop_oneof![Just(b'R'), Just(b'I'), any::<u8>()], rest in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut v = vec![tag];
            v.extend(rest);
            let _ = decode(&Bytes::from(v));
        }
    }
}
