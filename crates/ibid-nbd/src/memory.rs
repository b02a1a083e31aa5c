//! An in-memory backend: a sparse map of 4 KiB blocks with honest block status, for tests,
//! fuzzing and demos.
//!
//! Blocks that read as zero are never stored (a write of zeroes deallocates, like the engine),
//! so `block_status` reports exactly: stored blocks are data, everything else is a zero hole.
//! An optional capacity (in blocks) makes writes that need new blocks fail with
//! [`ExportError::NoSpace`] without changing anything, to test the pool-full path.

use crate::export::{Export, ExportError, ExportInfo, Exports, Extent};
use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError, RwLock};

/// Size of one stored block, in bytes.
pub const MEMORY_BLOCK_LEN: u64 = 4096;

type Blocks = BTreeMap<u64, Box<[u8]>>;

/// A sparse in-memory volume.
#[derive(Debug)]
pub struct MemoryExport {
    size: u64,
    read_only: bool,
    capacity_blocks: Option<usize>,
    blocks: RwLock<Blocks>,
}

impl MemoryExport {
    /// A writable, empty (all-zero) export of `size` bytes (a multiple of 512).
    pub fn new(size: u64) -> Self {
        assert_eq!(size % 512, 0, "export size must be a multiple of 512");
        MemoryExport {
            size,
            read_only: false,
            capacity_blocks: None,
            blocks: RwLock::new(BTreeMap::new()),
        }
    }

    /// The same export, but read-only.
    pub fn read_only(mut self) -> Self {
        self.read_only = true;
        self
    }

    /// Limits the stored blocks to `blocks`; writes needing more fail with `NoSpace`.
    pub fn with_capacity_blocks(mut self, blocks: usize) -> Self {
        self.capacity_blocks = Some(blocks);
        self
    }

    /// Writes without the read-only check (to fill read-only exports in tests).
    pub fn fill(&self, offset: u64, data: &[u8]) -> Result<(), ExportError> {
        self.check_range(offset, data.len() as u64)?;
        self.store(offset, data)
    }

    /// Number of 4 KiB blocks currently stored (non-zero data).
    pub fn stored_blocks(&self) -> usize {
        self.blocks
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), ExportError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(ExportError::OutOfRange),
        }
    }

    /// Splits `[offset, offset+len)` into (block index, offset in block, length) pieces.
    fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u64, usize, usize)> {
        let end = offset + len;
        let mut pos = offset;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let block = pos / MEMORY_BLOCK_LEN;
            let in_block = pos % MEMORY_BLOCK_LEN;
            let n = (MEMORY_BLOCK_LEN - in_block).min(end - pos);
            pos += n;
            Some((block, in_block as usize, n as usize))
        })
    }

    fn store(&self, offset: u64, data: &[u8]) -> Result<(), ExportError> {
        let mut blocks = self.blocks.write().unwrap_or_else(PoisonError::into_inner);
        // Count the new blocks first so that a full pool changes nothing.
        let mut consumed = 0usize;
        let mut new_blocks = 0usize;
        for (block, _, n) in Self::pieces(offset, data.len() as u64) {
            let chunk = &data[consumed..consumed + n];
            consumed += n;
            if !blocks.contains_key(&block) && chunk.iter().any(|&b| b != 0) {
                new_blocks += 1;
            }
        }
        if let Some(cap) = self.capacity_blocks {
            if blocks.len() + new_blocks > cap {
                return Err(ExportError::NoSpace);
            }
        }
        let mut consumed = 0usize;
        for (block, at, n) in Self::pieces(offset, data.len() as u64) {
            let chunk = &data[consumed..consumed + n];
            consumed += n;
            match blocks.get_mut(&block) {
                Some(stored) => {
                    stored[at..at + n].copy_from_slice(chunk);
                    if stored.iter().all(|&b| b == 0) {
                        blocks.remove(&block);
                    }
                }
                None if chunk.iter().all(|&b| b == 0) => {}
                None => {
                    let mut stored = vec![0u8; MEMORY_BLOCK_LEN as usize].into_boxed_slice();
                    stored[at..at + n].copy_from_slice(chunk);
                    blocks.insert(block, stored);
                }
            }
        }
        Ok(())
    }

    fn zero(&self, offset: u64, len: u64) {
        let mut blocks = self.blocks.write().unwrap_or_else(PoisonError::into_inner);
        let first = offset / MEMORY_BLOCK_LEN;
        let last = (offset + len).div_ceil(MEMORY_BLOCK_LEN);
        // Visit only stored blocks: cost is per stored block, not per block of the range.
        let keys: Vec<u64> = blocks.range(first..last).map(|(k, _)| *k).collect();
        for block in keys {
            let start = (block * MEMORY_BLOCK_LEN).max(offset);
            let end = ((block + 1) * MEMORY_BLOCK_LEN).min(offset + len);
            let at = (start - block * MEMORY_BLOCK_LEN) as usize;
            let n = (end - start) as usize;
            let remove = match blocks.get_mut(&block) {
                Some(stored) => {
                    stored[at..at + n].fill(0);
                    stored.iter().all(|&b| b == 0)
                }
                None => false,
            };
            if remove {
                blocks.remove(&block);
            }
        }
    }
}

impl Export for MemoryExport {
    fn size(&self) -> u64 {
        self.size
    }

    fn description(&self) -> String {
        format!("in-memory export of {} bytes", self.size)
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        self.check_range(offset, buf.len() as u64)?;
        let blocks = self.blocks.read().unwrap_or_else(PoisonError::into_inner);
        let mut done = 0usize;
        for (block, at, n) in Self::pieces(offset, buf.len() as u64) {
            let out = &mut buf[done..done + n];
            done += n;
            match blocks.get(&block) {
                Some(stored) => out.copy_from_slice(&stored[at..at + n]),
                None => out.fill(0),
            }
        }
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> Result<(), ExportError> {
        if self.read_only {
            return Err(ExportError::ReadOnly);
        }
        self.check_range(offset, data.len() as u64)?;
        self.store(offset, data)
    }

    fn write_zeroes(&self, offset: u64, len: u64, _fua: bool) -> Result<(), ExportError> {
        if self.read_only {
            return Err(ExportError::ReadOnly);
        }
        self.check_range(offset, len)?;
        self.zero(offset, len);
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64) -> Result<(), ExportError> {
        self.write_zeroes(offset, len, false)
    }

    fn flush(&self) -> Result<(), ExportError> {
        Ok(())
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, ExportError> {
        self.check_range(offset, len)?;
        let end = offset + len;
        let blocks = self.blocks.read().unwrap_or_else(PoisonError::into_inner);
        let mut extents: Vec<Extent> = Vec::new();
        let mut push = |len: u64, data: bool| {
            if len == 0 {
                return;
            }
            match extents.last_mut() {
                Some(last) if last.hole != data => last.len += len,
                _ => extents.push(Extent {
                    len,
                    zero: !data,
                    hole: !data,
                }),
            }
        };
        let mut pos = offset;
        let first = offset / MEMORY_BLOCK_LEN;
        let last = end.div_ceil(MEMORY_BLOCK_LEN);
        for (&block, _) in blocks.range(first..last) {
            let start = (block * MEMORY_BLOCK_LEN).max(offset);
            let stop = ((block + 1) * MEMORY_BLOCK_LEN).min(end);
            push(start - pos, false);
            push(stop - start, true);
            pos = stop;
        }
        push(end - pos, false);
        Ok(extents)
    }
}

/// A named set of [`MemoryExport`]s.
#[derive(Debug, Default)]
pub struct MemoryExports {
    exports: RwLock<BTreeMap<String, Arc<MemoryExport>>>,
}

impl MemoryExports {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the export `name`; returns it for direct inspection in tests.
    pub fn insert(&self, name: &str, export: MemoryExport) -> Arc<MemoryExport> {
        let export = Arc::new(export);
        self.exports
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(name.to_string(), export.clone());
        export
    }
}

impl Exports for MemoryExports {
    fn list(&self) -> Vec<ExportInfo> {
        let exports = self.exports.read().unwrap_or_else(PoisonError::into_inner);
        exports
            .iter()
            .map(|(name, e)| ExportInfo {
                name: name.clone(),
                description: e.description(),
            })
            .collect()
    }

    fn open(&self, name: &str) -> Option<Arc<dyn Export>> {
        let exports = self.exports.read().unwrap_or_else(PoisonError::into_inner);
        exports.get(name).map(|e| e.clone() as Arc<dyn Export>)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_zero_and_status() {
        let e = MemoryExport::new(64 * 1024);
        e.write(4096, &[7u8; 8192], false).expect("write");
        e.write(512, &[0u8; 512], false).expect("zero write");
        assert_eq!(e.stored_blocks(), 2);
        let mut buf = vec![0u8; 16384];
        e.read(0, &mut buf).expect("read");
        assert!(buf[..4096].iter().all(|&b| b == 0));
        assert!(buf[4096..12288].iter().all(|&b| b == 7));
        let st = e.block_status(0, 65536).expect("status");
        assert_eq!(
            st,
            vec![
                Extent {
                    len: 4096,
                    zero: true,
                    hole: true
                },
                Extent {
                    len: 8192,
                    zero: false,
                    hole: false
                },
                Extent {
                    len: 53248,
                    zero: true,
                    hole: true
                },
            ]
        );
        e.write_zeroes(4096, 4096, false).expect("zero");
        assert_eq!(e.stored_blocks(), 1);
        let st = e.block_status(6144, 1024).expect("status");
        assert_eq!(
            st,
            vec![Extent {
                len: 1024,
                zero: true,
                hole: true
            }]
        );
    }

    #[test]
    fn full_pool_changes_nothing() {
        let e = MemoryExport::new(1 << 20).with_capacity_blocks(1);
        e.write(0, &[1u8; 4096], false).expect("first block fits");
        assert_eq!(
            e.write(4096, &[2u8; 8192], false),
            Err(ExportError::NoSpace)
        );
        assert_eq!(e.stored_blocks(), 1);
        e.write(0, &[3u8; 4096], false)
            .expect("overwrite needs no space");
    }
}
