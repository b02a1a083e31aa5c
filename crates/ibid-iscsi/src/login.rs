//! Login phase (RFC 7143 sections 6.3, 11.12, 11.13): security negotiation
//! with CHAP (RFC 1994 MD5, one-way or mutual) and operational parameter
//! negotiation. The state machine is pure except for the CHAP challenge.

use crate::config::{ChapConfig, TargetConfig};
use crate::pdu::{Pdu, FLAG_CONTINUE, FLAG_TRANSIT, OP_LOGIN_RESP};
use crate::text;

/// Login stage: security negotiation.
pub const STAGE_SECURITY: u8 = 0;
/// Login stage: operational negotiation.
pub const STAGE_OPERATIONAL: u8 = 1;
/// Login stage: full feature phase.
pub const STAGE_FULL_FEATURE: u8 = 3;

/// Login status class/detail: success.
pub const STATUS_SUCCESS: u16 = 0x0000;
/// Login status: authentication failure.
pub const STATUS_AUTH_FAILED: u16 = 0x0201;
/// Login status: target not found.
pub const STATUS_NOT_FOUND: u16 = 0x0203;
/// Login status: unsupported version.
pub const STATUS_BAD_VERSION: u16 = 0x0205;
/// Login status: too many connections.
pub const STATUS_TOO_MANY_CONNS: u16 = 0x0206;
/// Login status: missing parameter.
pub const STATUS_MISSING_PARAM: u16 = 0x0207;
/// Login status: session does not exist.
pub const STATUS_NO_SESSION: u16 = 0x020a;
/// Login status: invalid request during login.
pub const STATUS_INVALID_REQUEST: u16 = 0x020b;
/// Login status: initiator error (generic).
pub const STATUS_INITIATOR_ERROR: u16 = 0x0200;

/// CHAP algorithm number for MD5.
const CHAP_MD5: &str = "5";
/// CHAP challenge length in bytes.
const CHAP_CHALLENGE_LEN: usize = 16;

/// Negotiated operational parameters of a connection/session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    /// CRC32C header digests.
    pub header_digest: bool,
    /// CRC32C data digests.
    pub data_digest: bool,
    /// Largest data segment the initiator accepts from us.
    pub initiator_max_recv_dsl: u32,
    /// Largest data segment we accept.
    pub target_max_recv_dsl: u32,
    /// Maximum solicited or unsolicited burst.
    pub max_burst: u32,
    /// Maximum unsolicited data (immediate + unsolicited Data-Out).
    pub first_burst: u32,
    /// Immediate data allowed.
    pub immediate_data: bool,
    /// Unsolicited Data-Out PDUs forbidden.
    pub initial_r2t: bool,
    /// R2Ts outstanding per task.
    pub max_outstanding_r2t: u32,
}

impl Params {
    /// RFC 7143 defaults, with our receive limit.
    pub fn defaults(cfg: &TargetConfig) -> Self {
        Params {
            header_digest: false,
            data_digest: false,
            initiator_max_recv_dsl: 8192,
            target_max_recv_dsl: cfg.max_recv_data_segment_length,
            max_burst: 262_144.min(cfg.max_burst_length),
            first_burst: 65_536.min(cfg.first_burst_length),
            immediate_data: true,
            initial_r2t: true,
            max_outstanding_r2t: 1,
        }
    }
}

/// Kind of session being logged in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionType {
    /// Normal session with SCSI access.
    Normal,
    /// Discovery session (SendTargets only).
    Discovery,
}

/// What a successful login yields.
#[derive(Debug, Clone)]
pub struct LoginOutcome {
    /// Normal or discovery.
    pub session_type: SessionType,
    /// The initiator's iSCSI name.
    pub initiator_name: String,
    /// ISID (6 bytes).
    pub isid: [u8; 6],
    /// TSIH the initiator asked for (0 = new session).
    pub tsih: u16,
    /// Negotiated parameters.
    pub params: Params,
    /// CmdSN of the first command.
    pub cmdsn: u32,
}

/// What the connection should do with a login response.
#[derive(Debug)]
pub enum LoginStep {
    /// Send this response and wait for the next request.
    Continue(Pdu),
    /// Send this response (with the TSIH filled in by the caller) and enter full feature phase.
    Done(Pdu, LoginOutcome),
    /// Send this failure response and close the connection.
    Fail(Pdu),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Chap {
    None,
    WaitAlgorithm,
    WaitResponse { id: u8, challenge: Vec<u8> },
    Done,
}

/// The login state machine of one connection.
pub struct Login {
    cfg: TargetConfig,
    params: Params,
    chap: Chap,
    initiator_name: Option<String>,
    session_type: SessionType,
    target_ok: bool,
    declared_mrdsl: bool,
    declared_tpgt: bool,
    pending_text: Vec<u8>,
    first: Option<(u32, [u8; 6], u16)>,
}

impl Login {
    /// A new login state machine.
    pub fn new(cfg: TargetConfig) -> Self {
        Login {
            params: Params::defaults(&cfg),
            cfg,
            chap: Chap::None,
            initiator_name: None,
            session_type: SessionType::Normal,
            target_ok: false,
            declared_mrdsl: false,
            declared_tpgt: false,
            pending_text: Vec::new(),
            first: None,
        }
    }

    /// Handle one Login Request PDU.
    pub fn step(&mut self, req: &Pdu) -> LoginStep {
        let flags = req.flags();
        let transit = flags & FLAG_TRANSIT != 0;
        let csg = (flags >> 2) & 3;
        let nsg = flags & 3;
        let isid: [u8; 6] = req.bhs[8..14].try_into().unwrap_or([0; 6]);
        let tsih = u16::from_be_bytes([req.bhs[14], req.bhs[15]]);
        if self.first.is_none() {
            self.first = Some((req.field32(24), isid, tsih));
        }
        if req.bhs[3] > 0 || req.bhs[2] < req.bhs[3] {
            return LoginStep::Fail(self.response(req, 0, STATUS_BAD_VERSION, Vec::new()));
        }
        self.pending_text.extend_from_slice(&req.data);
        if flags & FLAG_CONTINUE != 0 {
            if transit {
                return LoginStep::Fail(self.response(req, 0, STATUS_INVALID_REQUEST, Vec::new()));
            }
            let resp = self.response(req, csg << 2 | nsg, STATUS_SUCCESS, Vec::new());
            return LoginStep::Continue(resp);
        }
        let pairs = text::parse(&std::mem::take(&mut self.pending_text));
        if csg == 2 || (transit && (nsg == 2 || nsg < csg)) {
            return LoginStep::Fail(self.response(req, 0, STATUS_INVALID_REQUEST, Vec::new()));
        }
        let answers = match self.negotiate(csg, &pairs) {
            Ok(a) => a,
            Err(status) => return LoginStep::Fail(self.response(req, 0, status, Vec::new())),
        };
        if csg == STAGE_OPERATIONAL && self.auth_required() && self.chap != Chap::Done {
            return LoginStep::Fail(self.response(req, 0, STATUS_AUTH_FAILED, Vec::new()));
        }
        let chap_busy = matches!(self.chap, Chap::WaitAlgorithm | Chap::WaitResponse { .. });
        let may_transit = transit && !chap_busy;
        let data = text::encode(&answers);
        if may_transit && nsg == STAGE_FULL_FEATURE {
            return self.finish(req, csg, data);
        }
        let f = if may_transit {
            FLAG_TRANSIT | csg << 2 | nsg
        } else {
            csg << 2
        };
        LoginStep::Continue(self.response(req, f, STATUS_SUCCESS, data))
    }

    fn finish(&mut self, req: &Pdu, csg: u8, data: Vec<u8>) -> LoginStep {
        let Some(name) = self.initiator_name.clone() else {
            return LoginStep::Fail(self.response(req, 0, STATUS_MISSING_PARAM, Vec::new()));
        };
        if self.session_type == SessionType::Normal && !self.target_ok {
            return LoginStep::Fail(self.response(req, 0, STATUS_MISSING_PARAM, Vec::new()));
        }
        if self.auth_required() && self.chap != Chap::Done {
            return LoginStep::Fail(self.response(req, 0, STATUS_AUTH_FAILED, Vec::new()));
        }
        let (cmdsn, isid, tsih) = self.first.unwrap_or((0, [0; 6], 0));
        let resp = self.response(req, FLAG_TRANSIT | csg << 2 | STAGE_FULL_FEATURE, 0, data);
        let outcome = LoginOutcome {
            session_type: self.session_type,
            initiator_name: name,
            isid,
            tsih,
            params: self.params.clone(),
            cmdsn,
        };
        LoginStep::Done(resp, outcome)
    }

    fn auth_required(&self) -> bool {
        self.cfg.chap.is_some()
    }

    fn response(&self, req: &Pdu, flags: u8, status: u16, data: Vec<u8>) -> Pdu {
        let mut p = Pdu::new(OP_LOGIN_RESP);
        p.bhs[1] = flags;
        p.bhs[8..16].copy_from_slice(&req.bhs[8..16]);
        p.bhs[16..20].copy_from_slice(&req.bhs[16..20]);
        p.bhs[36..38].copy_from_slice(&status.to_be_bytes());
        p.data = data;
        p
    }

    /// Answer every key; Err(status) fails the login.
    fn negotiate(
        &mut self,
        csg: u8,
        pairs: &[(String, String)],
    ) -> Result<Vec<(String, String)>, u16> {
        let mut out = Vec::new();
        for (k, v) in pairs {
            if let Some(a) = self.answer(csg, k, v)? {
                out.push((k.clone(), a));
            }
        }
        if csg == STAGE_SECURITY {
            self.chap_step(pairs, &mut out)?;
        }
        if self.session_type == SessionType::Normal && !self.declared_tpgt {
            self.declared_tpgt = true;
            out.push((
                "TargetPortalGroupTag".into(),
                self.cfg.portal_group_tag.to_string(),
            ));
        }
        if csg == STAGE_OPERATIONAL && !self.declared_mrdsl {
            self.declared_mrdsl = true;
            out.push((
                "MaxRecvDataSegmentLength".into(),
                self.params.target_max_recv_dsl.to_string(),
            ));
        }
        Ok(out)
    }

    fn answer(&mut self, csg: u8, key: &str, v: &str) -> Result<Option<String>, u16> {
        let num = || v.parse::<u64>().map_err(|_| STATUS_INITIATOR_ERROR);
        let p = &mut self.params;
        let a = match key {
            "InitiatorName" => {
                if v.is_empty() {
                    return Err(STATUS_MISSING_PARAM);
                }
                self.initiator_name = Some(v.to_string());
                return Ok(None);
            }
            "TargetName" => {
                if v != self.cfg.target_name {
                    return Err(STATUS_NOT_FOUND);
                }
                self.target_ok = true;
                return Ok(None);
            }
            "SessionType" => {
                self.session_type = match v {
                    "Discovery" => SessionType::Discovery,
                    "Normal" => SessionType::Normal,
                    _ => return Err(STATUS_INITIATOR_ERROR),
                };
                return Ok(None);
            }
            "InitiatorAlias" | "TargetAlias" | "TargetAddress" | "TargetPortalGroupTag" => {
                return Ok(None)
            }
            "AuthMethod" => return Ok(Some(self.auth_method(csg, v)?)),
            k if k.starts_with("CHAP_") => return Ok(None),
            "HeaderDigest" => {
                let c = digest_choice(v);
                p.header_digest = c == "CRC32C";
                c.to_string()
            }
            "DataDigest" => {
                let c = digest_choice(v);
                p.data_digest = c == "CRC32C";
                c.to_string()
            }
            "MaxConnections" => "1".into(),
            "InitialR2T" => {
                p.initial_r2t = v != "No";
                yes_no(p.initial_r2t)
            }
            "ImmediateData" => {
                p.immediate_data = v == "Yes";
                yes_no(p.immediate_data)
            }
            "MaxRecvDataSegmentLength" => {
                p.initiator_max_recv_dsl = num()?.clamp(512, 16_777_215) as u32;
                return Ok(None);
            }
            "MaxBurstLength" => {
                p.max_burst = num()?.clamp(512, self.cfg.max_burst_length as u64) as u32;
                p.first_burst = p.first_burst.min(p.max_burst);
                p.max_burst.to_string()
            }
            "FirstBurstLength" => {
                p.first_burst = num()?.clamp(512, self.cfg.first_burst_length as u64) as u32;
                p.first_burst = p.first_burst.min(p.max_burst);
                p.first_burst.to_string()
            }
            "DefaultTime2Wait" => num()?.clamp(2, 3600).to_string(),
            "DefaultTime2Retain" => num()?.min(20).to_string(),
            "MaxOutstandingR2T" => {
                p.max_outstanding_r2t = num()?.clamp(1, 16) as u32;
                p.max_outstanding_r2t.to_string()
            }
            "DataPDUInOrder" | "DataSequenceInOrder" => "Yes".into(),
            "ErrorRecoveryLevel" => "0".into(),
            "IFMarker" | "OFMarker" => "No".into(),
            "IFMarkInt" | "OFMarkInt" => "Irrelevant".into(),
            "iSCSIProtocolLevel" => num()?.min(1).to_string(),
            "TaskReporting" => "RFC3720".into(),
            _ => "NotUnderstood".into(),
        };
        Ok(Some(a))
    }

    fn auth_method(&mut self, csg: u8, v: &str) -> Result<String, u16> {
        if csg != STAGE_SECURITY {
            return Err(STATUS_INITIATOR_ERROR);
        }
        let offered: Vec<&str> = v.split(',').collect();
        if self.auth_required() {
            if !offered.contains(&"CHAP") {
                return Err(STATUS_AUTH_FAILED);
            }
            self.chap = Chap::WaitAlgorithm;
            return Ok("CHAP".into());
        }
        if offered.contains(&"None") {
            return Ok("None".into());
        }
        Err(STATUS_AUTH_FAILED)
    }

    fn chap_step(
        &mut self,
        pairs: &[(String, String)],
        out: &mut Vec<(String, String)>,
    ) -> Result<(), u16> {
        let get = |k: &str| {
            pairs
                .iter()
                .find(|(kk, _)| kk == k)
                .map(|(_, v)| v.as_str())
        };
        let Some(chap_cfg) = self.cfg.chap.clone() else {
            return Ok(());
        };
        match self.chap.clone() {
            Chap::WaitAlgorithm => {
                let Some(algs) = get("CHAP_A") else {
                    return Ok(());
                };
                if !algs.split(',').any(|a| a == CHAP_MD5) {
                    return Err(STATUS_AUTH_FAILED);
                }
                let id: u8 = rand::random();
                let challenge: Vec<u8> = (0..CHAP_CHALLENGE_LEN)
                    .map(|_| rand::random::<u8>())
                    .collect();
                out.push(("CHAP_A".into(), CHAP_MD5.into()));
                out.push(("CHAP_I".into(), id.to_string()));
                out.push(("CHAP_C".into(), format!("0x{}", hex(&challenge))));
                self.chap = Chap::WaitResponse { id, challenge };
                Ok(())
            }
            Chap::WaitResponse { id, challenge } => {
                let (Some(name), Some(resp)) = (get("CHAP_N"), get("CHAP_R")) else {
                    return Err(STATUS_AUTH_FAILED);
                };
                let resp = decode_binary(resp).ok_or(STATUS_AUTH_FAILED)?;
                let want = chap_md5(id, chap_cfg.secret.as_bytes(), &challenge);
                if name != chap_cfg.user || resp != want {
                    return Err(STATUS_AUTH_FAILED);
                }
                self.mutual(&chap_cfg, get("CHAP_I"), get("CHAP_C"), &challenge, out)?;
                self.chap = Chap::Done;
                Ok(())
            }
            Chap::None | Chap::Done => Ok(()),
        }
    }

    fn mutual(
        &self,
        cfg: &ChapConfig,
        id: Option<&str>,
        challenge: Option<&str>,
        ours: &[u8],
        out: &mut Vec<(String, String)>,
    ) -> Result<(), u16> {
        let (Some(id), Some(c)) = (id, challenge) else {
            return if cfg.mutual.is_some() {
                Err(STATUS_AUTH_FAILED)
            } else {
                Ok(())
            };
        };
        let Some((user, secret)) = &cfg.mutual else {
            return Err(STATUS_AUTH_FAILED);
        };
        let id: u8 = id.parse().map_err(|_| STATUS_AUTH_FAILED)?;
        let c = decode_binary(c).ok_or(STATUS_AUTH_FAILED)?;
        if c == ours || c.is_empty() {
            return Err(STATUS_AUTH_FAILED);
        }
        out.push(("CHAP_N".into(), user.clone()));
        out.push((
            "CHAP_R".into(),
            format!("0x{}", hex(&chap_md5(id, secret.as_bytes(), &c))),
        ));
        Ok(())
    }
}

fn digest_choice(v: &str) -> &'static str {
    match v.split(',').find(|c| *c == "CRC32C" || *c == "None") {
        Some("CRC32C") => "CRC32C",
        Some(_) => "None",
        None => "Reject",
    }
}

fn yes_no(b: bool) -> String {
    if b { "Yes" } else { "No" }.into()
}

/// CHAP response: MD5(id || secret || challenge).
pub fn chap_md5(id: u8, secret: &[u8], challenge: &[u8]) -> Vec<u8> {
    let mut ctx = md5::Context::new();
    ctx.consume([id]);
    ctx.consume(secret);
    ctx.consume(challenge);
    ctx.compute().0.to_vec()
}

/// Lower-case hex of `b`.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Decode an iSCSI binary value: `0x` hex or `0b` base64.
pub fn decode_binary(v: &str) -> Option<Vec<u8>> {
    if let Some(h) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        if h.len() % 2 != 0 {
            return None;
        }
        return (0..h.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(h.get(i..i + 2)?, 16).ok())
            .collect();
    }
    let b = v.strip_prefix("0b").or_else(|| v.strip_prefix("0B"))?;
    base64_decode(b)
}

fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut acc = 0u32;
    let mut bits = 0;
    for c in s.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' => break,
            _ => return None,
        };
        acc = (acc << 6) | v as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_values() {
        assert_eq!(decode_binary("0x0aff"), Some(vec![10, 255]));
        assert_eq!(decode_binary("0bAQID"), Some(vec![1, 2, 3]));
        assert_eq!(decode_binary("0x0"), None);
    }

    fn req(csg: u8, nsg: u8, transit: bool, keys: &str) -> Pdu {
        let mut p = Pdu::new(crate::pdu::OP_LOGIN_REQ);
        p.bhs[1] = csg << 2 | nsg | if transit { FLAG_TRANSIT } else { 0 };
        p.bhs[8..14].copy_from_slice(&[0x80, 0, 0, 0, 0, 1]);
        p.data = keys.replace(';', "\0").into_bytes();
        p
    }

    fn answers(p: &Pdu) -> Vec<(String, String)> {
        text::parse(&p.data)
    }

    fn get<'a>(a: &'a [(String, String)], k: &str) -> Option<&'a str> {
        a.iter().find(|(kk, _)| kk == k).map(|(_, v)| v.as_str())
    }

    /// Operational negotiation: digests picked from the offer, numbers
    /// clamped to our limits, unknown keys NotUnderstood, our MRDSL declared.
    #[test]
    fn operational_negotiation() {
        let mut l = Login::new(TargetConfig::new("iqn.t:x"));
        let keys = "InitiatorName=iqn.i:y;TargetName=iqn.t:x;HeaderDigest=CRC32C,None;DataDigest=None;\
                    MaxBurstLength=16777215;FirstBurstLength=65536;InitialR2T=No;ImmediateData=Yes;\
                    MaxOutstandingR2T=64;ErrorRecoveryLevel=2;X-foo=bar;MaxRecvDataSegmentLength=131072;";
        let LoginStep::Done(resp, out) = l.step(&req(1, 3, true, keys)) else {
            panic!("login did not complete")
        };
        let a = answers(&resp);
        assert_eq!(get(&a, "HeaderDigest"), Some("CRC32C"));
        assert_eq!(get(&a, "DataDigest"), Some("None"));
        assert_eq!(get(&a, "MaxBurstLength"), Some("1048576"));
        assert_eq!(get(&a, "ErrorRecoveryLevel"), Some("0"));
        assert_eq!(get(&a, "MaxOutstandingR2T"), Some("16"));
        assert_eq!(get(&a, "X-foo"), Some("NotUnderstood"));
        assert_eq!(get(&a, "MaxRecvDataSegmentLength"), Some("262144"));
        assert_eq!(get(&a, "TargetPortalGroupTag"), Some("1"));
        assert!(out.params.header_digest && !out.params.data_digest && !out.params.initial_r2t);
        assert_eq!(out.params.initiator_max_recv_dsl, 131_072);
    }

    /// Wrong target name: status 0203; missing InitiatorName: 0207.
    #[test]
    fn login_failures() {
        let mut l = Login::new(TargetConfig::new("iqn.t:x"));
        let LoginStep::Fail(r) = l.step(&req(
            1,
            3,
            true,
            "InitiatorName=iqn.i:y;TargetName=iqn.t:other;",
        )) else {
            panic!("expected failure")
        };
        assert_eq!(&r.bhs[36..38], &STATUS_NOT_FOUND.to_be_bytes());
        let mut l = Login::new(TargetConfig::new("iqn.t:x"));
        let LoginStep::Fail(r) = l.step(&req(1, 3, true, "TargetName=iqn.t:x;")) else {
            panic!("expected failure")
        };
        assert_eq!(&r.bhs[36..38], &STATUS_MISSING_PARAM.to_be_bytes());
    }

    /// CHAP: challenge, correct response accepted and mutual answer given;
    /// skipping the security stage is refused.
    #[test]
    fn chap_flow() {
        let mut cfg = TargetConfig::new("iqn.t:x");
        cfg.chap = Some(ChapConfig {
            user: "u".into(),
            secret: "s3cret-s3cret".into(),
            mutual: Some(("t".into(), "t-secret-12345".into())),
        });
        let mut skip = Login::new(cfg.clone());
        assert!(matches!(
            skip.step(&req(
                1,
                3,
                true,
                "InitiatorName=iqn.i:y;TargetName=iqn.t:x;"
            )),
            LoginStep::Fail(_)
        ));
        let mut l = Login::new(cfg);
        let LoginStep::Continue(r) = l.step(&req(
            0,
            1,
            true,
            "InitiatorName=iqn.i:y;TargetName=iqn.t:x;AuthMethod=CHAP,None;",
        )) else {
            panic!()
        };
        assert_eq!(get(&answers(&r), "AuthMethod"), Some("CHAP"));
        let LoginStep::Continue(r) = l.step(&req(0, 1, true, "CHAP_A=5;")) else {
            panic!()
        };
        let a = answers(&r);
        let id: u8 = get(&a, "CHAP_I").unwrap().parse().unwrap();
        let c = decode_binary(get(&a, "CHAP_C").unwrap()).unwrap();
        let resp = hex(&chap_md5(id, b"s3cret-s3cret", &c));
        let keys = format!("CHAP_N=u;CHAP_R=0x{resp};CHAP_I=7;CHAP_C=0x0102030405060708;");
        let LoginStep::Continue(r) = l.step(&req(0, 1, true, &keys)) else {
            panic!()
        };
        assert_eq!(r.bhs[1] & FLAG_TRANSIT, FLAG_TRANSIT);
        let a = answers(&r);
        let want = hex(&chap_md5(7, b"t-secret-12345", &[1, 2, 3, 4, 5, 6, 7, 8]));
        assert_eq!(get(&a, "CHAP_R"), Some(format!("0x{want}").as_str()));
        assert!(matches!(l.step(&req(1, 3, true, "")), LoginStep::Done(..)));
    }
}
