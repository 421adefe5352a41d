//! The fetch pool: a few threads that finish reads needing a chunk not in the memory tier, off
//! the queue threads, so one slow fetch never stalls the other requests of its queue.

use std::io;
use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Sender};
use tracing::warn;

/// A job: finish one deferred read and report its completion.
pub type Job = Box<dyn FnOnce() + Send>;

/// Default number of fetch threads.
pub const DEFAULT_FETCH_THREADS: usize = 4;

/// A fixed set of threads running [`Job`]s in submission order (each job on whichever thread is
/// free). Dropping the pool lets queued jobs finish, then joins the threads (once every
/// [`FetchHandle`] is gone too).
pub struct FetchPool {
    tx: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for FetchPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FetchPool").field("threads", &self.threads.len()).finish()
    }
}

impl FetchPool {
    /// Start `threads` (at least 1) fetch threads.
    pub fn new(threads: usize) -> io::Result<Self> {
        let (tx, rx) = unbounded::<Job>();
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let h = std::thread::Builder::new().name(format!("tessera-fetch-{i}")).spawn(move || {
                for job in rx {
                    job();
                }
            })?;
            handles.push(h);
        }
        Ok(Self { tx: Some(tx), threads: handles })
    }

    /// A handle submitting jobs to this pool. The threads run until the pool and every handle
    /// are dropped (a job may hold a handle: no thread ever joins itself).
    pub fn handle(&self) -> Option<FetchHandle> {
        self.tx.clone().map(|tx| FetchHandle { tx })
    }
}

/// Submits [`Job`]s to a [`FetchPool`].
#[derive(Clone, Debug)]
pub struct FetchHandle {
    tx: Sender<Job>,
}

impl FetchHandle {
    /// Run `job` on a fetch thread; gives it back if the threads are gone.
    pub fn submit(&self, job: Job) -> Result<(), Job> {
        self.tx.send(job).map_err(|e| e.into_inner())
    }
}

impl Drop for FetchPool {
    fn drop(&mut self) {
        drop(self.tx.take());
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                warn!("a fetch thread panicked");
            }
        }
    }
}
