//! The Tessera daemon core: a vhost-user-blk backend that serves an image to a VMM.
//!
//! Every request goes **parse → plan → execute**:
//! - [`request::parse`] turns a descriptor chain into a typed [`Request`] (spec MUSTs, bounds
//!   and overflow checks; hostile input becomes a typed [`RequestError`], never a panic, and
//!   never an access outside guest memory);
//! - [`plan::plan`] checks it against the device (range, read-only) without I/O;
//! - [`execute::execute`] copies image bytes (through a [`BlockDevice`], normally
//!   `tessera_store::ImageReader`) into guest memory;
//! - [`RequestError::status`] is the one mapping from errors to the virtio status byte.
//!
//! [`BlkBackend`] implements `vhost_user_backend::VhostUserBackend` (one worker thread per
//! queue) and [`Server`] owns the socket: one client at a time, a fresh daemon per connection,
//! so a VMM may disconnect and reconnect.
//!
//! A writable device writes into the copy-on-write overlay (`tessera-overlay`: one file, durable
//! at each FLUSH with one `fdatasync`); a read-only device serves the base image alone. Reads are
//! served by the read engine (`tessera-engine`: decoded chunks in memory) straight into guest
//! memory on the queue's worker thread; a read missing memory is deferred, finished on the
//! engine's threads once its chunks are fetched, and completes out of order (`docs/daemon.md`).
//! This crate owns no cache: it is virtio only.
//!
//! ```no_run
//! use std::sync::Arc;
//! use tessera_engine::{FetchLimits, MemTier};
//! use tessera_store::{ImageReader, LocalStore, OpenImage};
//! use tessera_vhost::{DeviceConfig, Disk, Server, DEFAULT_SOCKET_MODE};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = LocalStore::open("/var/lib/tessera")?;
//! let id = store.resolve("web")?;
//! let reader = ImageReader::new(OpenImage::open(&store, &id)?, store.clone());
//! let tier = MemTier::new(reader, 256 << 20, FetchLimits::new(4))?;
//! let device = DeviceConfig::new(&id, tier.device_bytes(), 1, true);
//! let disk = Disk::Base(Arc::new(tier));
//! let server = Server::bind("/run/web.sock".as_ref(), DEFAULT_SOCKET_MODE, device, disk)?;
//! let stop = server.stop_handle(); // stop.stop() from a signal thread
//! server.run()?;
//! # Ok(()) }
//! ```

pub mod backend;
pub mod config;
pub mod error;
pub mod execute;
pub mod guest;
pub mod inflight;
pub mod log_limit;
pub mod notify;
pub mod plan;
pub mod poll;
pub mod record;
pub mod request;
pub mod server;
pub mod used;

pub use backend::{BlkBackend, GuestMem, DRAIN_TIMEOUT};
pub use config::{serial_for, DeviceConfig, MAX_QUEUES, MAX_QUEUE_SIZE};
pub use error::{DropReason, RequestError, ServeError, Status};
pub use execute::{
    serve_chain, start_chain, Completion, DeferredFlush, DeferredRead, Disk, Executed, Started,
};
pub use record::{RecordError, RequestRecorder};
pub use request::{Parsed, Request, RequestKind};
pub use server::{Server, StopHandle, DEFAULT_SOCKET_MODE};
pub use tessera_metrics::{Metrics, RequestStatus, RequestType};
