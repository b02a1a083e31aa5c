//! Human units for sizes: `10G`, `1.5 TiB`, `512`, `4k`. Powers of 1024 throughout, as storage
//! administrators expect of disk sizes (`G` = `GiB`).

/// Parses a size such as `50G`, `1.5TiB`, `4096`, `512k` into bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let shift = match unit.trim_end_matches("ib").trim_end_matches('b') {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        "p" => 50,
        _ => {
            return Err(format!(
                "{s:?}: unknown unit {unit:?} (use K, M, G, T or P)"
            ))
        }
    };
    if num.is_empty() {
        return Err(format!("{s:?}: expected a number, e.g. 10G"));
    }
    let bytes = if num.contains('.') {
        let v: f64 = num.parse().map_err(|_| format!("{s:?}: not a number"))?;
        v * (1u64 << shift) as f64
    } else {
        let v: u64 = num.parse().map_err(|_| format!("{s:?}: not a number"))?;
        return v
            .checked_mul(1 << shift)
            .ok_or_else(|| format!("{s:?}: too large"));
    };
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("{s:?}: out of range"));
    }
    Ok(bytes.round() as u64)
}

pub use ibid_engine::units::{format_exact, format_size};

/// How a thick volume's reservation is sized, in words: `4632 bytes per 4 KiB block without
/// data: 13 % over its size, room for each block's record and metadata`.
pub fn reservation_rule() -> String {
    let per_block = ibid_engine::RESERVED_BYTES_PER_BLOCK;
    let block = 4096;
    format!(
        "{per_block} bytes per 4 KiB block without data: {:.0} % over its size, room for each \
         block's record and metadata",
        (per_block - block) as f64 * 100.0 / block as f64
    )
}

/// The most space the pool keeps as overwrite headroom for its thick volumes, in bytes.
pub fn overwrite_headroom_max() -> u64 {
    ibid_engine::OVERWRITE_HEADROOM_BLOCKS_MAX * ibid_engine::RESERVED_BYTES_PER_BLOCK
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_formats_human_sizes() {
        assert_eq!(parse_size("10G"), Ok(10 << 30));
        assert_eq!(parse_size("1.5 TiB"), Ok(3 << 39));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert_eq!(parse_size("1PB"), Ok(1 << 50));
        assert!(parse_size("10X").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("99999999999P").is_err());
        assert_eq!(format_size(3 << 39), "1.5 TiB");
        assert_eq!(format_size(512), "512 B");
        assert_eq!(format_size(16 << 30), "16 GiB");
    }
}
