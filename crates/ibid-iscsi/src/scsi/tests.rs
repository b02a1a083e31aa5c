//! Unit tests of the SCSI layer against the in-memory backend.

use super::*;
use crate::memory::MemLuns;

fn target() -> Target {
    let mut luns = MemLuns::new(1 << 30, 80);
    luns.add(0, 64 << 20, false);
    luns.add(1, 64 << 20, false);
    Target::new(
        Arc::new(luns),
        TargetConfig::new("iqn.2026-11.org.ibid:test"),
    )
}

fn nexus(n: &str) -> Nexus {
    Nexus {
        port: format!("iqn.i{n},i,0x000000000001"),
        initiator: format!("iqn.i{n}"),
    }
}

#[test]
fn write_read_roundtrip_and_residual_length() {
    let t = target();
    let n = nexus("a");
    let data = vec![7u8; 1024];
    let r = t.execute(&n, 0, &[0x2a, 0, 0, 0, 0, 8, 0, 0, 2, 0], &data);
    assert_eq!(r.status, 0, "{r:?}");
    assert_eq!(r.data_out_len, Some(1024));
    let r = t.execute(&n, 0, &[0x28, 0, 0, 0, 0, 8, 0, 0, 2, 0], &[]);
    assert_eq!(r.data_in, data);
}

#[test]
fn caw_miscompare_reports_offset() {
    let t = target();
    let n = nexus("a");
    let mut d = vec![0u8; 1024];
    d[512..].fill(1);
    let cdb = [0x89, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0];
    assert_eq!(t.execute(&n, 0, &cdb, &d).status, 0);
    let r = t.execute(&n, 0, &cdb, &d);
    assert_eq!(r.sense, Some(Sense::miscompare(0)));
}

#[test]
fn unknown_opcode_and_bad_lun() {
    let t = target();
    let n = nexus("a");
    assert_eq!(
        t.execute(&n, 0, &[0xc1], &[]).sense,
        Some(Sense::invalid_opcode())
    );
    assert_eq!(
        t.execute(&n, 9, &[0x00], &[]).sense,
        Some(Sense::lun_not_supported())
    );
}

#[test]
fn xcopy_between_luns() {
    let t = target();
    let n = nexus("a");
    t.execute(&n, 0, &[0x2a, 0, 0, 0, 0, 0, 0, 0, 1, 0], &[9u8; 512]);
    let mut p = vec![0u8; 16];
    p[2..4].copy_from_slice(&64u16.to_be_bytes());
    p[8..12].copy_from_slice(&28u32.to_be_bytes());
    for lun in [0u64, 1] {
        let dev = t.luns.open(lun).unwrap();
        let mut td = vec![0u8; 32];
        td[0] = 0xe4;
        td[4..8].copy_from_slice(&[1, 3, 0, 16]);
        td[8..24].copy_from_slice(&naa_designator(&dev.id()));
        td[30] = 2;
        p.extend_from_slice(&td);
    }
    let mut sd = vec![0x02, 0, 0, 24, 0, 0, 0, 1, 0, 0, 0, 1];
    sd.extend_from_slice(&0u64.to_be_bytes());
    sd.extend_from_slice(&5u64.to_be_bytes());
    p.extend_from_slice(&sd);
    let mut cdb = [0u8; 16];
    cdb[0] = 0x83;
    cdb[10..14].copy_from_slice(&(p.len() as u32).to_be_bytes());
    let r = t.execute(&n, 0, &cdb, &p);
    assert_eq!(r.status, 0, "{r:?}");
    let r = t.execute(&n, 1, &[0x28, 0, 0, 0, 0, 5, 0, 0, 1, 0], &[]);
    assert_eq!(r.data_in, vec![9u8; 512]);
}

#[test]
fn persistent_reservation_blocks_other_writers() {
    let t = target();
    let (a, b) = (nexus("a"), nexus("b"));
    let mut reg = vec![0u8; 24];
    reg[8..16].copy_from_slice(&0xabu64.to_be_bytes());
    let prout = |sa: u8, ty: u8| [0x5f, sa, ty, 0, 0, 0, 0, 0, 24, 0];
    assert_eq!(t.execute(&a, 0, &prout(0, 0), &reg).status, 0);
    let mut res = vec![0u8; 24];
    res[0..8].copy_from_slice(&0xabu64.to_be_bytes());
    assert_eq!(t.execute(&a, 0, &prout(1, 1), &res).status, 0);
    let w = [0x2a, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    assert_eq!(
        t.execute(&b, 0, &w, &[0u8; 512]).status,
        STATUS_RESERVATION_CONFLICT
    );
    assert_eq!(t.execute(&a, 0, &w, &[0u8; 512]).status, 0);
}

/// Pool past the soft threshold: one UNIT ATTENTION 38h/07h per nexus, then
/// normal service; pool full: DATA PROTECT 27h/07h and the other LUN still
/// readable, and unmapping makes room again.
#[test]
fn soft_threshold_and_pool_full() {
    let mut luns = MemLuns::new(16 * 4096, 50);
    luns.add(0, 1 << 20, false);
    luns.add(1, 1 << 20, false);
    let t = Target::new(Arc::new(luns), TargetConfig::new("iqn.2026-11.org.ibid:t"));
    let (a, b) = (nexus("a"), nexus("b"));
    let w = |lba: u8| [0x2a, 0, 0, 0, 0, lba, 0, 0, 8, 0];
    for i in 0..8u8 {
        let r = t.execute(&a, 0, &w(i * 8), &[1u8; 4096]);
        assert_eq!(r.status, 0, "{r:?}");
    }
    let r = t.execute(&a, 0, &[0x00; 6], &[]);
    assert_eq!(r.sense, Some(Sense::soft_threshold()));
    assert_eq!(
        t.execute(&a, 0, &[0x00; 6], &[]).status,
        0,
        "UA is raised once"
    );
    assert_eq!(
        t.execute(&b, 1, &[0x00; 6], &[]).sense,
        Some(Sense::soft_threshold())
    );
    // Unit attentions are per I_T_L nexus: LUN 1 tells nexus a once too.
    assert_eq!(
        t.execute(&a, 1, &[0x00; 6], &[]).sense,
        Some(Sense::soft_threshold())
    );
    for i in 0..8u8 {
        assert_eq!(t.execute(&a, 1, &w(i * 8), &[2u8; 4096]).status, 0);
    }
    let r = t.execute(&a, 0, &w(128), &[3u8; 4096]);
    assert_eq!(r.sense, Some(Sense::no_space()));
    assert_eq!(
        t.execute(&b, 0, &[0x00; 6], &[]).sense,
        Some(Sense::soft_threshold())
    );
    let r = t.execute(&b, 0, &[0x28, 0, 0, 0, 0, 0, 0, 0, 8, 0], &[]);
    assert!(r.data_in == vec![1u8; 4096], "existing data stays readable");
    let mut unmap = vec![0, 22, 0, 16, 0, 0, 0, 0];
    unmap.extend_from_slice(&0u64.to_be_bytes());
    unmap.extend_from_slice(&8u32.to_be_bytes());
    unmap.extend_from_slice(&[0; 4]);
    assert_eq!(
        t.execute(&a, 0, &[0x42, 0, 0, 0, 0, 0, 0, 0, 24, 0], &unmap)
            .status,
        0
    );
    assert_eq!(
        t.execute(&a, 0, &w(128), &[3u8; 4096]).status,
        0,
        "unmap made room"
    );
}

/// GET LBA STATUS reports true mapped/deallocated extents from the start LBA.
#[test]
fn get_lba_status_extents() {
    let t = target();
    let n = nexus("a");
    t.execute(&n, 0, &[0x2a, 0, 0, 0, 0, 16, 0, 0, 8, 0], &[5u8; 4096]);
    let mut cdb = [0u8; 16];
    cdb[0] = 0x9e;
    cdb[1] = 0x12;
    cdb[9] = 4;
    cdb[13] = 64;
    let d = t.execute(&n, 0, &cdb, &[]).data_in;
    let desc = |i: usize| {
        let o = 8 + 16 * i;
        (
            u64::from_be_bytes(d[o..o + 8].try_into().unwrap()),
            u32::from_be_bytes(d[o + 8..o + 12].try_into().unwrap()),
            d[o + 12],
        )
    };
    assert_eq!(desc(0), (4, 12, 1));
    assert_eq!(desc(1), (16, 8, 0));
    assert_eq!(desc(2).0, 24);
    assert_eq!(desc(2).2, 1);
}

/// A capacity change is reported once per nexus as UNIT ATTENTION 2Ah/09h.
#[test]
fn capacity_change_unit_attention() {
    let mut luns = MemLuns::new(1 << 30, 80);
    let l = luns.add(0, 1 << 20, false);
    let t = Target::new(Arc::new(luns), TargetConfig::new("iqn.2026-11.org.ibid:t"));
    let n = nexus("a");
    assert_eq!(t.execute(&n, 0, &[0x00; 6], &[]).status, 0);
    l.resize(2 << 20);
    let ua = Sense::new(crate::sense::KEY_UNIT_ATTENTION, 0x2a, 0x09);
    assert_eq!(t.execute(&n, 0, &[0x00; 6], &[]).sense, Some(ua));
    assert_eq!(t.execute(&n, 0, &[0x00; 6], &[]).status, 0);
}

/// MODE SELECT accepts the current values back and refuses a change.
#[test]
fn mode_select_only_restates_current_values() {
    let t = target();
    let n = nexus("a");
    let sense = t
        .execute(&n, 0, &[0x1a, 0x08, 0x08, 0, 255, 0], &[])
        .data_in;
    let mut list = vec![0u8, 0, 0, 0];
    list.extend_from_slice(&sense[4..]);
    let cdb = [0x15, 0x10, 0, 0, list.len() as u8, 0];
    assert_eq!(t.execute(&n, 0, &cdb, &list).status, 0);
    list[6] &= !0x04; // clear WCE
    assert_eq!(
        t.execute(&n, 0, &cdb, &list).sense.map(|s| s.asc),
        Some(0x26)
    );
}

/// A connection's cached LUN handle is reused while the inventory stays the same and dropped
/// when it changes: after LUN 0 comes to address another device, the same cache reaches it.
#[test]
fn lun_cache_follows_inventory_changes() {
    use crate::backend::LunInfo;
    use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
    struct Renumbered {
        generation: AtomicU64,
        opens: AtomicU64,
        devs: [Arc<dyn Lun>; 2],
    }
    impl Luns for Renumbered {
        fn list(&self) -> Vec<LunInfo> {
            Vec::new()
        }
        fn open(&self, lun: u64) -> Option<Arc<dyn Lun>> {
            self.opens.fetch_add(1, SeqCst);
            (lun == 0).then(|| self.devs[(self.generation.load(SeqCst) % 2) as usize].clone())
        }
        fn copy_range(&self, _: u64, _: u64, _: u64, _: u64, _: u64) -> Result<(), LunError> {
            Err(LunError::OutOfRange)
        }
        fn generation(&self) -> u64 {
            self.generation.load(SeqCst)
        }
    }
    let mut mem = MemLuns::new(1 << 30, 80);
    let a: Arc<dyn Lun> = mem.add(0, 1 << 20, false);
    let b: Arc<dyn Lun> = mem.add(1, 2 << 20, false);
    assert_ne!(a.id(), b.id());
    let luns = Renumbered {
        generation: AtomicU64::new(0),
        opens: AtomicU64::new(0),
        devs: [a.clone(), b.clone()],
    };
    let cache = LunCache::default();
    for _ in 0..3 {
        assert_eq!(cache.get(&luns, 0).map(|d| d.id()), Some(a.id()));
    }
    assert_eq!(
        luns.opens.load(SeqCst),
        1,
        "opened once while nothing changed"
    );
    luns.generation.store(1, SeqCst);
    assert_eq!(cache.get(&luns, 0).map(|d| d.id()), Some(b.id()));
    assert!(cache.get(&luns, 5).is_none());
}
