//! Changing a volume's provisioning format (see `provision.rs`): to a thick format reserves
//! space for the blocks that hold no data, to thin releases it; in O(1).

use crate::error::{Error, Result};
use crate::format::VolumeFormat;
use crate::meta;
use crate::pool::Pool;
use crate::provision::{reservation_share, volume_blocks};
use std::sync::atomic::Ordering;

impl Pool {
    /// Changes a volume's provisioning format, in O(1): to a thick format it reserves space for
    /// the blocks that hold no data (`CannotReserve` if that does not fit); to thin it releases
    /// the reservation. Lazy- to eager-zeroed thick (`vmkfstools -k`) and thin to eager-zeroed
    /// thick (`inflate`) are the seeds' conversions. Returns the previous format.
    pub fn set_volume_format(&self, name: &str, format: VolumeFormat) -> Result<VolumeFormat> {
        self.inner.check_failed()?;
        let state = self.live_state(name)?;
        let reserving = self.inner.space.reserving();
        let mut map = state.map.lock();
        if map.deleted {
            return Err(Error::NotFound(name.to_string()));
        }
        let old = state.format();
        if old == format {
            return Ok(old);
        }
        let share = reservation_share(map.size, map.mapped_blocks);
        let blocks = volume_blocks(map.size) as i64;
        match (old.is_thick(), format.is_thick()) {
            (false, true) => {
                reserving.check(share, blocks)?;
                reserving.add(share, blocks);
            }
            (true, false) => self.inner.space.release(share, blocks),
            _ => {}
        }
        state.format.store(format.code(), Ordering::Relaxed);
        map.record_dirty = true;
        drop(map);
        drop(reserving);
        self.inner.commit()?;
        self.inner.check_soft_threshold();
        Ok(old)
    }

    /// Changes the pool's capacity. Refused with `CannotReserve` below what is used and
    /// reserved: the capacity is a promise to thick volumes.
    pub fn set_capacity(&self, capacity_bytes: u64) -> Result<()> {
        self.set_capacity_checked(capacity_bytes, false)
    }

    /// [`Pool::set_capacity`], accepting a capacity larger than the filesystem can hold
    /// (the pool then promises space the filesystem may not have; writes of new data get
    /// ENOSPC when it fills).
    pub fn set_capacity_forced(&self, capacity_bytes: u64) -> Result<()> {
        self.set_capacity_checked(capacity_bytes, true)
    }

    fn set_capacity_checked(&self, capacity_bytes: u64, force: bool) -> Result<()> {
        self.inner.check_failed()?;
        // What the filesystem can hold: what the pool's files take now and what is free.
        let (_, fs_avail) = self.inner.space.fs().now();
        let holdable = (self.inner.segment_file_bytes() + self.inner.space.meta_bytes())
            .saturating_add(fs_avail);
        if capacity_bytes > holdable && !force {
            return Err(Error::InvalidArgument(format!(
                "capacity {} is more than the filesystem under the pool can hold ({}: its \
                 files and the space available); force it to promise space the filesystem may \
                 not have",
                crate::units::format_exact(capacity_bytes),
                crate::units::format_exact(holdable)
            )));
        }
        self.inner
            .space
            .reserving()
            .set_capacity(capacity_bytes, || {
                self.update_pool_record(|r| r.capacity_bytes = capacity_bytes)
            })?;
        self.inner.check_soft_threshold();
        Ok(())
    }

    /// Changes the soft threshold (1 to 100 percent of capacity).
    pub fn set_soft_threshold(&self, pct: u8) -> Result<()> {
        self.inner.check_failed()?;
        if pct == 0 || pct > 100 {
            return Err(Error::InvalidArgument(format!(
                "soft threshold {pct}: must be 1 to 100 percent"
            )));
        }
        self.update_pool_record(|r| r.soft_threshold_pct = pct as u64)?;
        self.inner.space.set_soft_threshold_pct(pct as u64);
        self.inner.check_soft_threshold();
        Ok(())
    }

    /// Changes the committed pool record in its own transaction.
    fn update_pool_record(&self, change: impl FnOnce(&mut meta::PoolRecord)) -> Result<()> {
        let mut cs = self.inner.commit.lock();
        self.inner.update_pool_record(&mut cs, change)
    }
}
