//! CRC-32C helpers with the exact conventions of ext4's `metadata_csum` (reference §15).
//!
//! ext4 (kernel `ext4_chksum`, e2fsprogs `ext2fs_crc32c_le`) uses the raw CRC register: seeded with an
//! arbitrary value and *not* inverted at the end. The `crc32c` crate implements the standard
//! (pre- and post-inverted) CRC, so the raw form is obtained by inverting around it.

/// CRC-32C with the register initialised to `seed` and no final inversion.
pub fn crc32c_raw(seed: u32, data: &[u8]) -> u32 {
    !crc32c::crc32c_append(!seed, data)
}

/// The filesystem checksum seed: `crc32c_raw(~0, s_uuid)`.
pub fn fs_seed(uuid: &[u8; 16]) -> u32 {
    crc32c_raw(!0, uuid)
}

/// The per-inode seed used by inode, extent, and directory checksums.
pub fn inode_seed(fs_seed: u32, ino: u32, generation: u32) -> u32 {
    let s = crc32c_raw(fs_seed, &ino.to_le_bytes());
    crc32c_raw(s, &generation.to_le_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_matches_standard_crc() {
        // Standard CRC-32C("123456789") = 0xE3069283; raw(~0, x) is its complement.
        assert_eq!(crc32c_raw(!0, b"123456789") ^ !0, 0xE306_9283);
    }

    #[test]
    fn raw_chains() {
        // Feeding data in two pieces must equal feeding it at once: the seeds chain.
        let a = crc32c_raw(0x1234_5678, b"hello world");
        let b = crc32c_raw(crc32c_raw(0x1234_5678, b"hello "), b"world");
        assert_eq!(a, b);
    }
}
