//! Transmission: request headers (compact and extended), validation, execution, encoding.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| ibid_nbd::fuzzing::transmission_bytes(data));
