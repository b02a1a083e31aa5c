//! Fuzz CDB parsing and the parameter-list parsers (UNMAP, EXTENDED COPY).
#![no_main]

use ibid_iscsi::scsi::{block, cdb, xcopy};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (c, p) = data.split_at(data.len().min(16));
    let _ = cdb::parse(c);
    let _ = block::parse_unmap(p);
    let _ = xcopy::parse(p);
});
