//! POSIX ACL conversion from the VFS xattr format (what `getxattr` returns and tar stores: version 2,
//! 8-byte entries) to ext4's on-disk format (version 1, 4-byte short entries for the owner/group/mask/
//! other tags). Reference §10.

pub const ACL_USER_OBJ: u16 = 0x01;
pub const ACL_USER: u16 = 0x02;
pub const ACL_GROUP_OBJ: u16 = 0x04;
pub const ACL_GROUP: u16 = 0x08;
pub const ACL_MASK: u16 = 0x10;
pub const ACL_OTHER: u16 = 0x20;

const VFS_VERSION: u32 = 2;
const EXT4_VERSION: u32 = 1;

/// Convert a VFS-format ACL to the ext4 disk format. Entries are put in canonical order (by tag, then
/// id), which the tag values already encode; the kernel rejects ACLs out of that order.
pub fn vfs_to_disk(value: &[u8]) -> Result<Vec<u8>, &'static str> {
    if value.len() < 4 || (value.len() - 4) % 8 != 0 {
        return Err("POSIX ACL value has a bad length");
    }
    let version = u32::from_le_bytes([value[0], value[1], value[2], value[3]]);
    if version != VFS_VERSION {
        return Err("POSIX ACL value is not version 2");
    }
    let mut entries: Vec<(u16, u16, u32)> = value[4..]
        .chunks_exact(8)
        .map(|c| {
            (
                u16::from_le_bytes([c[0], c[1]]),
                u16::from_le_bytes([c[2], c[3]]),
                u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
            )
        })
        .collect();
    for &(tag, perm, _) in &entries {
        if ![ACL_USER_OBJ, ACL_USER, ACL_GROUP_OBJ, ACL_GROUP, ACL_MASK, ACL_OTHER].contains(&tag) {
            return Err("POSIX ACL has an unknown tag");
        }
        if perm & !7 != 0 {
            return Err("POSIX ACL has invalid permission bits");
        }
    }
    // Ids of the short-form tags are meaningless (ACL_UNDEFINED_ID); sort only by id for named tags.
    entries.sort_by_key(|&(tag, _, id)| (tag, if tag == ACL_USER || tag == ACL_GROUP { id } else { 0 }));
    for w in entries.windows(2) {
        let same_tag = w[0].0 == w[1].0;
        let named = w[0].0 == ACL_USER || w[0].0 == ACL_GROUP;
        if same_tag && (!named || w[0].2 == w[1].2) {
            return Err("POSIX ACL has duplicate entries");
        }
    }
    let mut out = Vec::with_capacity(4 + 8 * entries.len());
    out.extend_from_slice(&EXT4_VERSION.to_le_bytes());
    for (tag, perm, id) in entries {
        out.extend_from_slice(&tag.to_le_bytes());
        out.extend_from_slice(&perm.to_le_bytes());
        if tag == ACL_USER || tag == ACL_GROUP {
            out.extend_from_slice(&id.to_le_bytes());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vfs(entries: &[(u16, u16, u32)]) -> Vec<u8> {
        let mut v = 2u32.to_le_bytes().to_vec();
        for &(t, p, i) in entries {
            v.extend_from_slice(&t.to_le_bytes());
            v.extend_from_slice(&p.to_le_bytes());
            v.extend_from_slice(&i.to_le_bytes());
        }
        v
    }

    #[test]
    fn converts_to_short_and_long_entries() {
        let input = vfs(&[
            (ACL_USER_OBJ, 7, u32::MAX),
            (ACL_USER, 6, 1000),
            (ACL_GROUP_OBJ, 5, u32::MAX),
            (ACL_GROUP, 4, 2000),
            (ACL_MASK, 6, u32::MAX),
            (ACL_OTHER, 0, u32::MAX),
        ]);
        let out = vfs_to_disk(&input).expect("valid");
        let want: Vec<u8> = [
            &1u32.to_le_bytes()[..],
            &[1, 0, 7, 0],
            &[2, 0, 6, 0, 0xE8, 3, 0, 0],
            &[4, 0, 5, 0],
            &[8, 0, 4, 0, 0xD0, 7, 0, 0],
            &[0x10, 0, 6, 0],
            &[0x20, 0, 0, 0],
        ]
        .concat();
        assert_eq!(out, want);
    }

    #[test]
    fn sorts_and_rejects() {
        let a = vfs(&[(ACL_OTHER, 4, 0), (ACL_USER_OBJ, 6, 0), (ACL_GROUP_OBJ, 4, 0)]);
        let out = vfs_to_disk(&a).expect("valid");
        assert_eq!(&out[4..6], &[1, 0]);
        assert!(vfs_to_disk(&[1, 0, 0, 0]).is_err());
        assert!(vfs_to_disk(&[2, 0, 0, 0, 1]).is_err());
        assert!(vfs_to_disk(&vfs(&[(0x40, 0, 0)])).is_err());
        assert!(vfs_to_disk(&vfs(&[(ACL_USER_OBJ, 6, 0), (ACL_USER_OBJ, 6, 0)])).is_err());
        assert!(vfs_to_disk(&vfs(&[(ACL_USER, 6, 5), (ACL_USER, 4, 5)])).is_err());
    }
}
