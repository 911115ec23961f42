//! Acks read on the next wake-up, not on one of their own.
//!
//! At a quiet rate every transaction woke the relay twice: its WAL, then,
//! a fraction of a millisecond after its events went out, their acks. On
//! this project's box a wake-up from idle costs tens of microseconds of
//! CPU whatever the work it brings (the relay bench: 27 µs per event at
//! 2,000 events/s in 10-row transactions against 5 flat out). An ack only
//! moves the slot's confirmed position, which nobody waits on to the
//! millisecond; so while acks are expected, the socket's `SO_RCVLOWAT` is
//! raised and the kernel wakes nobody for them. The relay reads them when
//! it wakes anyway (the next transaction's WAL: [`Lowat::kick`] lowers the
//! mark, and the kernel signals what waits), and at the latest
//! [`LAZY_MAX`] after the oldest was sent. Commit answers, PONGs and a link
//! with nothing outstanding stay eager: they are read the moment they come.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The longest an expected ack waits unread: well inside every clock that
/// judges silence (the stall after two seconds, the keepalive's five).
pub const LAZY_MAX: Duration = Duration::from_millis(20);

/// While lazy, the kernel signals the socket readable only once this much
/// waits: about 600 acks, far more than one wake-up's worth.
const LAZY_BYTES: libc::c_int = 64 * 1024;

/// The receive low-water mark of a link's TCP socket (a duplicate of its
/// descriptor: the socket's halves belong to the reader and the writer).
pub(super) struct Lowat {
    fd: OwnedFd,
    lazy: AtomicBool,
}

impl Lowat {
    /// `None` where the descriptor cannot be duplicated: the link stays
    /// eager, as it was before this existed.
    pub(super) fn new(socket: &impl AsFd) -> Option<Lowat> {
        let fd = socket.as_fd().try_clone_to_owned().ok()?;
        Some(Lowat {
            fd,
            lazy: AtomicBool::new(false),
        })
    }

    pub(super) fn is_lazy(&self) -> bool {
        self.lazy.load(Ordering::Relaxed)
    }

    /// Wake nobody until [`LAZY_BYTES`] wait.
    pub(super) fn lazy(&self) {
        if !self.lazy.swap(true, Ordering::Relaxed) && !self.set(LAZY_BYTES) {
            self.lazy.store(false, Ordering::Relaxed);
        }
    }

    /// Back to eager: what already waits is signalled at once (Linux checks
    /// the new mark against the queue when it is lowered).
    pub(super) fn kick(&self) {
        // Were it to fail on a socket that lives, answers would show once
        // 64 KiB wait, or the publisher's stall clock would replace the
        // link: never a loop of kicks.
        if self.is_lazy() && self.lazy.swap(false, Ordering::Relaxed) {
            self.set(1);
        }
    }

    /// Eager only if something waits to be read: kicked with nothing
    /// there, the socket would wake the relay for the acks still to come.
    pub(super) fn kick_if_waiting(&self) {
        if self.is_lazy() && self.waiting() {
            self.kick();
        }
    }

    /// Bytes received and not read yet, whatever the mark.
    fn waiting(&self) -> bool {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one c_int through the pointer.
        let rc = unsafe { libc::ioctl(self.fd.as_raw_fd(), libc::FIONREAD, &mut n) };
        // Unknown counts as waiting: a kick too many costs one wake-up.
        rc != 0 || n > 0
    }

    fn set(&self, bytes: libc::c_int) -> bool {
        // SAFETY: a valid descriptor we own, a pointer to a live c_int and
        // its size; setsockopt reads no more than that.
        let rc = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                (&bytes as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        rc == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (theirs, _) = listener.accept().unwrap();
        (ours, theirs)
    }

    fn queued(s: &TcpStream) -> libc::c_int {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one c_int through the pointer.
        assert_eq!(
            unsafe { libc::ioctl(s.as_raw_fd(), libc::FIONREAD, &mut n) },
            0
        );
        n
    }

    fn readable_now(s: &TcpStream) -> bool {
        let mut p = libc::pollfd {
            fd: s.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, timeout 0.
        assert!(unsafe { libc::poll(&mut p, 1, 0) } >= 0);
        p.revents & libc::POLLIN != 0
    }

    #[test]
    fn a_lazy_socket_hides_a_few_bytes_until_kicked_and_still_reads_them() {
        let (ours, mut theirs) = pair();
        let lowat = Lowat::new(&ours).unwrap();
        lowat.lazy();
        assert!(lowat.is_lazy());
        theirs.write_all(b"+ACK 1\r\n").unwrap();
        // The bytes have arrived (the queue says so) ...
        while queued(&ours) < 8 {
            std::thread::yield_now();
        }
        // ... and readiness does not say so while the mark is raised.
        assert!(!readable_now(&ours));
        lowat.kick();
        assert!(!lowat.is_lazy());
        assert!(readable_now(&ours));
        // A read under a raised mark still returns what is there: the
        // reader, woken by a kick, re-arms laziness before it reads on.
        lowat.lazy();
        ours.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 64];
        let n = (&ours).read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"+ACK 1\r\n");
    }

    #[test]
    fn a_kick_with_nothing_waiting_leaves_the_socket_lazy() {
        let (ours, mut theirs) = pair();
        let lowat = Lowat::new(&ours).unwrap();
        lowat.lazy();
        lowat.kick_if_waiting();
        assert!(lowat.is_lazy());
        theirs.write_all(b"MSG").unwrap();
        while queued(&ours) < 3 {
            std::thread::yield_now();
        }
        lowat.kick_if_waiting();
        assert!(!lowat.is_lazy());
        assert!(readable_now(&ours));
    }

    #[test]
    fn an_eager_socket_signals_every_byte() {
        let (ours, mut theirs) = pair();
        let lowat = Lowat::new(&ours).unwrap();
        lowat.lazy();
        lowat.kick();
        lowat.kick();
        theirs.write_all(b"P").unwrap();
        while queued(&ours) < 1 {
            std::thread::yield_now();
        }
        assert!(readable_now(&ours));
    }
}
