//! iSCSI text key=value lists (RFC 7143 section 6): `key=value\0` pairs.

/// Longest key or value accepted, in bytes (RFC 7143 limits values to 8192).
pub const MAX_VALUE_LEN: usize = 8192;

/// Parse a text data segment into ordered pairs. Entries without `=` or too
/// long are returned with an empty value so the caller can reject them.
pub fn parse(data: &[u8]) -> Vec<(String, String)> {
    data.split(|&b| b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| {
            let s = String::from_utf8_lossy(s);
            match s.split_once('=') {
                Some((k, v)) if v.len() <= MAX_VALUE_LEN => (k.to_string(), v.to_string()),
                Some((k, _)) => (k.to_string(), String::new()),
                None => (s.to_string(), String::new()),
            }
        })
        .collect()
}

/// Encode pairs as `key=value\0...`.
pub fn encode(pairs: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(b'=');
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn roundtrip() {
        let p = super::parse(b"A=1\0B=x,y\0\0C\0");
        assert_eq!(p.len(), 3);
        assert_eq!(p[1], ("B".into(), "x,y".into()));
        assert_eq!(super::parse(&super::encode(&p[..2])), p[..2].to_vec());
    }
}
