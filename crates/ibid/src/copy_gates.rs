//! Per-volume gates between the writes that reach a volume — over iSCSI and over NBD — and
//! the EXTENDED COPYs that involve it.
//!
//! A copy needs a moment when its volumes have no uncommitted change (the engine quiesces
//! them, and gives up if they keep changing): ESXi's ATS heartbeats write to a datastore every
//! few milliseconds while it clones a disk on it, and an NBD client writing to the same volume
//! does the same. So a volume's gate lets in either writes or copies, any number of either but
//! never both: the writes that arrive during a copy wait for it (milliseconds) instead of
//! failing it. Copies share the gate with each other, so the segments ESXi keeps in flight
//! reach the engine together and are applied together (one quiesce and one catalog
//! transaction for a batch of them; the engine orders the ones whose windows conflict).
//!
//! The gate is phase-fair: once one side waits, newcomers of the side inside wait behind it,
//! and when the side inside drains, every waiter of the other side goes in at once. A stream
//! of copies cannot starve the heartbeats (ESXi gives a command one second), nor a stream of
//! writes a copy.

use parking_lot::{Condvar, Mutex, MutexGuard};
use std::collections::HashMap;
use std::sync::Arc;

/// The two sides of a gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Writes = 0,
    Copies = 1,
}

impl Side {
    fn other(self) -> Side {
        match self {
            Side::Writes => Side::Copies,
            Side::Copies => Side::Writes,
        }
    }
}

/// Who is inside a gate and who waits.
#[derive(Debug, Default)]
struct State {
    /// The side inside, `None` when nobody is.
    inside: Option<Side>,
    /// How many of it.
    holders: usize,
    /// Waiters, by side.
    waiting: [usize; 2],
    /// Times each side's waiters were let in, by side: a waiter leaves its wait when its
    /// side's count moves (it was counted among the holders by whoever let it in).
    admissions: [u64; 2],
}

/// A volume's gate: writes and copies pass it in turns (see the module's doc).
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<State>,
    turn: Condvar,
}

/// A write's or a copy's way through a gate, held for the operation's duration.
#[must_use = "the gate is passed only while the pass is held"]
pub struct Pass<'a> {
    gate: &'a Gate,
    side: Side,
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        self.gate.leave(self.side);
    }
}

impl Gate {
    /// Passes the gate for a write: at once unless a copy is inside or waiting.
    pub fn write(&self) -> Pass<'_> {
        self.enter(Side::Writes)
    }

    /// Passes the gate for a copy: at once unless a write is inside or waiting.
    pub fn copy(&self) -> Pass<'_> {
        self.enter(Side::Copies)
    }

    /// Whether a write arriving now would wait (a copy is inside or waiting).
    pub fn copying(&self) -> bool {
        let s = self.state.lock();
        s.inside == Some(Side::Copies) || s.waiting[Side::Copies as usize] > 0
    }

    fn enter(&self, side: Side) -> Pass<'_> {
        let mut s = self.state.lock();
        match s.inside {
            None => {
                s.inside = Some(side);
                s.holders = 1;
            }
            Some(inside) if inside == side && s.waiting[side.other() as usize] == 0 => {
                s.holders += 1;
            }
            Some(_) => {
                s.waiting[side as usize] += 1;
                let round = s.admissions[side as usize];
                while s.admissions[side as usize] == round {
                    self.turn.wait(&mut s);
                }
            }
        }
        Pass { gate: self, side }
    }

    fn leave(&self, side: Side) {
        let mut s = self.state.lock();
        debug_assert_eq!(s.inside, Some(side));
        s.holders -= 1;
        if s.holders > 0 {
            return;
        }
        // The other side first: it has been waiting since before the last of ours came in.
        if s.waiting[side.other() as usize] > 0 {
            self.admit(&mut s, side.other());
        } else if s.waiting[side as usize] > 0 {
            self.admit(&mut s, side);
        } else {
            s.inside = None;
        }
    }

    /// Lets every waiter of `side` in at once.
    fn admit(&self, s: &mut MutexGuard<'_, State>, side: Side) {
        s.inside = Some(side);
        s.holders = s.waiting[side as usize];
        s.waiting[side as usize] = 0;
        s.admissions[side as usize] += 1;
        self.turn.notify_all();
    }

    #[cfg(test)]
    fn waiting(&self, side: Side) -> usize {
        self.state.lock().waiting[side as usize]
    }
}

/// The gates of a pool's volumes, by volume id (one per volume ever written or copied while
/// the server runs).
#[derive(Default)]
pub struct CopyGates {
    gates: Mutex<HashMap<u64, Arc<Gate>>>,
}

impl CopyGates {
    /// Volume `id`'s gate.
    pub fn gate(&self, id: u64) -> Arc<Gate> {
        self.gates.lock().entry(id).or_default().clone()
    }

    /// The gates of volumes `ids`, each once and in id order: a copy passes them in this
    /// order, so two copies in opposite directions cannot deadlock (a write passes one gate
    /// and waits for no other while it holds it).
    pub fn for_copy(&self, ids: &[u64]) -> Vec<Arc<Gate>> {
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        ids.iter().map(|&id| self.gate(id)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    /// Waits until `f` holds (the other threads reach their waits), for at most 10 s.
    fn until(what: &str, f: impl Fn() -> bool) {
        let t0 = Instant::now();
        while !f() {
            assert!(t0.elapsed() < Duration::from_secs(10), "{what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// One gate per volume, shared by everyone who asks for it; a copy's gates come once
    /// each, in id order.
    #[test]
    fn one_gate_per_volume_in_id_order() {
        let gates = CopyGates::default();
        assert!(Arc::ptr_eq(&gates.gate(3), &gates.gate(3)));
        assert!(!Arc::ptr_eq(&gates.gate(3), &gates.gate(4)));
        let copy = gates.for_copy(&[7, 3, 7]);
        assert_eq!(copy.len(), 2);
        assert!(Arc::ptr_eq(&copy[0], &gates.gate(3)));
        assert!(Arc::ptr_eq(&copy[1], &gates.gate(7)));
    }

    /// Writes share the gate, and so do copies; a copy waits for the writes inside, and the
    /// writes that come while it waits wait behind it (the copy is not starved by a stream of
    /// writes); when it leaves, they go in together.
    #[test]
    fn writes_and_copies_take_turns() {
        let gate = Arc::new(Gate::default());
        let w1 = gate.write();
        let w2 = gate.write();
        assert!(!gate.copying());
        let (tx, rx) = mpsc::channel();
        let copier = {
            let (gate, tx) = (gate.clone(), tx.clone());
            std::thread::spawn(move || {
                let c = gate.copy();
                tx.send("copy in").expect("send");
                std::thread::sleep(Duration::from_millis(20));
                tx.send("copy out").expect("send");
                drop(c);
            })
        };
        until("the copy waits", || gate.waiting(Side::Copies) == 1);
        assert!(gate.copying());
        let late_writer = {
            let (gate, tx) = (gate.clone(), tx.clone());
            std::thread::spawn(move || {
                let _w = gate.write();
                tx.send("late write in").expect("send");
            })
        };
        until("the late write waits", || gate.waiting(Side::Writes) == 1);
        drop(w1);
        assert!(rx.try_recv().is_err(), "the copy went in beside a write");
        drop(w2);
        copier.join().expect("copier");
        late_writer.join().expect("late writer");
        let order: Vec<&str> = rx.try_iter().collect();
        assert_eq!(order, ["copy in", "copy out", "late write in"]);
        // Copies share the gate.
        let c1 = gate.copy();
        let c2 = gate.copy();
        assert!(gate.copying());
        drop((c1, c2));
        assert!(!gate.copying());
    }

    /// Copies in a stream do not starve a write: once it waits, newer copies wait behind it,
    /// and it goes in as soon as the copies inside leave.
    #[test]
    fn a_waiting_write_stops_new_copies() {
        let gate = Arc::new(Gate::default());
        let c1 = gate.copy();
        let (tx, rx) = mpsc::channel();
        let writer = {
            let (gate, tx) = (gate.clone(), tx.clone());
            std::thread::spawn(move || {
                let w = gate.write();
                tx.send("write in").expect("send");
                std::thread::sleep(Duration::from_millis(20));
                tx.send("write out").expect("send");
                drop(w);
            })
        };
        until("the write waits", || gate.waiting(Side::Writes) == 1);
        let late_copier = {
            let (gate, tx) = (gate.clone(), tx.clone());
            std::thread::spawn(move || {
                let _c = gate.copy();
                tx.send("late copy in").expect("send");
            })
        };
        until("the late copy waits", || gate.waiting(Side::Copies) == 1);
        drop(c1);
        writer.join().expect("writer");
        late_copier.join().expect("late copier");
        let order: Vec<&str> = rx.try_iter().collect();
        assert_eq!(order, ["write in", "write out", "late copy in"]);
    }

    /// Many threads of both sides through one gate: never a write and a copy inside at once,
    /// and everyone gets through.
    #[test]
    fn never_a_write_beside_a_copy() {
        use std::sync::atomic::{AtomicI64, Ordering};
        let gate = Arc::new(Gate::default());
        // Writes count up, copies down; each side checks the other is not inside.
        let inside = Arc::new(AtomicI64::new(0));
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let (gate, inside) = (gate.clone(), inside.clone());
                std::thread::spawn(move || {
                    for i in 0..2_000 {
                        if (t + i) % 5 == 0 {
                            let _c = gate.copy();
                            assert!(inside.fetch_sub(1, Ordering::SeqCst) <= 0);
                            std::hint::spin_loop();
                            inside.fetch_add(1, Ordering::SeqCst);
                        } else {
                            let _w = gate.write();
                            assert!(inside.fetch_add(1, Ordering::SeqCst) >= 0);
                            std::hint::spin_loop();
                            inside.fetch_sub(1, Ordering::SeqCst);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        assert_eq!(inside.load(Ordering::SeqCst), 0);
        assert!(!gate.copying());
    }
}
