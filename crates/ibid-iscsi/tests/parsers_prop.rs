//! Property tests: the pure parsers (PDU framing, CDBs, UNMAP and EXTENDED
//! COPY and MODE SELECT parameter lists, text keys, the login state machine) never panic on
//! arbitrary bytes, and PDU encode/decode round-trips.

use ibid_iscsi::config::TargetConfig;
use ibid_iscsi::login::Login;
use ibid_iscsi::pdu::Pdu;
use ibid_iscsi::scsi::{block, cdb, info, xcopy};
use ibid_iscsi::text;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn pdu_decode_total(buf in proptest::collection::vec(any::<u8>(), 0..600), hd: bool, dd: bool) {
        let _ = Pdu::decode(&buf, hd, dd, 512);
    }

    #[test]
    fn pdu_roundtrip(bhs in proptest::collection::vec(any::<u8>(), 48), data in proptest::collection::vec(any::<u8>(), 0..300), hd: bool, dd: bool) {
        let mut p = Pdu { bhs: bhs.try_into().unwrap(), ahs: Vec::new(), data };
        let wire = p.encode(hd, dd);
        let (q, used) = Pdu::decode(&wire, hd, dd, 1 << 24).unwrap();
        prop_assert_eq!(used, wire.len());
        prop_assert_eq!(q, p);
    }

    #[test]
    fn cdb_parse_total(c in proptest::collection::vec(any::<u8>(), 0..20)) {
        let _ = cdb::parse(&c);
    }

    #[test]
    fn parameter_lists_total(p in proptest::collection::vec(any::<u8>(), 0..400)) {
        let _ = block::parse_unmap(&p);
        let _ = xcopy::parse(&p);
        let _ = text::parse(&p);
        let _ = info::check_mode_select(&p, false);
        let _ = info::check_mode_select(&p, true);
    }

    #[test]
    fn login_total(bhs in proptest::collection::vec(any::<u8>(), 48), data in proptest::collection::vec(any::<u8>(), 0..200)) {
        let mut l = Login::new(TargetConfig::new("iqn.2026-11.org.ibid:p"));
        let p = Pdu { bhs: bhs.try_into().unwrap(), ahs: Vec::new(), data };
        let _ = l.step(&p);
        let _ = l.step(&p);
    }
}
