//! Group geometry (reference §2 and §14).

use tessera_image::BlockSize;

/// Blocks per group: one 4096-byte bitmap block covers 32768 blocks (one bit each).
pub const BLOCKS_PER_GROUP: u64 = BlockSize::U64 * 8;
/// 256-byte inodes per inode-table block.
pub const INODES_PER_BLOCK: u64 = BlockSize::U64 / 256;
pub const MAX_IPG: u64 = 32768;

/// sparse_super: groups 0, 1 and powers of 3, 5 and 7 carry superblock + GDT copies.
pub fn group_has_super(group: u64) -> bool {
    if group <= 1 {
        return true;
    }
    if group % 2 == 0 {
        return false;
    }
    [3u64, 5, 7].iter().any(|&base| is_power_of(group, base))
}

fn is_power_of(mut n: u64, base: u64) -> bool {
    while n % base == 0 {
        n /= base;
    }
    n == 1
}

/// GDT blocks for `groups` 64-byte descriptors.
pub fn gdt_blocks(groups: u64) -> u64 {
    (groups * 64).div_ceil(BlockSize::U64)
}

/// Inode-table blocks per group.
pub fn itable_blocks(ipg: u64) -> u64 {
    ipg / INODES_PER_BLOCK
}

/// Block ranges `[start, end)` of the superblock + GDT copies in groups ≥ 1 (group 0's copy is where the
/// allocator starts). Clipped to `blocks_count`.
pub fn backup_ranges(groups: u64, blocks_count: u64) -> Vec<(u64, u64)> {
    let len = 1 + gdt_blocks(groups);
    (1..groups)
        .filter(|&g| group_has_super(g))
        .map(|g| {
            let s = g * BLOCKS_PER_GROUP;
            (s, (s + len).min(blocks_count))
        })
        .collect()
}

/// mke2fs drops a last group too small to hold its own overhead plus 50 blocks
/// (`ext2fs_initialize`). Returns the possibly reduced block count.
pub fn trim_tail_group(blocks_count: u64, ipg: u64) -> u64 {
    let groups = blocks_count.div_ceil(BLOCKS_PER_GROUP);
    let rem = blocks_count % BLOCKS_PER_GROUP;
    if rem == 0 || groups <= 1 {
        return blocks_count;
    }
    let last = groups - 1;
    let mut overhead = 2 + itable_blocks(ipg);
    if group_has_super(last) {
        overhead += 1 + gdt_blocks(groups);
    }
    if rem < overhead + 50 {
        blocks_count - rem
    } else {
        blocks_count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_super_groups() {
        let backups: Vec<u64> = (0..512).filter(|&g| group_has_super(g)).collect();
        assert_eq!(backups, vec![0, 1, 3, 5, 7, 9, 25, 27, 49, 81, 125, 243, 343]);
    }

    #[test]
    fn gdt_and_backups() {
        assert_eq!(gdt_blocks(1), 1);
        assert_eq!(gdt_blocks(64), 1);
        assert_eq!(gdt_blocks(65), 2);
        assert_eq!(backup_ranges(4, 4 * 32768), vec![(32768, 32770), (98304, 98306)]);
    }

    #[test]
    fn tail_group() {
        assert_eq!(trim_tail_group(32768 + 10, 4096), 32768);
        assert_eq!(trim_tail_group(32768 + 2000, 4096), 32768 + 2000);
        assert_eq!(trim_tail_group(1000, 4096), 1000);
    }
}
