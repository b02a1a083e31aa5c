//! A volume's in-memory state: its map (stack of frames, uncommitted changes, mapped-block
//! count), its stripe locks, and what [`VolumeInfo`] reports of it.

use crate::format::{Frame, VolumeFormat, VolumeRecord};
use crate::overlay::Overlay;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

/// Number of stripe locks per volume that order read-modify-writes of partial blocks.
pub const STRIPES: usize = 64;

/// In-memory state of one volume.
pub(crate) struct VolumeState {
    /// Volume name, or `VOLUME@SNAPSHOT` for a snapshot.
    pub name: String,
    pub id: u64,
    pub created_unix_s: u64,
    /// Snapshots are read-only views of a frozen stack.
    pub read_only: bool,
    /// The [`VolumeFormat`] code; changed only with `map` locked (see `reformat.rs`).
    pub format: AtomicU8,
    pub map: Mutex<VolumeMap>,
    pub stripes: Vec<Mutex<()>>,
    /// When the last range copy by frames into this volume happened (see `copy/`).
    pub frames_copied_at: Mutex<Option<std::time::Instant>>,
}

pub(crate) struct VolumeMap {
    pub size: u64,
    /// Map frames (layers seen through windows), bottom first; the last is the writable top
    /// layer. Changes only with the commit lock held (a catalog operation, or a range copy
    /// made permanent, see `copy/`) and, except for the latter, the gate held
    /// exclusively and no uncommitted changes (see `snapshot.rs`).
    pub stack: Vec<Frame>,
    /// Changes since the last swap.
    pub dirty: Overlay,
    /// Changes being committed (readers see them until the commit is durable).
    pub committing: Arc<Overlay>,
    /// Blocks mapped to data, including uncommitted changes.
    pub mapped_blocks: u64,
    /// Bumped whenever `committing` is cleared, so a writer knows its prefetch is stale.
    pub generation: u64,
    /// Flattening steps applied to this stack's layers (with the commit lock held). A step
    /// moves entries between two of its layers, a frozen one among them, and leaves the stack
    /// as it was until the last: a copy being made permanent whose walk began before one
    /// gives up (see `copy/`).
    pub merge_steps: u64,
    /// The volume was deleted; its handles fail.
    pub deleted: bool,
    /// The size or record changed and must be written at the next commit.
    pub record_dirty: bool,
}

impl VolumeMap {
    /// A zeroed range is still to settle (uncommitted, being committed, or left by a commit).
    pub fn has_zeroed(&self) -> bool {
        self.dirty.has_zeroed() || self.committing.has_zeroed()
    }
}

/// Describes a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeInfo {
    /// Volume id: unique in the pool, never reused.
    pub id: u64,
    /// Volume name.
    pub name: String,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Blocks (4 KiB) mapped to non-zero data.
    pub mapped_blocks: u64,
    /// Creation time, seconds since the Unix epoch.
    pub created_unix_s: u64,
    /// Space reservation policy.
    pub format: VolumeFormat,
    /// Blocks "to be zeroed": never written (or zeroed since) in a lazy-zeroed thick volume;
    /// 0 for the other formats. Such blocks read as zeros at no cost either way.
    pub tbz_blocks: u64,
    /// Pool space this volume keeps reserved for its blocks that hold no data (thick only).
    pub reserved_bytes: u64,
}

pub(crate) fn new_volume_state(name: String, r: &VolumeRecord, read_only: bool) -> VolumeState {
    VolumeState {
        name,
        id: r.id,
        created_unix_s: r.created_unix_s,
        read_only,
        format: AtomicU8::new(r.format.code()),
        map: Mutex::new(VolumeMap {
            size: r.size,
            stack: r.layers.clone(),
            dirty: Overlay::new(),
            committing: Arc::new(Overlay::new()),
            mapped_blocks: r.mapped_blocks,
            generation: 0,
            merge_steps: 0,
            deleted: false,
            record_dirty: false,
        }),
        stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
        frames_copied_at: Mutex::new(None),
    }
}

pub(crate) fn volume_info(v: &VolumeState) -> VolumeInfo {
    let map = v.map.lock();
    let format = v.format();
    let unwritten = crate::provision::unwritten_blocks(map.size, map.mapped_blocks);
    VolumeInfo {
        id: v.id,
        name: v.name.clone(),
        size_bytes: map.size,
        mapped_blocks: map.mapped_blocks,
        created_unix_s: v.created_unix_s,
        format,
        tbz_blocks: if format == VolumeFormat::LazyZeroedThick {
            unwritten
        } else {
            0
        },
        reserved_bytes: if format.is_thick() {
            unwritten * crate::provision::RESERVED_BYTES_PER_BLOCK
        } else {
            0
        },
    }
}

impl VolumeState {
    /// The volume's provisioning format.
    pub(crate) fn format(&self) -> VolumeFormat {
        VolumeFormat::from_code(self.format.load(Ordering::Relaxed)).unwrap_or_default()
    }
}
