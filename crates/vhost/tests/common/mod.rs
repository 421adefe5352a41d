//! Shared helpers: a small image built with the real builder, an in-process server on a real
//! unix socket, and a libblkio client.
#![allow(dead_code, clippy::unwrap_used)]

use std::fs;
use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use rand::{Rng, SeedableRng};
use tessera_builder::{build_dir, BuildConfig, NoProgress};
use tessera_engine::{export_raw, ExportOptions};
use tessera_ext4::SizePolicy;
use tessera_image::ImageId;
use tessera_store::{ImageReader, LocalStore, OpenImage};
use tessera_vhost::{DeviceConfig, Disk, Server, StopHandle, DEFAULT_SOCKET_MODE};

/// A built image, its exported raw bytes, and the directory holding everything.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub store: LocalStore,
    pub id: ImageId,
    pub raw: Vec<u8>,
}

/// Build a small image: files of several sizes (a multi-chunk one with 64 KiB chunks, small
/// ones, an empty one, a sparse one), a symlink and nested directories, on a 64 MiB device.
pub fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    fs::create_dir_all(src.join("a/b/c")).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut random = |n: usize| (0..n).map(|_| rng.gen::<u8>()).collect::<Vec<u8>>();
    fs::write(src.join("big.bin"), random(3 << 20)).unwrap();
    fs::write(src.join("a/small.txt"), b"hello tessera\n").unwrap();
    fs::write(src.join("a/b/odd.bin"), random(70_001)).unwrap();
    fs::write(src.join("a/b/c/zeros"), vec![0u8; 200_000]).unwrap();
    fs::write(src.join("empty"), b"").unwrap();
    for i in 0..50 {
        fs::write(src.join(format!("a/b/c/f{i}")), random(1000 + i * 97)).unwrap();
    }
    std::os::unix::fs::symlink("a/small.txt", src.join("link")).unwrap();
    let store = LocalStore::create_or_open(dir.path().join("store")).unwrap();
    let config =
        BuildConfig { chunk_size: 64 << 10, size: SizePolicy::Exact(64 << 20), ..BuildConfig::default() };
    let out = build_dir(&src, &store, &config, &NoProgress).unwrap();
    let raw_path = dir.path().join("raw.img");
    let r = reader(&store, &out.id);
    export_raw(r.image(), &r, ExportOptions::default(), &raw_path, |_| {}).unwrap();
    let raw = fs::read(&raw_path).unwrap();
    Fixture { dir, store, id: out.id, raw }
}

pub fn overlay_params(f: &Fixture) -> tessera_overlay::OverlayParams {
    tessera_overlay::OverlayParams {
        image_id: f.id,
        block_size: tessera_image::BLOCK_SIZE,
        device_bytes: f.raw.len() as u64,
    }
}

pub fn reader(store: &LocalStore, id: &ImageId) -> ImageReader<LocalStore> {
    ImageReader::new(OpenImage::open(store, id).unwrap(), store.clone())
}

/// A server running on its own thread.
pub struct Running {
    pub socket: PathBuf,
    pub stop: StopHandle,
    pub thread: Option<JoinHandle<Result<(), tessera_vhost::ServeError>>>,
}

impl Running {
    pub fn start(f: &Fixture, queues: u16) -> Running {
        let socket = f.dir.path().join(format!("vhost-{queues}.sock"));
        let r = reader(&f.store, &f.id);
        let device = DeviceConfig::new(&f.id, r.device_bytes(), queues, true);
        Self::serve(&socket, device, Disk::Base(Arc::new(r)))
    }

    /// A writable device over the overlay file `overlay` (created if missing).
    pub fn start_rw(f: &Fixture, queues: u16, overlay: &Path) -> Running {
        let socket = f.dir.path().join(format!("vhost-rw-{queues}.sock"));
        let r = Arc::new(reader(&f.store, &f.id));
        let device = DeviceConfig::new(&f.id, r.device_bytes(), queues, false);
        let params = overlay_params(f);
        let o = tessera_overlay::Overlay::open_or_create_file(overlay, params, r).unwrap();
        Self::serve(&socket, device, Disk::Overlay(Arc::new(o)))
    }

    pub fn serve(socket: &Path, device: DeviceConfig, disk: Disk) -> Running {
        Self::run(Server::bind(socket, DEFAULT_SOCKET_MODE, device, disk).unwrap())
    }

    /// Run a bound (and configured) server on its own thread.
    pub fn run(server: Server) -> Running {
        let socket = server.path().to_owned();
        let stop = server.stop_handle();
        let thread = std::thread::spawn(move || server.run());
        Running { socket, stop, thread: Some(thread) }
    }

    /// Stop and join; the server must have exited cleanly.
    pub fn finish(mut self) {
        self.stop.stop();
        self.thread.take().unwrap().join().unwrap().unwrap();
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A libblkio client with one mapped buffer region.
pub struct Client {
    pub blkio: Blkio,
    pub queues: Vec<Blkioq>,
    pub region: MemoryRegion,
    pub capacity: u64,
}

pub const REGION_LEN: usize = 8 << 20;

impl Client {
    /// Connect read-only with `queues` queues.
    pub fn connect(socket: &Path, queues: i32) -> Client {
        Self::try_connect(socket, queues, true).unwrap()
    }

    pub fn try_connect(socket: &Path, queues: i32, read_only: bool) -> Result<Client, blkio::Error> {
        let mut blkio = Blkio::new("virtio-blk-vhost-user")?;
        blkio.set_str("path", socket.to_str().unwrap())?;
        blkio.set_bool("read-only", read_only)?;
        blkio.connect()?;
        let capacity = blkio.get_u64("capacity")?;
        blkio.set_i32("num-queues", queues)?;
        let started = blkio.start()?;
        let region = blkio.alloc_mem_region(REGION_LEN)?;
        blkio.map_mem_region(&region)?;
        Ok(Client { blkio, queues: started.queues, region, capacity })
    }

    /// The mapped region as bytes.
    pub fn buf(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset + len <= self.region.len);
        // SAFETY: the region is a live mapping of `region.len` bytes owned by `self.blkio`
        // (freed only when it drops); no request using this range is in flight when the
        // caller looks at it.
        unsafe { std::slice::from_raw_parts((self.region.addr as *const u8).add(offset), len) }
    }

    pub fn ptr(&self, offset: usize) -> *mut u8 {
        assert!(offset < self.region.len);
        (self.region.addr + offset) as *mut u8
    }

    /// Wait for `n` completions on queue `q`; returns them as (user_data, ret).
    pub fn complete(&mut self, q: usize, n: usize) -> Vec<(usize, i32)> {
        let mut out = Vec::with_capacity(n);
        let mut completions: Vec<MaybeUninit<Completion>> = (0..n).map(|_| MaybeUninit::uninit()).collect();
        while out.len() < n {
            let want = n - out.len();
            let mut timeout = Duration::from_secs(20);
            let got = self.queues[q].do_io(&mut completions[..want], want, Some(&mut timeout), None).unwrap();
            assert!(got > 0, "no completion within 20 s");
            for c in &completions[..got] {
                // SAFETY: do_io initialized the first `got` entries.
                let c = unsafe { c.assume_init_ref() };
                out.push((c.user_data, c.ret));
            }
        }
        out
    }

    /// The mapped region as mutable bytes.
    pub fn buf_mut(&mut self, offset: usize, len: usize) -> &mut [u8] {
        assert!(offset + len <= self.region.len);
        // SAFETY: as in `buf`; `&mut self` keeps other views of the region out while it lives.
        unsafe { std::slice::from_raw_parts_mut((self.region.addr as *mut u8).add(offset), len) }
    }

    /// Write `len` bytes from region `buf_off` at device `offset` on queue 0 and wait.
    pub fn write(&mut self, offset: u64, buf_off: usize, len: usize) -> i32 {
        let ptr = self.ptr(buf_off);
        self.queues[0].write(offset, ptr, len, 8, ReqFlags::empty());
        self.complete(0, 1)[0].1
    }

    pub fn flush(&mut self) -> i32 {
        self.queues[0].flush(9, ReqFlags::empty());
        self.complete(0, 1)[0].1
    }

    pub fn discard(&mut self, offset: u64, len: u64) -> i32 {
        self.queues[0].discard(offset, len, 10, ReqFlags::empty());
        self.complete(0, 1)[0].1
    }

    pub fn write_zeroes(&mut self, offset: u64, len: u64) -> i32 {
        self.queues[0].write_zeroes(offset, len, 11, ReqFlags::empty());
        self.complete(0, 1)[0].1
    }

    /// Read `len` bytes at device `offset` into region `buf_off` on queue 0 and wait.
    pub fn read(&mut self, offset: u64, buf_off: usize, len: usize) -> i32 {
        let ptr = self.ptr(buf_off);
        self.queues[0].read(offset, ptr, len, 7, ReqFlags::empty());
        let c = self.complete(0, 1);
        assert_eq!(c[0].0, 7);
        c[0].1
    }
}
