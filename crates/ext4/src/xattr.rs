//! Extended attributes (reference §10): name-prefix encoding, the in-inode area after `i_extra_isize`,
//! and external xattr blocks.

use crate::acl;
use crate::bytes::{align4, put_u16, put_u32, put_u8};
use crate::checksum::crc32c_raw;
use crate::inode::XATTR_AREA_LEN;
use tessera_image::BlockSize;

pub const XATTR_MAGIC: u32 = 0xEA02_0000;
const BLOCK_HEADER: usize = 32;
const ENTRY_HEADER: usize = 16;

/// One attribute as stored: a name index (prefix), the name after the prefix, and the value bytes
/// (POSIX ACLs already converted to the disk format).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DiskXattr {
    pub index: u8,
    pub name: Vec<u8>,
    pub value: Vec<u8>,
}

impl DiskXattr {
    /// The kernel's sort key for block entries: (index, name length, name).
    fn key(&self) -> (u8, usize, &[u8]) {
        (self.index, self.name.len(), &self.name)
    }

    fn entry_len(&self) -> usize {
        align4(ENTRY_HEADER + self.name.len())
    }

    fn value_len(&self) -> usize {
        align4(self.value.len())
    }

    /// Entry plus value footprint.
    pub fn footprint(&self) -> usize {
        self.entry_len() + self.value_len()
    }
}

/// Map a full attribute name to (index, suffix), most specific prefix first, and convert ACL values.
pub fn parse(name: &[u8], value: &[u8]) -> Result<DiskXattr, &'static str> {
    let (index, suffix): (u8, &[u8]) = if name == b"system.posix_acl_access" {
        (2, b"")
    } else if name == b"system.posix_acl_default" {
        (3, b"")
    } else if name == b"system.richacl" {
        (8, b"")
    } else if let Some(s) = name.strip_prefix(b"user.") {
        (1, s)
    } else if let Some(s) = name.strip_prefix(b"trusted.") {
        (4, s)
    } else if let Some(s) = name.strip_prefix(b"security.") {
        (6, s)
    } else if let Some(s) = name.strip_prefix(b"system.") {
        if s == b"data" {
            // system.data holds inline data, a feature this filesystem does not have.
            return Err("system.data is reserved for inline data");
        }
        (7, s)
    } else {
        return Err("unknown name prefix");
    };
    if suffix.is_empty() && index != 2 && index != 3 && index != 8 {
        return Err("empty name after prefix");
    }
    if suffix.len() > 255 {
        return Err("name longer than 255 bytes");
    }
    if suffix.contains(&0) {
        return Err("name contains NUL");
    }
    let value = if index == 2 || index == 3 { acl::vfs_to_disk(value)? } else { value.to_vec() };
    Ok(DiskXattr { index, name: suffix.to_vec(), value })
}

/// The full attribute name (prefix + stored name), for messages.
pub fn full_name(x: &DiskXattr) -> Vec<u8> {
    let prefix: &[u8] = match x.index {
        1 => b"user.",
        2 => b"system.posix_acl_access",
        3 => b"system.posix_acl_default",
        4 => b"trusted.",
        6 => b"security.",
        8 => b"system.richacl",
        _ => b"system.",
    };
    [prefix, &x.name].concat()
}

/// e2fsprogs `ext2fs_ext_attr_hash_entry`: name bytes unsigned, then the value as LE u32 words.
pub fn entry_hash(x: &DiskXattr) -> u32 {
    let mut h: u32 = 0;
    for &c in &x.name {
        h = (h << 5) ^ (h >> 27) ^ c as u32;
    }
    for chunk in x.value.chunks(4) {
        let mut w = [0u8; 4];
        w[..chunk.len()].copy_from_slice(chunk);
        h = (h << 16) ^ (h >> 16) ^ u32::from_le_bytes(w);
    }
    h
}

/// Sort attributes the way block lookups require (the kernel stops at the first greater entry).
pub fn sort(xattrs: &mut [DiskXattr]) {
    xattrs.sort_by(|a, b| a.key().cmp(&b.key()));
}

/// Lay out entries at `buf[entries_off..]` with values packed down from `buf.len()`; value offsets are
/// relative to `base`. Returns false if they do not fit (with the 4-byte terminator).
fn lay_out(buf: &mut [u8], entries_off: usize, base: usize, xattrs: &[DiskXattr]) -> bool {
    let entries: usize = xattrs.iter().map(DiskXattr::entry_len).sum();
    let values: usize = xattrs.iter().map(DiskXattr::value_len).sum();
    if entries_off + entries + 4 + values > buf.len() {
        return false;
    }
    let mut off = entries_off;
    let mut val_end = buf.len();
    for x in xattrs {
        let value_offs = if x.value.is_empty() {
            0
        } else {
            val_end -= x.value_len();
            buf[val_end..val_end + x.value.len()].copy_from_slice(&x.value);
            val_end - base
        };
        put_u8(buf, off, x.name.len() as u8);
        put_u8(buf, off + 1, x.index);
        put_u16(buf, off + 2, value_offs as u16);
        put_u32(buf, off + 4, 0); // e_value_inum: no ea_inode
        put_u32(buf, off + 8, x.value.len() as u32);
        put_u32(buf, off + 12, entry_hash(x));
        buf[off + ENTRY_HEADER..off + ENTRY_HEADER + x.name.len()].copy_from_slice(&x.name);
        off += x.entry_len();
    }
    true
}

/// Whether `xattrs` fit in the in-inode area (magic + entries + terminator + values).
pub fn fits_in_inode(xattrs: &[DiskXattr]) -> bool {
    4 + xattrs.iter().map(DiskXattr::footprint).sum::<usize>() + 4 <= XATTR_AREA_LEN
}

/// Whether `xattrs` fit in one external block.
pub fn fits_in_block(xattrs: &[DiskXattr]) -> bool {
    BLOCK_HEADER + xattrs.iter().map(DiskXattr::footprint).sum::<usize>() + 4 <= BlockSize::USIZE
}

/// Render the in-inode area (inode bytes 0xA0..0x100). Value offsets are relative to the first entry.
pub fn render_inode_area(xattrs: &[DiskXattr]) -> Option<[u8; XATTR_AREA_LEN]> {
    let mut area = [0u8; XATTR_AREA_LEN];
    if xattrs.is_empty() {
        return Some(area);
    }
    put_u32(&mut area, 0, XATTR_MAGIC);
    if lay_out(&mut area, 4, 4, xattrs) {
        Some(area)
    } else {
        None
    }
}

/// Render the block contents without the per-block checksum and refcount (the sharing key).
pub fn render_block_body(xattrs: &[DiskXattr]) -> Option<Vec<u8>> {
    let mut b = vec![0u8; BlockSize::USIZE];
    put_u32(&mut b, 0, XATTR_MAGIC);
    put_u32(&mut b, 8, 1); // h_blocks: must be 1
    if !lay_out(&mut b, BLOCK_HEADER, 0, xattrs) {
        return None;
    }
    // h_hash mixes the entry hashes (0 if any is 0, as e2fsprogs does).
    let hashes: Vec<u32> = xattrs.iter().map(entry_hash).collect();
    let h = if hashes.contains(&0) { 0 } else { hashes.iter().fold(0u32, |h, &e| (h << 16) ^ (h >> 16) ^ e) };
    put_u32(&mut b, 12, h);
    Some(b)
}

/// Finish a block body: set the refcount and the checksum, which covers the block number.
pub fn seal_block(body: &[u8], refcount: u32, block_nr: u64, fs_seed: u32) -> Vec<u8> {
    let mut b = body.to_vec();
    put_u32(&mut b, 4, refcount);
    put_u32(&mut b, 16, 0);
    let c = crc32c_raw(fs_seed, &block_nr.to_le_bytes());
    let c = crc32c_raw(c, &b);
    put_u32(&mut b, 16, c);
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::{get_u16, get_u32};

    fn x(name: &str, value: &[u8]) -> DiskXattr {
        parse(name.as_bytes(), value).expect("valid")
    }

    #[test]
    fn prefixes() {
        assert_eq!(x("user.foo", b"").index, 1);
        assert_eq!(x("user.foo", b"").name, b"foo");
        assert_eq!(x("trusted.a", b"").index, 4);
        assert_eq!(x("security.capability", b"").index, 6);
        assert_eq!(x("system.foo", b"").index, 7);
        let acl = [2, 0, 0, 0, 1, 0, 6, 0, 0xFF, 0xFF, 0xFF, 0xFF];
        let a = x("system.posix_acl_access", &acl);
        assert_eq!((a.index, a.name.len()), (2, 0));
        assert_eq!(&a.value[..4], &[1, 0, 0, 0]);
        assert_eq!(x("system.posix_acl_default", &acl).index, 3);
        assert!(parse(b"system.data", b"").is_err());
        assert!(parse(b"bogus.x", b"").is_err());
        assert!(parse(b"user.", b"").is_err());
        assert!(parse(b"system.posix_acl_access", b"junk").is_err());
    }

    #[test]
    fn full_names_round_trip() {
        for n in ["user.a", "trusted.b", "security.capability", "system.foo", "system.posix_acl_default"] {
            let v = if n.contains("acl") { vec![2, 0, 0, 0] } else { vec![] };
            assert_eq!(full_name(&x(n, &v)), n.as_bytes());
        }
    }

    #[test]
    fn hash_known_value() {
        // name "a" → h = 0x61; value "abcd" (LE 0x64636261) → (0x61<<16) ^ 0 ^ 0x64636261.
        let h = entry_hash(&x("user.a", b"abcd"));
        assert_eq!(h, (0x61 << 16) ^ 0x6463_6261);
    }

    #[test]
    fn in_inode_layout() {
        let cap = x("security.capability", &[1u8; 20]);
        assert!(fits_in_inode(std::slice::from_ref(&cap)));
        let area = render_inode_area(std::slice::from_ref(&cap)).expect("fits");
        assert_eq!(get_u32(&area, 0), XATTR_MAGIC);
        assert_eq!(area[4], 10); // name_len of "capability"
        assert_eq!(area[5], 6);
        let offs = get_u16(&area, 6) as usize;
        assert_eq!(offs, 92 - 20); // relative to the first entry at area offset 4
        assert_eq!(&area[4 + offs..4 + offs + 20], &[1u8; 20]);
        assert!(!fits_in_inode(&[x("user.big", &[0u8; 80])]));
    }

    #[test]
    fn block_layout_sorted_and_checksummed() {
        let mut v = vec![x("user.b", b"2"), x("user.a", b"1"), x("security.z", b"3"), x("user.aa", b"")];
        sort(&mut v);
        let names: Vec<&[u8]> = v.iter().map(|e| e.name.as_slice()).collect();
        assert_eq!(names, vec![&b"a"[..], b"b", b"aa", b"z"]);
        let body = render_block_body(&v).expect("fits");
        let b = seal_block(&body, 2, 1234, 77);
        assert_eq!(get_u32(&b, 4), 2);
        assert_eq!(get_u32(&b, 8), 1);
        let mut z = b.clone();
        z[16..20].fill(0);
        let c = crc32c_raw(crc32c_raw(77, &1234u64.to_le_bytes()), &z);
        assert_eq!(get_u32(&b, 16), c);
        // First entry's value sits at the very end of the block.
        assert_eq!(get_u16(&b, 32 + 2), 4092);
        assert!(render_block_body(&[x("user.v", &[0u8; 4096])]).is_none());
        assert!(render_block_body(&[x("user.v", &[0u8; 3000])]).is_some());
    }
}
