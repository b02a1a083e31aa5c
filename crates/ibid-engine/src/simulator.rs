//! The deterministic simulator: one seed drives a random sequence of engine operations on a
//! pool on a [`SimDisk`], cuts the power at random I/O points, reopens the pool and checks it
//! against a model.
//!
//! The pool runs without threads of its own ([`PoolConfig::threads`] off, no background
//! thread), so a seed's run does the same I/O every time: a failure replays from its seed.
//! [`SimOptions::threads`] runs the engine's threads, and [`SimOptions::background`] also its
//! background committer and cleaner, at the price of exact replay.
//!
//! # What the model knows
//! For every block of every volume, the bytes it holds now and every content it may hold
//! after a power cut: its last durable content, then each content it was given since. A
//! flush, a FUA write (its blocks), a sync, and the catalog operations that commit (snapshot,
//! clone, resize, delete, format change) make contents durable. A snapshot's content is fixed
//! at creation. After each power cut and reopen:
//! - the catalog (volumes with their sizes, snapshots) is the model's, or — for a catalog
//!   operation the cut interrupted — what it would be had that operation completed;
//! - every block of every volume reads as one of the contents it may hold (so nothing
//!   appears that was never written, and no acknowledged durable write is lost), and every
//!   snapshot reads exactly as when it was taken;
//! - `verify` (counts, references, accounting) passes.
//!
//! Between cuts, every read is checked against the bytes the model holds now.
//!
//! About one operation in 60 also arms an I/O error (EIO, or ENOSPC for a write) on one of the
//! next reads, writes or syncs of a segment, the journal or the metadata store. An operation
//! that fails after such an error fired is treated like one the power cut: the pool is dropped,
//! the power cut, and the same checks run (a read must fail or return the model's bytes; a
//! write or flush must fail, or be durable as acknowledged).

use crate::disk::{Fault, FaultOp, Rng, SimDisk};
use crate::error::Error;
use crate::event_log::EventLog;
use crate::format::VolumeFormat;
use crate::{Pool, PoolConfig};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

const BLOCK: u64 = 4096;
const SECTOR: u64 = 512;
/// Where the simulated pool lives on its disk.
const POOL_DIR: &str = "/pool";
/// Operations kept for a failure's report.
const LOG_KEEP: usize = 40;
/// Engine steps and operations kept for a failure's report when the engine's threads run.
const EVENTS_KEEP: usize = 400;

/// How a run goes.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Engine operations per seed.
    pub operations: u64,
    /// A cut is armed to happen within this many mutating I/O operations of the disk.
    pub cut_within_io: u64,
    /// Run the engine's own threads ([`PoolConfig::threads`]): races between them and the
    /// foreground are exercised too, but a seed no longer replays the same I/O.
    pub threads: bool,
    /// Also run the background thread ([`PoolConfig::background`]: the committer that commits
    /// when writes pile up or time passes, and the segment cleaner); implies `threads`.
    pub background: bool,
    /// After every operation, read every volume whole and compare it with the model (slower:
    /// catches a wrong in-memory state at the operation that made it, not at the next cut, and
    /// the reads' timing shakes the background's races differently).
    pub check_each_step: bool,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            operations: 300,
            cut_within_io: 400,
            threads: false,
            background: false,
            check_each_step: false,
        }
    }
}

/// What one seed's run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimOutcome {
    /// Power cuts (the last, at the end of the run, included).
    pub power_cuts: u64,
    /// Engine operations run.
    pub operations: u64,
    /// Mutating I/O operations of the disk.
    pub io_operations: u64,
    /// Injected I/O errors that fired.
    pub faults: u64,
    /// The disk's digest of its I/O (equal for two runs of the same seed).
    pub digest: u64,
}

/// A failed check: what went wrong, with the operations that led to it.
#[derive(Debug, Clone)]
pub struct SimFailure {
    /// The seed that replays it.
    pub seed: u64,
    /// What was wrong.
    pub message: String,
    /// The last operations before it, oldest first.
    pub log: Vec<String>,
    /// With the engine's threads running: the last engine steps interleaved with the
    /// operations (`op:`), oldest first (see `event_log.rs`).
    pub events: Vec<String>,
}

impl std::fmt::Display for SimFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "seed {}: {}", self.seed, self.message)?;
        for line in &self.log {
            writeln!(f, "  {line}")?;
        }
        if !self.events.is_empty() {
            writeln!(f, "engine steps and operations, oldest first:")?;
            for line in &self.events {
                writeln!(f, "  {line}")?;
            }
        }
        Ok(())
    }
}

fn hash(block: &[u8]) -> u64 {
    let h = blake3::hash(block);
    u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap_or_default())
}

/// A volume as the model knows it.
#[derive(Debug, Clone)]
struct VolModel {
    image: Vec<u8>,
    /// Per block: the contents it may hold after a power cut (durable first).
    possible: Vec<Vec<u64>>,
    /// Its format, where the model knows it (a clone's is the engine's choice).
    format: Option<VolumeFormat>,
}

impl VolModel {
    fn new(image: Vec<u8>, format: Option<VolumeFormat>) -> VolModel {
        let possible = image
            .chunks(BLOCK as usize)
            .map(|b| vec![hash(b)])
            .collect();
        VolModel {
            image,
            possible,
            format,
        }
    }

    fn size(&self) -> u64 {
        self.image.len() as u64
    }

    fn blocks(offset: u64, len: u64) -> std::ops::Range<usize> {
        (offset / BLOCK) as usize..(offset + len).div_ceil(BLOCK) as usize
    }

    fn block(&self, b: usize) -> &[u8] {
        &self.image[b * BLOCK as usize..(b + 1) * BLOCK as usize]
    }

    /// Puts `data` at `offset`: the touched blocks may now also hold their new content.
    fn write(&mut self, offset: u64, data: &[u8]) {
        self.image[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        for b in Self::blocks(offset, data.len() as u64) {
            let h = hash(self.block(b));
            self.possible[b].push(h);
        }
    }

    /// The blocks of `[offset, offset + len)` hold their content durably.
    fn durable(&mut self, offset: u64, len: u64) {
        for b in Self::blocks(offset, len) {
            self.possible[b] = vec![hash(self.block(b))];
        }
    }

    fn durable_all(&mut self) {
        self.durable(0, self.size());
    }
}

/// The pool as the model knows it.
#[derive(Debug, Clone, Default)]
struct Model {
    vols: BTreeMap<String, VolModel>,
    /// `VOLUME@SNAPSHOT` → content.
    snaps: BTreeMap<String, Vec<u8>>,
    next_name: u64,
}

impl Model {
    fn durable_all(&mut self) {
        self.vols.values_mut().for_each(VolModel::durable_all);
    }
}

/// Runs one seed.
pub fn run(seed: u64, options: &SimOptions) -> Result<SimOutcome, SimFailure> {
    let mut sim = Sim::new(seed, options.clone());
    let result = sim.run();
    let stats = sim.disk.stats();
    match result {
        Ok(()) => Ok(SimOutcome {
            power_cuts: stats.power_cuts,
            operations: sim.operations,
            io_operations: stats.ops,
            faults: stats.faults,
            digest: stats.digest,
        }),
        Err(message) => Err(SimFailure {
            seed,
            message,
            events: sim.events.as_ref().map_or_else(Vec::new, |e| e.recent()),
            log: sim.log,
        }),
    }
}

struct Sim {
    rng: Rng,
    disk: SimDisk,
    options: SimOptions,
    pool: Option<Pool>,
    model: Model,
    operations: u64,
    /// Injected faults that had fired at the last recovery.
    faults_seen: u64,
    log: Vec<String>,
    /// Where the pool and the run log their steps, when the engine's threads run.
    events: Option<Arc<EventLog>>,
}

/// An operation's result: done, or the power went during it (`Err(Cut)`), or a failed check.
enum Stop {
    Cut,
    Failed(String),
}

type Step = Result<(), Stop>;

impl From<String> for Stop {
    fn from(s: String) -> Stop {
        Stop::Failed(s)
    }
}

impl Sim {
    fn new(seed: u64, options: SimOptions) -> Sim {
        let mut rng = Rng::new(seed);
        let disk = SimDisk::new(rng.next_u64(), 1 << 30);
        let events =
            (options.threads || options.background).then(|| Arc::new(EventLog::new(EVENTS_KEEP)));
        Sim {
            rng,
            disk,
            options,
            pool: None,
            model: Model::default(),
            operations: 0,
            faults_seen: 0,
            log: Vec::new(),
            events,
        }
    }

    fn config(&self) -> PoolConfig {
        PoolConfig {
            capacity_bytes: Some(256 << 20),
            segment_bytes_max: 256 << 10,
            // Few descriptors, so that reads reopen files closed as idle.
            segment_files_open_max: 6,
            dirty_blocks_commit: 64,
            dirty_blocks_throttle: 128,
            dirty_blocks_max: 256,
            background: self.options.background,
            // The committer wakes often enough to commit between the run's operations, and the
            // cleaner and the idle work do not wait for a pause the run never makes.
            background_interval_ms: 2,
            commit_interval_ms: 2,
            io_quiet_ms: 0,
            threads: self.options.threads || self.options.background,
            meta_backend: crate::store::Backend::Redb,
            frame_copy_blocks_min: 16,
            dedup_filter_min: 1 << 12,
            dedup_run_keys_min: 32,
            dedup_runs_max: 6,
            dedup_merge_slices: 3,
            dedup_run_keys_target: 40,
            zero_settle_entries_max: 64,
            flatten_step_entries: 16,
            disk: Arc::new(self.disk.clone()),
            events: self.events.clone(),
            ..PoolConfig::default()
        }
    }

    fn note(&mut self, line: String) {
        if let Some(events) = &self.events {
            events.push(format_args!("op: {line}"));
        }
        if self.log.len() == LOG_KEEP {
            self.log.remove(0);
        }
        self.log.push(line);
    }

    fn pool(&self) -> &Pool {
        self.pool.as_ref().expect("the pool is open")
    }

    /// An engine error: the power cut or an injected fault fired (the pool is then cut and
    /// checked as after any cut), or a failure of the run.
    fn engine(&self, what: &str, e: Error) -> Stop {
        if self.disk.is_off() || self.disk.stats().faults > self.faults_seen {
            Stop::Cut
        } else {
            Stop::Failed(format!("{what}: {e}"))
        }
    }

    fn run(&mut self) -> Result<(), String> {
        let pool =
            Pool::create(POOL_DIR, self.config()).map_err(|e| format!("create the pool: {e}"))?;
        self.pool = Some(pool);
        for _ in 0..2 {
            self.create_volume()
                .map_err(|_| "create a volume".to_string())?;
        }
        self.arm();
        while self.operations < self.options.operations {
            self.operations += 1;
            let before = self.model.clone();
            match self.step().and_then(|()| self.check_each_step()) {
                Ok(()) => {}
                Err(Stop::Cut) => self.recover(before)?,
                Err(Stop::Failed(why)) => return Err(why),
            }
        }
        self.disk.disarm();
        self.note("final power cut".into());
        self.recover(self.model.clone())
    }

    /// With [`SimOptions::check_each_step`]: every volume reads as the model holds it now.
    fn check_each_step(&mut self) -> Step {
        if !self.options.check_each_step {
            return Ok(());
        }
        let pool = self.pool().clone();
        for (name, vol) in &self.model.vols {
            let handle = pool.volume(name).map_err(|e| self.engine("open", e))?;
            let mut buf = vec![0u8; vol.size() as usize];
            handle
                .read(0, &mut buf)
                .map_err(|e| self.engine("read", e))?;
            if buf != vol.image {
                let at = buf.iter().zip(&vol.image).position(|(a, b)| a != b);
                let block = at.unwrap_or(0) as u64 / BLOCK;
                return Err(Stop::Failed(format!(
                    "{name} block {block} differs from the model's after the operation (no cut)"
                )));
            }
        }
        Ok(())
    }

    fn arm(&mut self) {
        let n = 1 + self.rng.below(self.options.cut_within_io);
        self.disk.cut_after(n);
    }

    /// After the power went: drops the pool, cuts, reopens (the power may go again during
    /// recovery), and checks the pool against `self.model` or, if the interrupted operation
    /// did complete, against what the model would be (`before` is the model before it).
    fn recover(&mut self, before: Model) -> Result<(), String> {
        let after = self.model.clone();
        if let Some(pool) = self.pool.take() {
            pool.simulate_crash();
        }
        for attempt in 0.. {
            self.disk.power_cut();
            if attempt < 3 && self.rng.one_in(4) {
                // The power goes again while the pool recovers.
                self.disk
                    .cut_after(1 + self.rng.below(self.options.cut_within_io / 4 + 1));
            }
            let opened = Pool::open(POOL_DIR, self.config());
            // No cut after this point; one armed for the recovery may have come already, also
            // in work the open does not wait on (the filters' build, on a thread of its own
            // when the engine runs its threads).
            self.disk.disarm();
            match opened {
                Ok(pool) if self.disk.is_off() => {
                    pool.simulate_crash();
                    self.note("power cut during recovery".into());
                }
                Ok(pool) => {
                    self.pool = Some(pool);
                    break;
                }
                Err(_) if self.disk.is_off() => {
                    self.note("power cut during recovery".into());
                }
                Err(e) => return Err(format!("reopen after a power cut: {e}")),
            }
        }
        self.disk.disarm();
        self.faults_seen = self.disk.stats().faults;
        self.note("reopened".into());
        self.model = self.pick_catalog(before, after)?;
        self.check_after_cut()?;
        self.arm();
        Ok(())
    }

    /// The catalog found at reopen: `after`'s (the interrupted operation completed) or
    /// `before`'s; anything else is a failure.
    fn pick_catalog(&self, before: Model, after: Model) -> Result<Model, String> {
        let found = self.catalog();
        let catalog = |m: &Model| {
            let vols: Vec<(String, u64)> =
                m.vols.iter().map(|(n, v)| (n.clone(), v.size())).collect();
            let snaps: Vec<String> = m.snaps.keys().cloned().collect();
            (vols, snaps)
        };
        if found == catalog(&after) && found == catalog(&before) {
            // Either may have happened (a write, a flush, a format change...).
            Ok(merge(before, after))
        } else if found == catalog(&after) {
            Ok(after)
        } else if found == catalog(&before) {
            Ok(before)
        } else {
            Err(format!(
                "catalog after a power cut: found {found:?}, expected {:?} or {:?}",
                catalog(&after),
                catalog(&before)
            ))
        }
    }

    fn catalog(&self) -> (Vec<(String, u64)>, Vec<String>) {
        let mut vols: Vec<(String, u64)> = (self.pool().list_volumes().into_iter())
            .map(|v| (v.name, v.size_bytes))
            .collect();
        vols.sort();
        let mut snaps: Vec<String> = (self.pool().list_snapshots(None).into_iter())
            .map(|s| format!("{}@{}", s.volume, s.name))
            .collect();
        snaps.sort();
        (vols, snaps)
    }

    /// Every block reads as a content it may hold (which becomes its durable content), every
    /// snapshot as taken, and `verify` passes.
    fn check_after_cut(&mut self) -> Result<(), String> {
        let pool = self.pool().clone();
        for (name, vol) in self.model.vols.iter_mut() {
            let handle = pool.volume(name).map_err(|e| format!("open {name}: {e}"))?;
            let mut buf = vec![0u8; vol.size() as usize];
            handle
                .read(0, &mut buf)
                .map_err(|e| format!("read {name} after a power cut: {e}"))?;
            for (b, block) in buf.chunks(BLOCK as usize).enumerate() {
                let h = hash(block);
                if !vol.possible[b].contains(&h) {
                    return Err(format!(
                        "{name} block {b} after a power cut holds content never written there \
                         or lost a durable write ({} possible contents; reads {})",
                        vol.possible[b].len(),
                        describe(block)
                    ));
                }
                vol.possible[b] = vec![h];
            }
            vol.image = buf;
        }
        for (key, image) in &self.model.snaps {
            let (v, s) = key.split_once('@').unwrap_or((key, ""));
            let handle = pool
                .snapshot(v, s)
                .map_err(|e| format!("open {key}: {e}"))?;
            let mut buf = vec![0u8; image.len()];
            handle
                .read(0, &mut buf)
                .map_err(|e| format!("read {key} after a power cut: {e}"))?;
            if &buf != image {
                return Err(format!("snapshot {key} changed across a power cut"));
            }
        }
        pool.verify()
            .map_err(|e| format!("verify after a power cut: {e}"))?;
        Ok(())
    }

    /// Makes one of the next reads, writes or syncs of a segment, the journal or the
    /// metadata store fail with EIO or ENOSPC.
    fn inject_fault(&mut self) {
        let op = [FaultOp::Read, FaultOp::Write, FaultOp::Sync][self.rng.below(3) as usize];
        let path = [".seg", "journal", "meta.redb"][self.rng.below(3) as usize];
        let errno = if op == FaultOp::Write && self.rng.one_in(2) {
            libc::ENOSPC
        } else {
            libc::EIO
        };
        let nth = 1 + self.rng.below(20);
        self.note(format!("fault: {op:?} {path} #{nth} errno {errno}"));
        self.disk.inject(Fault {
            op,
            path_contains: path.into(),
            nth,
            errno,
        });
    }

    /// One random operation.
    fn step(&mut self) -> Step {
        if self.rng.one_in(60) {
            self.inject_fault();
        }
        match self.rng.below(100) {
            0..=29 => self.write(),
            30..=34 => self.zero(),
            35..=42 => self.flush(),
            43..=48 => self.copy(),
            49..=52 => self.compare_and_write(),
            53..=55 => self.snapshot(),
            56..=57 => self.delete_snapshot(),
            58..=59 => self.clone_volume(),
            60..=61 => self.create_volume(),
            62 => self.delete_volume(),
            63 => self.resize(),
            64..=65 => self.set_format(),
            66..=69 => self.gc(),
            70..=73 => self.commit(),
            74..=75 => self.sync(),
            _ => self.read(),
        }
    }

    /// The model of volume `name`.
    fn vol_model(&mut self, name: &str) -> &mut VolModel {
        self.model
            .vols
            .get_mut(name)
            .expect("a volume of the model")
    }

    /// A handle on volume `name`.
    fn volume(&self, name: &str) -> Result<crate::Volume, Stop> {
        self.pool().volume(name).map_err(|e| self.engine("open", e))
    }

    fn pick_volume(&mut self) -> String {
        let n = self.model.vols.len() as u64;
        let i = self.rng.below(n) as usize;
        self.model.vols.keys().nth(i).cloned().expect("a volume")
    }

    /// A sector-aligned range of `name` of 1 sector to 16 blocks, often block-aligned.
    fn pick_range(&mut self, name: &str, max_blocks: u64) -> (u64, u64) {
        let size = self.model.vols[name].size();
        let aligned = self.rng.one_in(2);
        let unit = if aligned { BLOCK } else { SECTOR };
        let units = size / unit;
        let len_units = 1 + self.rng.below((max_blocks * BLOCK / unit).min(units));
        let offset = self.rng.below(units - len_units + 1) * unit;
        (offset, len_units * unit)
    }

    /// Data of one of the shapes writes have: unique, a repeated block (dedup), zeros, or
    /// compressible.
    fn data(&mut self, len: u64) -> Vec<u8> {
        let mut out = vec![0u8; len as usize];
        match self.rng.below(4) {
            0 => out
                .chunks_mut(8)
                .for_each(|c| c.copy_from_slice(&self.rng.next_u64().to_le_bytes()[..c.len()])),
            1 => {
                let pattern = self.rng.below(4) as u8;
                out.iter_mut()
                    .enumerate()
                    .for_each(|(i, b)| *b = pattern.wrapping_mul(31).wrapping_add((i % 251) as u8));
            }
            2 => {}
            _ => {
                let byte = self.rng.next_u64() as u8;
                let run = 1 + self.rng.below(64) as usize;
                out.iter_mut()
                    .enumerate()
                    .for_each(|(i, b)| *b = if (i / run).is_multiple_of(2) { byte } else { 0 });
            }
        }
        out
    }

    fn write(&mut self) -> Step {
        let name = self.pick_volume();
        let (offset, len) = self.pick_range(&name, 16);
        let data = self.data(len);
        let fua = self.rng.one_in(8);
        self.note(format!("write {name} {offset}+{len} fua={fua}"));
        self.vol_model(&name).write(offset, &data);
        let vol = self.volume(&name)?;
        vol.write(offset, &data, fua)
            .map_err(|e| self.engine("write", e))?;
        if fua {
            self.vol_model(&name).durable(offset, len);
        }
        Ok(())
    }

    fn zero(&mut self) -> Step {
        let name = self.pick_volume();
        let (offset, len) = self.pick_range(&name, 64);
        let fua = self.rng.one_in(8);
        self.note(format!("zero {name} {offset}+{len} fua={fua}"));
        let zeros = vec![0u8; len as usize];
        self.vol_model(&name).write(offset, &zeros);
        let vol = self.volume(&name)?;
        vol.write_zeroes(offset, len, fua)
            .map_err(|e| self.engine("zero", e))?;
        if fua {
            self.vol_model(&name).durable(offset, len);
        }
        Ok(())
    }

    fn flush(&mut self) -> Step {
        self.note("flush".into());
        self.pool().flush().map_err(|e| self.engine("flush", e))?;
        self.model.durable_all();
        Ok(())
    }

    fn copy(&mut self) -> Step {
        let src = self.pick_volume();
        let dst = self.pick_volume();
        let (src_off, len) = self.pick_range(&src, 64);
        let dst_size = self.model.vols[&dst].size();
        if len > dst_size {
            return Ok(());
        }
        let unit = if self.rng.one_in(4) { SECTOR } else { BLOCK };
        let dst_off = self.rng.below((dst_size - len) / unit + 1) * unit;
        self.note(format!("copy {src} {src_off}+{len} -> {dst} {dst_off}"));
        let data = self.model.vols[&src].image[src_off as usize..(src_off + len) as usize].to_vec();
        self.vol_model(&dst).write(dst_off, &data);
        let (s, d) = (self.volume(&src)?, self.volume(&dst)?);
        d.copy_from(&s, src_off, dst_off, len)
            .map_err(|e| self.engine("copy", e))?;
        Ok(())
    }

    fn compare_and_write(&mut self) -> Step {
        let name = self.pick_volume();
        let (offset, len) = self.pick_range(&name, 2);
        let current =
            self.model.vols[&name].image[offset as usize..(offset + len) as usize].to_vec();
        let mut expected = current.clone();
        if self.rng.one_in(3) {
            let i = self.rng.below(len) as usize;
            expected[i] ^= 0x5a;
        }
        let new = self.data(len);
        let fua = self.rng.one_in(4);
        self.note(format!("compare-and-write {name} {offset}+{len} fua={fua}"));
        let should = current.iter().zip(&expected).position(|(a, b)| a != b);
        if should.is_none() {
            self.vol_model(&name).write(offset, &new);
        }
        let vol = self.volume(&name)?;
        let got = vol
            .compare_and_write(offset, &expected, &new, fua)
            .map_err(|e| self.engine("compare-and-write", e))?;
        if got != should.map(|i| i as u64) {
            return Err(format!("compare-and-write answered {got:?}, the model {should:?}").into());
        }
        if fua && should.is_none() {
            self.vol_model(&name).durable(offset, len);
        }
        Ok(())
    }

    fn fresh_name(&mut self, prefix: &str) -> String {
        self.model.next_name += 1;
        format!("{prefix}{}", self.model.next_name)
    }

    fn snapshot(&mut self) -> Step {
        if self.model.snaps.len() >= 8 {
            return Ok(());
        }
        let name = self.pick_volume();
        let snap = self.fresh_name("s");
        self.note(format!("snapshot {name}@{snap}"));
        // Taking it commits everything written so far.
        self.model.durable_all();
        let image = self.model.vols[&name].image.clone();
        self.model.snaps.insert(format!("{name}@{snap}"), image);
        self.pool()
            .create_snapshot(&name, &snap)
            .map_err(|e| self.engine("snapshot", e))?;
        Ok(())
    }

    fn delete_snapshot(&mut self) -> Step {
        let n = self.model.snaps.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let i = self.rng.below(n) as usize;
        let key = self.model.snaps.keys().nth(i).cloned().expect("a snapshot");
        self.note(format!("delete snapshot {key}"));
        self.model.snaps.remove(&key);
        self.model.durable_all();
        let (v, s) = key.split_once('@').expect("a snapshot key");
        self.pool()
            .delete_snapshot(v, s)
            .map_err(|e| self.engine("delete snapshot", e))?;
        Ok(())
    }

    fn clone_volume(&mut self) -> Step {
        if self.model.vols.len() >= 6 {
            return Ok(());
        }
        let n = self.model.snaps.len() as u64;
        let source = if n > 0 && self.rng.one_in(2) {
            let i = self.rng.below(n) as usize;
            self.model.snaps.keys().nth(i).cloned().expect("a snapshot")
        } else {
            self.pick_volume()
        };
        let name = self.fresh_name("c");
        self.note(format!("clone {source} -> {name}"));
        let image = match self.model.snaps.get(&source) {
            Some(image) => image.clone(),
            None => {
                // A clone of a live volume commits everything written so far.
                self.model.durable_all();
                self.model.vols[&source].image.clone()
            }
        };
        self.model
            .vols
            .insert(name.clone(), VolModel::new(image, None));
        self.pool()
            .clone_volume(&source, &name)
            .map_err(|e| self.engine("clone", e))?;
        Ok(())
    }

    fn create_volume(&mut self) -> Step {
        if self.model.vols.len() >= 6 {
            return Ok(());
        }
        let name = self.fresh_name("v");
        let size = (16 + self.rng.below(240)) * BLOCK;
        let format = self.pick_format();
        self.note(format!("create {name} {size} {format:?}"));
        self.model.vols.insert(
            name.clone(),
            VolModel::new(vec![0; size as usize], Some(format)),
        );
        self.pool()
            .create_volume_with_format(&name, size, format)
            .map_err(|e| self.engine("create volume", e))?;
        Ok(())
    }

    fn pick_format(&mut self) -> VolumeFormat {
        match self.rng.below(3) {
            0 => VolumeFormat::Thin,
            1 => VolumeFormat::LazyZeroedThick,
            _ => VolumeFormat::EagerZeroedThick,
        }
    }

    fn delete_volume(&mut self) -> Step {
        if self.model.vols.len() <= 1 {
            return Ok(());
        }
        let name = self.pick_volume();
        self.note(format!("delete {name}"));
        self.model.vols.remove(&name);
        let prefix = format!("{name}@");
        self.model.snaps.retain(|k, _| !k.starts_with(&prefix));
        self.model.durable_all();
        self.pool()
            .delete_volume(&name)
            .map_err(|e| self.engine("delete volume", e))?;
        Ok(())
    }

    fn resize(&mut self) -> Step {
        let name = self.pick_volume();
        let grow = (1 + self.rng.below(32)) * BLOCK;
        let new_size = self.model.vols[&name].size() + grow;
        self.note(format!("resize {name} to {new_size}"));
        let v = self.vol_model(&name);
        v.image.resize(new_size as usize, 0);
        let zero = hash(&[0u8; BLOCK as usize]);
        v.possible
            .resize(new_size.div_ceil(BLOCK) as usize, vec![zero]);
        self.model.durable_all();
        self.pool()
            .resize_volume(&name, new_size)
            .map_err(|e| self.engine("resize", e))?;
        Ok(())
    }

    fn set_format(&mut self) -> Step {
        let name = self.pick_volume();
        let format = self.pick_format();
        self.note(format!("format {name} {format:?}"));
        // A change commits everything written so far; setting the format it has does nothing.
        let old = self.vol_model(&name).format.replace(format);
        if old.is_some_and(|f| f != format) {
            self.model.durable_all();
        }
        self.pool()
            .set_volume_format(&name, format)
            .map_err(|e| self.engine("set format", e))?;
        Ok(())
    }

    fn gc(&mut self) -> Step {
        self.note("gc".into());
        self.pool().gc_now().map_err(|e| self.engine("gc", e))?;
        self.model.durable_all();
        Ok(())
    }

    fn commit(&mut self) -> Step {
        self.note("commit".into());
        self.pool()
            .commit_once()
            .map_err(|e| self.engine("commit", e))?;
        Ok(())
    }

    fn sync(&mut self) -> Step {
        self.note("sync".into());
        self.pool().sync().map_err(|e| self.engine("sync", e))?;
        self.model.durable_all();
        Ok(())
    }

    fn read(&mut self) -> Step {
        let snaps = self.model.snaps.len() as u64;
        let (handle, expect, what) = if snaps > 0 && self.rng.one_in(4) {
            let i = self.rng.below(snaps) as usize;
            let key = self.model.snaps.keys().nth(i).cloned().expect("a snapshot");
            let (v, s) = key.split_once('@').expect("a snapshot key");
            let h = self
                .pool()
                .snapshot(v, s)
                .map_err(|e| self.engine("open", e))?;
            (h, self.model.snaps[&key].clone(), key)
        } else {
            let name = self.pick_volume();
            let h = self.volume(&name)?;
            (h, self.model.vols[&name].image.clone(), name)
        };
        let size = expect.len() as u64;
        let offset = self.rng.below(size / SECTOR) * SECTOR;
        let len = (1 + self.rng.below(64)) * SECTOR;
        let len = len.min(size - offset);
        self.note(format!("read {what} {offset}+{len}"));
        let mut buf = vec![0u8; len as usize];
        handle
            .read(offset, &mut buf)
            .map_err(|e| self.engine("read", e))?;
        if buf[..] != expect[offset as usize..(offset + len) as usize] {
            return Err(
                format!("{what} {offset}+{len} reads other bytes than were written").into(),
            );
        }
        Ok(())
    }
}

/// A model allowing what either `before` or `after` allows (same catalog).
fn merge(before: Model, mut after: Model) -> Model {
    for (name, b) in before.vols {
        let Some(a) = after.vols.get_mut(&name) else {
            continue;
        };
        for (pa, pb) in a.possible.iter_mut().zip(b.possible) {
            for h in pb {
                if !pa.contains(&h) {
                    pa.push(h);
                }
            }
        }
        if a.format != b.format {
            a.format = None;
        }
    }
    after
}

fn describe(block: &[u8]) -> String {
    let nonzero = block.iter().filter(|&&b| b != 0).count();
    format!("{nonzero} nonzero bytes, first {:02x?}", &block[..8])
}

/// The pool directory of simulated pools (for tools that inspect a [`SimDisk`]).
pub fn pool_dir() -> &'static Path {
    Path::new(POOL_DIR)
}
