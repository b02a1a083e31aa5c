//! Byte counts for people: binary units (`16 GiB`, powers of 1024, as storage administrators
//! expect of disk sizes), with the exact figure next to them where rounding would hide it. Error
//! messages and the front ends' output use these.

/// Formats bytes with a binary unit and at most one decimal: `1.5 GiB`, `16 GiB`, `512 B`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes} B")
    } else if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[i])
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

/// [`format_size`], followed by the exact byte count when the unit rounds it:
/// `16 GiB`, `16.0 GiB (17179869696 bytes)`, `1000 bytes`.
pub fn format_exact(bytes: u64) -> String {
    if bytes < 1024 {
        return format!("{bytes} bytes");
    }
    let shown = format_size(bytes);
    if shown.contains('.') {
        format!("{shown} ({bytes} bytes)")
    } else {
        shown
    }
}

/// [`format_size`] with the exact byte count always (from 1 KiB on): `17 GiB (18253611008
/// bytes)`, for offsets and lengths a reader may want to compare byte for byte.
pub fn format_with_bytes(bytes: u64) -> String {
    if bytes < 1024 {
        format!("{bytes} bytes")
    } else {
        format!("{} ({bytes} bytes)", format_size(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_in_binary_units() {
        assert_eq!(format_size(3 << 39), "1.5 TiB");
        assert_eq!(format_size(512), "512 B");
        assert_eq!(format_size(16 << 30), "16 GiB");
        assert_eq!(format_exact(16 << 30), "16 GiB");
        assert_eq!(
            format_exact((16 << 30) + 512),
            "16.0 GiB (17179869696 bytes)"
        );
        assert_eq!(format_exact(1000), "1000 bytes");
        assert_eq!(format_with_bytes(17 << 30), "17 GiB (18253611008 bytes)");
        assert_eq!(format_with_bytes(0), "0 bytes");
    }
}
