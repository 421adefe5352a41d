//! The overlay's file access, behind a small trait so that tests can model a power loss (an
//! implementation that forgets what was not `sync_data`'d).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// Positional I/O on the overlay file.
pub trait OverlayIo: Send + Sync {
    /// Fill `buf` from `offset`; bytes past the end of the file read as zeros.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Write all of `buf` at `offset` (the file grows as needed). Not durable before
    /// [`Self::sync_data`].
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Make every completed write durable (`fdatasync`).
    fn sync_data(&self) -> io::Result<()>;
    /// Current size of the file.
    fn size(&self) -> io::Result<u64>;
}

/// [`OverlayIo`] on a real file.
#[derive(Debug)]
pub struct FileIo {
    file: File,
}

impl FileIo {
    pub fn new(file: File) -> Self {
        Self { file }
    }

    pub fn file(&self) -> &File {
        &self.file
    }
}

impl OverlayIo for FileIo {
    fn read_at(&self, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
        while !buf.is_empty() {
            match self.file.read_at(buf, offset) {
                Ok(0) => {
                    buf.fill(0);
                    return Ok(());
                }
                Ok(n) => {
                    buf = &mut buf[n..];
                    offset += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
}

/// A fault double for whole-process tests (`tessera serve --overlay-lose-unsynced`): an
/// [`OverlayIo`] over a real file that makes a `kill -9` lose what a power loss could. Every
/// write is held in process memory until a [`OverlayIo::sync_data`] covers it; meanwhile some
/// writes (about one in three, chosen at random, a third of those torn at 512-byte sectors)
/// reach the file early, as a disk's write-back may persist any unsynced write. Reads see every
/// completed write, as the page cache would. A sync writes everything it covers to the file in
/// issue order, then `fdatasync`s. So a process killed at any point leaves the file holding its
/// last synced state plus an arbitrary, possibly torn subset of the writes since: the states a
/// power loss can leave. The real [`FileIo`] cannot lose those writes on a kill (the page cache
/// keeps them), which is why this double exists.
#[derive(Debug)]
pub struct LoseUnsyncedIo {
    file: FileIo,
    state: std::sync::Mutex<Unsynced>,
}

#[derive(Debug)]
struct Unsynced {
    /// Writes no completed sync covers yet, in issue order; the first has sequence `first_seq`.
    writes: std::collections::VecDeque<(u64, Vec<u8>)>,
    first_seq: u64,
    /// xorshift64 state: which writes reach the file early, and which sectors of them.
    rng: u64,
}

impl Unsynced {
    fn next(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }
}

impl LoseUnsyncedIo {
    /// The double over `file`; `seed` picks which writes reach the file early.
    pub fn new(file: FileIo, seed: u64) -> Self {
        let rng = seed | 1;
        Self {
            file,
            state: std::sync::Mutex::new(Unsynced { writes: Default::default(), first_seq: 0, rng }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Unsynced> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Copy the part of write `(at, data)` that overlaps `[offset, offset + buf.len())` into `buf`.
fn overlay_write(buf: &mut [u8], offset: u64, at: u64, data: &[u8]) {
    let start = at.max(offset);
    let end = (at + data.len() as u64).min(offset + buf.len() as u64);
    if start < end {
        let (b, d) = ((start - offset) as usize, (start - at) as usize);
        let n = (end - start) as usize;
        buf[b..b + n].copy_from_slice(&data[d..d + n]);
    }
}

impl OverlayIo for LoseUnsyncedIo {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let st = self.lock();
        self.file.read_at(buf, offset)?;
        for (at, data) in &st.writes {
            overlay_write(buf, offset, *at, data);
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let mut st = self.lock();
        match st.next() % 9 {
            0 | 1 => self.file.write_at(buf, offset)?,
            2 => {
                for (i, sector) in buf.chunks(512).enumerate() {
                    if st.next() % 2 == 0 {
                        self.file.write_at(sector, offset + (i * 512) as u64)?;
                    }
                }
            }
            _ => {}
        }
        st.writes.push_back((offset, buf.to_vec()));
        Ok(())
    }

    /// Covers the writes issued before the call, and only those (as `fdatasync` promises).
    fn sync_data(&self) -> io::Result<()> {
        let upto = {
            let st = self.lock();
            for (at, data) in &st.writes {
                self.file.write_at(data, *at)?;
            }
            st.first_seq + st.writes.len() as u64
        };
        self.file.sync_data()?;
        let mut st = self.lock();
        while st.first_seq < upto && st.writes.pop_front().is_some() {
            st.first_seq += 1;
        }
        Ok(())
    }

    fn size(&self) -> io::Result<u64> {
        let st = self.lock();
        let held = st.writes.iter().map(|(at, d)| at + d.len() as u64).max().unwrap_or(0);
        Ok(self.file.size()?.max(held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(i: u64) -> Vec<u8> {
        (0..4096u64).map(|k| (i * 31 + k) as u8 | 1).collect()
    }

    /// The double holds what no sync covered (the file alone lacks some of it, as after a
    /// power loss), shows every completed write to reads, and a sync makes the file exact.
    #[test]
    fn lose_unsynced_holds_unsynced_writes_until_a_sync() {
        let file = tempfile::tempfile().unwrap();
        let raw = file.try_clone().unwrap();
        let io = LoseUnsyncedIo::new(FileIo::new(file), 7);
        let mut model = vec![0u8; 64 * 4096];
        for i in 0..64u64 {
            io.write_at(&block(i), i * 4096).unwrap();
            model[(i * 4096) as usize..][..4096].copy_from_slice(&block(i));
        }
        // Overlapping writes keep their issue order.
        io.write_at(&[0xee; 1000], 4000).unwrap();
        model[4000..5000].fill(0xee);
        assert_eq!(io.size().unwrap(), 64 * 4096);
        let mut seen = vec![0u8; model.len()];
        io.read_at(&mut seen, 0).unwrap();
        assert!(seen == model, "reads see every completed write");

        // The file alone (what a kill leaves): some writes missing, some present, some torn.
        let on_file = |raw: &File| {
            let mut b = vec![0u8; model.len()];
            FileIo::new(raw.try_clone().unwrap()).read_at(&mut b, 0).unwrap();
            b
        };
        let before = on_file(&raw);
        let kept = (0..64).filter(|&i| before[i * 4096..][..4096] == model[i * 4096..][..4096]).count();
        let empty = (0..64).filter(|&i| before[i * 4096..][..4096].iter().all(|&b| b == 0)).count();
        assert!(kept > 0 && empty > 0, "{kept} writes on the file before a sync, {empty} not at all");
        assert!(kept + empty < 64, "no torn write among 64");

        io.sync_data().unwrap();
        assert!(on_file(&raw) == model, "a sync leaves the file exact");
        io.read_at(&mut seen, 0).unwrap();
        assert!(seen == model);
    }
}
