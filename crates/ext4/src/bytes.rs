//! Little helpers to write little-endian fields at fixed offsets of on-disk structures.
//!
//! Offsets in this crate are compile-time constants taken from the reference tables, so an out-of-range
//! write is a programming error (and panics in tests), never an input-dependent condition.

pub fn put_u8(buf: &mut [u8], off: usize, v: u8) {
    buf[off] = v;
}

pub fn put_u16(buf: &mut [u8], off: usize, v: u16) {
    buf[off..off + 2].copy_from_slice(&v.to_le_bytes());
}

pub fn put_u32(buf: &mut [u8], off: usize, v: u32) {
    buf[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

pub fn put_u64(buf: &mut [u8], off: usize, v: u64) {
    buf[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

pub fn put_be32(buf: &mut [u8], off: usize, v: u32) {
    buf[off..off + 4].copy_from_slice(&v.to_be_bytes());
}

#[cfg(test)]
pub fn get_u16(buf: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([buf[off], buf[off + 1]])
}

pub fn get_u32(buf: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]])
}

/// Round `v` up to a multiple of 4 (directory and xattr records are 4-byte aligned).
pub fn align4(v: usize) -> usize {
    (v + 3) & !3
}
