//! The relay bench's receiver: a bare NATS subscription on a thread of its
//! own, noting each message's `Nats-Msg-Id` and arrival instant.
//!
//! The bench shares two cores with what it measures. Received through
//! async-nats, every message had its header block parsed into a map and
//! crossed a channel and the runtime: about 5.7 µs of CPU per event
//! (docs/guide/benchmarks.md), as much as the relay itself spends, taken
//! from the system under test. This reads the protocol (`HMSG` frames,
//! `PING`) off the socket and looks for the one header it needs.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use uuid::Uuid;

pub type Received = Arc<Mutex<Vec<(Uuid, Instant)>>>;

pub struct Receiver {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Receiver {
    /// Subscribe to `subject` on the server at `url` (`nats://host:port`,
    /// no TLS or auth: the bench's own stack). Returns once the server has
    /// the subscription.
    pub fn start(url: &str, subject: &str, into: Received) -> Receiver {
        let addr = url
            .trim_start_matches("nats://")
            .split(',')
            .next()
            .unwrap_or_default()
            .to_owned();
        let mut conn = TcpStream::connect(&addr).expect("receiver: connect to NATS");
        conn.set_nodelay(true).ok();
        conn.set_read_timeout(Some(Duration::from_millis(100)))
            .expect("receiver: read timeout");
        write!(
            conn,
            "CONNECT {{\"verbose\":false,\"pedantic\":false,\"headers\":true,\"protocol\":1,\"name\":\"bench-receiver\"}}\r\nSUB {subject} 1\r\nPING\r\n"
        )
        .expect("receiver: subscribe");
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || read_loop(conn, into, stop, ready_tx))
        };
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("receiver: no PONG from NATS");
        Receiver {
            stop,
            thread: Some(thread),
        }
    }

    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().ok();
        }
    }
}

fn read_loop(
    mut conn: TcpStream,
    into: Received,
    stop: Arc<AtomicBool>,
    ready: std::sync::mpsc::Sender<()>,
) {
    let mut buf: Vec<u8> = Vec::with_capacity(1 << 20);
    let mut chunk = vec![0u8; 256 * 1024];
    let mut batch: Vec<(Uuid, Instant)> = Vec::with_capacity(4096);
    while !stop.load(Ordering::Relaxed) {
        let n = match conn.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(e) => panic!("receiver: {e}"),
        };
        let now = Instant::now();
        buf.extend_from_slice(&chunk[..n]);
        let mut at = 0;
        while let Some(end) = find(&buf[at..], b"\r\n").map(|i| at + i) {
            let line = &buf[at..end];
            let mut words = line.split(|&b| b == b' ').filter(|w| !w.is_empty());
            let op = words.next().unwrap_or_default();
            let frame = match op {
                b"HMSG" | b"MSG" => {
                    let args: Vec<&[u8]> = words.collect();
                    let num = |w: &[u8]| -> usize {
                        std::str::from_utf8(w)
                            .ok()
                            .and_then(|s| s.parse().ok())
                            .expect("receiver: frame size")
                    };
                    let (hdr, total) = if op == b"HMSG" {
                        (num(args[args.len() - 2]), num(args[args.len() - 1]))
                    } else {
                        (0, num(args[args.len() - 1]))
                    };
                    Some((hdr, total))
                }
                _ => None,
            };
            match frame {
                Some((hdr, total)) => {
                    let body = end + 2;
                    if buf.len() < body + total + 2 {
                        break; // the rest of the frame has not arrived
                    }
                    if let Some(id) = msg_id(&buf[body..body + hdr]) {
                        batch.push((id, now));
                    } else if hdr == 0 {
                        // A peer's batch of ids (`scripts/bench.sh peers`),
                        // one a line.
                        let ids = std::str::from_utf8(&buf[body..body + total]).unwrap_or("");
                        batch.extend(
                            ids.lines()
                                .filter_map(|l| Uuid::parse_str(l.trim()).ok())
                                .map(|id| (id, now)),
                        );
                    }
                    at = body + total + 2;
                }
                None => {
                    if op == b"PING" {
                        conn.write_all(b"PONG\r\n").expect("receiver: PONG");
                    } else if op == b"PONG" {
                        ready.send(()).ok();
                    } else if op == b"-ERR" {
                        panic!("receiver: {}", String::from_utf8_lossy(line));
                    }
                    at = end + 2;
                }
            }
        }
        buf.drain(..at);
        if !batch.is_empty() {
            into.lock().unwrap().append(&mut batch);
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn msg_id(headers: &[u8]) -> Option<Uuid> {
    const NAME: &[u8] = b"\r\nNats-Msg-Id:";
    let at = find(headers, NAME)? + NAME.len();
    let rest = &headers[at..];
    let end = find(rest, b"\r\n")?;
    Uuid::parse_str(std::str::from_utf8(&rest[..end]).ok()?.trim()).ok()
}
