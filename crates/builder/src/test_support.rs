//! Helpers for tests and fuzz seeds (feature `test-support`).

/// A GNU tar header owned by 1000:100 with mtime 1 600 000 000 and a valid checksum.
pub fn tar_header(path: &str, kind: tar::EntryType, size: u64, mode: u32) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(mode);
    h.set_uid(1000);
    h.set_gid(100);
    h.set_mtime(1_600_000_000);
    h.set_path(path).expect("a test path fits a tar header");
    h.set_cksum();
    h
}

/// [`tar_header`] for a device node (`kind` Char or Block) with these numbers.
pub fn device_header(path: &str, kind: tar::EntryType, mode: u32, major: u32, minor: u32) -> tar::Header {
    let mut h = tar_header(path, kind, 0, mode);
    h.set_device_major(major).expect("device numbers fit a GNU header");
    h.set_device_minor(minor).expect("device numbers fit a GNU header");
    h.set_cksum();
    h
}
