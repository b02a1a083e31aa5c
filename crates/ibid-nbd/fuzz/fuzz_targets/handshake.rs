//! Option haggling: option headers, option bodies and the handshake state machine.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| ibid_nbd::fuzzing::handshake_bytes(data));
