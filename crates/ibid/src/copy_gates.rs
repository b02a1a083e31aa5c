//! Per-volume gates between the writes that reach a volume — over iSCSI and over NBD — and
//! the EXTENDED COPYs that involve it.
//!
//! A copy needs a moment when its volumes have no uncommitted change (the engine quiesces
//! them, and gives up if they keep changing): ESXi's ATS heartbeats write to a datastore every
//! few milliseconds while it clones a disk on it, and an NBD client writing to the same volume
//! does the same. So writes pass their volume's gate shared, a copy takes its volumes' gates
//! exclusively for its duration, and the writes that arrive meanwhile wait for the copy
//! (milliseconds) instead of failing it.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// A volume's gate: writes hold it shared, a copy exclusively.
pub type Gate = parking_lot::RwLock<()>;

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

    /// The gates of volumes `ids`, each once and in id order: a copy takes them in this
    /// order, so two copies in opposite directions cannot deadlock.
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
        // A writer's shared hold keeps a copy out until it ends.
        let write = gates.gate(7);
        let held = write.read();
        assert!(copy[1].try_write().is_none());
        drop(held);
        assert!(copy[1].try_write().is_some());
    }
}
