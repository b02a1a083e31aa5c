//! [`SimDisk`]: a pool directory in memory that can lose power.
//!
//! Every file keeps two images: what is *durable* and what is *current* (durable plus the
//! writes and size changes since its last `sync_data`, kept in order). Directory entries work
//! the same way: a file created or removed since its directory's last `sync_dir` may or may
//! not be there after a power cut. [`SimDisk::power_cut`] turns each file's pending changes
//! into one of what a real disk could leave: none of them, a random subset (a device reorders
//! writes it has not been told to flush), or all of them with the last write torn at a
//! 512-byte sector boundary. Handles opened before a cut fail every later operation with EIO
//! (the process that held them is dead); the disk is then reopened through new handles.
//!
//! A cut is armed with [`SimDisk::cut_after`]: the n-th mutating operation from then on
//! (write, size change, sync, create, remove) fails with EIO instead of happening, and so does
//! everything after it until [`SimDisk::power_cut`]. [`SimDisk::inject`] fails one chosen
//! operation with a chosen errno (EIO, ENOSPC) and leaves the disk running;
//! [`SimDisk::set_latency`] makes chosen operations slow and [`SimDisk::pause`] holds them
//! until resumed.
//!
//! All randomness comes from the seed given to [`SimDisk::new`]: the same seed and the same
//! sequence of operations leave the same bytes.

use super::{Disk, DiskFile, OpenMode};
use parking_lot::Mutex;
use std::any::Any;
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Sector size: the unit a torn write keeps or loses.
const SECTOR_BYTES: usize = 512;
/// Unit of `O_DIRECT` alignment.
const DIRECT_ALIGN: usize = 4096;

/// A small deterministic random number generator (SplitMix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator started from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        self.next_u64() % n
    }

    /// True with probability `1/n`.
    pub fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }
}

/// Which operations a [`Fault`] matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultOp {
    /// `read_exact_at`.
    Read,
    /// `write_all_at`.
    Write,
    /// `sync_data` and `sync_dir`.
    Sync,
}

/// One operation made to fail: the `nth` (from 1) operation of kind `op` on a path containing
/// `path_contains`, counted from when the fault is injected, fails with `errno`.
#[derive(Debug, Clone)]
pub struct Fault {
    /// The kind of operation.
    pub op: FaultOp,
    /// A substring of the file's path.
    pub path_contains: String,
    /// Which matching operation fails (1: the next one).
    pub nth: u64,
    /// The error, e.g. `libc::EIO` or `libc::ENOSPC`.
    pub errno: i32,
}

/// What the disk has seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Mutating operations (writes, size changes, syncs, creations, removals).
    pub ops: u64,
    /// Syncs (`sync_data` and `sync_dir`).
    pub syncs: u64,
    /// Power cuts.
    pub power_cuts: u64,
    /// Faults that fired.
    pub faults: u64,
    /// A digest of every mutating operation (kind, path, offset, length), in order: equal for
    /// two runs that did the same I/O.
    pub digest: u64,
    /// Most operations that were ever inside their latency or pause at once (how many a
    /// slow device had in flight together).
    pub peak_in_flight: u64,
}

#[derive(Debug, Clone)]
enum Change {
    Write { at: u64, data: Vec<u8> },
    SetLen(u64),
}

#[derive(Debug, Default)]
struct FileData {
    durable: Vec<u8>,
    current: Vec<u8>,
    pending: Vec<Change>,
}

fn apply(image: &mut Vec<u8>, change: &Change) {
    match change {
        Change::Write { at, data } => {
            let (at, end) = (*at as usize, *at as usize + data.len());
            if image.len() < end {
                image.resize(end, 0);
            }
            image[at..end].copy_from_slice(data);
        }
        Change::SetLen(len) => image.resize(*len as usize, 0),
    }
}

type Entry = Arc<Mutex<FileData>>;

#[derive(Debug, Default)]
struct State {
    rng: Option<Rng>,
    /// Bumped at each power cut: handles of an older generation fail.
    generation: u64,
    files: BTreeMap<PathBuf, Entry>,
    /// The entries a power cut would find (as of each directory's last sync).
    durable_files: BTreeMap<PathBuf, Entry>,
    dirs: BTreeSet<PathBuf>,
    /// Mutating operations left before the power goes (`None`: not armed).
    cut_in: Option<u64>,
    /// The power is off until [`SimDisk::power_cut`].
    off: bool,
    faults: Vec<(Fault, u64)>,
    /// Extra time taken by operations of a kind on paths containing a substring.
    latency: Vec<(FaultOp, String, std::time::Duration)>,
    /// Operations of a kind on paths containing a substring wait until resumed.
    paused: Vec<(FaultOp, String)>,
    /// Operations between their start and the end of their latency or pause, now.
    in_flight: u64,
    locked: BTreeSet<PathBuf>,
    capacity: u64,
    stats: SimStats,
}

impl State {
    /// Counts a mutating operation; fails it if the power is off or goes now.
    fn mutate(
        &mut self,
        generation: u64,
        kind: u64,
        path: &Path,
        at: u64,
        len: u64,
    ) -> io::Result<()> {
        self.check(generation)?;
        if let Some(left) = self.cut_in.as_mut() {
            if *left <= 1 {
                self.cut_in = None;
                self.off = true;
                return Err(eio("power cut"));
            }
            *left -= 1;
        }
        if trace() {
            eprintln!("sim-io {kind} {} at={at} len={len}", path.display());
        }
        let s = &mut self.stats;
        s.ops += 1;
        for v in [kind, hash_path(path), at, len] {
            s.digest = (s.digest ^ v)
                .wrapping_mul(0x0000_0100_0000_01b3)
                .rotate_left(17);
        }
        Ok(())
    }

    fn check(&self, generation: u64) -> io::Result<()> {
        if self.off || generation != self.generation {
            return Err(eio("the power is off"));
        }
        Ok(())
    }

    /// Fires a fault matching this operation, if one is due.
    fn fault(&mut self, op: FaultOp, path: &Path) -> io::Result<()> {
        let p = path.to_string_lossy();
        let mut fired = None;
        for (i, (f, seen)) in self.faults.iter_mut().enumerate() {
            if f.op == op && p.contains(&f.path_contains) {
                *seen += 1;
                if *seen == f.nth {
                    fired = Some(i);
                    break;
                }
            }
        }
        match fired {
            Some(i) => {
                let (f, _) = self.faults.remove(i);
                self.stats.faults += 1;
                Err(io::Error::from_raw_os_error(f.errno))
            }
            None => Ok(()),
        }
    }

    fn used_bytes(&self) -> u64 {
        self.files
            .values()
            .map(|f| f.lock().current.len() as u64)
            .sum()
    }
}

/// The error every operation gets while the power is off (`_why` says which case, for the
/// reader of this file).
fn eio(_why: &str) -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

/// Whether `IBID_SIM_TRACE` asks for every operation and power cut on stderr.
fn trace() -> bool {
    static TRACE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TRACE.get_or_init(|| std::env::var_os("IBID_SIM_TRACE").is_some())
}

fn hash_path(path: &Path) -> u64 {
    path.as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
        })
}

/// A pause of some operations (see [`SimDisk::pause`]); they resume when it is dropped.
#[derive(Debug)]
pub struct Paused {
    disk: SimDisk,
    op: FaultOp,
    path_contains: String,
}

impl Drop for Paused {
    fn drop(&mut self) {
        let mut st = self.disk.state.lock();
        if let Some(i) =
            (st.paused.iter()).position(|(o, p)| *o == self.op && *p == self.path_contains)
        {
            st.paused.remove(i);
        }
        drop(st);
        self.disk.resumed.notify_all();
    }
}

/// A pool directory in memory that can lose power (see the module's doc). Clones share the
/// same disk.
#[derive(Debug, Clone, Default)]
pub struct SimDisk {
    state: Arc<Mutex<State>>,
    /// Signalled when a pause ends.
    resumed: Arc<parking_lot::Condvar>,
}

impl SimDisk {
    /// An empty disk of `capacity` bytes whose randomness comes from `seed`.
    pub fn new(seed: u64, capacity: u64) -> SimDisk {
        let state = State {
            rng: Some(Rng::new(seed)),
            capacity,
            ..Default::default()
        };
        SimDisk {
            state: Arc::new(Mutex::new(state)),
            resumed: Arc::default(),
        }
    }

    /// Arms a power cut: the `n`-th mutating operation from now on (n ≥ 1) fails, and so does
    /// everything after it, until [`SimDisk::power_cut`].
    pub fn cut_after(&self, n: u64) {
        self.state.lock().cut_in = Some(n.max(1));
    }

    /// Disarms a cut armed by [`SimDisk::cut_after`] that has not happened.
    pub fn disarm(&self) {
        self.state.lock().cut_in = None;
    }

    /// Whether the power is off (an armed cut happened).
    pub fn is_off(&self) -> bool {
        self.state.lock().off
    }

    /// Makes one operation fail (see [`Fault`]).
    pub fn inject(&self, fault: Fault) {
        self.state.lock().faults.push((fault, 0));
    }

    /// Removes faults that have not fired.
    pub fn clear_faults(&self) {
        self.state.lock().faults.clear();
    }

    /// Makes every operation of kind `op` on a path containing `path_contains` take `delay`
    /// longer (a slow device; a zero delay removes it). Kept across power cuts.
    pub fn set_latency(&self, op: FaultOp, path_contains: &str, delay: std::time::Duration) {
        let mut st = self.state.lock();
        st.latency
            .retain(|(o, p, _)| !(*o == op && p == path_contains));
        if !delay.is_zero() {
            st.latency.push((op, path_contains.to_string(), delay));
        }
    }

    /// Makes every operation of kind `op` on a path containing `path_contains` wait, from
    /// now until the returned guard is dropped (a device that stalls; for tests of what runs
    /// while a write or sync is held up).
    pub fn pause(&self, op: FaultOp, path_contains: &str) -> Paused {
        self.state
            .lock()
            .paused
            .push((op, path_contains.to_string()));
        Paused {
            disk: self.clone(),
            op,
            path_contains: path_contains.to_string(),
        }
    }

    /// Ends every pause (their guards then end nothing).
    pub fn resume_all(&self) {
        self.state.lock().paused.clear();
        self.resumed.notify_all();
    }

    /// Waits while `op` on `path` is paused, then sleeps for its latency, if any; both outside
    /// the disk's lock, counted in flight.
    fn wait(&self, op: FaultOp, path: &Path) {
        let p = path.to_string_lossy();
        let matches = |o: &FaultOp, sub: &str| *o == op && p.contains(sub);
        let mut st = self.state.lock();
        let delay: std::time::Duration = (st.latency.iter())
            .filter(|(o, sub, _)| matches(o, sub))
            .map(|(_, _, d)| *d)
            .sum();
        let paused = |st: &State| st.paused.iter().any(|(o, sub)| matches(o, sub));
        if delay.is_zero() && !paused(&st) {
            return;
        }
        st.in_flight += 1;
        st.stats.peak_in_flight = st.stats.peak_in_flight.max(st.in_flight);
        while paused(&st) {
            self.resumed.wait(&mut st);
        }
        drop(st);
        std::thread::sleep(delay);
        self.state.lock().in_flight -= 1;
    }

    /// What the disk has seen so far.
    pub fn stats(&self) -> SimStats {
        self.state.lock().stats
    }

    /// Cuts the power (whether or not an armed cut happened) and brings it back: every file's
    /// changes since its last sync and every directory change since its last sync are lost,
    /// kept in part or torn, at random; handles opened before fail from now on.
    pub fn power_cut(&self) {
        let mut st = self.state.lock();
        let st = &mut *st;
        let mut rng = st.rng.take().unwrap_or_else(|| Rng::new(0));
        // The directory entries a restart finds.
        let mut names: BTreeMap<PathBuf, Entry> = BTreeMap::new();
        let paths: BTreeSet<PathBuf> = st
            .files
            .keys()
            .chain(st.durable_files.keys())
            .cloned()
            .collect();
        for path in paths {
            let entry = match (st.files.get(&path), st.durable_files.get(&path)) {
                (Some(c), Some(d)) if Arc::ptr_eq(c, d) => Some(c.clone()),
                (Some(c), Some(d)) => Some(if rng.one_in(2) { c } else { d }.clone()),
                // Created since the directory's last sync, or removed.
                (Some(e), None) | (None, Some(e)) => rng.one_in(2).then(|| e.clone()),
                (None, None) => None,
            };
            if trace() && entry.is_none() {
                eprintln!("sim-cut {}: entry lost", path.display());
            }
            if let Some(e) = entry {
                names.insert(path, e);
            }
        }
        // Each file's pending changes: none, a random subset, or all with the last one torn.
        let mut done: Vec<*const Mutex<FileData>> = Vec::new();
        for entry in names.values() {
            if done.contains(&Arc::as_ptr(entry)) {
                continue;
            }
            done.push(Arc::as_ptr(entry));
            let mut f = entry.lock();
            let pending = std::mem::take(&mut f.pending);
            let mut image = std::mem::take(&mut f.durable);
            let how = rng.below(3);
            if trace() && !pending.is_empty() {
                let path = names
                    .iter()
                    .find(|(_, e)| Arc::ptr_eq(e, entry))
                    .map(|(p, _)| p);
                eprintln!("sim-cut {path:?}: {} pending, mode {how}", pending.len());
            }
            match how {
                0 => {}
                1 => {
                    for c in pending.iter().filter(|_| rng.one_in(2)) {
                        apply(&mut image, c);
                    }
                }
                _ => {
                    if let Some((last, rest)) = pending.split_last() {
                        for c in rest {
                            apply(&mut image, c);
                        }
                        match last {
                            Change::Write { at, data } => {
                                let sectors = data.len().div_ceil(SECTOR_BYTES) as u64;
                                let keep = rng.below(sectors + 1) as usize * SECTOR_BYTES;
                                let keep = keep.min(data.len());
                                if keep > 0 {
                                    let torn = Change::Write {
                                        at: *at,
                                        data: data[..keep].to_vec(),
                                    };
                                    apply(&mut image, &torn);
                                }
                            }
                            c => apply(&mut image, c),
                        }
                    }
                }
            }
            f.current = image.clone();
            f.durable = image;
        }
        st.files = names.clone();
        st.durable_files = names;
        st.generation += 1;
        st.off = false;
        st.cut_in = None;
        st.faults.clear();
        st.locked.clear();
        st.stats.power_cuts += 1;
        st.rng = Some(rng);
    }

    fn handle(
        &self,
        path: &Path,
        entry: Entry,
        generation: u64,
        direct: bool,
    ) -> Arc<dyn DiskFile> {
        Arc::new(SimFile {
            disk: self.clone(),
            path: path.to_path_buf(),
            data: entry,
            generation,
            direct,
        })
    }
}

/// An open file of a [`SimDisk`].
#[derive(Debug)]
struct SimFile {
    disk: SimDisk,
    path: PathBuf,
    data: Entry,
    generation: u64,
    /// Opened for `O_DIRECT` writes: unaligned ones fail with EINVAL.
    direct: bool,
}

impl SimFile {
    fn check_aligned(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let aligned = |v: usize| v.is_multiple_of(DIRECT_ALIGN);
        if self.direct
            && !(aligned(buf.as_ptr() as usize) && aligned(buf.len()) && aligned(offset as usize))
        {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        Ok(())
    }
}

impl DiskFile for SimFile {
    /// The simulated disk is memory: a read never waits (faults and latency as for a read).
    fn read_exact_at_nowait(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_exact_at(buf, offset)
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.disk.wait(FaultOp::Read, &self.path);
        let mut st = self.disk.state.lock();
        st.check(self.generation)?;
        st.fault(FaultOp::Read, &self.path)?;
        let f = self.data.lock();
        let end = offset as usize + buf.len();
        // As `pread`: nothing to read is no error, wherever the offset.
        if buf.is_empty() {
            return Ok(());
        }
        if end > f.current.len() {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        buf.copy_from_slice(&f.current[offset as usize..end]);
        Ok(())
    }

    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.check_aligned(buf, offset)?;
        self.disk.wait(FaultOp::Write, &self.path);
        let mut st = self.disk.state.lock();
        st.mutate(self.generation, 1, &self.path, offset, buf.len() as u64)?;
        st.fault(FaultOp::Write, &self.path)?;
        let end = offset + buf.len() as u64;
        let free = st.capacity.saturating_sub(st.used_bytes());
        let mut f = self.data.lock();
        if end > f.current.len() as u64 {
            let grow = end - f.current.len() as u64;
            if grow > free {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
        }
        let change = Change::Write {
            at: offset,
            data: buf.to_vec(),
        };
        apply(&mut f.current, &change);
        f.pending.push(change);
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        self.disk.wait(FaultOp::Sync, &self.path);
        let mut st = self.disk.state.lock();
        st.mutate(self.generation, 2, &self.path, 0, 0)?;
        st.fault(FaultOp::Sync, &self.path)?;
        st.stats.syncs += 1;
        let mut f = self.data.lock();
        let pending = std::mem::take(&mut f.pending);
        for c in &pending {
            apply(&mut f.durable, c);
        }
        debug_assert_eq!(f.durable, f.current);
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        let st = self.disk.state.lock();
        st.check(self.generation)?;
        let len = self.data.lock().current.len() as u64;
        Ok(len)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut st = self.disk.state.lock();
        st.mutate(self.generation, 3, &self.path, len, 0)?;
        let mut f = self.data.lock();
        let change = Change::SetLen(len);
        apply(&mut f.current, &change);
        f.pending.push(change);
        Ok(())
    }

    fn allocate(&self, len: u64) -> io::Result<()> {
        let current = self.len()?;
        if len > current {
            let free = {
                let st = self.disk.state.lock();
                st.capacity.saturating_sub(st.used_bytes())
            };
            if len - current > free {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
            self.set_len(len)?;
        }
        Ok(())
    }
}

/// The lock on a directory of a [`SimDisk`], released when dropped.
struct DirLock {
    disk: SimDisk,
    dir: PathBuf,
    generation: u64,
}

impl Drop for DirLock {
    fn drop(&mut self) {
        let mut st = self.disk.state.lock();
        if st.generation == self.generation {
            st.locked.remove(&self.dir);
        }
    }
}

impl Disk for SimDisk {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut st = self.state.lock();
        st.check(st.generation)?;
        // Directories are durable at once (a pool directory is made once).
        for d in dir.ancestors() {
            st.dirs.insert(d.to_path_buf());
        }
        Ok(())
    }

    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn DiskFile>> {
        let mut st = self.state.lock();
        let generation = st.generation;
        st.check(generation)?;
        let parent = path.parent().unwrap_or(Path::new("/"));
        if !st.dirs.contains(parent) {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        let entry = match (st.files.get(path).cloned(), mode) {
            (Some(_), OpenMode::CreateNew) => {
                return Err(io::Error::from(io::ErrorKind::AlreadyExists))
            }
            (Some(e), _) => e,
            (None, OpenMode::Existing) => return Err(io::Error::from(io::ErrorKind::NotFound)),
            (None, _) => {
                st.mutate(generation, 4, path, 0, 0)?;
                let e = Entry::default();
                st.files.insert(path.to_path_buf(), e.clone());
                e
            }
        };
        drop(st);
        Ok(self.handle(path, entry, generation, false))
    }

    fn open_direct(&self, path: &Path) -> io::Result<Option<Arc<dyn DiskFile>>> {
        let st = self.state.lock();
        let generation = st.generation;
        st.check(generation)?;
        let entry = st
            .files
            .get(path)
            .cloned()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        drop(st);
        Ok(Some(self.handle(path, entry, generation, true)))
    }

    fn exists(&self, path: &Path) -> bool {
        let st = self.state.lock();
        st.files.contains_key(path) || st.dirs.contains(path)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let st = self.state.lock();
        st.check(st.generation)?;
        if !st.dirs.contains(dir) {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        let children = st
            .files
            .keys()
            .chain(st.dirs.iter())
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| p.file_name()?.to_str().map(str::to_string));
        let mut names: Vec<String> = children.collect();
        names.sort();
        Ok(names)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let mut st = self.state.lock();
        let generation = st.generation;
        st.mutate(generation, 5, path, 0, 0)?;
        match st.files.remove(path) {
            Some(_) => Ok(()),
            None => Err(io::Error::from(io::ErrorKind::NotFound)),
        }
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.wait(FaultOp::Sync, dir);
        let mut st = self.state.lock();
        let generation = st.generation;
        st.mutate(generation, 6, dir, 0, 0)?;
        st.fault(FaultOp::Sync, dir)?;
        st.stats.syncs += 1;
        let st = &mut *st;
        st.durable_files.retain(|p, _| p.parent() != Some(dir));
        for (p, e) in &st.files {
            if p.parent() == Some(dir) {
                st.durable_files.insert(p.clone(), e.clone());
            }
        }
        Ok(())
    }

    fn fs_space(&self, _dir: &Path) -> io::Result<(u64, u64)> {
        let st = self.state.lock();
        Ok((st.capacity, st.capacity.saturating_sub(st.used_bytes())))
    }

    fn lock_dir(&self, dir: &Path) -> io::Result<Option<Box<dyn Any + Send + Sync>>> {
        let mut st = self.state.lock();
        st.check(st.generation)?;
        if !st.locked.insert(dir.to_path_buf()) {
            return Ok(None);
        }
        Ok(Some(Box::new(DirLock {
            disk: self.clone(),
            dir: dir.to_path_buf(),
            generation: st.generation,
        })))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn disk_with_file(seed: u64) -> (SimDisk, Arc<dyn DiskFile>) {
        let d = SimDisk::new(seed, 1 << 30);
        d.create_dir_all(Path::new("/p")).unwrap();
        let f = d.open(Path::new("/p/f"), OpenMode::Create).unwrap();
        d.sync_dir(Path::new("/p")).unwrap();
        (d, f)
    }

    #[test]
    fn synced_writes_survive_a_power_cut_and_old_handles_fail() {
        for seed in 0..32 {
            let (d, f) = disk_with_file(seed);
            f.write_all_at(&[1; 1024], 0).unwrap();
            f.sync_data().unwrap();
            f.write_all_at(&[2; 1024], 512).unwrap();
            d.power_cut();
            assert!(f.len().is_err(), "a handle from before the cut fails");
            let f = d.open(Path::new("/p/f"), OpenMode::Existing).unwrap();
            let mut b = vec![0; f.len().unwrap() as usize];
            f.read_exact_at(&mut b, 0).unwrap();
            // The synced bytes are there; the unsynced write is absent, whole or torn at a
            // sector boundary.
            assert!(b.len() == 1024 || b.len() == 1536, "len {}", b.len());
            assert_eq!(&b[..512], &[1; 512][..]);
            let two = b[512..].iter().take_while(|&&x| x == 2).count();
            assert!(two % SECTOR_BYTES == 0, "torn at a sector: {two}");
            assert!(b[512 + two..].iter().all(|&x| x == 1));
        }
    }

    #[test]
    fn an_unsynced_creation_may_vanish_and_a_synced_one_stays() {
        let mut vanished = 0;
        for seed in 0..32 {
            let (d, _) = disk_with_file(seed);
            let g = d.open(Path::new("/p/g"), OpenMode::CreateNew).unwrap();
            g.write_all_at(b"x", 0).unwrap();
            g.sync_data().unwrap();
            d.power_cut();
            assert!(d.exists(Path::new("/p/f")));
            vanished += !d.exists(Path::new("/p/g")) as u32;
        }
        assert!(vanished > 0 && vanished < 32, "{vanished}");
    }

    #[test]
    fn an_armed_cut_fails_that_operation_and_all_after_it() {
        let (d, f) = disk_with_file(1);
        d.cut_after(2);
        f.write_all_at(b"a", 0).unwrap();
        assert!(f.write_all_at(b"b", 1).is_err());
        assert!(d.is_off());
        assert!(f.sync_data().is_err());
        d.power_cut();
        assert!(!d.is_off());
    }

    #[test]
    fn faults_fire_once_on_the_chosen_operation() {
        let (d, f) = disk_with_file(1);
        d.inject(Fault {
            op: FaultOp::Write,
            path_contains: "/p/f".into(),
            nth: 2,
            errno: libc::ENOSPC,
        });
        f.write_all_at(b"a", 0).unwrap();
        let e = f.write_all_at(b"b", 1).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        f.write_all_at(b"c", 2).unwrap();
        assert_eq!(d.stats().faults, 1);
    }

    #[test]
    fn latency_slows_the_chosen_operations_only() {
        let (d, f) = disk_with_file(1);
        let ms = std::time::Duration::from_millis(40);
        d.set_latency(FaultOp::Sync, "/p/f", ms);
        let t = std::time::Instant::now();
        f.write_all_at(b"a", 0).unwrap();
        assert!(t.elapsed() < ms, "a write waited");
        f.sync_data().unwrap();
        assert!(t.elapsed() >= ms, "the sync did not wait");
        d.set_latency(FaultOp::Sync, "/p/f", std::time::Duration::ZERO);
        let t = std::time::Instant::now();
        f.sync_data().unwrap();
        assert!(t.elapsed() < ms);
    }

    #[test]
    fn direct_handles_refuse_unaligned_writes() {
        let (d, _) = disk_with_file(1);
        let f = d.open_direct(Path::new("/p/f")).unwrap().unwrap();
        assert_eq!(
            f.write_all_at(&[0; 100], 0).unwrap_err().raw_os_error(),
            Some(libc::EINVAL)
        );
    }
}
