//! The link's unit tests: its parts against in-memory pipes.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::context::PublishErrorKind;
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::dial::*;
use super::error::LinkError;
use super::handle::*;
use super::queues::*;
use super::reader::*;
use super::writer::*;
use proptest::prelude::*;

fn headers() -> Vec<(Cow<'static, str>, String)> {
    vec![
        (Cow::Borrowed("Nats-Msg-Id"), "e1".to_owned()),
        (
            Cow::Owned("Outbox-Event-Type".to_owned()),
            "tick".to_owned(),
        ),
    ]
}

/// A link whose writer writes to `ours` (nothing reads for it).
fn writing_link(shared: &Arc<Shared>, ours: tokio::io::DuplexStream) -> Link {
    let stop = CancellationToken::new();
    tokio::spawn(write_out(shared.clone(), Box::new(ours), stop.clone()));
    Link {
        shared: shared.clone(),
        _tasks: stop.drop_guard(),
        prefix: "_I.".into(),
        sent_mark: 0,
        server: "test".into(),
    }
}

/// The `HPUB` line and header block of a message with [`headers`] and
/// `extra`, to `subject` answered under `prefix` as `reply`.
fn head(
    (subject, prefix, reply): (&str, &str, Reply),
    extra: &[(&str, &str)],
    body_len: usize,
) -> Vec<u8> {
    let mut out = Vec::new();
    encode_head(
        &mut out,
        subject,
        prefix,
        reply,
        &headers(),
        extra,
        body_len,
    );
    out
}

#[test]
fn an_hpub_carries_its_header_block_and_body_with_their_sizes() {
    let mut out = head(
        ("ctx.load", "_INBOX.x.", Reply::Ack(42)),
        &[("Nats-Expected-Last-Msg-Id", "e0")],
        2,
    );
    out.extend_from_slice(b"{}\r\n");
    let block = "NATS/1.0\r\nNats-Msg-Id: e1\r\nOutbox-Event-Type: tick\r\nNats-Expected-Last-Msg-Id: e0\r\n\r\n";
    let want = format!(
        "HPUB ctx.load _INBOX.x.42 {} {}\r\n{block}{{}}\r\n",
        block.len(),
        block.len() + 2
    );
    assert_eq!(String::from_utf8(out).unwrap(), want);
    assert_eq!(
        header_block_len(&headers(), &[("Nats-Expected-Last-Msg-Id", "e0")]),
        block.len()
    );
}

/// Small bodies are copied into the buffer, large ones written from
/// their own bytes at their place: the stream is the same.
#[tokio::test]
async fn the_writer_puts_large_bodies_in_their_place() {
    let shared = Arc::new(Shared::new(1 << 20, Arc::default()));
    let (ours, mut theirs) = tokio::io::duplex(1 << 20);
    let big = Bytes::from(vec![b'b'; COPY_MAX + 1]);
    let mut link = writing_link(&shared, ours);
    let mut want = Vec::new();
    let extra = [("Nats-Batch-Id", "b1")];
    for (reply, body) in [
        (Reply::Ack(1), Bytes::from_static(b"s1")),
        (Reply::None, big.clone()),
        (Reply::Commit(3), Bytes::from_static(b"s3")),
    ] {
        assert!(link.publish("a.b", reply, &headers(), &extra, &body));
        encode_head(
            &mut want,
            "a.b",
            "_I.",
            reply,
            &headers(),
            &extra,
            body.len(),
        );
        want.extend_from_slice(&body);
        want.extend_from_slice(b"\r\n");
    }
    let mut got = vec![0; want.len()];
    theirs.read_exact(&mut got).await.unwrap();
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HPUB a.b _I.1 "), "{text:.40}");
    assert!(
        text.contains("HPUB a.b 73 16458\r\n"),
        "a batch's message has no reply subject"
    );
    assert!(text.contains("HPUB a.b _I.c3 "), "a commit's reply subject");
    assert!(
        got == want,
        "the bytes written differ from the messages encoded"
    );
    // Too large for the server: answered here, never written.
    let huge = Bytes::from(vec![b'h'; 1 << 20]);
    assert!(link.publish("a.b", Reply::Ack(4), &headers(), &[], &huge));
    let Heard::Answer(token, answer) = link.next_answer().await.unwrap() else {
        panic!("an answer")
    };
    assert_eq!(token, 4);
    assert_eq!(
        answer.unwrap_err().kind(),
        PublishErrorKind::MaxPayloadExceeded
    );
    // The other end gone: the link says so, and takes nothing more.
    drop(theirs);
    assert!(link.publish(
        "a.b",
        Reply::Ack(5),
        &headers(),
        &[],
        &Bytes::from_static(b"x")
    ));
    tokio::time::timeout(Duration::from_secs(5), async {
        while !link.broken() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the writer notices");
    assert!(!link.publish(
        "a.b",
        Reply::Ack(6),
        &headers(),
        &[],
        &Bytes::from_static(b"x")
    ));
}

/// Acks and commits' answers go to their own queues, whatever comes
/// between them; a PING is answered; the end of the connection ends
/// both queues once they are drained.
#[tokio::test]
async fn the_reader_sorts_answers_and_answers_pings() {
    let (mut link, mut theirs) = piped(Arc::default());
    let ack = br#"{"stream":"S","seq":1}"#;
    let commit = br#"{"stream":"S","seq":3,"batch":"b1","count":2}"#;
    let mut wire = format!("MSG _I.c9 1 {}\r\n", commit.len()).into_bytes();
    wire.extend_from_slice(commit);
    wire.extend_from_slice(b"\r\nPING\r\nMSG _OTHER.1 1 2\r\n{}\r\n");
    wire.extend_from_slice(format!("MSG _I.7 1 {}\r\n", ack.len()).as_bytes());
    wire.extend_from_slice(ack);
    wire.extend_from_slice(b"\r\n");
    theirs.write_all(&wire).await.unwrap();
    let Heard::Answer(token, answer) = link.next_answer().await.unwrap() else {
        panic!("an answer")
    };
    assert_eq!((token, answer.ok()), (7, Some(false)));
    let Heard::Answer(token, answer) = link.next_commit().await.unwrap() else {
        panic!("a commit's answer")
    };
    assert_eq!(token, 9);
    assert_eq!(answer.unwrap().batch.as_deref(), Some("b1"));
    theirs
        .write_all(b"-ERR 'Permissions Violation for Publish to \"a.b\"'\r\n")
        .await
        .unwrap();
    assert!(matches!(link.next_answer().await.unwrap(), Heard::Denied(s) if s == "a.b"));
    let mut pong = [0; 6];
    theirs.read_exact(&mut pong).await.unwrap();
    assert_eq!(&pong, b"PONG\r\n");
    // A barrier: refusals before its PONG are of forgotten copies.
    link.barrier();
    let mut ping = [0; 6];
    theirs.read_exact(&mut ping).await.unwrap();
    assert_eq!(&ping, b"PING\r\n");
    refusals_around_the_barriers_pong(&mut link, &mut theirs).await;
    // A later INFO may lower the connection's max_payload.
    says(&mut theirs, b"INFO {\"max_payload\":4096}").await;
    assert_eq!(link.max_payload(), 4096);
    drop(theirs);
    assert!(link.next_answer().await.is_err());
    assert!(link.next_commit().await.is_err());
    assert!(link.broken());
}

/// The server refuses a publish before the barrier's PONG (a forgotten
/// copy's) and one after: only the second is heard.
async fn refusals_around_the_barriers_pong(link: &mut Link, theirs: &mut tokio::io::DuplexStream) {
    theirs
        .write_all(b"-ERR 'Permissions Violation for Publish to \"a.old\"'\r\nPONG\r\n-ERR 'Permissions Violation for Publish to \"a.new\"'\r\n")
        .await
        .unwrap();
    assert!(
        matches!(link.next_answer().await.unwrap(), Heard::Denied(s) if s == "a.new"),
        "the refusal before the barrier's PONG is dropped"
    );
}

/// The server says `line`, then PINGs, and the link's PONG comes back: by
/// then the link has read the line.
async fn says(theirs: &mut tokio::io::DuplexStream, line: &[u8]) {
    theirs.write_all(line).await.unwrap();
    theirs.write_all(b"\r\nPING\r\n").await.unwrap();
    let mut pong = [0; 6];
    theirs.read_exact(&mut pong).await.unwrap();
    assert_eq!(&pong, b"PONG\r\n");
}

/// A link over a duplex pipe; the test plays the server on `theirs`.
fn piped(announced: Arc<Mutex<Vec<String>>>) -> (Link, tokio::io::DuplexStream) {
    let shared = Arc::new(Shared::new(1 << 20, announced));
    let (ours, theirs) = tokio::io::duplex(1 << 16);
    let (r, w) = tokio::io::split(ours);
    let stop = CancellationToken::new();
    tokio::spawn(write_out(shared.clone(), Box::new(w), stop.clone()));
    tokio::spawn(read_in(
        shared.clone(),
        Box::new(r),
        BytesMut::new(),
        "_I.".into(),
        stop.clone(),
    ));
    let link = Link {
        shared,
        _tasks: stop.drop_guard(),
        prefix: "_I.".into(),
        sent_mark: 0,
        server: "test".into(),
    };
    (link, theirs)
}

/// Each `-ERR` after which nats-server closes the connection ends the
/// link at once, with the server's words as the reason; one it keeps
/// the connection after (one we do not know) is only logged.
#[tokio::test]
async fn an_error_the_server_closes_after_ends_the_link_with_its_words() {
    for err in [
        "'Authorization Violation'",
        "'Stale Connection'",
        "'Slow Consumer'",
        "'Maximum Payload Violation'",
        "'User Authentication Expired'",
    ] {
        let (mut link, mut theirs) = piped(Arc::default());
        theirs
            .write_all(format!("-ERR {err}\r\n").as_bytes())
            .await
            .unwrap();
        let e = link.next_answer().await.expect_err(err).to_string();
        assert!(e.contains(err.trim_matches('\'')), "{err}: {e}");
        assert!(link.broken(), "{err}");
    }
    let (link, mut theirs) = piped(Arc::default());
    says(&mut theirs, b"-ERR 'Something New'").await;
    assert!(!link.broken());
}

/// A later INFO in lame duck mode marks the link as leaving; the
/// servers it announces reach the dialer.
#[tokio::test]
async fn a_lame_duck_info_marks_the_link_and_announces_servers() {
    let announced = Arc::default();
    let (link, mut theirs) = piped(Arc::clone(&announced));
    assert!(!link.lame_duck());
    says(
        &mut theirs,
        b"INFO {\"ldm\":true,\"connect_urls\":[\"127.0.0.1:4223\"]}",
    )
    .await;
    assert!(link.lame_duck());
    assert!(!link.broken(), "what is in flight is still answered");
    assert_eq!(
        *announced.lock().unwrap(),
        vec!["127.0.0.1:4223".to_owned()]
    );
}

/// An idle link whose server says nothing asks with a PING after
/// [`KEEPALIVE`], and ends after twice that with no answer; one that
/// answers stays. A keepalive's PONG is not taken for a barrier's.
#[tokio::test(start_paused = true)]
async fn a_silent_idle_link_pings_and_is_given_up_without_a_pong() {
    let (mut link, mut theirs) = piped(Arc::default());
    let mut ping = [0; 6];
    theirs.read_exact(&mut ping).await.unwrap();
    assert_eq!(&ping, b"PING\r\n");
    link.barrier();
    theirs.read_exact(&mut ping).await.unwrap();
    // The keepalive's PONG: the barrier's is still to come.
    theirs.write_all(b"PONG\r\n").await.unwrap();
    refusals_around_the_barriers_pong(&mut link, &mut theirs).await;
    tokio::time::sleep(KEEPALIVE).await;
    assert!(!link.broken(), "it answered");
    // Now silent: a PING, then the end.
    theirs.read_exact(&mut ping).await.unwrap();
    assert_eq!(&ping, b"PING\r\n");
    let e = link.next_answer().await.expect_err("given up").to_string();
    assert!(e.contains("taken for dead"), "{e}");
    assert!(link.broken());
}

/// Bytes still leaving, slowly, are not silence; a writer stuck since
/// the last look, or done, is.
#[tokio::test]
async fn a_link_still_sending_is_told_from_a_silent_one() {
    let shared = Arc::new(Shared::new(1 << 20, Arc::default()));
    let (ours, mut theirs) = tokio::io::duplex(256);
    let mut link = writing_link(&shared, ours);
    let written = || shared.written.load(Ordering::Relaxed);
    async fn until(what: &str, done: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !done() {
            assert!(std::time::Instant::now() < deadline, "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let body = Bytes::from(vec![b'x'; 4096]);
    assert!(link.publish("a.b", Reply::Ack(1), &headers(), &[], &body));
    // The pipe holds 256 bytes: the writer is stuck behind them.
    until("the pipe full", || written() == 256).await;
    assert!(link.still_sending(), "it wrote since the last look");
    assert!(!link.still_sending(), "no progress since the last look");
    let mut chunk = [0u8; 1024];
    theirs.read_exact(&mut chunk).await.unwrap();
    until("more written", || written() > 256).await;
    assert!(link.still_sending(), "it wrote since the last look");
    let total = head(("a.b", "_I.", Reply::Ack(1)), &[], body.len()).len() + body.len() + 2;
    let mut rest = vec![0u8; total - chunk.len()];
    theirs.read_exact(&mut rest).await.unwrap();
    until("all written", || written() == total as u64).await;
    assert!(!link.still_sending(), "everything left");
}

#[test]
fn decimals() {
    for n in [0usize, 7, 10, 99, 1234567890, usize::MAX] {
        let mut out = Vec::new();
        push_decimal(&mut out, n);
        assert_eq!(String::from_utf8(out).unwrap(), n.to_string());
    }
}

#[test]
fn a_permission_refusal_names_its_subject() {
    for (err, subject) in [
        (
            r#"Permissions Violation for Publish to "orders.x""#,
            Some("orders.x"),
        ),
        (
            "Permissions Violation for Publish to orders.x",
            Some("orders.x"),
        ),
        (
            r#"Permissions Violation for Publish to "a.b" using reply subject "_I.7""#,
            Some("a.b"),
        ),
        (r#"Permissions Violation for Subscription to "_I.>""#, None),
        ("Authorization Violation", None),
        ("Permissions Violation for Publish to ", None),
    ] {
        assert_eq!(denied_subject(err), subject, "{err}");
    }
}

#[test]
fn server_operations() {
    let ops = b"INFO {\"max_payload\":1}\r\nPING\r\n+OK\r\n-ERR 'Permissions Violation for Publish to x'\r\nMSG _INBOX.a.7 1 5\r\nhello\r\nHMSG _INBOX.a.8 1 16 16\r\nNATS/1.0 503\r\n\r\n\r\nhmsg _INBOX.a.9 1 _R 12 14\r\nNATS/1.0\r\n\r\nok\r\nPONG\r\n";
    let mut at = 0;
    let mut got = Vec::new();
    while let Some((op, used)) = parse(&ops[at..]).unwrap() {
        got.push(op);
        at += used;
    }
    assert_eq!(at, ops.len());
    assert_eq!(
        got,
        vec![
            Op::Info(b"{\"max_payload\":1}".to_vec()),
            Op::Ping,
            Op::Ok,
            Op::Err("Permissions Violation for Publish to x".into()),
            Op::Msg {
                subject: b"_INBOX.a.7".to_vec(),
                status: None,
                payload: b"hello".to_vec()
            },
            Op::Msg {
                subject: b"_INBOX.a.8".to_vec(),
                status: Some(503),
                payload: vec![]
            },
            Op::Msg {
                subject: b"_INBOX.a.9".to_vec(),
                status: None,
                payload: b"ok".to_vec()
            },
            Op::Pong,
        ]
    );
}

#[test]
fn what_is_not_nats_is_an_error() {
    assert!(parse(b"HELLO\r\n").is_err());
    assert!(parse(b"MSG a 1 x\r\n").is_err());
    assert!(parse(b"MSG a 1 2\r\nabcd\r\n").is_err());
    assert!(parse(b"HMSG a 1 9 2\r\n").is_err());
    assert_eq!(parse(&[b'x'; 100]).unwrap(), None);
    assert!(parse(&vec![b'x'; MAX_LINE + 1]).is_err());
}

#[test]
fn creds_files_give_their_jwt_and_seed() {
    let text = "-----BEGIN NATS USER JWT-----\neyJhbGciOi.x.y\n------END NATS USER JWT------\n\n************************* IMPORTANT *************************\nNKEY Seed printed below can be used to sign and prove identity.\n\n-----BEGIN USER NKEY SEED-----\nSUAIBDPBAUTWCWBKIO6XHQNINK5FWJW4OHLXC3HQ2KFE4PEJUA44CNHTC4\n------END USER NKEY SEED------\n";
    assert_eq!(
        parse_creds(text),
        Some((
            "eyJhbGciOi.x.y".to_owned(),
            "SUAIBDPBAUTWCWBKIO6XHQNINK5FWJW4OHLXC3HQ2KFE4PEJUA44CNHTC4".to_owned()
        ))
    );
    assert_eq!(parse_creds("-----BEGIN NATS USER JWT-----\nx\n"), None);
}

#[test]
fn a_nonce_is_signed_by_the_seed() {
    use base64::Engine as _;
    let user = nkeys::KeyPair::new_user();
    let seed = user.seed().unwrap();
    let sig = sign_nonce(&seed, "nonce-1").unwrap();
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(sig)
        .unwrap();
    user.verify(b"nonce-1", &raw).unwrap();
    assert_eq!(sign_nonce("not a seed", "n"), None);
}

proptest! {
    /// However the socket cuts the bytes, the same operations come out.
    #[test]
    fn operations_survive_any_split(cuts in proptest::collection::vec(0usize..120, 0..6)) {
        let ops: &[u8] = b"PING\r\nMSG _INBOX.a.1 1 9\r\n{\"seq\":1}\r\nHMSG _INBOX.a.2 1 16 20\r\nNATS/1.0 503\r\n\r\nabcd\r\nPONG\r\n";
        let whole = {
            let mut at = 0;
            let mut v = Vec::new();
            while let Some((op, used)) = parse(&ops[at..]).unwrap() { v.push(op); at += used; }
            v
        };
        prop_assert_eq!(whole.len(), 4);
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(ops.len())).collect();
        cuts.sort_unstable();
        cuts.push(ops.len());
        let mut buf = Vec::new();
        let mut got = Vec::new();
        let mut fed = 0;
        for c in cuts {
            buf.extend_from_slice(&ops[fed..c]);
            fed = c;
            while let Some((op, used)) = parse(&buf).unwrap() {
                got.push(op);
                buf.drain(..used);
            }
        }
        prop_assert_eq!(got, whole);
    }
}

/// A server that answers the handshake with `-ERR` refuses the link: a
/// typed refusal, told from a timeout and from a broken protocol.
#[tokio::test]
async fn a_handshake_refusal_a_silent_server_and_a_broken_one_are_told_apart() {
    let (mut ours, mut server) = tokio::io::duplex(4096);
    let talk = tokio::spawn(async move {
        let mut buf = [0u8; 1024];
        let _ = server.read(&mut buf).await;
        server
            .write_all(b"-ERR 'Authorization Violation'\r\n")
            .await
            .unwrap();
        server
    });
    let mut rbuf = BytesMut::new();
    let refused = greet(
        &mut ours,
        &mut rbuf,
        b"CONNECT {}\r\nPING\r\nPING\r\n",
        "s:1",
    )
    .await;
    assert!(
        matches!(&refused, Err(LinkError::Refused { message, .. }) if message.contains("Authorization Violation")),
        "{refused:?}"
    );
    drop(talk.await.unwrap());

    let (mut ours, mut server) = tokio::io::duplex(4096);
    server.write_all(b"HELLO there\r\n").await.unwrap();
    let broken = read_info(&mut ours, &mut BytesMut::new(), "s:1").await;
    assert!(matches!(broken, Err(LinkError::Protocol(_))), "{broken:?}");

    // A listener that accepts and never speaks: no INFO within the dial's
    // time.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("nats://{}", silent.local_addr().unwrap());
    let args = crate::nats::NatsArgs {
        nats_url: url,
        ..Default::default()
    };
    let mut dialer = Dialer::new(&args, "test".into()).unwrap();
    let timed_out = dialer.dial().await.err();
    assert!(
        matches!(timed_out, Some(LinkError::TimedOut { .. })),
        "{timed_out:?}"
    );
}
