//! `tessera serve --record-trace FILE`: the recorder plus a thread that flushes it every second,
//! so a daemon killed without warning loses at most the last second of first touches.

use std::path::Path;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result};
use tessera_engine::TraceRecorder;
use tessera_image::{BlockMap, ImageId};

const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// A trace being recorded, flushed periodically until [`Self::finish`].
pub struct TraceSession {
    recorder: Arc<TraceRecorder>,
    stop: Sender<()>,
    flusher: JoinHandle<()>,
}

impl TraceSession {
    /// Create `path` (truncating it) for `image` and start the flusher.
    pub fn start(path: &Path, image: ImageId, map: &BlockMap) -> Result<Self> {
        let recorder = Arc::new(TraceRecorder::create(path, image, map)?);
        let (stop, stopped) = mpsc::channel::<()>();
        let flushed = recorder.clone();
        let flusher = std::thread::Builder::new()
            .name("trace-flush".into())
            .spawn(move || {
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(FLUSH_EVERY) {
                    if let Err(e) = flushed.flush() {
                        tracing::warn!(error = %e, "writing the trace");
                    }
                }
            })
            .context("starting the trace flusher")?;
        tracing::info!(path = %path.display(), "recording first touches");
        Ok(Self { recorder, stop, flusher })
    }

    /// The recorder to hand to the memory tier.
    pub fn recorder(&self) -> Arc<TraceRecorder> {
        self.recorder.clone()
    }

    /// Stop the flusher, write what is left and sync the file.
    pub fn finish(self) -> Result<u64> {
        drop(self.stop);
        let _ = self.flusher.join();
        let chunks = self.recorder.finish()?;
        tracing::info!(chunks, "trace written");
        Ok(chunks)
    }
}
