//! `tessera serve --record-requests FILE`: every request the device answers, written to a
//! request trace (`tessera_image::RequestTrace`, `docs/formats/requests.md`).
//!
//! The queue workers and the read engine's threads call [`RequestRecorder::record`] once per
//! completed request: a clock read and a send on a channel (no lock, no I/O); a writer thread
//! appends the records to the file through a buffer, flushed every second, and on
//! [`RequestRecorder::finish`] writes the record count into the header and syncs. Without the
//! flag the backend holds no recorder, and the cost is a branch on an `Option`.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tessera_image::{RequestOp, RequestRecord, RequestStatus, RequestTraceHeader};
use tessera_metrics::RequestType;
use thiserror::Error;

use crate::error::Status;
use crate::execute::Completion;

/// How often buffered records reach the file.
const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// A request trace that could not be written.
#[derive(Debug, Error)]
#[error("request trace {}: {source}", path.display())]
pub struct RecordError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

#[derive(Debug)]
enum Msg {
    Record(RequestRecord),
    Finish,
}

/// Records every completed request into a request trace file.
#[derive(Debug)]
pub struct RequestRecorder {
    path: PathBuf,
    /// Time 0 of the trace.
    start: Instant,
    tx: Sender<Msg>,
    writer: Mutex<Option<JoinHandle<Result<u64, std::io::Error>>>>,
}

impl RequestRecorder {
    /// Create (or truncate) `path`, write the header (record count "unfinished") and start the
    /// writer thread. Time 0 of the trace is now.
    pub fn create(path: &Path, header: RequestTraceHeader) -> Result<Arc<Self>, RecordError> {
        let err = |source| RecordError { path: path.to_owned(), source };
        let mut file = OpenOptions::new().create(true).truncate(true).write(true).open(path).map_err(err)?;
        file.write_all(&header.encode(tessera_image::REQUEST_TRACE_UNFINISHED)).map_err(err)?;
        let (tx, rx) = mpsc::channel::<Msg>();
        let writer = std::thread::Builder::new()
            .name("request-trace".into())
            .spawn(move || write_records(file, header, &rx))
            .map_err(err)?;
        Ok(Arc::new(Self {
            path: path.to_owned(),
            start: Instant::now(),
            tx,
            writer: Mutex::new(Some(writer)),
        }))
    }

    /// A request taken off queue `queue`'s ring at `taken` has just completed as `done`.
    pub fn record(&self, queue: usize, done: &Completion, taken: Instant) {
        let ns = |t: Duration| u64::try_from(t.as_nanos()).unwrap_or(u64::MAX);
        let completed_ns = ns(self.start.elapsed());
        let record = RequestRecord {
            queue: u16::try_from(queue).unwrap_or(u16::MAX),
            op: op(done.kind),
            status: status(done.status),
            sector: done.sector,
            len: done.len,
            issued_ns: ns(taken.saturating_duration_since(self.start)).min(completed_ns),
            completed_ns,
        };
        // After `finish` the writer is gone: later requests are not recorded.
        let _ = self.tx.send(Msg::Record(record));
    }

    /// Write what is buffered, the record count into the header, and sync the file; requests
    /// completed after this are not recorded. Returns the number of records. Idempotent (a
    /// second call returns 0).
    pub fn finish(&self) -> Result<u64, RecordError> {
        let Some(writer) = self.writer.lock().unwrap_or_else(PoisonError::into_inner).take() else {
            return Ok(0);
        };
        let _ = self.tx.send(Msg::Finish);
        let err = |source| RecordError { path: self.path.clone(), source };
        match writer.join() {
            Ok(r) => r.map_err(err),
            Err(_) => Err(err(std::io::Error::other("the request trace writer panicked"))),
        }
    }
}

/// The writer thread: append records until told to finish, then complete the header.
fn write_records(
    file: File,
    header: RequestTraceHeader,
    rx: &mpsc::Receiver<Msg>,
) -> Result<u64, std::io::Error> {
    let mut out = BufWriter::with_capacity(256 << 10, file);
    let mut count = 0u64;
    let mut last_flush = Instant::now();
    loop {
        match rx.recv_timeout(FLUSH_EVERY) {
            Ok(Msg::Record(r)) => {
                out.write_all(&r.encode())?;
                count += 1;
                if last_flush.elapsed() >= FLUSH_EVERY {
                    out.flush()?;
                    last_flush = Instant::now();
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                out.flush()?;
                last_flush = Instant::now();
            }
            Ok(Msg::Finish) | Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    let mut file = out.into_inner().map_err(|e| e.into_error())?;
    file.seek(SeekFrom::Start(0))?;
    file.write_all(&header.encode(count))?;
    file.sync_data()?;
    Ok(count)
}

fn op(kind: RequestType) -> RequestOp {
    match kind {
        RequestType::Read => RequestOp::Read,
        RequestType::Write => RequestOp::Write,
        RequestType::Flush => RequestOp::Flush,
        RequestType::Discard => RequestOp::Discard,
        RequestType::WriteZeroes => RequestOp::WriteZeroes,
        RequestType::GetId => RequestOp::GetId,
        RequestType::Unsupported => RequestOp::Unsupported,
        RequestType::Invalid => RequestOp::Invalid,
    }
}

fn status(s: Option<Status>) -> RequestStatus {
    match s {
        Some(Status::Ok) => RequestStatus::Ok,
        Some(Status::IoErr) => RequestStatus::IoErr,
        Some(Status::Unsupp) => RequestStatus::Unsupp,
        None => RequestStatus::Dropped,
    }
}

#[cfg(test)]
mod tests {
    use tessera_image::{ImageId, RequestTrace, Sha256Digest};

    use super::*;

    #[test]
    fn records_reach_the_file_and_the_count_the_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("req.trace");
        let header = RequestTraceHeader {
            image: ImageId(Sha256Digest::of(b"i")),
            device_bytes: 1 << 20,
            queues: 2,
            read_only: true,
        };
        let rec = RequestRecorder::create(&path, header).unwrap();
        // Unfinished: the strict decoder refuses it.
        assert!(RequestTrace::decode(&std::fs::read(&path).unwrap()).is_err());
        let taken = Instant::now();
        let done =
            |kind, status, sector, len| Completion { used_len: 1, status, kind, bytes: len, sector, len };
        rec.record(0, &done(RequestType::Read, Some(Status::Ok), 8, 4096), taken);
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let rec = Arc::clone(&rec);
                std::thread::spawn(move || {
                    for i in 0..100 {
                        rec.record(
                            1,
                            &done(RequestType::Write, Some(Status::IoErr), t * 1000 + i, 512),
                            Instant::now(),
                        );
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        rec.record(1, &done(RequestType::Invalid, None, 0, 0), Instant::now());
        assert_eq!(rec.finish().unwrap(), 402);
        assert_eq!(rec.finish().unwrap(), 0, "idempotent");
        rec.record(0, &done(RequestType::Flush, Some(Status::Ok), 0, 0), Instant::now());
        let t = RequestTrace::decode(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(t.header, header);
        assert_eq!(t.records.len(), 402);
        let first = t.records[0];
        assert_eq!(
            (first.queue, first.op, first.status, first.sector, first.len),
            (0, RequestOp::Read, RequestStatus::Ok, 8, 4096)
        );
        assert!(first.issued_ns <= first.completed_ns);
        let writes: Vec<_> = t.records.iter().filter(|r| r.op == RequestOp::Write).collect();
        assert_eq!(writes.len(), 400);
        assert!(writes.iter().all(|r| r.status == RequestStatus::IoErr && r.queue == 1 && r.len == 512));
        let last = t.records[401];
        assert_eq!((last.op, last.status), (RequestOp::Invalid, RequestStatus::Dropped));
    }
}
