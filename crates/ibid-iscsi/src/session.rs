//! Sessions: the registry of logged-in sessions (TSIH allocation, session
//! reinstatement at ERL 0) and CmdSN window state.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use tokio::sync::Notify;

/// Serial number arithmetic (RFC 1982, 32 bits): a < b.
pub fn sn_lt(a: u32, b: u32) -> bool {
    a != b && (b.wrapping_sub(a) as i32) > 0
}

/// Serial number arithmetic: a <= b.
pub fn sn_le(a: u32, b: u32) -> bool {
    a == b || sn_lt(a, b)
}

/// CmdSN window of one session (one connection per session at ERL 0).
#[derive(Debug)]
pub struct Window {
    exp_cmdsn: AtomicU32,
    inflight: AtomicU32,
    depth: u32,
}

/// What to do with a command according to its CmdSN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnCheck {
    /// In order (or immediate): process it.
    Accept,
    /// Outside the window: silently ignore (RFC 7143 4.2.2.1).
    Drop,
}

impl Window {
    /// A window starting at `cmdsn` with `depth` commands.
    pub fn new(cmdsn: u32, depth: u32) -> Self {
        Window {
            exp_cmdsn: AtomicU32::new(cmdsn),
            inflight: AtomicU32::new(0),
            depth: depth.max(1),
        }
    }

    /// ExpCmdSN to report.
    pub fn exp_cmdsn(&self) -> u32 {
        self.exp_cmdsn.load(Ordering::SeqCst)
    }

    /// MaxCmdSN to report: the window shrinks while commands are in flight,
    /// bounding the work one session can queue.
    pub fn max_cmdsn(&self) -> u32 {
        let used = self.inflight.load(Ordering::SeqCst).min(self.depth - 1);
        self.exp_cmdsn().wrapping_add(self.depth - 1 - used)
    }

    /// Check and consume a CmdSN. Immediate PDUs do not advance the window.
    pub fn check(&self, cmdsn: u32, immediate: bool) -> SnCheck {
        if immediate {
            return SnCheck::Accept;
        }
        let exp = self.exp_cmdsn();
        if sn_lt(cmdsn, exp) || sn_lt(self.max_cmdsn(), cmdsn) {
            return SnCheck::Drop;
        }
        self.exp_cmdsn
            .store(cmdsn.wrapping_add(1), Ordering::SeqCst);
        SnCheck::Accept
    }

    /// A command started executing (counts against the window).
    pub fn begin(&self) {
        self.inflight.fetch_add(1, Ordering::SeqCst);
    }

    /// A command finished.
    pub fn end(&self) {
        let _ = self
            .inflight
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1));
    }
}

/// A registered session: what reinstatement needs to stop it.
#[derive(Debug)]
pub struct SessionEntry {
    /// Target-assigned session handle.
    pub tsih: u16,
    /// Signalled to make the session's connection close.
    pub kill: Arc<Notify>,
}

/// Registry of normal sessions keyed by (InitiatorName, ISID).
#[derive(Debug, Default)]
pub struct Registry {
    sessions: Mutex<HashMap<(String, [u8; 6]), SessionEntry>>,
    next_tsih: AtomicU32,
}

impl Registry {
    /// Register a new session, closing any older one with the same key
    /// (session reinstatement). Returns its TSIH.
    pub fn add(&self, initiator: &str, isid: [u8; 6], kill: Arc<Notify>) -> u16 {
        let tsih = loop {
            let t = (self.next_tsih.fetch_add(1, Ordering::SeqCst) % 0xffff + 1) as u16;
            if t != 0 {
                break t;
            }
        };
        let old = self
            .sessions
            .lock()
            .insert((initiator.to_string(), isid), SessionEntry { tsih, kill });
        if let Some(old) = old {
            old.kill.notify_one();
        }
        tsih
    }

    /// Remove a session if it is still the registered one.
    pub fn remove(&self, initiator: &str, isid: [u8; 6], tsih: u16) {
        let mut s = self.sessions.lock();
        let key = (initiator.to_string(), isid);
        if s.get(&key).is_some_and(|e| e.tsih == tsih) {
            s.remove(&key);
        }
    }

    /// Close every session (TARGET COLD RESET).
    pub fn kill_all(&self) {
        for e in self.sessions.lock().values() {
            e.kill.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window() {
        let w = Window::new(10, 4);
        assert_eq!(w.max_cmdsn(), 13);
        assert_eq!(w.check(14, false), SnCheck::Drop);
        assert_eq!(w.check(9, false), SnCheck::Drop);
        assert_eq!(w.check(10, false), SnCheck::Accept);
        w.begin();
        assert_eq!(w.exp_cmdsn(), 11);
        assert_eq!(w.max_cmdsn(), 13);
        w.end();
        assert_eq!(w.max_cmdsn(), 14);
        assert!(sn_lt(u32::MAX, 0));
    }
}
