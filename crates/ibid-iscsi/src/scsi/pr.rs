//! Reservations: SPC-2 RESERVE/RELEASE and SPC-4 persistent reservations
//! (PERSISTENT RESERVE IN/OUT). Registrations are held in memory per LUN and
//! keyed by initiator port; when the last REGISTER set APTPL, the LUN's state is
//! also written to the target's [`super::pr_store::PrStore`] before the command
//! completes, and comes back after a restart (PTPL_C is reported when the target
//! has a state directory to keep it in).

use super::{alloc_trunc, param_list, Access, Ctx, Response};
use crate::sense::{Sense, KEY_ILLEGAL_REQUEST};

/// Reservation type Write Exclusive.
pub const TYPE_WE: u8 = 1;
/// Reservation type Exclusive Access.
pub const TYPE_EA: u8 = 3;
/// Reservation type Write Exclusive - Registrants Only.
pub const TYPE_WERO: u8 = 5;
/// Reservation type Exclusive Access - Registrants Only.
pub const TYPE_EARO: u8 = 6;
/// Reservation type Write Exclusive - All Registrants.
pub const TYPE_WEAR: u8 = 7;
/// Reservation type Exclusive Access - All Registrants.
pub const TYPE_EAAR: u8 = 8;
/// PERSISTENT RESERVE OUT parameter list length (basic, no SPEC_I_PT).
const PROUT_PARAM_LEN: usize = 24;

/// A persistent reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// Holder's initiator port (ignored for all-registrants types).
    pub holder: String,
    /// Reservation type.
    pub ty: u8,
}

/// Persistent reservation state of one LUN.
#[derive(Debug, Default, Clone)]
pub struct PrState {
    /// PRGENERATION.
    pub generation: u32,
    /// (initiator port, key), in registration order.
    pub registrations: Vec<(String, u64)>,
    /// The reservation, if any.
    pub reservation: Option<Reservation>,
    /// Activate Persist Through Power Loss: set by the last REGISTER's APTPL bit.
    pub aptpl: bool,
}

fn all_registrants(ty: u8) -> bool {
    ty == TYPE_WEAR || ty == TYPE_EAAR
}

impl PrState {
    fn key_of(&self, port: &str) -> Option<u64> {
        self.registrations
            .iter()
            .find(|(p, _)| p == port)
            .map(|(_, k)| *k)
    }

    fn is_holder(&self, port: &str) -> bool {
        match &self.reservation {
            Some(r) if all_registrants(r.ty) => self.key_of(port).is_some(),
            Some(r) => r.holder == port,
            None => false,
        }
    }

    /// Whether a command of `class` from `port` conflicts (SPC-4 table 66).
    pub fn conflicts(&self, port: &str, class: Access) -> bool {
        let Some(r) = &self.reservation else {
            return false;
        };
        if class == Access::Always || self.is_holder(port) {
            return false;
        }
        let registered = self.key_of(port).is_some();
        match r.ty {
            TYPE_WE => class == Access::Write,
            TYPE_EA => true,
            TYPE_WERO | TYPE_WEAR => !registered && class == Access::Write,
            _ => !registered,
        }
    }

    fn unregister(&mut self, port: &str) {
        self.registrations.retain(|(p, _)| p != port);
        let release = match &self.reservation {
            Some(r) if all_registrants(r.ty) => self.registrations.is_empty(),
            Some(r) => r.holder == port,
            None => false,
        };
        if release {
            self.reservation = None;
        }
    }
}

/// SPC-2 RESERVE(6/10).
pub fn reserve(ctx: &Ctx) -> Response {
    ctx.with_state(|st| {
        if !st.pr.registrations.is_empty() {
            return Response::conflict();
        }
        match &st.reserved_by {
            Some(h) if h != &ctx.nexus.port => Response::conflict(),
            _ => {
                st.reserved_by = Some(ctx.nexus.port.clone());
                Response::good(Vec::new())
            }
        }
    })
}

/// SPC-2 RELEASE(6/10): only the holder releases; others get GOOD.
pub fn release(ctx: &Ctx) -> Response {
    ctx.with_state(|st| {
        if !st.pr.registrations.is_empty() {
            return Response::conflict();
        }
        if st.reserved_by.as_deref() == Some(ctx.nexus.port.as_str()) {
            st.reserved_by = None;
        }
        Response::good(Vec::new())
    })
}

/// PERSISTENT RESERVE IN.
pub fn pr_in(ctx: &Ctx, sa: u8, alloc: u32) -> Response {
    let d = ctx.with_state(|st| match sa {
        0 => Ok(read_keys(&st.pr)),
        1 => Ok(read_reservation(&st.pr)),
        2 => Ok(report_capabilities(
            ctx.target.pr_store.durable(),
            st.pr.aptpl,
        )),
        3 => Ok(read_full_status(&st.pr)),
        _ => Err(Sense::invalid_cdb(1)),
    });
    match d {
        Ok(d) => Response::good(alloc_trunc(d, alloc)),
        Err(s) => s.into(),
    }
}

fn with_len_header(gen: u32, body: Vec<u8>) -> Vec<u8> {
    let mut d = gen.to_be_bytes().to_vec();
    d.extend_from_slice(&(body.len() as u32).to_be_bytes());
    d.extend_from_slice(&body);
    d
}

fn read_keys(pr: &PrState) -> Vec<u8> {
    let body = pr
        .registrations
        .iter()
        .flat_map(|(_, k)| k.to_be_bytes())
        .collect();
    with_len_header(pr.generation, body)
}

fn read_reservation(pr: &PrState) -> Vec<u8> {
    let Some(r) = &pr.reservation else {
        return with_len_header(pr.generation, Vec::new());
    };
    let key = if all_registrants(r.ty) {
        0
    } else {
        pr.key_of(&r.holder).unwrap_or(0)
    };
    let mut body = key.to_be_bytes().to_vec();
    body.extend_from_slice(&[0, 0, 0, 0, 0, r.ty, 0, 0]);
    with_len_header(pr.generation, body)
}

/// REPORT CAPABILITIES: PTPL_C if APTPL can be honoured, PTPL_A if it is active.
fn report_capabilities(ptpl_capable: bool, ptpl_active: bool) -> Vec<u8> {
    // Length 8; TMV with the type mask: WR_EX_AR, EX_AC_RO, WR_EX_RO, EX_AC, WR_EX | EX_AC_AR.
    vec![
        0,
        8,
        u8::from(ptpl_capable),
        0x80 | u8::from(ptpl_active),
        0x80 | 0x40 | 0x20 | 0x08 | 0x02,
        0x01,
        0,
        0,
    ]
}

/// iSCSI TransportID, initiator port format (SPC-4 7.6.4.6).
fn transport_id(port: &str) -> Vec<u8> {
    let mut name = port.as_bytes().to_vec();
    name.push(0);
    name.resize(crate::pdu::pad4(name.len().max(20)), 0);
    let mut d = vec![0x45, 0];
    d.extend_from_slice(&(name.len() as u16).to_be_bytes());
    d.extend_from_slice(&name);
    d
}

fn read_full_status(pr: &PrState) -> Vec<u8> {
    let mut body = Vec::new();
    for (port, key) in &pr.registrations {
        let tid = transport_id(port);
        body.extend_from_slice(&key.to_be_bytes());
        body.extend_from_slice(&[0; 4]);
        let holder = pr.is_holder(port);
        body.push(if holder { 0x01 } else { 0 });
        body.push(if holder {
            pr.reservation.as_ref().map_or(0, |r| r.ty)
        } else {
            0
        });
        body.extend_from_slice(&[0; 4]);
        body.extend_from_slice(&1u16.to_be_bytes());
        body.extend_from_slice(&(tid.len() as u32).to_be_bytes());
        body.extend_from_slice(&tid);
    }
    with_len_header(pr.generation, body)
}

/// Parsed PERSISTENT RESERVE OUT basic parameter list.
struct ProutParams {
    key: u64,
    sa_key: u64,
    aptpl: bool,
}

fn parse_prout(p: &[u8]) -> Result<ProutParams, Sense> {
    if p.len() != PROUT_PARAM_LEN {
        return Err(Sense::param_list_length());
    }
    let k = |i: usize| {
        u64::from_be_bytes([
            p[i],
            p[i + 1],
            p[i + 2],
            p[i + 3],
            p[i + 4],
            p[i + 5],
            p[i + 6],
            p[i + 7],
        ])
    };
    if p[20] & 0x0c != 0 {
        // SPEC_I_PT and ALL_TG_PT are not supported.
        return Err(Sense::invalid_param(20));
    }
    Ok(ProutParams {
        key: k(0),
        sa_key: k(8),
        aptpl: p[20] & 0x01 != 0,
    })
}

/// PERSISTENT RESERVE OUT.
pub fn pr_out(ctx: &Ctx, sa: u8, scope: u8, ty: u8, len: u32) -> Response {
    if sa > 6 {
        return Sense::invalid_cdb(1).into();
    }
    let params = match parse_prout(param_list(ctx, len)) {
        Ok(p) => p,
        Err(s) => return s.into(),
    };
    let store = &ctx.target.pr_store;
    if params.aptpl && matches!(sa, 0 | 6) && !store.durable() {
        return Sense::invalid_param(20).into();
    }
    let port = ctx.nexus.port.clone();
    let id = ctx.dev.id();
    let r = ctx.with_state(|st| {
        let all_ports: Vec<String> = st.pr.registrations.iter().map(|(p, _)| p.clone()).collect();
        let mut pr = st.pr.clone();
        let out = match sa {
            0 | 6 => register(&mut pr, &port, &params, sa == 6),
            1 => reserve_pr(&mut pr, &port, &params, scope, ty),
            2 => release_pr(&mut pr, &port, &params, scope, ty),
            3 => clear(&mut pr, &port, &params),
            _ => preempt(&mut pr, &port, &params, scope, ty),
        };
        let ua = out?;
        if matches!(sa, 0 | 6) {
            pr.aptpl = params.aptpl;
        }
        // Durable before the command completes; if it cannot be, nothing changes.
        if let Err(e) = store.save(&id, &pr) {
            tracing::error!("saving persistent reservations: {e}");
            return Err(Some(Sense::new(
                crate::sense::KEY_HARDWARE_ERROR,
                0x44,
                0x00,
            )));
        }
        st.pr = pr;
        if let Some(ua) = ua {
            st.ua_all_but(&all_ports, &port, ua);
        }
        Ok(ua)
    });
    match r {
        Ok(_) => Response::good(Vec::new()),
        Err(None) => Response::conflict(),
        Err(Some(s)) => s.into(),
    }
}

/// Ok(unit attention for other registrants) or Err(None = conflict | sense).
type PrResult = Result<Option<Sense>, Option<Sense>>;

fn check_key(pr: &PrState, port: &str, key: u64) -> Result<(), Option<Sense>> {
    match pr.key_of(port) {
        Some(k) if k == key => Ok(()),
        _ => Err(None),
    }
}

fn check_scope_type(scope: u8, ty: u8) -> Result<(), Option<Sense>> {
    if scope != 0 {
        return Err(Some(Sense::invalid_cdb(2)));
    }
    if ![TYPE_WE, TYPE_EA, TYPE_WERO, TYPE_EARO, TYPE_WEAR, TYPE_EAAR].contains(&ty) {
        return Err(Some(Sense::invalid_cdb(2)));
    }
    Ok(())
}

fn register(pr: &mut PrState, port: &str, p: &ProutParams, ignore: bool) -> PrResult {
    match pr.key_of(port) {
        None if !ignore && p.key != 0 => return Err(None),
        Some(k) if !ignore && k != p.key => return Err(None),
        _ => {}
    }
    if p.sa_key == 0 {
        if pr.key_of(port).is_some() {
            pr.unregister(port);
            pr.generation = pr.generation.wrapping_add(1);
        }
        return Ok(None);
    }
    match pr.registrations.iter_mut().find(|(pp, _)| pp == port) {
        Some(e) => e.1 = p.sa_key,
        None => pr.registrations.push((port.to_string(), p.sa_key)),
    }
    pr.generation = pr.generation.wrapping_add(1);
    Ok(None)
}

fn reserve_pr(pr: &mut PrState, port: &str, p: &ProutParams, scope: u8, ty: u8) -> PrResult {
    check_key(pr, port, p.key)?;
    check_scope_type(scope, ty)?;
    match &pr.reservation {
        Some(r) if pr.is_holder(port) && r.ty == ty => Ok(None),
        Some(_) => Err(None),
        None => {
            pr.reservation = Some(Reservation {
                holder: port.to_string(),
                ty,
            });
            Ok(None)
        }
    }
}

fn release_pr(pr: &mut PrState, port: &str, p: &ProutParams, scope: u8, ty: u8) -> PrResult {
    check_key(pr, port, p.key)?;
    let Some(r) = pr.reservation.clone() else {
        return Ok(None);
    };
    if !pr.is_holder(port) {
        return Ok(None);
    }
    if scope != 0 || r.ty != ty {
        return Err(Some(Sense::new(KEY_ILLEGAL_REQUEST, 0x26, 0x04)));
    }
    pr.reservation = None;
    let notify = !matches!(r.ty, TYPE_WE | TYPE_EA);
    Ok(notify.then(Sense::reservations_released))
}

fn clear(pr: &mut PrState, port: &str, p: &ProutParams) -> PrResult {
    check_key(pr, port, p.key)?;
    pr.registrations.clear();
    pr.reservation = None;
    pr.generation = pr.generation.wrapping_add(1);
    Ok(Some(Sense::reservations_preempted()))
}

fn preempt(pr: &mut PrState, port: &str, p: &ProutParams, scope: u8, ty: u8) -> PrResult {
    check_key(pr, port, p.key)?;
    let holder_key = pr.reservation.as_ref().map(|r| {
        if all_registrants(r.ty) {
            0
        } else {
            pr.key_of(&r.holder).unwrap_or(0)
        }
    });
    let preempting_reservation = match (&pr.reservation, holder_key) {
        (Some(r), _) if all_registrants(r.ty) => true,
        (Some(_), Some(k)) => k == p.sa_key,
        _ => false,
    };
    if !preempting_reservation && p.sa_key == 0 {
        return Err(Some(Sense::invalid_param(8)));
    }
    if preempting_reservation {
        check_scope_type(scope, ty)?;
    }
    let before = pr.registrations.len();
    let all = preempting_reservation && p.sa_key == 0;
    pr.registrations
        .retain(|(pp, k)| pp == port || !(all || *k == p.sa_key));
    if !preempting_reservation && pr.registrations.len() == before {
        return Err(None);
    }
    if preempting_reservation {
        pr.reservation = Some(Reservation {
            holder: port.to_string(),
            ty,
        });
    }
    pr.generation = pr.generation.wrapping_add(1);
    Ok(Some(Sense::registrations_preempted()))
}
