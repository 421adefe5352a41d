use thiserror::Error;

/// The filesystem and device block size. Tessera images always use 4 KiB blocks. This is the one
/// definition of the value; [`BlockSize`] gives it in the other integer types.
pub const BLOCK_SIZE: u32 = 4096;

/// [`BLOCK_SIZE`] in the integer types it is used as, so callers need no casts of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSize;

impl BlockSize {
    /// The block size as the image record stores it.
    pub const U32: u32 = BLOCK_SIZE;
    /// The block size for block-number ↔ byte-offset arithmetic.
    pub const U64: u64 = BLOCK_SIZE as u64;
    /// The block size for buffer lengths.
    pub const USIZE: usize = BLOCK_SIZE as usize;
}

/// Why a size string was rejected.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum SizeParseError {
    #[error("empty size")]
    Empty,
    #[error(
        "invalid size {0:?}: expected an integer with an optional suffix K, M, G, T (or KiB, MiB, GiB, TiB)"
    )]
    Invalid(String),
    #[error("size {0:?} is too large")]
    Overflow(String),
}

/// Parse a size such as `4096`, `512K`, `64M`, `2G`, `1T`, `64MiB` (binary units; the suffix is
/// case-insensitive, so `2g` and `64mib` work too). The one size parser of every `SIZE` option.
pub fn parse_size(text: &str) -> Result<u64, SizeParseError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(SizeParseError::Empty);
    }
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits_end);
    if num.is_empty() {
        return Err(SizeParseError::Invalid(text.to_owned()));
    }
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        _ => return Err(SizeParseError::Invalid(text.to_owned())),
    };
    let n: u64 = num.parse().map_err(|_| SizeParseError::Overflow(text.to_owned()))?;
    n.checked_mul(1u64 << shift).ok_or_else(|| SizeParseError::Overflow(text.to_owned()))
}

/// Check a tag against `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`.
pub fn validate_tag(tag: &str) -> bool {
    let b = tag.as_bytes();
    if b.is_empty() || b.len() > 128 {
        return false;
    }
    let first_ok = b[0].is_ascii_alphanumeric() || b[0] == b'_';
    first_ok && b[1..].iter().all(|&c| c.is_ascii_alphanumeric() || c == b'_' || c == b'.' || c == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512K"), Ok(512 << 10));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert_eq!(parse_size("3GiB"), Ok(3 << 30));
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("64mib"), Ok(64 << 20));
        assert_eq!(parse_size("1KiB"), Ok(1024));
        assert_eq!(parse_size(" 256M "), Ok(256 << 20));
        assert!(parse_size("1.5G").is_err());
        assert!(parse_size("1 G").is_err());
        assert!(parse_size("1GB").is_err(), "decimal-looking suffixes are refused, not guessed");
        assert!(parse_size("").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("12X").is_err());
        assert!(parse_size("-1").is_err());
        assert!(matches!(parse_size("99999999999999999T"), Err(SizeParseError::Overflow(_))));
    }

    #[test]
    fn tags() {
        assert!(validate_tag("latest"));
        assert!(validate_tag("_x.y-z"));
        assert!(validate_tag(&"a".repeat(128)));
        assert!(!validate_tag(&"a".repeat(129)));
        assert!(!validate_tag(".hidden"));
        assert!(!validate_tag("-x"));
        assert!(!validate_tag("a/b"));
        assert!(!validate_tag(""));
    }
}
