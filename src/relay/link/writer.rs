//! The link's writer: `HPUB`s encoded straight into one buffer (large
//! bodies written from their own bytes), written out each time the buffer
//! fills from empty; and the keepalive that gives up a silent connection.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::queues::{Reply, Shared, COMMIT, COPY_MAX};

pub(super) type Writer = Box<dyn AsyncWrite + Send + Unpin>;

/// Write whatever gathered, each time the buffer fills from empty, until
/// stopped or the connection fails. The buffer holds only what the
/// publisher's window lets in flight, so it is bounded in bytes and count
/// by `--max-inflight-bytes` and `--max-inflight`.
pub(super) async fn write_out(shared: Arc<Shared>, mut w: Writer, stop: CancellationToken) {
    const KEEP: usize = 256 * 1024;
    let mut spare = Vec::with_capacity(64 * 1024);
    let mut bodies = Vec::new();
    let mut check = tokio::time::interval(KEEPALIVE_TICK);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut quiet = Quiet::default();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = shared.wrote.notified() => {}
            _ = check.tick() => {
                if !quiet.tick(&shared) {
                    return;
                }
                continue;
            }
        }
        loop {
            let fenced = shared
                .fence
                .get()
                .is_some_and(|f| !f.holds(tokio::time::Instant::now()));
            if fenced {
                shared.close("the relay was paused: nothing queued before it is sent".into());
                return;
            }
            match shared.out.lock() {
                Ok(mut s) if !s.buf.is_empty() => {
                    std::mem::swap(&mut s.buf, &mut spare);
                    std::mem::swap(&mut s.bodies, &mut bodies);
                }
                _ => break,
            }
            let written = tokio::select! {
                _ = stop.cancelled() => return,
                r = async {
                    let mut at = 0;
                    for (offset, body) in &bodies {
                        send_all(&mut w, &spare[at..*offset], &shared.written).await?;
                        send_all(&mut w, body, &shared.written).await?;
                        at = *offset;
                    }
                    send_all(&mut w, &spare[at..], &shared.written).await?;
                    w.flush().await
                } => r,
            };
            spare.clear();
            bodies.clear();
            // A burst of large rows must not pin its size for the session.
            spare.shrink_to(KEEP);
            if let Err(e) = written {
                shared.close(format!("writing: {e}"));
                return;
            }
        }
    }
}

/// An idle link asks the server for a PONG after this long without a word
/// from it, and takes it for dead after twice this: a black-holed path is
/// replaced before the next event needs it, not found by that event's
/// stall. (The server pings an idle client only every two minutes.)
pub(super) const KEEPALIVE: Duration = Duration::from_secs(5);

pub(super) const KEEPALIVE_TICK: Duration = Duration::from_millis(2_500);

/// The keepalive's count of ticks with nothing heard.
#[derive(Default)]
pub(super) struct Quiet {
    pub(super) heard: u64,
    pub(super) ticks: u32,
}

impl Quiet {
    /// One tick: `false` once the link is closed (silent too long).
    pub(super) fn tick(&mut self, shared: &Shared) -> bool {
        let heard = shared.heard.load(Ordering::Relaxed);
        if heard != self.heard {
            self.heard = heard;
            self.ticks = 0;
        } else {
            self.ticks += 1;
        }
        let silent = KEEPALIVE_TICK * self.ticks;
        if silent >= 2 * KEEPALIVE {
            let why = format!(
                "no word from the server for {silent:?}, a PING unanswered: the connection is taken for dead"
            );
            tracing::warn!("{why}; the next event goes on a new one");
            shared.close(why);
            return false;
        }
        let waiting = shared.pings.lock().is_ok_and(|p| !p.is_empty());
        if silent >= KEEPALIVE && !waiting {
            return shared.ping(false);
        }
        !shared.broken()
    }
}

/// `write_all`, counting each partial write: a large write in progress
/// shows as progress ([`Link::still_sending`]).
pub(super) async fn send_all(
    w: &mut Writer,
    mut buf: &[u8],
    written: &AtomicU64,
) -> std::io::Result<()> {
    while !buf.is_empty() {
        let n = w.write(buf).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        written.fetch_add(n as u64, Ordering::Relaxed);
        buf = &buf[n..];
    }
    Ok(())
}

/// The message's headers, then `extra`, as header lines.
pub(super) fn header_block_len(
    headers: &[(Cow<'static, str>, String)],
    extra: &[(&str, &str)],
) -> usize {
    crate::wire::header_block_size(
        headers
            .iter()
            .map(|(k, v)| (k.as_ref(), v.as_str()))
            .chain(extra.iter().copied()),
    )
}

/// `HPUB <subject> [<reply>] <header bytes> <total bytes>` and the header
/// block (the message's headers, then `extra`); the body and a CRLF
/// follow. Names and values were checked for CR/LF when routed.
pub(super) fn encode_head(
    out: &mut Vec<u8>,
    subject: &str,
    prefix: &str,
    reply: Reply,
    headers: &[(Cow<'static, str>, String)],
    extra: &[(&str, &str)],
    body_len: usize,
) {
    let block = header_block_len(headers, extra);
    out.reserve(subject.len() + prefix.len() + 64 + block + body_len.min(COPY_MAX));
    out.extend_from_slice(b"HPUB ");
    out.extend_from_slice(subject.as_bytes());
    out.push(b' ');
    match reply {
        Reply::None => {}
        Reply::Ack(token) | Reply::Commit(token) => {
            out.extend_from_slice(prefix.as_bytes());
            if matches!(reply, Reply::Commit(_)) {
                out.push(COMMIT);
            }
            push_decimal(out, token as usize);
            out.push(b' ');
        }
    }
    push_decimal(out, block);
    out.push(b' ');
    push_decimal(out, block + body_len);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(crate::wire::HEADER_VERSION_LINE.as_bytes());
    let mut line = |k: &str, v: &str| {
        out.extend_from_slice(k.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(v.as_bytes());
        out.extend_from_slice(b"\r\n");
    };
    for (k, v) in headers {
        line(k, v);
    }
    for (k, v) in extra {
        line(k, v);
    }
    out.extend_from_slice(b"\r\n");
}

/// One per-event message as the link writes it (for the per-event bench).
#[cfg(any(test, feature = "testing"))]
pub fn encode_message(
    out: &mut Vec<u8>,
    msg: &super::super::route::OutMessage,
    chain: Option<&str>,
) {
    let chain = chain.map(|id| (crate::wire::EXPECTED_LAST_MSG_ID, id));
    encode_head(
        out,
        &msg.subject,
        "_INBOX.0123456789abcdef0123456789abcdef.",
        Reply::Ack(1_000_000),
        &msg.headers,
        chain.as_slice(),
        msg.body.len(),
    );
    out.extend_from_slice(&msg.body);
    out.extend_from_slice(b"\r\n");
}

pub(super) fn push_decimal(out: &mut Vec<u8>, mut n: usize) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}
