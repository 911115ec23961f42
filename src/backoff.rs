//! One exponential backoff for every retry loop: the pause doubles from a
//! first one up to a ceiling, and `reset` starts it over after a success.
//!
//! Where many processes retry the same thing together (every relay and
//! consumer after a NATS or Postgres restart), the pauses are jittered
//! ("equal jitter": half the pause fixed, half drawn), so they do not come
//! back in step; a pause is never longer than the unjittered one, so a
//! bound written for that still holds. A growing *timeout* (how long to
//! wait for an answer) takes no jitter.

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
    jitter: bool,
}

impl Backoff {
    /// Doubling from `first` to `max`, every value given as it is.
    pub const fn new(first: Duration, max: Duration) -> Backoff {
        Backoff {
            first,
            max,
            next: first,
            jitter: false,
        }
    }

    /// As [`Backoff::new`], each pause drawn from its upper half.
    pub const fn jittered(first: Duration, max: Duration) -> Backoff {
        Backoff {
            jitter: true,
            ..Backoff::new(first, max)
        }
    }

    /// The pause to take now; the next one doubles (up to the ceiling).
    pub fn next_pause(&mut self) -> Duration {
        let pause = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        if self.jitter {
            let half = pause / 2;
            half + half.mul_f64(unit_random())
        } else {
            pause
        }
    }

    /// The pause `next_pause` would start from now, before jitter.
    pub fn peek(&self) -> Duration {
        self.next
    }

    /// After a success: the next pause is the first again.
    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

/// A number in [0, 1) for jitter: std's per-process random hash keys, so
/// no random-number crate is pulled in for it.
fn unit_random() -> f64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    );
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn it_doubles_to_the_ceiling_and_starts_over_on_reset() {
        let ms = Duration::from_millis;
        let mut b = Backoff::new(ms(100), ms(500));
        let pauses: Vec<Duration> = (0..5).map(|_| b.next_pause()).collect();
        assert_eq!(pauses, [ms(100), ms(200), ms(400), ms(500), ms(500)]);
        b.reset();
        assert_eq!(b.next_pause(), ms(100));
        assert_eq!(b.peek(), ms(200));
    }

    #[test]
    fn jittered_pauses_are_spread() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..20 {
            let mut b = Backoff::jittered(Duration::from_secs(1), Duration::from_secs(1));
            seen.insert(b.next_pause());
        }
        assert!(seen.len() > 10, "{seen:?}");
    }

    proptest! {
        /// A jittered pause lies in the upper half of the plain one.
        #[test]
        fn a_jittered_pause_is_within_half_of_the_plain_one(first in 1u64..10_000, max in 1u64..100_000, n in 0usize..20) {
            let (first, max) = (Duration::from_millis(first), Duration::from_millis(max.max(first)));
            let mut plain = Backoff::new(first, max);
            let mut jittered = Backoff::jittered(first, max);
            for _ in 0..n {
                let p = plain.next_pause();
                let j = jittered.next_pause();
                prop_assert!(j <= p && j >= p / 2, "{j:?} against {p:?}");
            }
        }
    }
}
