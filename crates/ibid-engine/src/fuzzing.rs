//! Entry points for the fuzz targets (`crates/ibid-engine/fuzz/`): arbitrary bytes through the
//! on-disk parsers a pool reads at open. The property: no input panics or allocates without
//! bound, and whatever parses re-encodes to bytes that parse to the same thing.

use crate::journal;

/// Treats `data` as a journal file: parses the records stamped like the first one (as
/// recovery does), then checks that they survive an encode/parse round trip.
pub fn journal_bytes(data: &[u8]) {
    let stamp = data
        .get(12..20)
        .map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    let changes = journal::parse(data, stamp);
    let mut again = Vec::new();
    for c in &changes {
        journal::encode(&mut again, stamp, c);
    }
    assert_eq!(journal::parse(&again, stamp), changes);
}
