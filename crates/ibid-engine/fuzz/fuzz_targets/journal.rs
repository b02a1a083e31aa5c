//! Journal files as recovery reads them: record headers, checksums, bodies of each kind.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| ibid_engine::fuzzing::journal_bytes(data));
