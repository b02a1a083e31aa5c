//! A bounded log of the engine's recent internal steps — commits with what they settled and
//! freed, journal flushes, cleaner passes, flattening, copies made permanent, recovery — for
//! diagnosis ([`crate::PoolConfig::events`]).
//!
//! The simulator gives each seed's pools one log and writes its own operations into it too,
//! so that a failure found with the background threads running (which does not replay from
//! its seed) comes with the interleaving that led to it. Off by default: the engine then only
//! tests an `Option`.

use parking_lot::Mutex;
use std::collections::VecDeque;

/// The last lines logged, oldest first (a ring: older lines are dropped).
#[derive(Debug)]
pub struct EventLog {
    keep: usize,
    lines: Mutex<VecDeque<String>>,
}

impl EventLog {
    /// A log keeping the last `keep` lines.
    pub fn new(keep: usize) -> EventLog {
        EventLog {
            keep: keep.max(1),
            lines: Mutex::new(VecDeque::with_capacity(keep.max(1))),
        }
    }

    /// Appends `line`, prefixed with the name of the thread that logs it.
    pub fn push(&self, line: impl std::fmt::Display) {
        let thread = std::thread::current();
        let line = format!("[{}] {line}", thread.name().unwrap_or("?"));
        let mut lines = self.lines.lock();
        if lines.len() == self.keep {
            lines.pop_front();
        }
        lines.push_back(line);
    }

    /// The lines kept, oldest first.
    pub fn recent(&self) -> Vec<String> {
        self.lines.lock().iter().cloned().collect()
    }

    /// Drops every line.
    pub fn clear(&self) {
        self.lines.lock().clear();
    }
}

/// Blocks (ascending) as runs, `3..5 9 12..20`, at most 16 runs then `…`.
pub(crate) fn block_runs(blocks: impl IntoIterator<Item = u64>) -> String {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for b in blocks {
        match runs.last_mut() {
            Some((_, end)) if *end == b => *end = b + 1,
            _ => runs.push((b, b + 1)),
        }
    }
    let mut out: Vec<String> = runs
        .iter()
        .take(16)
        .map(|&(s, e)| {
            if e == s + 1 {
                s.to_string()
            } else {
                format!("{s}..{e}")
            }
        })
        .collect();
    if runs.len() > 16 {
        out.push("…".into());
    }
    if out.is_empty() {
        return "none".into();
    }
    out.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_lines_in_order() {
        let log = EventLog::new(3);
        for i in 0..5 {
            log.push(i);
        }
        let recent = log.recent();
        assert_eq!(recent.len(), 3);
        assert!(
            recent[0].ends_with("] 2") && recent[2].ends_with("] 4"),
            "{recent:?}"
        );
        log.clear();
        assert!(log.recent().is_empty());
    }

    /// A pool given a log records its flushes, commits (with the blocks they wrote) and, after
    /// a crash, its recovery and the changes it replayed.
    #[test]
    fn a_pool_logs_its_flushes_commits_and_recovery() {
        use crate::disk::SimDisk;
        use crate::{Pool, PoolConfig};
        use std::sync::Arc;
        let disk = SimDisk::new(1, 1 << 30);
        let log = Arc::new(EventLog::new(100));
        let config = || PoolConfig {
            capacity_bytes: Some(64 << 20),
            background: false,
            threads: false,
            meta_backend: crate::store::Backend::Redb,
            disk: Arc::new(disk.clone()),
            events: Some(log.clone()),
            ..PoolConfig::default()
        };
        let pool = Pool::create("/pool", config()).expect("create");
        let v = pool.create_volume("v", 1 << 20).expect("volume");
        v.write(0, &[7u8; 8192], false).expect("write");
        pool.commit_once().expect("commit");
        v.write(3 << 12, &[9u8; 4096], false).expect("write");
        v.flush().expect("flush");
        drop(v);
        pool.simulate_crash();
        disk.power_cut();
        let pool = Pool::open("/pool", config()).expect("reopen");
        let lines = log.recent();
        let has = |what: &[&str]| lines.iter().any(|l| what.iter().all(|w| l.contains(w)));
        assert!(has(&["commit ", " v [", "entries 0..2"]), "{lines:#?}");
        assert!(has(&["flush: journaled"]), "{lines:#?}");
        assert!(
            has(&["open: batches resume after", "journaled changes"]),
            "{lines:#?}"
        );
        assert!(has(&["replayed: ", "install v 3=0x"]), "{lines:#?}");
        drop(pool);
    }

    #[test]
    fn blocks_print_as_runs() {
        assert_eq!(block_runs([3, 4, 9, 12, 13, 14]), "3..5 9 12..15");
        assert_eq!(block_runs([]), "none");
        assert!(block_runs((0..40).map(|b| b * 2)).ends_with(" …"));
    }
}
