//! Target configuration.

/// CHAP credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChapConfig {
    /// User name the initiator must present (CHAP_N).
    pub user: String,
    /// Secret the initiator must know.
    pub secret: String,
    /// For mutual CHAP: the name and secret the target answers with.
    pub mutual: Option<(String, String)>,
}

/// Configuration of the one target served by [`crate::serve`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetConfig {
    /// Target IQN, e.g. `iqn.2026-11.org.ibid:pool`.
    pub target_name: String,
    /// Target portal group tag reported at login and in SendTargets.
    pub portal_group_tag: u16,
    /// CHAP required when set.
    pub chap: Option<ChapConfig>,
    /// Largest data segment we accept (declared MaxRecvDataSegmentLength).
    pub max_recv_data_segment_length: u32,
    /// Upper bound we accept for MaxBurstLength.
    pub max_burst_length: u32,
    /// Upper bound we accept for FirstBurstLength.
    pub first_burst_length: u32,
    /// Commands a session may have outstanding (CmdSN window).
    pub queue_depth: u32,
    /// Idle time after which the target pings with a NOP-In; a connection
    /// silent for three intervals is closed. `None` disables keepalive.
    pub nop_in_interval: Option<std::time::Duration>,
    /// Vendor identification in INQUIRY (8 chars).
    pub vendor: String,
    /// Product identification in INQUIRY (16 chars).
    pub product: String,
    /// Directory where the target keeps state that must survive a restart: persistent
    /// reservations with APTPL (`reservations.json`). `None`: nothing is kept and APTPL is
    /// refused (PTPL_C = 0).
    pub state_dir: Option<std::path::PathBuf>,
    /// Threads that run commands for all sessions (at least one).
    pub workers: usize,
}

impl TargetConfig {
    /// Defaults for target `target_name`.
    pub fn new(target_name: impl Into<String>) -> Self {
        TargetConfig {
            target_name: target_name.into(),
            portal_group_tag: 1,
            chap: None,
            max_recv_data_segment_length: 262_144,
            max_burst_length: 1 << 20,
            first_burst_length: 262_144,
            queue_depth: 64,
            nop_in_interval: Some(std::time::Duration::from_secs(30)),
            vendor: "IBID".into(),
            product: "ibid volume".into(),
            state_dir: None,
            workers: WORKERS_DEFAULT,
        }
    }
}

/// Default number of command threads: one per command of an initiator at queue depth 32, so
/// such an initiator's commands all run at once (the NBD server's measured best on 2 cores).
pub const WORKERS_DEFAULT: usize = 32;

/// Shortest CHAP secret accepted, in bytes (RFC 7143 12.1.3: 96 bits).
pub const CHAP_SECRET_MIN_LEN: usize = 12;
/// Longest CHAP secret accepted, in bytes.
pub const CHAP_SECRET_MAX_LEN: usize = 256;

/// A configuration that cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The target name is not an `iqn.`, `eui.` or `naa.` iSCSI name.
    #[error("invalid target name {0:?}")]
    TargetName(String),
    /// A CHAP secret is shorter than 12 or longer than 256 bytes.
    #[error("CHAP secret must be {CHAP_SECRET_MIN_LEN}..={CHAP_SECRET_MAX_LEN} bytes")]
    ChapSecretLength,
    /// Mutual CHAP uses the same secret in both directions (reflection risk).
    #[error("mutual CHAP secrets must differ")]
    ChapSameSecret,
    /// A size limit is out of the range RFC 7143 allows.
    #[error("{0} out of range")]
    Limit(&'static str),
}

impl TargetConfig {
    /// Check the configuration; [`crate::serve`] refuses an invalid one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let n = &self.target_name;
        let prefixed = ["iqn.", "eui.", "naa."].iter().any(|p| n.starts_with(p));
        if !prefixed || n.len() > 223 || n.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(ConfigError::TargetName(n.clone()));
        }
        if let Some(chap) = &self.chap {
            let ok = |s: &str| (CHAP_SECRET_MIN_LEN..=CHAP_SECRET_MAX_LEN).contains(&s.len());
            if !ok(&chap.secret) || chap.mutual.as_ref().is_some_and(|(_, s)| !ok(s)) {
                return Err(ConfigError::ChapSecretLength);
            }
            if chap.mutual.as_ref().is_some_and(|(_, s)| *s == chap.secret) {
                return Err(ConfigError::ChapSameSecret);
            }
        }
        if !(512..=16_777_215).contains(&self.max_recv_data_segment_length) {
            return Err(ConfigError::Limit("max_recv_data_segment_length"));
        }
        if !(512..=16_777_215).contains(&self.max_burst_length)
            || self.first_burst_length > self.max_burst_length
        {
            return Err(ConfigError::Limit("max_burst_length / first_burst_length"));
        }
        if self.first_burst_length < 512 || self.queue_depth == 0 {
            return Err(ConfigError::Limit("first_burst_length / queue_depth"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation() {
        assert_eq!(
            TargetConfig::new("iqn.2026-11.org.ibid:pool").validate(),
            Ok(())
        );
        assert!(TargetConfig::new("pool").validate().is_err());
        let mut c = TargetConfig::new("iqn.2026-11.org.ibid:pool");
        c.chap = Some(ChapConfig {
            user: "u".into(),
            secret: "short".into(),
            mutual: None,
        });
        assert_eq!(c.validate(), Err(ConfigError::ChapSecretLength));
        c.chap = Some(ChapConfig {
            user: "u".into(),
            secret: "long-enough-1".into(),
            mutual: Some(("t".into(), "long-enough-1".into())),
        });
        assert_eq!(c.validate(), Err(ConfigError::ChapSameSecret));
    }
}
