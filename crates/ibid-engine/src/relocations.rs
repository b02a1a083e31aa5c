//! Segments the cleaner has cleaned (see `gc.rs`) whose moves wait for the next commit, and
//! the segments that must not be cleaned meanwhile.

use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};

/// Segments whose live records the cleaner has copied and made durable, waiting for the next
/// commit to point their chunks at the copies ([`crate::inner::Inner::apply_relocations`]).
#[derive(Debug, Default)]
pub(crate) struct Relocations {
    state: Mutex<RelocationState>,
}

#[derive(Debug, Default)]
struct RelocationState {
    queued: Vec<Relocation>,
    /// Segments queued ones moved records into, not yet applied, with how many relocations
    /// did: not to be cleaned (their usage rows do not count the copies yet).
    targets: HashMap<u64, usize>,
    /// Segments queued or being applied.
    sources: HashSet<u64>,
}

/// One cleaned segment: the moves of its live records, `(chunk id, old offset, new segment,
/// new offset)`.
#[derive(Debug)]
pub(crate) struct Relocation {
    /// The cleaned segment.
    pub segment: u64,
    /// `(chunk id, old offset, new segment, new offset)` of each live record moved.
    pub moved: Vec<(u64, u32, u64, u32)>,
}

impl Relocations {
    pub(crate) fn push(&self, r: Relocation) {
        let mut s = self.state.lock();
        for t in r.targets() {
            *s.targets.entry(t).or_default() += 1;
        }
        s.sources.insert(r.segment);
        s.queued.push(r);
    }

    /// The queued relocations, for a commit to apply; their segments stay excluded from
    /// cleaning until [`Relocations::applied`].
    pub(crate) fn take(&self) -> Vec<Relocation> {
        std::mem::take(&mut self.state.lock().queued)
    }

    /// `done` are durable: their segments may be cleaned again (the copies' segments) or are
    /// gone (the sources).
    pub(crate) fn applied(&self, done: &[Relocation]) {
        let mut s = self.state.lock();
        for r in done {
            s.sources.remove(&r.segment);
            for t in r.targets() {
                if let Some(n) = s.targets.get_mut(&t) {
                    *n -= 1;
                    if *n == 0 {
                        s.targets.remove(&t);
                    }
                }
            }
        }
    }

    /// Relocations waiting for a commit.
    pub(crate) fn queued(&self) -> usize {
        self.state.lock().queued.len()
    }

    /// The segments that must not be cleaned now (queued, or holding queued copies).
    pub(crate) fn busy(&self) -> HashSet<u64> {
        let s = self.state.lock();
        s.targets.keys().chain(&s.sources).copied().collect()
    }
}

impl Relocation {
    /// The segments its records were copied into, each once.
    fn targets(&self) -> HashSet<u64> {
        self.moved.iter().map(|m| m.2).collect()
    }
}
