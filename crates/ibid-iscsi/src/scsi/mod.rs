//! SCSI command execution (SPC-4 / SBC-3) on top of [`crate::backend`].
//!
//! [`Target::execute`] takes a CDB and the collected Data-Out buffer and
//! returns status, sense and Data-In. It is synchronous: the iSCSI layer
//! calls it from `spawn_blocking`.

pub mod block;
pub mod cdb;
pub mod info;
pub mod pr;
pub mod pr_store;
pub mod xcopy;

use crate::backend::{HeldData, Lun, LunError, Luns};
use crate::config::TargetConfig;
use crate::sense::{Sense, STATUS_CHECK_CONDITION, STATUS_GOOD, STATUS_RESERVATION_CONFLICT};
use cdb::Op;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

/// Logical block size in bytes.
pub const BLOCK_SIZE: u64 = 512;
/// log2(logical blocks per physical block): 4 KiB physical (512e).
pub const LBPPB_EXPONENT: u8 = 3;
/// Largest READ/WRITE/VERIFY transfer, in blocks (B0h MAXIMUM TRANSFER LENGTH).
pub const MAX_TRANSFER_BLOCKS: u32 = 65_536;
/// Largest COMPARE AND WRITE, in blocks (B0h MAXIMUM COMPARE AND WRITE LENGTH).
pub const MAX_CAW_BLOCKS: u8 = 16;
/// Largest UNMAP descriptor / WRITE SAME, in blocks (B0h).
pub const MAX_UNMAP_BLOCKS: u32 = 1 << 20;
/// Largest number of UNMAP block descriptors (B0h).
pub const MAX_UNMAP_DESCRIPTORS: u32 = 256;
/// Largest WRITE SAME, in blocks (B0h MAXIMUM WRITE SAME LENGTH).
pub const MAX_WRITE_SAME_BLOCKS: u64 = 1 << 22;
/// Unmap/optimal granularity, in blocks: one 4 KiB engine block.
pub const GRANULARITY_BLOCKS: u32 = 8;
/// Pending unit attentions kept per I_T nexus and LUN.
const UA_QUEUE_MAX: usize = 8;

/// The initiator side of an I_T nexus.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Nexus {
    /// Initiator port name: `<InitiatorName>,i,0x<ISID>` (SPC-4 TransportID).
    pub port: String,
    /// Initiator name alone.
    pub initiator: String,
}

/// The outcome of one command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// SCSI status.
    pub status: u8,
    /// Sense data for CHECK CONDITION.
    pub sense: Option<Sense>,
    /// Data-In (before truncation to the expected transfer length).
    pub data_in: Vec<u8>,
    /// Data-Out the CDB asked for (for write residuals), if it is a data-out command.
    pub data_out_len: Option<u64>,
    /// Parts of the Data-In held outside `data_in`. Its bytes there are meaningless (an
    /// earlier command's, in a reused buffer): `data_in` is never sent without them.
    pub held: Held,
}

/// Parts of a response's Data-In that a LUN left where they were ([`crate::Lun::read_held`]),
/// sent from there; `None`: `data_in` holds all of it.
#[derive(Clone, Default)]
pub struct Held(pub Option<Arc<dyn HeldData>>);

impl Held {
    /// The held parts: (offset in the Data-In, bytes), ascending.
    pub fn parts(&self) -> impl Iterator<Item = (usize, &[u8])> + '_ {
        self.0
            .iter()
            .flat_map(|held| (0..held.parts()).map(move |i| held.part(i)))
    }
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Held({} parts)", self.parts().count())
    }
}

impl PartialEq for Held {
    fn eq(&self, other: &Held) -> bool {
        self.parts().eq(other.parts())
    }
}

impl Eq for Held {}

impl Response {
    /// GOOD with data.
    pub fn good(data_in: Vec<u8>) -> Self {
        Response {
            status: STATUS_GOOD,
            sense: None,
            data_in,
            data_out_len: None,
            held: Held::default(),
        }
    }
    /// CHECK CONDITION with `sense`.
    pub fn check(sense: Sense) -> Self {
        Response {
            status: STATUS_CHECK_CONDITION,
            sense: Some(sense),
            data_in: Vec::new(),
            data_out_len: None,
            held: Held::default(),
        }
    }
    /// RESERVATION CONFLICT.
    pub fn conflict() -> Self {
        Response {
            status: STATUS_RESERVATION_CONFLICT,
            sense: None,
            data_in: Vec::new(),
            data_out_len: None,
            held: Held::default(),
        }
    }
    /// GOOD with data, parts of it held where they are (`data_in` has holes there).
    pub fn good_held(data_in: Vec<u8>, held: Option<Arc<dyn HeldData>>) -> Self {
        Response {
            held: Held(held),
            ..Response::good(data_in)
        }
    }
    fn with_out(mut self, n: u64) -> Self {
        self.data_out_len = Some(n);
        self
    }
}

impl From<Sense> for Response {
    fn from(s: Sense) -> Self {
        Response::check(s)
    }
}

/// Map a backend error to sense.
pub fn lun_error_sense(e: &LunError) -> Sense {
    match e {
        LunError::NoSpace => Sense::no_space(),
        LunError::OutOfRange => Sense::lba_out_of_range(),
        LunError::ReadOnly => Sense::write_protected(),
        LunError::NoSuchLun => Sense::lun_not_supported(),
        LunError::Io(_) => Sense::medium_error(),
    }
}

/// The NAA IEEE Registered Extended designator (NAA 6) derived from the LUN id: the LUN's
/// identity in the Device Identification VPD page and in EXTENDED COPY's target descriptors.
pub fn naa_designator(id: &[u8; 16]) -> [u8; 16] {
    let mut d = *id;
    d[0] = 0x60 | (d[0] & 0x0f);
    d
}

/// Truncate `v` to the allocation length `alloc`.
pub fn alloc_trunc(mut v: Vec<u8>, alloc: u32) -> Vec<u8> {
    v.truncate(alloc as usize);
    v
}

/// Per-LUN state shared by all sessions.
#[derive(Default)]
pub struct LunState {
    /// Identity ([`Lun::id`]) of the device this state belongs to: if the LUN number comes
    /// to address another device, its reservations and copy results are dropped (and the
    /// new device's saved reservations loaded); pending unit attentions and known ports stay.
    pub identity: Option<[u8; 16]>,
    /// SPC-2 RESERVE holder (initiator port).
    pub reserved_by: Option<String>,
    /// Persistent reservations.
    pub pr: pr::PrState,
    /// Pending unit attentions per initiator port.
    pub ua: HashMap<String, VecDeque<Sense>>,
    /// Initiator ports that have used this LUN (they get reset UAs), with
    /// the LUN-inventory generation and capacity each one last saw.
    pub ports: HashMap<String, (u64, u64)>,
    /// Ports already told about the soft threshold.
    pub space_told: HashSet<String>,
    /// EXTENDED COPY results per (initiator port, list id).
    pub copies: HashMap<(String, u8), xcopy::CopyResult>,
}

impl LunState {
    /// A reset: SPC-2 reservations dropped, `ua` queued for every known port.
    fn reset(&mut self, ua: Sense) {
        self.reserved_by = None;
        let ports: Vec<String> = self.ports.keys().cloned().collect();
        self.ua_all_but(&ports, "", ua);
    }

    /// Queue a unit attention for every port in `ports` except `but`.
    pub fn ua_all_but(&mut self, ports: &[String], but: &str, s: Sense) {
        for p in ports.iter().filter(|p| p.as_str() != but) {
            let q = self.ua.entry(p.clone()).or_default();
            if q.len() < UA_QUEUE_MAX {
                q.push_back(s);
            }
        }
    }
}

/// The LUN handles one connection has opened, reused while [`Luns::generation`] stays the
/// same (no LUN added, removed or renumbered): a command then costs no [`Luns::open`].
#[derive(Default)]
pub struct LunCache {
    open: Mutex<HashMap<u64, CachedLun>>,
}

/// A LUN handle and the inventory generation it was opened at.
type CachedLun = (u64, Arc<dyn Lun>);

impl LunCache {
    /// LUN `lun`'s handle: the cached one if the LUN inventory has not changed since it was
    /// opened, else a fresh one.
    pub fn get(&self, luns: &dyn Luns, lun: u64) -> Option<Arc<dyn Lun>> {
        let generation = luns.generation();
        if let Some((g, dev)) = self.open.lock().get(&lun) {
            if *g == generation {
                return Some(dev.clone());
            }
        }
        let dev = luns.open(lun);
        let mut open = self.open.lock();
        match &dev {
            Some(d) => open.insert(lun, (generation, d.clone())),
            None => open.remove(&lun),
        };
        dev
    }
}

/// The SCSI side of the target: LUNs plus the shared per-LUN state.
pub struct Target {
    /// The backend.
    pub luns: Arc<dyn Luns>,
    /// Configuration (names for INQUIRY).
    pub cfg: TargetConfig,
    /// Where reservations with APTPL are kept.
    pub pr_store: pr_store::PrStore,
    /// Read buffers, reused once their data is sent.
    pub(crate) buffers: crate::buffers::Buffers,
    state: Mutex<HashMap<u64, LunState>>,
}

/// Everything a handler needs about the command it runs.
pub struct Ctx<'a> {
    /// The target.
    pub target: &'a Target,
    /// Who sent it.
    pub nexus: &'a Nexus,
    /// LUN number.
    pub lun: u64,
    /// The device.
    pub dev: Arc<dyn Lun>,
    /// The Data-Out buffer.
    pub data: &'a [u8],
}

impl Ctx<'_> {
    /// Capacity in logical blocks.
    pub fn blocks(&self) -> u64 {
        self.dev.size() / BLOCK_SIZE
    }
    /// Run `f` with this LUN's state locked.
    pub fn with_state<R>(&self, f: impl FnOnce(&mut LunState) -> R) -> R {
        self.target.with_state(self.lun, f)
    }
}

impl Target {
    /// A target over `luns` that keeps no state on disk (APTPL is refused), whatever
    /// `cfg.state_dir` says.
    pub fn new(luns: Arc<dyn Luns>, cfg: TargetConfig) -> Self {
        Target {
            luns,
            cfg,
            pr_store: pr_store::PrStore::none(),
            buffers: Default::default(),
            state: Mutex::new(HashMap::new()),
        }
    }

    /// A target over `luns` keeping persistent reservations in `cfg.state_dir` (if set),
    /// with what is saved there read back.
    pub fn open(luns: Arc<dyn Luns>, cfg: TargetConfig) -> std::io::Result<Self> {
        let pr_store = match &cfg.state_dir {
            Some(dir) => pr_store::PrStore::open(dir)?,
            None => pr_store::PrStore::none(),
        };
        Ok(Target {
            luns,
            cfg,
            pr_store,
            buffers: Default::default(),
            state: Mutex::new(HashMap::new()),
        })
    }

    /// Run `f` with LUN `lun`'s state locked.
    pub fn with_state<R>(&self, lun: u64, f: impl FnOnce(&mut LunState) -> R) -> R {
        f(self.state.lock().entry(lun).or_default())
    }

    /// Execute one command.
    pub fn execute(&self, nexus: &Nexus, lun: u64, cdb_bytes: &[u8], data: &[u8]) -> Response {
        self.execute_cached(nexus, lun, cdb_bytes, data, &LunCache::default())
    }

    /// Execute one command, taking the LUN's handle from `cache` (one per connection).
    pub fn execute_cached(
        &self,
        nexus: &Nexus,
        lun: u64,
        cdb_bytes: &[u8],
        data: &[u8],
        cache: &LunCache,
    ) -> Response {
        let op = match cdb::parse(cdb_bytes) {
            Ok(op) => op,
            Err(s) => return s.into(),
        };
        if let Some(r) = self.lun_independent(nexus, lun, &op) {
            return r;
        }
        let Some(dev) = cache.get(self.luns.as_ref(), lun) else {
            return Sense::lun_not_supported().into();
        };
        let ctx = Ctx {
            target: self,
            nexus,
            lun,
            dev,
            data,
        };
        if let Some(r) = self.admit(&ctx, &op) {
            return r;
        }
        dispatch(&ctx, op)
    }

    fn lun_independent(&self, nexus: &Nexus, lun: u64, op: &Op) -> Option<Response> {
        match op {
            Op::ReportLuns { select, alloc } => Some(info::report_luns(self, *select, *alloc)),
            Op::Inquiry { .. } if self.luns.open(lun).is_none() => Some(info::inquiry_no_lun(op)),
            Op::RequestSense { desc, alloc } => {
                Some(info::request_sense(self, nexus, lun, *desc, *alloc))
            }
            _ => None,
        }
    }

    /// What a command meets in its LUN's state before it runs, under one lock: the state
    /// bound to its device (see [`LunState::identity`]), then a pending unit attention
    /// (INQUIRY, REPORT LUNS and REQUEST SENSE pass them), then a reservation conflict.
    fn admit(&self, ctx: &Ctx, op: &Op) -> Option<Response> {
        let check_ua = !matches!(
            op,
            Op::Inquiry { .. } | Op::ReportLuns { .. } | Op::RequestSense { .. }
        );
        let warn = check_ua && self.luns.space_warning();
        let now = (self.luns.generation(), ctx.dev.size());
        let id = ctx.dev.id();
        let port = &ctx.nexus.port;
        let class = access_class(op);
        ctx.with_state(|st| {
            if st.identity != Some(id) {
                st.identity = Some(id);
                st.reserved_by = None;
                st.copies.clear();
                st.pr = self.pr_store.load(&id).unwrap_or_default();
            }
            if check_ua {
                let before = match st.ports.get_mut(port) {
                    Some(seen) => Some(std::mem::replace(seen, now)),
                    None => {
                        st.ports.insert(port.clone(), now);
                        None
                    }
                };
                if let Some(s) = inventory_change(before, now) {
                    return Some(s.into());
                }
                if warn && !st.space_told.contains(port) {
                    st.space_told.insert(port.clone());
                    return Some(Sense::soft_threshold().into());
                }
                if !warn && !st.space_told.is_empty() {
                    st.space_told.remove(port);
                }
                if let Some(s) = st.ua.get_mut(port).and_then(|q| q.pop_front()) {
                    return Some(Response::check(s));
                }
            }
            if let Some(holder) = &st.reserved_by {
                if holder != port && class != Access::Always && !matches!(op, Op::Release) {
                    return Some(Response::conflict());
                }
            }
            st.pr.conflicts(port, class).then(Response::conflict)
        })
    }

    /// Drop SPC-2 reservations held by `port` on every LUN (I_T nexus loss).
    pub fn nexus_lost(&self, port: &str) {
        for st in self.state.lock().values_mut() {
            if st.reserved_by.as_deref() == Some(port) {
                st.reserved_by = None;
            }
        }
    }

    /// LOGICAL UNIT RESET: clear SPC-2 reservations, raise 29h/03h for others.
    pub fn lun_reset(&self, lun: u64) {
        self.with_state(lun, |st| {
            st.reset(Sense::new(crate::sense::KEY_UNIT_ATTENTION, 0x29, 0x03))
        });
    }

    /// TARGET RESET: a reset of every LUN, with 29h/00h.
    pub fn target_reset(&self) {
        for st in self.state.lock().values_mut() {
            st.reset(Sense::reset_occurred());
        }
    }
}

/// The UA for a change since a port last looked: REPORTED LUNS DATA HAS
/// CHANGED (3Fh/0Eh) or CAPACITY DATA HAS CHANGED (2Ah/09h).
fn inventory_change(before: Option<(u64, u64)>, now: (u64, u64)) -> Option<Sense> {
    let (gen, size) = before?;
    if gen != now.0 {
        return Some(Sense::new(crate::sense::KEY_UNIT_ATTENTION, 0x3f, 0x0e));
    }
    if size != now.1 {
        return Some(Sense::new(crate::sense::KEY_UNIT_ATTENTION, 0x2a, 0x09));
    }
    None
}

/// How a command is treated under reservations (SPC-4 5.13.1, table 66).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Allowed whatever the reservation.
    Always,
    /// A read of the medium.
    Read,
    /// A write of the medium or of device state.
    Write,
}

fn access_class(op: &Op) -> Access {
    match op {
        Op::Inquiry { .. }
        | Op::ReportLuns { .. }
        | Op::RequestSense { .. }
        | Op::PrIn { .. }
        | Op::PrOut { .. }
        | Op::ReportOpcodes { .. }
        | Op::ReportTargetPortGroups { .. }
        | Op::ReadCapacity10 { .. }
        | Op::ReadCapacity16 { .. }
        | Op::TestUnitReady
        | Op::Release => Access::Always,
        Op::Read(_)
        | Op::Verify(_)
        | Op::Prefetch { .. }
        | Op::GetLbaStatus { .. }
        | Op::ModeSense { .. } => Access::Read,
        _ => Access::Write,
    }
}

fn dispatch(ctx: &Ctx, op: Op) -> Response {
    match op {
        Op::TestUnitReady => Response::good(Vec::new()),
        Op::Inquiry { evpd, page, alloc } => info::inquiry(ctx, evpd, page, alloc),
        Op::ReadCapacity10 { lba, pmi } => info::read_capacity10(ctx, lba, pmi),
        Op::ReadCapacity16 { alloc } => info::read_capacity16(ctx, alloc),
        Op::ModeSense { .. } => info::mode_sense(ctx, &op),
        Op::ModeSelect { ten, pf, sp, len } => info::mode_select(ctx, ten, pf, sp, len),
        Op::ReportOpcodes {
            options,
            rctd,
            opcode,
            sa,
            alloc,
        } => info::report_opcodes(options, rctd, opcode, sa, alloc),
        Op::ReportTargetPortGroups { alloc } => info::report_tpg(alloc),
        Op::StartStopUnit { .. } | Op::PreventAllow { .. } => Response::good(Vec::new()),
        Op::Reserve => pr::reserve(ctx),
        Op::Release => pr::release(ctx),
        Op::PrIn { sa, alloc } => pr::pr_in(ctx, sa, alloc),
        Op::PrOut { sa, scope, ty, len } => pr::pr_out(ctx, sa, scope, ty, len),
        Op::ExtendedCopy { len } => xcopy::extended_copy(ctx, len),
        Op::ReceiveCopyResults { sa, list_id, alloc } => {
            xcopy::receive_copy_results(ctx, sa, list_id, alloc)
        }
        other => block::dispatch(ctx, other),
    }
}

/// Parameter list bytes actually usable: the smaller of CDB length and data.
pub fn param_list<'a>(ctx: &Ctx<'a>, len: u32) -> &'a [u8] {
    &ctx.data[..(len as usize).min(ctx.data.len())]
}

/// Attach the data-out length a write-type command expected.
pub fn expect_out(r: Response, n: u64) -> Response {
    r.with_out(n)
}

#[cfg(test)]
mod tests;
