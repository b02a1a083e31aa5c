//! An in-memory backend for tests: sparse 4 KiB blocks, honest block status,
//! atomic compare-and-write under the LUN lock, and an optional pool capacity
//! so tests can provoke the soft threshold and "pool full".

use crate::backend::{Extent, Lun, LunError, LunInfo, Luns};
use parking_lot::RwLock;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Allocation unit of the in-memory LUN, in bytes.
pub const MEM_BLOCK: u64 = 4096;

/// Pool-wide space accounting shared by all LUNs of one [`MemLuns`].
#[derive(Debug)]
pub struct MemPool {
    used_blocks: AtomicU64,
    capacity_blocks: u64,
    soft_blocks: u64,
}

impl MemPool {
    fn alloc(&self) -> Result<(), LunError> {
        let prev = self.used_blocks.fetch_add(1, Ordering::SeqCst);
        if prev >= self.capacity_blocks {
            self.used_blocks.fetch_sub(1, Ordering::SeqCst);
            return Err(LunError::NoSpace);
        }
        Ok(())
    }
    fn free(&self, n: u64) {
        self.used_blocks.fetch_sub(n, Ordering::SeqCst);
    }
    /// Blocks in use.
    pub fn used_blocks(&self) -> u64 {
        self.used_blocks.load(Ordering::SeqCst)
    }
}

/// One in-memory LUN.
pub struct MemLun {
    size: AtomicU64,
    read_only: bool,
    id: [u8; 16],
    pool: Arc<MemPool>,
    blocks: RwLock<HashMap<u64, Box<[u8]>>>,
}

impl MemLun {
    /// Change the size (data past a shrunk end stays allocated; tests only).
    pub fn resize(&self, size: u64) {
        self.size.store(size & !511, Ordering::SeqCst);
    }

    fn check(&self, off: u64, len: u64) -> Result<(), LunError> {
        match off.checked_add(len) {
            Some(end) if end <= self.size() => Ok(()),
            _ => Err(LunError::OutOfRange),
        }
    }

    fn read_locked(map: &HashMap<u64, Box<[u8]>>, off: u64, buf: &mut [u8]) {
        let mut pos = 0usize;
        while pos < buf.len() {
            let abs = off + pos as u64;
            let (blk, within) = (abs / MEM_BLOCK, (abs % MEM_BLOCK) as usize);
            let n = (MEM_BLOCK as usize - within).min(buf.len() - pos);
            match map.get(&blk) {
                Some(b) => buf[pos..pos + n].copy_from_slice(&b[within..within + n]),
                None => buf[pos..pos + n].fill(0),
            }
            pos += n;
        }
    }

    fn write_locked(
        &self,
        map: &mut HashMap<u64, Box<[u8]>>,
        off: u64,
        data: &[u8],
    ) -> Result<(), LunError> {
        let mut pos = 0usize;
        while pos < data.len() {
            let abs = off + pos as u64;
            let (blk, within) = (abs / MEM_BLOCK, (abs % MEM_BLOCK) as usize);
            let n = (MEM_BLOCK as usize - within).min(data.len() - pos);
            let chunk = &data[pos..pos + n];
            match map.entry(blk) {
                Entry::Occupied(mut e) => e.get_mut()[within..within + n].copy_from_slice(chunk),
                Entry::Vacant(_) if chunk.iter().all(|&b| b == 0) => {}
                Entry::Vacant(e) => {
                    self.pool.alloc()?;
                    e.insert(vec![0u8; MEM_BLOCK as usize].into_boxed_slice())[within..within + n]
                        .copy_from_slice(chunk);
                }
            }
            pos += n;
        }
        Ok(())
    }

    fn zero_locked(&self, map: &mut HashMap<u64, Box<[u8]>>, off: u64, len: u64) {
        let end = off + len;
        let mut abs = off;
        while abs < end {
            let (blk, within) = (abs / MEM_BLOCK, abs % MEM_BLOCK);
            let n = (MEM_BLOCK - within).min(end - abs);
            if n == MEM_BLOCK {
                if map.remove(&blk).is_some() {
                    self.pool.free(1);
                }
            } else if let Some(b) = map.get_mut(&blk) {
                b[within as usize..(within + n) as usize].fill(0);
            }
            abs += n;
        }
    }
}

impl Lun for MemLun {
    fn size(&self) -> u64 {
        self.size.load(Ordering::SeqCst)
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn id(&self) -> [u8; 16] {
        self.id
    }
    fn read(&self, off: u64, buf: &mut [u8]) -> Result<(), LunError> {
        self.check(off, buf.len() as u64)?;
        Self::read_locked(&self.blocks.read(), off, buf);
        Ok(())
    }
    /// Reads of 16 KiB or more hold every other 4 KiB of their data outside `buf` (whose
    /// bytes there are scrambled), so that the tests drive the target's sending of held parts.
    fn read_held(
        &self,
        off: u64,
        buf: &mut [u8],
    ) -> Result<Option<Box<dyn crate::HeldData>>, LunError> {
        self.read(off, buf)?;
        if buf.len() < 16 << 10 {
            return Ok(None);
        }
        let parts = buf
            .chunks_mut(4096)
            .enumerate()
            .step_by(2)
            .map(|(i, piece)| {
                let part = (i * 4096, piece.to_vec());
                piece.fill(0xa5);
                part
            })
            .collect();
        Ok(Some(Box::new(HeldCopies(parts))))
    }
    fn write(&self, off: u64, data: &[u8], _fua: bool) -> Result<(), LunError> {
        self.check(off, data.len() as u64)?;
        if self.read_only {
            return Err(LunError::ReadOnly);
        }
        self.write_locked(&mut self.blocks.write(), off, data)
    }
    fn write_zeroes(&self, off: u64, len: u64) -> Result<(), LunError> {
        self.check(off, len)?;
        if self.read_only {
            return Err(LunError::ReadOnly);
        }
        self.zero_locked(&mut self.blocks.write(), off, len);
        Ok(())
    }
    fn flush(&self) -> Result<(), LunError> {
        Ok(())
    }
    fn compare_and_write(
        &self,
        off: u64,
        expected: &[u8],
        new: &[u8],
    ) -> Result<Option<u64>, LunError> {
        self.check(off, expected.len() as u64)?;
        if self.read_only {
            return Err(LunError::ReadOnly);
        }
        let mut map = self.blocks.write();
        let mut cur = vec![0u8; expected.len()];
        Self::read_locked(&map, off, &mut cur);
        if let Some(i) = cur.iter().zip(expected).position(|(a, b)| a != b) {
            return Ok(Some(i as u64));
        }
        self.write_locked(&mut map, off, new)?;
        Ok(None)
    }
    fn block_status(&self, off: u64, len: u64) -> Result<Vec<Extent>, LunError> {
        self.check(off, len)?;
        let map = self.blocks.read();
        let mut out: Vec<Extent> = Vec::new();
        let end = off + len;
        let mut abs = off;
        while abs < end {
            let blk = abs / MEM_BLOCK;
            let n = ((blk + 1) * MEM_BLOCK).min(end) - abs;
            let mapped = map.contains_key(&blk);
            match out.last_mut() {
                Some(e) if e.mapped == mapped => e.len += n,
                _ => out.push(Extent {
                    off: abs,
                    len: n,
                    mapped,
                }),
            }
            abs += n;
        }
        Ok(out)
    }
}

/// Parts of a read held as copies of their own, (offset, bytes) ascending ([`MemLun`]'s
/// `read_held`).
pub(crate) struct HeldCopies(pub(crate) Vec<(usize, Vec<u8>)>);

impl crate::HeldData for HeldCopies {
    fn parts(&self) -> usize {
        self.0.len()
    }
    fn part(&self, i: usize) -> (usize, &[u8]) {
        (self.0[i].0, &self.0[i].1)
    }
}

/// A set of in-memory LUNs sharing one [`MemPool`].
pub struct MemLuns {
    luns: BTreeMap<u64, Arc<MemLun>>,
    pool: Arc<MemPool>,
}

impl MemLuns {
    /// A pool with room for `capacity` bytes and a soft threshold at
    /// `soft_percent` of it.
    pub fn new(capacity: u64, soft_percent: u64) -> Self {
        let capacity_blocks = capacity / MEM_BLOCK;
        MemLuns {
            luns: BTreeMap::new(),
            pool: Arc::new(MemPool {
                used_blocks: AtomicU64::new(0),
                capacity_blocks,
                soft_blocks: capacity_blocks * soft_percent / 100,
            }),
        }
    }

    /// Add LUN `lun` of `size` bytes (rounded down to 512).
    pub fn add(&mut self, lun: u64, size: u64, read_only: bool) -> Arc<MemLun> {
        let mut id = *b"ibid-mem-lun\0\0\0\0";
        id[12..16].copy_from_slice(&(lun as u32).to_be_bytes());
        let l = Arc::new(MemLun {
            size: AtomicU64::new(size & !511),
            read_only,
            id,
            pool: self.pool.clone(),
            blocks: RwLock::new(HashMap::new()),
        });
        self.luns.insert(lun, l.clone());
        l
    }

    /// The shared pool accounting.
    pub fn pool(&self) -> Arc<MemPool> {
        self.pool.clone()
    }
}

impl Luns for MemLuns {
    fn list(&self) -> Vec<LunInfo> {
        self.luns
            .keys()
            .map(|&lun| LunInfo {
                lun,
                name: format!("mem{lun}"),
            })
            .collect()
    }
    fn open(&self, lun: u64) -> Option<Arc<dyn Lun>> {
        self.luns.get(&lun).map(|l| l.clone() as Arc<dyn Lun>)
    }
    fn copy_range(
        &self,
        src_lun: u64,
        src_off: u64,
        dst_lun: u64,
        dst_off: u64,
        len: u64,
    ) -> Result<(), LunError> {
        let src = self.luns.get(&src_lun).ok_or(LunError::NoSuchLun)?;
        let dst = self.luns.get(&dst_lun).ok_or(LunError::NoSuchLun)?;
        let mut buf = vec![0u8; len as usize];
        src.read(src_off, &mut buf)?;
        dst.write(dst_off, &buf, false)
    }
    fn space_warning(&self) -> bool {
        self.pool.used_blocks() >= self.pool.soft_blocks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_rw_and_status() {
        let mut luns = MemLuns::new(1 << 30, 80);
        let l = luns.add(0, 1 << 20, false);
        l.write(8192, &[1u8; 512], false).unwrap();
        let st = l.block_status(0, 16384).unwrap();
        assert_eq!(st.len(), 3);
        assert!(st[1].mapped && st[1].off == 8192 && st[1].len == 4096);
        l.write_zeroes(8192, 4096).unwrap();
        assert_eq!(luns.pool().used_blocks(), 0);
        assert_eq!(l.compare_and_write(0, &[0; 512], &[2; 512]).unwrap(), None);
        assert_eq!(
            l.compare_and_write(0, &[0; 512], &[3; 512]).unwrap(),
            Some(0)
        );
    }

    #[test]
    fn pool_full() {
        let mut luns = MemLuns::new(8192, 50);
        let l = luns.add(0, 1 << 20, false);
        l.write(0, &[1u8; 8192], false).unwrap();
        assert!(luns.space_warning());
        assert_eq!(l.write(8192, &[1u8; 512], false), Err(LunError::NoSpace));
    }
}
