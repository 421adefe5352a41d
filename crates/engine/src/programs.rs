//! Which files of an image are programs (cold starts): the executable regular files its ext4
//! metadata lists ([`tessera_ext4::scan`]), as [`FileMap`] files. An `exec` reads a program's
//! header first and then most of the program, page fault by page fault, each a round trip of its
//! own: a program too large for the first-miss rule is worth fetching whole at the miss of its
//! first chunk ([`crate::MemTier::with_programs_whole`]). A large file read from its start that
//! is not executable (a database, an archive) keeps the third-miss rule.
//!
//! Pure: the metadata is the prefix the daemon holds; no I/O.

use std::collections::HashSet;

use tessera_image::SegmentSource;
use tessera_store::OpenImage;

use crate::files::FileMap;

/// The 4096 bytes of device block `block`, if the image's metadata prefix holds all of them.
pub fn metadata_block(image: &OpenImage, block: u64) -> Option<&[u8]> {
    let bs = tessera_image::BLOCK_SIZE as u64;
    let mut plan = image.record().block_map.plan(block.checked_mul(bs)?, bs).ok()?;
    let segment = plan.next()?;
    match segment.source {
        SegmentSource::Prefix { offset } if segment.len == bs => {
            let from = usize::try_from(offset).ok()?;
            image.prefix().get(from..from.checked_add(tessera_image::BLOCK_SIZE as usize)?)
        }
        _ => None,
    }
}

/// The files of `files` that are executable regular files of more than `above` and at most
/// `up_to` bytes, found by their first data block; a file whose data does not start with a
/// chunk's first block (not where [`FileMap`] starts one) is left out.
pub fn programs(image: &OpenImage, files: &FileMap, above: u64, up_to: u64) -> HashSet<u32> {
    let map = &image.record().block_map;
    let bs = tessera_image::BLOCK_SIZE as u64;
    tessera_ext4::scan::regular_files(|b| metadata_block(image, b))
        .into_iter()
        .filter(|f| f.executable() && f.size > above && f.size <= up_to)
        .filter_map(|f| {
            let segment = map.plan(f.first_block?.checked_mul(bs)?, 1).ok()?.next()?;
            let SegmentSource::Chunk { chunk, offset: 0 } = segment.source else { return None };
            let file = files.file_of(chunk)?;
            (files.chunks(file).first() == Some(&chunk)).then_some(file)
        })
        .collect()
}
