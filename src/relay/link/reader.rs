//! The link's reader: the NATS protocol parsed off the socket (`MSG`,
//! `HMSG`, `INFO`, `PING`, `PONG`, `+OK`, `-ERR`), answers sorted into the
//! queues by their reply subject, the server's PINGs answered.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use async_nats::StatusCode;
use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio_util::sync::CancellationToken;

use super::super::answer;
use super::error::LinkError;
use super::queues::{InfoUpdate, Shared, COMMIT};

/// A control line (INFO lists a cluster's URLs) longer than this is not
/// NATS.
pub(super) const MAX_LINE: usize = 1 << 20;

pub(super) type Reader = Box<dyn AsyncRead + Send + Unpin>;

/// Whether the server closes the connection after this `-ERR` (so the
/// link ends now, with the server's words as the reason). A permission
/// refusal keeps the connection; so may an error we do not know.
pub(super) fn closes_connection(err: &str) -> bool {
    const CLOSING: [&str; 9] = [
        "authorization violation",
        "stale connection",
        "slow consumer",
        "maximum payload violation",
        "user authentication expired",
        "user authentication revoked",
        "account authentication expired",
        "maximum connections exceeded",
        "unknown protocol operation",
    ];
    let err = err.trim().trim_matches('\'').to_ascii_lowercase();
    CLOSING.iter().any(|c| err.starts_with(c))
}

/// Read answers (and the server's PINGs) until stopped or the connection
/// ends. Always reading, idle or not, keeps the server from closing the
/// connection as stale and notices a closed one before the next publish.
/// Answers wait at most a window's worth (each copy sent is answered once).
pub(super) async fn read_in(
    shared: Arc<Shared>,
    mut r: Reader,
    mut rbuf: BytesMut,
    prefix: String,
    stop: CancellationToken,
) {
    loop {
        let op = tokio::select! {
            _ = stop.cancelled() => return,
            op = next_op(&mut r, &mut rbuf) => op,
        };
        shared.heard.fetch_add(1, Ordering::Relaxed);
        match op {
            Ok(Op::Msg {
                subject,
                status,
                payload,
            }) => {
                let status = status.and_then(|s| StatusCode::from_u16(s).ok());
                let tail = std::str::from_utf8(&subject)
                    .ok()
                    .and_then(|s| s.strip_prefix(prefix.as_str()));
                if let Some(tail) = tail {
                    if let Some(token) = tail.strip_prefix(COMMIT as char) {
                        if let Ok(token) = token.parse() {
                            shared.commit_answer(token, answer::read_commit(status, &payload));
                        }
                    } else if let Ok(token) = tail.parse() {
                        shared.answer(token, answer::read(status, &payload));
                    }
                }
            }
            Ok(Op::Ping) => {
                shared.push(|s| s.buf.extend_from_slice(b"PONG\r\n"));
            }
            Ok(Op::Err(text)) => match denied_subject(&text) {
                // For a message sent before a barrier: forgotten since.
                Some(subject) if shared.barrier_pending() => {
                    tracing::debug!(subject, "a refusal of a forgotten copy; ignored");
                }
                // The server keeps the connection and never answers the
                // message: only this line says it went nowhere.
                Some(subject) => shared.deny(subject.to_owned()),
                None if closes_connection(&text) => {
                    tracing::warn!(error = %text, "NATS closes the publish connection; what it did not answer is sent again on a new one");
                    shared.close(format!("the server said {text}"));
                    return;
                }
                None => {
                    tracing::warn!(error = %text, "NATS refused something on the publish connection")
                }
            },
            Ok(Op::Info(json)) => {
                let info = InfoUpdate::read(&json);
                if let Some(max) = info.max_payload {
                    shared.max_payload.store(max, Ordering::Relaxed);
                }
                if !info.connect_urls.is_empty() {
                    if let Ok(mut a) = shared.announced.lock() {
                        a.extend(info.connect_urls);
                    }
                }
                if info.ldm && !shared.lame_duck.swap(true, Ordering::Relaxed) {
                    tracing::info!("the NATS server is leaving (lame duck mode): the publish connection moves to another server once its answers are in");
                }
            }
            Ok(Op::Pong) => {
                if let Ok(mut p) = shared.pings.lock() {
                    p.pop_front();
                }
            }
            Ok(Op::Ok) => {}
            Err(e) => {
                shared.close(e.to_string());
                return;
            }
        }
    }
}

/// The subject of a publish the server refused for the user's permissions
/// (`Permissions Violation for Publish to "<subject>"`; older servers leave
/// out the quotes).
pub fn denied_subject(err: &str) -> Option<&str> {
    const PREFIX: &str = "permissions violation for publish to ";
    let head = err.get(..PREFIX.len())?;
    if !head.eq_ignore_ascii_case(PREFIX) {
        return None;
    }
    let subject = err[PREFIX.len()..].trim().trim_matches('"');
    // A reply subject the user may not publish to is named after the
    // subject: `… to "s" using reply subject "r"`.
    let subject = subject.split('"').next().unwrap_or(subject).trim();
    (!subject.is_empty()).then_some(subject)
}

/// One protocol operation off the socket, read into `rbuf` as needed.
pub(super) async fn next_op<R: AsyncRead + Unpin + ?Sized>(
    reader: &mut R,
    rbuf: &mut BytesMut,
) -> Result<Op, LinkError> {
    loop {
        if let Some((op, used)) = parse(rbuf).map_err(LinkError::Protocol)? {
            rbuf.advance(used);
            return Ok(op);
        }
        if rbuf.capacity() - rbuf.len() < 16 * 1024 {
            rbuf.reserve(64 * 1024);
        }
        let n = reader
            .read_buf(rbuf)
            .await
            .map_err(|source| LinkError::Io {
                server: "publish connection".into(),
                source,
            })?;
        if n == 0 {
            return Err(LinkError::Closed);
        }
    }
}

/// A server operation; payloads are copied out (acks are small).
#[derive(Debug, PartialEq, Eq)]
pub enum Op {
    Msg {
        subject: Vec<u8>,
        /// `HMSG`'s status line code (`503`: no responders).
        status: Option<u16>,
        payload: Vec<u8>,
    },
    Info(Vec<u8>),
    Ping,
    Pong,
    Ok,
    Err(String),
}

impl Op {
    pub(super) fn name(&self) -> &'static str {
        match self {
            Op::Msg { .. } => "MSG",
            Op::Info(_) => "INFO",
            Op::Ping => "PING",
            Op::Pong => "PONG",
            Op::Ok => "+OK",
            Op::Err(_) => "-ERR",
        }
    }
}

/// The first complete operation in `buf` and the bytes it takes, or
/// `None` until more arrives.
pub fn parse(buf: &[u8]) -> Result<Option<(Op, usize)>, String> {
    let Some(eol) = buf.windows(2).position(|w| w == b"\r\n") else {
        if buf.len() > MAX_LINE {
            return Err(format!("a control line over {MAX_LINE} bytes"));
        }
        return Ok(None);
    };
    let line = &buf[..eol];
    let after = eol + 2;
    let (verb, rest) = match line.iter().position(|&b| b == b' ' || b == b'\t') {
        Some(i) => (&line[..i], &line[i + 1..]),
        None => (line, &line[line.len()..]),
    };
    let upper = verb.to_ascii_uppercase();
    let op = match upper.as_slice() {
        b"PING" => Op::Ping,
        b"PONG" => Op::Pong,
        b"+OK" => Op::Ok,
        b"-ERR" => Op::Err(
            String::from_utf8_lossy(rest)
                .trim()
                .trim_matches('\'')
                .to_owned(),
        ),
        b"INFO" => Op::Info(rest.to_vec()),
        b"MSG" | b"HMSG" => {
            let fields: Vec<&[u8]> = rest
                .split(|&b| b == b' ' || b == b'\t')
                .filter(|f| !f.is_empty())
                .collect();
            let number = |f: &[u8]| -> Result<usize, String> {
                std::str::from_utf8(f)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| format!("bad size in {:?}", String::from_utf8_lossy(line)))
            };
            let headed = upper.as_slice() == b"HMSG";
            // MSG subject sid [reply] size; HMSG subject sid [reply] hdr total.
            let sizes = if headed { 2 } else { 1 };
            if fields.len() < 2 + sizes || fields.len() > 3 + sizes {
                return Err(format!("bad {:?}", String::from_utf8_lossy(line)));
            }
            let total = number(fields[fields.len() - 1])?;
            let header_len = if headed {
                number(fields[fields.len() - 2])?
            } else {
                0
            };
            if header_len > total {
                return Err(format!("bad sizes in {:?}", String::from_utf8_lossy(line)));
            }
            let end = after + total;
            if buf.len() < end + 2 {
                return Ok(None);
            }
            if &buf[end..end + 2] != b"\r\n" {
                return Err(format!(
                    "no CRLF after the payload of {:?}",
                    String::from_utf8_lossy(line)
                ));
            }
            let status = headed
                .then(|| status_of(&buf[after..after + header_len]))
                .flatten();
            return Ok(Some((
                Op::Msg {
                    subject: fields[0].to_vec(),
                    status,
                    payload: buf[after + header_len..end].to_vec(),
                },
                end + 2,
            )));
        }
        _ => {
            return Err(format!(
                "unknown operation {:?}",
                String::from_utf8_lossy(&line[..line.len().min(64)])
            ))
        }
    };
    Ok(Some((op, after)))
}

/// The code on a header block's `NATS/1.0 <code> [text]` line.
pub(super) fn status_of(block: &[u8]) -> Option<u16> {
    let first = block.split(|&b| b == b'\r').next()?;
    let rest = first.strip_prefix(crate::wire::HEADER_VERSION_LINE.trim_end().as_bytes())?;
    let code = rest.split(|&b| b == b' ').find(|f| !f.is_empty())?;
    std::str::from_utf8(code).ok()?.parse().ok()
}
