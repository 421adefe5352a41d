//! The shared libraries a program or library will load (issue 15, cold starts): its `DT_NEEDED`
//! entries, read from the ELF bytes the daemon already holds, and where the image stores those
//! libraries.
//!
//! A cold start of a program is a chain of round trips: the dynamic loader opens the libraries a
//! program needs one after another, and each one's first read is a miss the guest waits for
//! before it opens the next (`find`: libselinux, libm, libpcre2; gcc's `cc1`: libisl, libmpc,
//! libmpfr, libgmp, libz, libzstd, libm; python: libm, libz, libexpat). Once the program's
//! dynamic section is in memory the whole list is known, and the daemon can fetch them at once.
//!
//! [`parse`] is pure (the bytes come through a closure). [`locate`] finds the libraries in the
//! image's ext4 metadata, which the daemon holds whole (the metadata prefix), through
//! `ext4-view` reading memory: no I/O either.

use std::sync::Arc;

use tessera_image::SegmentSource;
use tessera_store::OpenImage;

/// What an ELF file's bytes at hand say about the libraries it needs.
#[derive(Debug, PartialEq, Eq)]
pub enum Needs {
    /// Not a 64-bit little-endian ELF file with a dynamic section, or one that does not parse:
    /// nothing to fetch.
    Nothing,
    /// An ELF file whose headers, dynamic section or names are not all in memory yet.
    Later,
    /// The libraries it names (`libm.so.6`), its machine (`e_machine`) and its program
    /// interpreter (`/lib64/ld-linux-x86-64.so.2`; a program's, not a library's).
    Libraries { machine: u16, names: Vec<String>, interp: Option<String> },
}

const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const PT_INTERP: u32 = 3;
const DT_NULL: u64 = 0;
const DT_NEEDED: u64 = 1;
const DT_STRTAB: u64 = 5;
const DT_STRSZ: u64 = 10;
const PHDR: usize = 56;
const DYN: usize = 16;
/// Program headers looked at, at most.
const MAX_PHDRS: usize = 64;
/// A larger dynamic section is not a loader's (a malformed file).
const MAX_DYNAMIC: u64 = 64 << 10;
/// Longest library name taken.
const MAX_NAME: usize = 255;
/// Libraries taken from one file, at most.
const MAX_NEEDED: usize = 64;

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// The libraries an ELF file of `len` bytes needs. `bytes(offset, n)` gives the file's `n` bytes
/// at `offset` if memory holds them all, else `None`; it is only asked for ranges inside the file.
pub fn parse(len: u64, bytes: impl Fn(u64, usize) -> Option<Vec<u8>>) -> Needs {
    let at = |offset: u64, n: usize| -> Result<Vec<u8>, Needs> {
        let end = offset.checked_add(n as u64).ok_or(Needs::Nothing)?;
        if end > len {
            return Err(Needs::Nothing);
        }
        bytes(offset, n).ok_or(Needs::Later)
    };
    match parse_with(len, at) {
        Ok(needs) | Err(needs) => needs,
    }
}

fn parse_with(len: u64, at: impl Fn(u64, usize) -> Result<Vec<u8>, Needs>) -> Result<Needs, Needs> {
    if len < 64 {
        return Ok(Needs::Nothing);
    }
    let header = at(0, 64)?;
    // 64-bit (2), little-endian (1), ELF version 1; an executable (2) or a shared object (3).
    if header[..4] != *b"\x7fELF" || header[4] != 2 || header[5] != 1 || header[6] != 1 {
        return Ok(Needs::Nothing);
    }
    let bad = || Needs::Nothing;
    let kind = u16_at(&header, 16).ok_or_else(bad)?;
    if kind != 2 && kind != 3 {
        return Ok(Needs::Nothing);
    }
    let machine = u16_at(&header, 18).ok_or_else(bad)?;
    let phoff = u64_at(&header, 32).ok_or_else(bad)?;
    let phentsize = u16_at(&header, 54).ok_or_else(bad)?;
    let phnum = usize::from(u16_at(&header, 56).ok_or_else(bad)?);
    if usize::from(phentsize) != PHDR || phnum == 0 || phnum > MAX_PHDRS {
        return Ok(Needs::Nothing);
    }
    let phdrs = at(phoff, phnum * PHDR)?;
    let mut loads = Vec::new();
    let (mut dynamic, mut interp) = (None, None);
    for p in phdrs.chunks_exact(PHDR) {
        let kind = u32_at(p, 0).ok_or_else(bad)?;
        let (offset, vaddr, filesz) =
            (u64_at(p, 8).ok_or_else(bad)?, u64_at(p, 16).ok_or_else(bad)?, u64_at(p, 32).ok_or_else(bad)?);
        match kind {
            PT_LOAD => loads.push((vaddr, offset, filesz)),
            PT_DYNAMIC if dynamic.is_none() => dynamic = Some((offset, filesz)),
            PT_INTERP if interp.is_none() && filesz <= 4096 => interp = Some((offset, filesz)),
            _ => {}
        }
    }
    // Statically linked: needs nothing.
    let Some((offset, size)) = dynamic else { return Ok(Needs::Nothing) };
    if size > MAX_DYNAMIC {
        return Ok(Needs::Nothing);
    }
    let entries = at(offset, usize::try_from(size).map_err(|_| bad())? / DYN * DYN)?;
    let (mut needed, mut strtab, mut strsz) = (Vec::new(), None, None);
    for d in entries.chunks_exact(DYN) {
        let (tag, value) = (u64_at(d, 0).ok_or_else(bad)?, u64_at(d, 8).ok_or_else(bad)?);
        match tag {
            DT_NULL => break,
            DT_NEEDED if needed.len() < MAX_NEEDED => needed.push(value),
            DT_STRTAB => strtab = Some(value),
            DT_STRSZ => strsz = Some(value),
            _ => {}
        }
    }
    if needed.is_empty() {
        return Ok(Needs::Nothing);
    }
    let (Some(strtab), Some(strsz)) = (strtab, strsz) else { return Ok(Needs::Nothing) };
    // The string table's address, as a file offset: inside a loaded segment's file bytes.
    let table = loads
        .iter()
        .find(|&&(vaddr, _, filesz)| strtab >= vaddr && strtab - vaddr < filesz)
        .map(|&(vaddr, offset, _)| offset + (strtab - vaddr))
        .ok_or_else(bad)?;
    let mut names = Vec::with_capacity(needed.len());
    for name in needed {
        if name >= strsz {
            return Ok(Needs::Nothing);
        }
        let start = table.checked_add(name).ok_or_else(bad)?;
        let room = (strsz - name).min(MAX_NAME as u64 + 1).min(len.saturating_sub(start));
        let text = at(start, usize::try_from(room).map_err(|_| bad())?)?;
        let Some(end) = text.iter().position(|&b| b == 0) else { return Ok(Needs::Nothing) };
        // A name with a slash is a path the loader opens as it is; not a search.
        match std::str::from_utf8(&text[..end]) {
            Ok(n) if !n.is_empty() && !n.contains('/') => names.push(n.to_owned()),
            _ => {}
        }
    }
    let interp = match interp {
        Some((offset, size)) => {
            let path = at(offset, usize::try_from(size).map_err(|_| bad())?)?;
            let end = path.iter().position(|&b| b == 0).unwrap_or(path.len());
            std::str::from_utf8(&path[..end]).ok().filter(|p| p.starts_with('/')).map(str::to_owned)
        }
        None => None,
    };
    Ok(Needs::Libraries { machine, names, interp })
}

/// Where the loader looks for a library of a program for `machine`, in order (Debian's
/// multiarch directories first, as its `ld.so.cache` lists them; `/lib` is a link to `/usr/lib`
/// on merged-/usr systems, and links are followed).
fn search_dirs(machine: u16) -> Vec<&'static str> {
    let mut dirs = match machine {
        62 => vec!["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu"],
        183 => vec!["/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu"],
        _ => Vec::new(),
    };
    dirs.extend(["/lib64", "/usr/lib64", "/lib", "/usr/lib"]);
    dirs
}

/// Reads an image's device from its metadata prefix. A block of chunk data, which the prefix
/// does not hold, reads as [`MARK`] and its own device offset, repeated: a file's first bytes
/// then say where its data starts, however `ext4-view`'s block cache came to hold the block (it
/// reads several blocks at a time, so a file's first block may have come in with a directory's
/// or a neighbour's).
struct PrefixRead {
    image: Arc<OpenImage>,
}

/// Marks a block of chunk data in [`PrefixRead`]'s output (random; a file stored in the prefix
/// that began with it would still be checked against the block map).
const MARK: [u8; 8] = *b"\x9e\x1d\x7fTsr\xb3\x05";

impl ext4_view::Ext4Read for PrefixRead {
    fn read(&mut self, start: u64, dst: &mut [u8]) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let map = &self.image.record().block_map;
        let prefix = self.image.prefix();
        let mut at = 0usize;
        for segment in map.plan(start, dst.len() as u64)? {
            let n = usize::try_from(segment.len)?;
            let out = dst.get_mut(at..at + n).ok_or("a segment past the buffer")?;
            match segment.source {
                SegmentSource::Zero => out.fill(0),
                SegmentSource::Prefix { offset } => {
                    let from = usize::try_from(offset)?;
                    out.copy_from_slice(prefix.get(from..from + n).ok_or("a segment past the prefix")?);
                }
                SegmentSource::Chunk { .. } => mark(out, start + at as u64),
            }
            at += n;
        }
        Ok(())
    }
}

/// Fill `out`, the device's bytes from `offset` on, with each block's mark: at every
/// 16-byte-aligned device offset `o`, [`MARK`] then `o`'s block's offset.
fn mark(out: &mut [u8], offset: u64) {
    for (i, byte) in out.iter_mut().enumerate() {
        let o = offset + i as u64;
        let (pair, within) = (o & !15, (o % 16) as usize);
        *byte = match within {
            0..8 => MARK[within],
            _ => (pair & !(BLOCK - 1)).to_le_bytes()[within - 8],
        };
    }
}

const BLOCK: u64 = tessera_image::BLOCK_SIZE as u64;

/// Where the image stores a program's libraries and interpreter: the device offset of each one's
/// first data byte.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Located {
    /// The libraries found (a regular file with data), in the order named; others left out.
    pub libraries: Vec<u64>,
    pub interp: Option<u64>,
}

/// Find `names` (libraries of a program for `machine`, in the loader's search order) and
/// `interp` (a path) in `image`'s ext4 metadata.
pub fn locate(image: &Arc<OpenImage>, machine: u16, names: &[String], interp: Option<&str>) -> Located {
    let read = PrefixRead { image: Arc::clone(image) };
    let Ok(fs) = ext4_view::Ext4::load(Box::new(read)) else { return Located::default() };
    let map = &image.record().block_map;
    // The device offset of the first data byte of the file at `path`, if it is one whose data
    // starts with a chunk's block (its first 16 bytes read as that block's mark).
    let first_byte = |path: &str| -> Option<Option<u64>> {
        let mut file = fs.open(path).ok()?;
        let mut head = [0u8; 16];
        let mut got = 0;
        while got < head.len() {
            match file.read_bytes(&mut head[got..]) {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n,
            }
        }
        let offset = u64::from_le_bytes(head[8..].try_into().unwrap_or_default());
        let chunk = |o: u64| {
            let first = map.plan(o, 1).ok().and_then(|mut plan| plan.next());
            first.is_some_and(|s| matches!(s.source, SegmentSource::Chunk { .. }))
        };
        Some(
            (got == head.len() && head[..8] == MARK && offset % BLOCK == 0 && chunk(offset))
                .then_some(offset),
        )
    };
    let dirs = search_dirs(machine);
    let mut located = Located { libraries: Vec::new(), interp: interp.and_then(|p| first_byte(p).flatten()) };
    for name in names {
        // The first directory holding the name is the loader's choice, data or not.
        if let Some(Some(offset)) = dirs.iter().find_map(|dir| first_byte(&format!("{dir}/{name}"))) {
            located.libraries.push(offset);
        }
    }
    located
}

/// A minimal 64-bit x86-64 ELF shared object for tests: one PT_LOAD at vaddr 0x1000 over the
/// whole file, a PT_DYNAMIC needing `names`, a string table, and a PT_INTERP if `interp` is
/// given (each at a fixed place: names of a few hundred bytes at most).
#[doc(hidden)]
pub fn sample_elf(interp: Option<&str>, names: &[&str]) -> Vec<u8> {
    let (phoff, interp_at, dyn_at, str_at) = (64usize, 256usize, 512usize, 1024usize);
    let mut strtab = vec![0u8];
    let mut offsets = Vec::new();
    for n in names {
        offsets.push(strtab.len() as u64);
        strtab.extend_from_slice(n.as_bytes());
        strtab.push(0);
    }
    let mut f = vec![0u8; str_at + strtab.len()];
    f[..4].copy_from_slice(b"\x7fELF");
    f[4..7].copy_from_slice(&[2, 1, 1]);
    f[16..18].copy_from_slice(&3u16.to_le_bytes());
    f[18..20].copy_from_slice(&62u16.to_le_bytes());
    f[32..40].copy_from_slice(&(phoff as u64).to_le_bytes());
    f[54..56].copy_from_slice(&(PHDR as u16).to_le_bytes());
    f[56..58].copy_from_slice(&3u16.to_le_bytes());
    let len = f.len() as u64;
    let mut ph = |i: usize, kind: u32, offset: u64, vaddr: u64, size: u64| {
        let p = phoff + i * PHDR;
        f[p..p + 4].copy_from_slice(&kind.to_le_bytes());
        f[p + 8..p + 16].copy_from_slice(&offset.to_le_bytes());
        f[p + 16..p + 24].copy_from_slice(&vaddr.to_le_bytes());
        f[p + 32..p + 40].copy_from_slice(&size.to_le_bytes());
    };
    ph(0, PT_LOAD, 0, 0x1000, len);
    let entries = names.len() + 3;
    ph(1, PT_DYNAMIC, dyn_at as u64, 0x1000 + dyn_at as u64, (entries * DYN) as u64);
    if let Some(path) = interp {
        ph(2, PT_INTERP, interp_at as u64, 0x1000 + interp_at as u64, path.len() as u64 + 1);
    }
    if let Some(path) = interp {
        f[interp_at..interp_at + path.len()].copy_from_slice(path.as_bytes());
    }
    let mut d = dyn_at;
    let mut put = |tag: u64, value: u64| {
        f[d..d + 8].copy_from_slice(&tag.to_le_bytes());
        f[d + 8..d + 16].copy_from_slice(&value.to_le_bytes());
        d += DYN;
    };
    for o in &offsets {
        put(DT_NEEDED, *o);
    }
    put(DT_STRTAB, 0x1000 + str_at as u64);
    put(DT_STRSZ, strtab.len() as u64);
    put(DT_NULL, 0);
    f[str_at..].copy_from_slice(&strtab);
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_of_chunk_data_reads_as_its_mark_from_any_offset() {
        let mut whole = vec![0u8; 2 * BLOCK as usize];
        mark(&mut whole, 7 * BLOCK);
        for (block, bytes) in whole.chunks(16).enumerate() {
            let at = 7 * BLOCK + (block as u64 * 16) / BLOCK * BLOCK;
            assert_eq!(bytes[..8], MARK);
            assert_eq!(bytes[8..], at.to_le_bytes());
        }
        let mut part = vec![0u8; 100];
        mark(&mut part, 7 * BLOCK + 4090);
        assert_eq!(part[..], whole[4090..4190]);
    }

    fn whole(file: &[u8]) -> impl Fn(u64, usize) -> Option<Vec<u8>> + '_ {
        move |offset, n| {
            let start = usize::try_from(offset).ok()?;
            file.get(start..start + n).map(<[u8]>::to_vec)
        }
    }

    #[test]
    fn names_come_from_the_dynamic_section() {
        let f = sample_elf(None, &["libm.so.6", "libz.so.1", "libc.so.6"]);
        let names = vec!["libm.so.6".to_owned(), "libz.so.1".to_owned(), "libc.so.6".to_owned()];
        assert_eq!(parse(f.len() as u64, whole(&f)), Needs::Libraries { machine: 62, names, interp: None });
    }

    #[test]
    fn bytes_not_in_memory_mean_later_and_bad_ones_nothing() {
        let f = sample_elf(None, &["libm.so.6"]);
        // The headers are in, the dynamic section is not (as when its chunk has not arrived).
        let head_only =
            |offset: u64, n: usize| (offset + n as u64 <= 400).then(|| f[offset as usize..][..n].to_vec());
        assert_eq!(parse(f.len() as u64, head_only), Needs::Later);
        assert_eq!(parse(f.len() as u64, |_, _| None), Needs::Later);
        let mut not_elf = f.clone();
        not_elf[0] = 0;
        assert_eq!(parse(f.len() as u64, whole(&not_elf)), Needs::Nothing);
        let mut big_endian = f.clone();
        big_endian[5] = 2;
        assert_eq!(parse(f.len() as u64, whole(&big_endian)), Needs::Nothing);
        // A name offset past the string table.
        let mut past = f.clone();
        past[512 + 8..512 + 16].copy_from_slice(&1000u64.to_le_bytes());
        assert_eq!(parse(f.len() as u64, whole(&past)), Needs::Nothing);
        assert_eq!(parse(10, whole(&f[..10])), Needs::Nothing);
    }

    /// Every truncation and every single-byte change of a real ELF file parses to an answer
    /// without a panic, and truncations never invent a library.
    #[test]
    fn truncated_or_flipped_files_never_panic() {
        let f = sample_elf(None, &["libselinux.so.1", "libpcre2-8.so.0"]);
        for cut in 0..f.len() {
            match parse(cut as u64, whole(&f[..cut])) {
                Needs::Nothing | Needs::Later => {}
                Needs::Libraries { names, .. } => {
                    assert!(names.iter().all(|n| n == "libselinux.so.1" || n == "libpcre2-8.so.0"))
                }
            }
        }
        for i in 0..f.len() {
            for bit in [0x01u8, 0x80] {
                let mut g = f.clone();
                g[i] ^= bit;
                let _ = parse(g.len() as u64, whole(&g));
            }
        }
    }

    /// The host's own programs, as the loader sees them (this machine's /bin/ls needs libc and
    /// is run by the x86-64 loader).
    #[test]
    fn a_real_program_needs_libc() {
        let f = std::fs::read("/bin/ls").expect("/bin/ls");
        match parse(f.len() as u64, whole(&f)) {
            Needs::Libraries { names, interp, .. } => {
                assert!(names.iter().any(|n| n == "libc.so.6"), "{names:?}");
                assert_eq!(interp.as_deref(), Some("/lib64/ld-linux-x86-64.so.2"));
            }
            other => panic!("/bin/ls: {other:?}"),
        }
    }
}
