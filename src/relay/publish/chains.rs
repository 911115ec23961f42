//! Per stream, the id the next publish must follow
//! (`Nats-Expected-Last-Msg-Id`), so the server, not hope, keeps the order.

use std::sync::Arc;

use crate::relay::acks::Lane;

/// The id each publish must follow, per stream: `Nats-Expected-Last-Msg-Id`
/// is checked against the stream the message lands in, and with the
/// `stream` role (SPEC §13) rows go to several. A stream with none yet
/// gets its next message alone. Each stream keeps its [`Lane`] number for
/// the publisher's life (0: the relay's own).
#[derive(Debug, Default)]
pub(super) struct Chains {
    /// The relay's own stream (and every message without a `stream`).
    own: Option<String>,
    /// The streams rows named, few: a scan beats a map. Lane `i + 1`.
    named: Vec<(Arc<str>, Option<String>)>,
}

impl Chains {
    /// The id `lane`'s next message follows, if any.
    pub(super) fn last(&self, lane: Lane) -> Option<&str> {
        match lane {
            0 => self.own.as_deref(),
            l => self
                .named
                .get(usize::try_from(l - 1).ok()?)
                .and_then(|(_, id)| id.as_deref()),
        }
    }

    /// `stream`'s lane; a stream met for the first time gets the next.
    pub(super) fn lane(&mut self, stream: &Option<Arc<str>>) -> Lane {
        let Some(s) = stream else {
            return 0;
        };
        let i = match self.named.iter().position(|(n, _)| n == s) {
            Some(i) => i,
            None => {
                self.named.push((s.clone(), None));
                self.named.len() - 1
            }
        };
        Lane::try_from(i + 1).unwrap_or(Lane::MAX)
    }

    pub(super) fn id_mut(&mut self, lane: Lane) -> Option<&mut Option<String>> {
        match lane {
            0 => Some(&mut self.own),
            l => self
                .named
                .get_mut(usize::try_from(l - 1).ok()?)
                .map(|(_, id)| id),
        }
    }

    /// The next message of `lane` follows `id`.
    pub(super) fn set(&mut self, lane: Lane, id: &str) {
        if let Some(slot) = self.id_mut(lane) {
            match slot {
                Some(last) => {
                    last.clear();
                    last.push_str(id);
                }
                None => *slot = Some(id.to_owned()),
            }
        }
    }

    /// The next message of `lane` goes alone.
    pub(super) fn forget(&mut self, lane: Lane) {
        if let Some(slot) = self.id_mut(lane) {
            *slot = None;
        }
    }

    pub(super) fn clear(&mut self) {
        self.own = None;
        for (_, id) in &mut self.named {
            *id = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Chains;
    use std::sync::Arc;

    #[test]
    fn each_stream_chains_to_its_own_last_message() {
        let mut c = Chains::default();
        let (a, b): (Option<Arc<str>>, Option<Arc<str>>) = (Some("A".into()), Some("B".into()));
        let (own, la, lb) = (c.lane(&None), c.lane(&a), c.lane(&b));
        assert_eq!(c.last(own), None);
        c.set(own, "own-1");
        c.set(la, "a-1");
        c.set(la, "a-2");
        assert_eq!(
            (c.last(own), c.last(la), c.last(lb)),
            (Some("own-1"), Some("a-2"), None)
        );
        c.set(lb, "b-1");
        assert_eq!(c.last(lb), Some("b-1"));
        c.forget(la);
        assert_eq!(
            (c.last(own), c.last(la), c.last(lb)),
            (Some("own-1"), None, Some("b-1")),
            "one stream's chain forgotten alone"
        );
        c.clear();
        assert_eq!((c.last(own), c.last(la)), (None, None));
        // Lanes keep their numbers across a clear: slots in flight name them.
        assert_eq!((c.lane(&None), c.lane(&a), c.lane(&b)), (own, la, lb));
        assert_ne!(la, lb);
    }
}
