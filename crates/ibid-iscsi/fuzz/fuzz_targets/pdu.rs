//! Fuzz the PDU framing and the login state machine with arbitrary bytes.
#![no_main]

use ibid_iscsi::login::Login;
use ibid_iscsi::pdu::Pdu;
use ibid_iscsi::TargetConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (hd, dd) = match data.first() {
        Some(b) => (b & 1 != 0, b & 2 != 0),
        None => return,
    };
    let mut rest = &data[1..];
    let mut login = Login::new(TargetConfig::new("iqn.2026-11.org.ibid:fuzz"));
    while let Ok((pdu, used)) = Pdu::decode(rest, hd, dd, 8192) {
        let _ = login.step(&pdu);
        rest = &rest[used..];
    }
});
