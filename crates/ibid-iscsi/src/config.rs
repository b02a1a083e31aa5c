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
        }
    }
}
