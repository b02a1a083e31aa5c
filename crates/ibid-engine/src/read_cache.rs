//! The read cache: checked 4 KiB blocks kept in memory by chunk id, so that a block read
//! again is served from here — no read of its segment file, no checksum, and, for a server
//! that sends from it ([`HeldBlocks`]), no copy into the reader's buffer either.
//!
//! Nothing is ever invalidated: a chunk id is never reused and a chunk's bytes never change
//! (an overwrite makes a new chunk; the cleaner moves records, not their bytes). A cached
//! block whose chunk died is simply never asked for again and ages out.
//!
//! - **Admission**: a block enters on its second miss within a window (the *doorkeeper*, a
//!   lock-free Bloom filter of ids missed once, cleared when it has noted as many ids as the
//!   cache has slots). One pass over a volume does not flush what is hot, and neither do
//!   passes over more data than the cache holds (a block's second miss comes after the
//!   doorkeeper forgot its first): data read again within about the cache's size is
//!   admitted, the rest streams past.
//! - **Eviction**: CLOCK per shard (a hit sets the slot's reference bit; the hand clears it
//!   or reuses the slot).
//! - **Memory**: one anonymous mapping, reserved at open (`MAP_NORESERVE`) and backed page
//!   by page as the cache first fills, then reused in place: a fill is a 4 KiB copy, never an
//!   allocation. A slot *held* by a read in flight (its [`HeldBlocks`] not yet dropped) is
//!   skipped by the hand.
//! - **Shards**: by chunk id with its low 12 bits dropped, so the neighbouring ids of data
//!   written together (`chunk_table.rs`) fall in one shard and a sequential read takes a few
//!   locks, not one per block.
//!
//! Soundness of the shared memory: a slot's bytes are written only under its shard's lock,
//! when no read holds it (its hold count, read with `Acquire` under the lock, is 0) and it is
//! not in the shard's map (so no read can start holding it). A read starts holding a slot
//! under the lock (so it sees the bytes written before) and stops with a `Release`.

use crate::format::BLOCK_BYTES;
use crate::shard::SHARD_BITS;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// Shards of a cache large enough to have [`SHARD_SLOTS_MIN`] slots in each.
const SHARDS_MAX: usize = 32;
/// Fewest slots a shard has when there are several (a smaller cache has fewer shards, down
/// to one): enough that the groups of neighbouring ids do not crowd one out.
const SHARD_SLOTS_MIN: usize = 1024;
/// Fewest slots a cache has (below, there is none).
const SLOTS_MIN: usize = 64;
/// Low bits of a chunk id ignored when choosing its shard: its shard-of-writer bits and 64
/// consecutive sequence numbers.
const SHARD_ID_SHIFT: u32 = SHARD_BITS + 6;
/// Most memory a cache takes, whatever it is given (slot numbers are `u32`).
const READ_CACHE_BYTES_MAX: u64 = 1 << 40;
/// Held slots the clock hand passes over before it gives up finding a victim (a shard whose
/// slots are nearly all held by reads in flight — initiators slow to take their data — does
/// not cache more until they are let go).
const HELD_SKIPS_MAX: usize = 256;
/// Bits of doorkeeper per slot of cache.
const DOORKEEPER_BITS_PER_SLOT: usize = 8;

/// Counters of a pool's read cache, as [`crate::Pool::read_cache_stats`] reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadCacheStats {
    /// Memory the cache may use, in bytes (0: no cache).
    pub capacity_bytes: u64,
    /// Memory holding cached blocks now, in bytes.
    pub used_bytes: u64,
    /// Blocks read from the cache.
    pub hits: u64,
    /// Blocks looked for and not found (read from their segment).
    pub misses: u64,
    /// Blocks put into the cache.
    pub admitted: u64,
    /// Cached blocks dropped to make room.
    pub evicted: u64,
}

/// The cache (see the module's comment). Shared by the pool and the [`HeldBlocks`] of reads
/// in flight.
pub(crate) struct ReadCache {
    shards: Box<[Mutex<Shard>]>,
    /// Each slot's holds, by slot number (all shards; shard `i` has slots
    /// `[i * per_shard, (i + 1) * per_shard)`).
    holds: Box<[AtomicU32]>,
    per_shard: usize,
    memory: Memory,
    doorkeeper: Doorkeeper,
    hits: AtomicU64,
    misses: AtomicU64,
    admitted: AtomicU64,
    evicted: AtomicU64,
}

/// A shard's number and its lock, held across a run of its ids.
type Locked<'a> = (usize, parking_lot::MutexGuard<'a, Shard>);

/// One shard's index and CLOCK state.
struct Shard {
    /// Chunk id → slot number within the shard.
    map: Index,
    /// The chunk id in each of the shard's slots in use (by slot number within the shard);
    /// grows as slots are first used.
    ids: Vec<u64>,
    /// Each slot's reference bit.
    referenced: Vec<bool>,
    /// The clock hand (a slot number within the shard).
    hand: usize,
}

impl ReadCache {
    /// A cache of at most `bytes` of blocks (rounded down to whole shards of slots; below
    /// [`SLOTS_MIN`] blocks, no cache).
    pub fn new(bytes: u64) -> ReadCache {
        let slots = (bytes.min(READ_CACHE_BYTES_MAX) / BLOCK_BYTES as u64) as usize;
        let memory = Memory::new(slots * BLOCK_BYTES);
        let slots = memory.len / BLOCK_BYTES;
        let shards = match slots {
            0..SLOTS_MIN => 0,
            _ => (slots / SHARD_SLOTS_MIN).clamp(1, SHARDS_MAX),
        };
        let per_shard = slots.checked_div(shards).unwrap_or(0);
        let total = shards * per_shard;
        ReadCache {
            shards: (0..shards)
                .map(|_| {
                    Mutex::new(Shard {
                        map: Index::default(),
                        ids: Vec::new(),
                        referenced: Vec::new(),
                        hand: 0,
                    })
                })
                .collect(),
            holds: (0..total).map(|_| AtomicU32::new(0)).collect(),
            per_shard,
            memory,
            doorkeeper: Doorkeeper::new(total * DOORKEEPER_BITS_PER_SLOT, total as u64),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            admitted: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        }
    }

    /// Whether the cache can hold anything.
    pub fn enabled(&self) -> bool {
        !self.shards.is_empty()
    }

    /// The cache's counters.
    pub fn stats(&self) -> ReadCacheStats {
        let used: usize = self.shards.iter().map(|s| s.lock().ids.len()).sum();
        ReadCacheStats {
            capacity_bytes: (self.holds.len() * BLOCK_BYTES) as u64,
            used_bytes: (used * BLOCK_BYTES) as u64,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            admitted: self.admitted.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
        }
    }

    fn shard_of(&self, id: u64) -> usize {
        let h = (id >> SHARD_ID_SHIFT).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((h >> 32) as usize) % self.shards.len()
    }

    /// The shard of `id` and its lock: the one in `current` if it is that shard's, else that
    /// shard's, taken after `current`'s is released. A run of ids of one shard (neighbouring
    /// ids) thus takes its lock once.
    fn locked<'a, 'c>(
        &'a self,
        current: &'c mut Option<Locked<'a>>,
        id: u64,
    ) -> (usize, &'c mut Shard) {
        let s = self.shard_of(id);
        if current.as_ref().is_none_or(|(held, _)| *held != s) {
            *current = None;
            *current = Some((s, self.shards[s].lock()));
        }
        let (_, guard) = current.as_mut().expect("set above");
        (s, guard)
    }

    /// Looks up `wanted` — (chunk id, the caller's tag) pairs, in any order — and calls
    /// `hit(tag, slot)` for each one cached, holding its slot (release it with
    /// [`ReadCache::release`], or keep it in a [`HeldBlocks`]); `miss(id, tag)` for the others.
    /// Consecutive ids of one shard are looked up under one lock.
    pub fn lookup<T: Copy>(
        &self,
        wanted: impl Iterator<Item = (u64, T)>,
        mut hit: impl FnMut(T, u32),
        mut miss: impl FnMut(u64, T),
    ) {
        let (mut hits, mut misses) = (0, 0);
        let mut current = None;
        for (id, tag) in wanted {
            let (s, shard) = self.locked(&mut current, id);
            match shard.map.get(id).filter(|&l| shard.ids[l as usize] == id) {
                Some(local) => {
                    shard.referenced[local as usize] = true;
                    let slot = (s * self.per_shard) as u32 + local;
                    self.holds[slot as usize].fetch_add(1, Ordering::Relaxed);
                    hits += 1;
                    hit(tag, slot);
                }
                None => {
                    misses += 1;
                    miss(id, tag);
                }
            }
        }
        drop(current);
        self.hits.fetch_add(hits, Ordering::Relaxed);
        self.misses.fetch_add(misses, Ordering::Relaxed);
    }

    /// The bytes of `slot`.
    ///
    /// # Safety
    /// The caller holds the slot (from [`ReadCache::lookup`]) for as long as it uses them:
    /// nothing writes a held slot.
    pub unsafe fn bytes(&self, slot: u32) -> &[u8] {
        // SAFETY: held (the caller's contract), and inside the region.
        unsafe { self.memory.slot(slot as usize) }
    }

    /// Stops holding `slot`.
    ///
    /// # Safety
    /// The caller holds the slot (each hold [`ReadCache::lookup`] took is released once) and
    /// no longer uses its bytes: once nothing holds it, the slot may be refilled.
    pub unsafe fn release(&self, slot: u32) {
        self.holds[slot as usize].fetch_sub(1, Ordering::Release);
    }

    /// Offers blocks just read and checked, as (chunk id, its 4 KiB): each is cached if the
    /// doorkeeper saw it missed before. Consecutive ids of one shard go in under one lock.
    pub fn offer<'a>(&self, blocks: impl Iterator<Item = (u64, &'a [u8])>) {
        // The doorkeeper first, holding no lock (its window's end clears it).
        let admit: Vec<(u64, &[u8])> = blocks
            .filter(|&(id, _)| self.doorkeeper.seen_before(id))
            .collect();
        let mut current = None;
        let mut admitted = 0;
        for (id, block) in admit {
            debug_assert_eq!(block.len(), BLOCK_BYTES);
            let (s, shard) = self.locked(&mut current, id);
            if self.insert(s, shard, id, block) {
                admitted += 1;
            }
        }
        drop(current);
        self.admitted.fetch_add(admitted, Ordering::Relaxed);
    }

    /// Puts `block` in shard `s` (locked as `shard`) as chunk `id`, in a free slot or the one
    /// the clock hand gives up; `false` if it was there already or every slot is held.
    fn insert(&self, s: usize, shard: &mut Shard, id: u64, block: &[u8]) -> bool {
        if shard
            .map
            .get(id)
            .is_some_and(|l| shard.ids[l as usize] == id)
        {
            return false;
        }
        let base = s * self.per_shard;
        let local = if shard.ids.len() < self.per_shard {
            shard.ids.push(id);
            shard.referenced.push(false);
            shard.ids.len() - 1
        } else {
            let Some(local) = self.victim(base, shard) else {
                return false;
            };
            let old = std::mem::replace(&mut shard.ids[local], id);
            shard.map.remove(old, local as u32);
            self.evicted.fetch_add(1, Ordering::Relaxed);
            local
        };
        // SAFETY: the slot is not in the map and nothing holds it (a new slot, or the victim:
        // hold count 0, read with `Acquire` under the lock that any new hold needs).
        unsafe { self.memory.slot_mut(base + local) }.copy_from_slice(block);
        shard.referenced[local] = false;
        shard.map.insert(id, local as u32);
        true
    }

    /// The slot (within the shard) the clock hand gives up: the first not held and not
    /// referenced since the hand last passed (clearing reference bits on the way), within
    /// two turns and [`HELD_SKIPS_MAX`] held slots.
    fn victim(&self, base: usize, shard: &mut Shard) -> Option<usize> {
        let mut held = 0;
        for _ in 0..2 * self.per_shard {
            let local = shard.hand;
            shard.hand = (shard.hand + 1) % self.per_shard;
            if self.holds[base + local].load(Ordering::Acquire) != 0 {
                held += 1;
                if held > HELD_SKIPS_MAX {
                    return None;
                }
                continue;
            }
            if std::mem::take(&mut shard.referenced[local]) {
                continue;
            }
            return Some(local);
        }
        None
    }
}

/// A shard's index: chunk id → slot, in groups of the 64 consecutive sequence numbers that
/// share `id >> SHARD_ID_SHIFT` (a chunk id is its sequence number above [`SHARD_BITS`] bits
/// that it alone has: `chunk_table.rs`). The blocks of a sequential read are neighbouring
/// ids, so its lookups touch a few groups — one hash lookup and a 256-byte array each,
/// mostly in the CPU's cache — instead of one scattered hash entry per block.
#[derive(Default)]
struct Index {
    groups: FxHashMap<u64, Box<Group>>,
}

/// The slots of 64 consecutive sequence numbers.
struct Group {
    /// Entries in use.
    used: u32,
    /// Per sequence number (its low six bits): slot + 1, or 0.
    slots: [u32; 64],
}

impl Index {
    fn place(id: u64) -> (u64, usize) {
        (id >> SHARD_ID_SHIFT, ((id >> SHARD_BITS) & 63) as usize)
    }

    /// The slot of `id`'s sequence number, if one is cached (the caller checks that the slot
    /// holds `id` itself).
    fn get(&self, id: u64) -> Option<u32> {
        let (key, at) = Index::place(id);
        let slot = self.groups.get(&key)?.slots[at];
        slot.checked_sub(1)
    }

    fn insert(&mut self, id: u64, slot: u32) {
        let (key, at) = Index::place(id);
        let group = self.groups.entry(key).or_insert_with(|| {
            Box::new(Group {
                used: 0,
                slots: [0; 64],
            })
        });
        if group.slots[at] == 0 {
            group.used += 1;
        }
        group.slots[at] = slot + 1;
    }

    /// Forgets `id`, if it is in `slot`.
    fn remove(&mut self, id: u64, slot: u32) {
        let (key, at) = Index::place(id);
        let Some(group) = self.groups.get_mut(&key) else {
            return;
        };
        if group.slots[at] == slot + 1 {
            group.slots[at] = 0;
            group.used -= 1;
            if group.used == 0 {
                self.groups.remove(&key);
            }
        }
    }
}

/// Whole blocks of a read left in the read cache's memory rather than copied into the
/// reader's buffer: each is held (never reused) until this is dropped. What
/// [`crate::Volume::read_held`] returns; a server sends these bytes from where they are.
pub struct HeldBlocks {
    cache: Arc<ReadCache>,
    /// (offset in the read, slot), ascending by offset.
    blocks: Vec<(usize, u32)>,
}

impl HeldBlocks {
    /// None yet, of `cache`.
    pub(crate) fn new(cache: &Arc<ReadCache>) -> HeldBlocks {
        HeldBlocks {
            cache: cache.clone(),
            blocks: Vec::new(),
        }
    }

    /// Adds `slot`, which the caller holds (this now does), as the block at `offset` in the
    /// read (past those added before).
    pub(crate) fn push(&mut self, offset: usize, slot: u32) {
        debug_assert!(self.blocks.last().is_none_or(|&(o, _)| o < offset));
        self.blocks.push((offset, slot));
    }

    /// How many blocks are held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The `i`th held block (ascending by offset): its offset in the read and its 4 KiB.
    pub fn get(&self, i: usize) -> (usize, &[u8]) {
        let (offset, slot) = self.blocks[i];
        // SAFETY: this holds the slot until it is dropped, and the bytes borrow it.
        (offset, unsafe { self.cache.bytes(slot) })
    }

    /// The held blocks, ascending by their offset in the read.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &[u8])> + '_ {
        (0..self.blocks.len()).map(|i| self.get(i))
    }

    /// Copies the held blocks into `buf`, the read's buffer, which then holds the whole read.
    pub fn copy_into(&self, buf: &mut [u8]) {
        for (offset, bytes) in self.iter() {
            buf[offset..offset + bytes.len()].copy_from_slice(bytes);
        }
    }
}

impl Drop for HeldBlocks {
    fn drop(&mut self) {
        for &(_, slot) in &self.blocks {
            // SAFETY: each slot was held once, for this, and its bytes are no longer borrowed.
            unsafe { self.cache.release(slot) };
        }
    }
}

impl std::fmt::Debug for HeldBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldBlocks")
            .field("blocks", &self.blocks.len())
            .finish()
    }
}

/// The cache's block memory: one private anonymous mapping (`MAP_NORESERVE`), which the
/// system backs page by page as slots are first written; unmapped when the cache goes.
struct Memory {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the region is plain bytes; access is synchronized as the module's comment says.
unsafe impl Send for Memory {}
// SAFETY: as above.
unsafe impl Sync for Memory {}

impl Memory {
    /// A mapping of `len` bytes; of none (`len` 0) if the system refuses it.
    fn new(len: usize) -> Memory {
        let none = Memory {
            ptr: std::ptr::null_mut(),
            len: 0,
        };
        if len == 0 {
            return none;
        }
        // SAFETY: a fresh anonymous mapping; no existing memory is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            tracing::warn!("no read cache: mapping {len} bytes failed: {e}");
            return none;
        }
        Memory {
            ptr: ptr.cast(),
            len,
        }
    }

    /// Slot `i`'s bytes.
    ///
    /// # Safety
    /// The caller holds the slot (nothing writes it meanwhile).
    unsafe fn slot(&self, i: usize) -> &[u8] {
        assert!((i + 1) * BLOCK_BYTES <= self.len);
        // SAFETY: inside the region; no writer while held (caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.add(i * BLOCK_BYTES), BLOCK_BYTES) }
    }

    /// Slot `i`'s bytes, to fill.
    ///
    /// # Safety
    /// Nobody else reads or writes the slot meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slot_mut(&self, i: usize) -> &mut [u8] {
        assert!((i + 1) * BLOCK_BYTES <= self.len);
        // SAFETY: inside the region; exclusive (caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(i * BLOCK_BYTES), BLOCK_BYTES) }
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: the mapping `new` made, unmapped once here; nothing borrows it any
            // more (every `HeldBlocks` keeps the cache, so this, alive).
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }
}

/// Ids missed once recently: a Bloom filter (two bits per id) set and tested without locks,
/// cleared once it has taken `window` ids.
struct Doorkeeper {
    words: Box<[AtomicU64]>,
    taken: AtomicU64,
    window: u64,
}

impl Doorkeeper {
    fn new(bits: usize, window: u64) -> Doorkeeper {
        let words = bits.div_ceil(64).max(1).next_power_of_two();
        Doorkeeper {
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
            taken: AtomicU64::new(0),
            window,
        }
    }

    /// Whether `id` was (probably) missed before within the window; notes it if not.
    fn seen_before(&self, id: u64) -> bool {
        let h = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (id >> 29);
        let h2 = h.rotate_left(32).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        let mask = (self.words.len() * 64 - 1) as u64;
        let (a, b) = (h & mask, h2 & mask);
        let bit = |p: u64| (&self.words[(p / 64) as usize], 1u64 << (p % 64));
        let ((wa, ba), (wb, bb)) = (bit(a), bit(b));
        if wa.load(Ordering::Relaxed) & ba != 0 && wb.load(Ordering::Relaxed) & bb != 0 {
            return true;
        }
        wa.fetch_or(ba, Ordering::Relaxed);
        wb.fetch_or(bb, Ordering::Relaxed);
        if self.taken.fetch_add(1, Ordering::Relaxed) + 1 >= self.window {
            self.taken.store(0, Ordering::Relaxed);
            for w in self.words.iter() {
                w.store(0, Ordering::Relaxed);
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(fill: u8) -> Vec<u8> {
        vec![fill; BLOCK_BYTES]
    }

    /// The chunk id of sequence number `seq`, as the engine makes them.
    fn id(seq: u64) -> u64 {
        (seq << SHARD_BITS) | (seq * 7 % 64)
    }

    /// Looks `ids` up; the bytes of each hit (released again).
    fn get(cache: &ReadCache, ids: &[u64]) -> Vec<Option<Vec<u8>>> {
        let mut out = vec![None; ids.len()];
        cache.lookup(
            ids.iter().copied().zip(0..),
            |i, slot| {
                // SAFETY: held by the lookup, released once after the copy.
                out[i] = Some(unsafe { cache.bytes(slot) }.to_vec());
                unsafe { cache.release(slot) };
            },
            |_, _| {},
        );
        out
    }

    #[test]
    fn a_block_is_cached_on_its_second_miss_and_served_as_offered() {
        let cache = ReadCache::new(1 << 20);
        assert!(cache.enabled());
        let b = block(7);
        cache.offer([(id(42), &b[..])].into_iter());
        assert_eq!(get(&cache, &[id(42)]), vec![None], "one miss: not admitted");
        cache.offer([(id(42), &b[..])].into_iter());
        assert_eq!(get(&cache, &[id(42)]), vec![Some(b.clone())]);
        assert_eq!(get(&cache, &[id(43), id(42) ^ 1]), vec![None, None]);
        let s = cache.stats();
        assert_eq!((s.hits, s.misses, s.admitted), (1, 3, 1));
        assert_eq!(s.used_bytes, BLOCK_BYTES as u64);
    }

    #[test]
    fn a_small_cache_is_none() {
        let cache = ReadCache::new(200 << 10);
        assert!(!cache.enabled());
        let b = block(1);
        cache.offer([(1, &b[..]), (1, &b[..])].into_iter());
        assert_eq!(cache.stats().capacity_bytes, 0);
    }

    #[test]
    fn eviction_keeps_the_cache_within_its_size_and_never_reuses_a_held_slot() {
        let cache = ReadCache::new(SLOTS_MIN as u64 * BLOCK_BYTES as u64);
        assert_eq!((cache.shards.len(), cache.per_shard), (1, SLOTS_MIN));
        let fill = |seq: u64| block((seq % 251) as u8);
        let offer = |seq: u64| {
            let b = fill(seq);
            cache.offer([(id(seq), &b[..]), (id(seq), &b[..])].into_iter());
        };
        offer(1);
        // Hold block 1 while many others pass through.
        let mut held = None;
        cache.lookup([(id(1), ())].into_iter(), |_, s| held = Some(s), |_, _| {});
        let held = held.expect("cached");
        for id in 2..1000 {
            offer(id);
        }
        let s = cache.stats();
        assert_eq!(s.used_bytes, (SLOTS_MIN * BLOCK_BYTES) as u64);
        // (Not all admitted: the doorkeeper forgets every `slots` ids.)
        assert!(s.evicted >= 800, "{s:?}");
        // SAFETY: held by the lookup above, released once.
        let kept = unsafe { cache.bytes(held) } == &fill(1)[..];
        unsafe { cache.release(held) };
        assert!(kept, "a held slot keeps its bytes");
        // Every block still cached is the one offered under its id.
        let ids: Vec<u64> = (1..1000).map(id).collect();
        let got = get(&cache, &ids);
        assert!(got.iter().filter(|g| g.is_some()).count() >= SLOTS_MIN / 2);
        for (seq, got) in (1..1000).zip(got) {
            if let Some(bytes) = got {
                assert_eq!(bytes, fill(seq), "block {seq}");
            }
        }
    }

    #[test]
    fn a_cache_whose_slots_are_all_held_admits_nothing_until_they_are_let_go() {
        let cache = Arc::new(ReadCache::new(SLOTS_MIN as u64 * BLOCK_BYTES as u64));
        let b = block(9);
        let offer = |seqs: std::ops::Range<u64>| {
            // Three times: the doorkeeper may forget the first at its window's end.
            for seq in seqs {
                cache.offer([(id(seq), &b[..]); 3].into_iter());
            }
        };
        offer(0..SLOTS_MIN as u64);
        let mut held = HeldBlocks::new(&cache);
        cache.lookup(
            (0..SLOTS_MIN as u64).map(|seq| (id(seq), seq as usize * BLOCK_BYTES)),
            |at, slot| held.push(at, slot),
            |id, _| panic!("{id:#x} not cached"),
        );
        offer(1000..1010);
        let s = cache.stats();
        assert_eq!((s.admitted, s.evicted), (SLOTS_MIN as u64, 0));
        drop(held);
        offer(2000..2010);
        assert_eq!(cache.stats().admitted, SLOTS_MIN as u64 + 10);
    }

    #[test]
    fn held_blocks_copy_into_a_buffer_and_release_on_drop() {
        let cache = Arc::new(ReadCache::new(1 << 20));
        let (a, b) = (block(3), block(4));
        cache.offer(
            [
                (id(10), &a[..]),
                (id(10), &a[..]),
                (id(11), &b[..]),
                (id(11), &b[..]),
            ]
            .into_iter(),
        );
        let mut held = HeldBlocks::new(&cache);
        cache.lookup(
            [(id(10), 0usize), (id(11), BLOCK_BYTES)].into_iter(),
            |off, slot| held.push(off, slot),
            |_, _| {},
        );
        let slots = held.blocks.clone();
        assert_eq!(held.len(), 2);
        let mut buf = vec![0u8; 2 * BLOCK_BYTES];
        held.copy_into(&mut buf);
        assert_eq!(&buf[..BLOCK_BYTES], &a[..]);
        assert_eq!(&buf[BLOCK_BYTES..], &b[..]);
        assert!(slots
            .iter()
            .all(|&(_, s)| cache.holds[s as usize].load(Ordering::Relaxed) == 1));
        drop(held);
        assert!(slots
            .iter()
            .all(|&(_, s)| cache.holds[s as usize].load(Ordering::Relaxed) == 0));
    }

    #[test]
    fn the_doorkeeper_forgets_after_its_window() {
        let d = Doorkeeper::new(1 << 16, 100);
        assert!(!d.seen_before(5));
        assert!(d.seen_before(5));
        for id in 1000..1100 {
            d.seen_before(id);
        }
        assert!(!d.seen_before(5), "cleared after 100 ids");
    }
}
