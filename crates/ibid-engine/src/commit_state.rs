//! What the committer owns, behind the commit lock: the pool record as committed and the
//! reference-count log.

use crate::meta::PoolRecord;
use crate::ref_log::RefLog;

/// Committed counters and the reference-count log, owned by the committer.
pub(crate) struct CommitState {
    pub record: PoolRecord,
    pub ref_log: RefLog,
}
