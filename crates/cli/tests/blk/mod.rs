//! A libblkio client of one queue for the CLI's black-box serve tests: each request waits for
//! its completion and returns its status (0 = done, negative errno otherwise).
#![allow(dead_code, clippy::unwrap_used)]

use std::mem::MaybeUninit;
use std::path::Path;
use std::time::Duration;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};

pub struct Client {
    _blkio: Blkio,
    q: Blkioq,
    region: MemoryRegion,
}

impl Client {
    /// Connect to the vhost-user socket at `socket` with one queue and a 2 MiB buffer.
    pub fn connect(socket: &Path) -> Client {
        let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
        b.set_str("path", socket.to_str().unwrap()).unwrap();
        b.connect().unwrap();
        b.set_i32("num-queues", 1).unwrap();
        let mut started = b.start().unwrap();
        let region = b.alloc_mem_region(2 << 20).unwrap();
        b.map_mem_region(&region).unwrap();
        Client { q: started.queues.remove(0), _blkio: b, region }
    }

    /// The first `len` bytes of the request buffer.
    pub fn buf(&mut self, len: usize) -> &mut [u8] {
        assert!(len <= self.region.len);
        // SAFETY: a live mapping of `region.len` bytes owned by the Blkio instance; no request
        // is in flight while the test touches it.
        unsafe { std::slice::from_raw_parts_mut(self.region.addr as *mut u8, len) }
    }

    fn wait(&mut self) -> i32 {
        let mut c = [MaybeUninit::<Completion>::uninit()];
        let mut timeout = Duration::from_secs(20);
        assert_eq!(self.q.do_io(&mut c, 1, Some(&mut timeout), None).unwrap(), 1);
        // SAFETY: do_io initialized one completion.
        unsafe { c[0].assume_init_ref() }.ret
    }

    /// Read `len` bytes at `off` into the buffer ([`Self::buf`]).
    pub fn read(&mut self, off: u64, len: usize) -> i32 {
        assert!(len <= self.region.len);
        self.q.read(off, self.region.addr as *mut u8, len, 0, ReqFlags::empty());
        self.wait()
    }

    /// Write `data` at `off`.
    pub fn write(&mut self, off: u64, data: &[u8]) -> i32 {
        self.buf(data.len()).copy_from_slice(data);
        self.q.write(off, self.region.addr as *const u8, data.len(), 0, ReqFlags::empty());
        self.wait()
    }

    pub fn flush(&mut self) -> i32 {
        self.q.flush(0, ReqFlags::empty());
        self.wait()
    }

    pub fn discard(&mut self, off: u64, len: u64) -> i32 {
        self.q.discard(off, len, 0, ReqFlags::empty());
        self.wait()
    }

    pub fn write_zeroes(&mut self, off: u64, len: u64) -> i32 {
        self.q.write_zeroes(off, len, 0, ReqFlags::empty());
        self.wait()
    }
}
