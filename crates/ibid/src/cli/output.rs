//! Human output (aligned tables and key-value lines with binary units) and `--json` output (the
//! API's JSON, pretty-printed, unchanged).

use super::error::CliError;
use crate::units::format_size;
use serde_json::Value;

/// Bytes per block in the API's block counts.
pub const BLOCK_BYTES: u64 = 4096;

/// Prints a JSON value, pretty, on stdout.
pub fn print_json(v: &Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
    );
}

/// Reads an unsigned number field of an API answer.
pub fn u64_field(v: &Value, key: &str) -> Result<u64, CliError> {
    v[key]
        .as_u64()
        .ok_or_else(|| CliError::bad_response(format!("answer lacks the number {key:?}: {v}")))
}

/// Reads a string field of an API answer.
pub fn str_field<'a>(v: &'a Value, key: &str) -> Result<&'a str, CliError> {
    v[key]
        .as_str()
        .ok_or_else(|| CliError::bad_response(format!("answer lacks the string {key:?}: {v}")))
}

/// Reads an array field (or a whole answer, with `key` empty).
pub fn array<'a>(v: &'a Value, key: &str) -> Result<&'a Vec<Value>, CliError> {
    let a = if key.is_empty() { v } else { &v[key] };
    a.as_array()
        .ok_or_else(|| CliError::bad_response(format!("answer is not a list: {v}")))
}

/// `1.5 GiB`.
pub fn size(bytes: u64) -> String {
    format_size(bytes)
}

/// `256 blocks (1 MiB)`.
pub fn blocks(n: u64) -> String {
    format!("{n} ({})", format_size(n.saturating_mul(BLOCK_BYTES)))
}

/// Seconds since the epoch as `YYYY-MM-DD HH:MM:SS UTC`.
pub fn timestamp(unix_s: u64) -> String {
    let days = unix_s / 86_400;
    let secs = unix_s % 86_400;
    // Civil-from-days (Howard Hinnant's algorithm), proleptic Gregorian calendar.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// Prints `key: value` lines with the values aligned.
pub fn print_fields(fields: &[(&str, String)]) {
    let width = fields.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    for (k, v) in fields {
        println!("{:<width$} {v}", format!("{k}:"));
    }
}

/// Prints a table: a header row, then rows; the first `text_columns` columns (names) are
/// left-aligned, the rest (numbers, sizes) right-aligned.
pub fn print_table(header: &[&str], text_columns: usize, rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let text: Vec<String> = cells
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, &w))| {
                if i < text_columns {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect();
        println!("{}", text.join("  ").trim_end());
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_civil_utc() {
        assert_eq!(timestamp(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(timestamp(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(timestamp(1_790_000_000), "2026-09-21 14:13:20 UTC");
    }
}
