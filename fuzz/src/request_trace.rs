//! `request_trace`: the request trace decoder ([`RequestTrace::decode`], `TESSREQ`,
//! `docs/formats/requests.md`): files written by `tessera serve --record-requests` and read back by
//! the replayer, possibly cut short or from another version.
//!
//! Input: raw trace bytes. Properties: never a panic, no allocation beyond the input's size;
//! what decodes re-encodes to the identical bytes; every record's queue is below the header's
//! queue count, its completion not before its issue, its range inside 64 bits; the encoding cut
//! short by a byte, and the header marked unfinished, do not decode.

use tessera_image::{
    ImageId, RequestOp, RequestRecord, RequestStatus, RequestTrace, RequestTraceHeader, Sha256Digest,
    REQUEST_HEADER_LEN, REQUEST_TRACE_UNFINISHED,
};

/// The fuzz target body.
pub fn run(data: &[u8]) {
    let Ok(t) = RequestTrace::decode(data) else { return };
    let bytes = t.encode();
    assert!(bytes == data, "request trace decode/encode is not the identity");
    for r in &t.records {
        assert!(r.queue < t.header.queues, "a record's queue is not below the queue count");
        assert!(r.completed_ns >= r.issued_ns, "a record completes before it is issued");
        assert!(r.sector.checked_mul(512).and_then(|b| b.checked_add(r.len)).is_some());
    }
    assert!(RequestTrace::decode(&bytes[..bytes.len() - 1]).is_err(), "a cut-short trace decodes");
    let mut unfinished = bytes;
    unfinished[..REQUEST_HEADER_LEN].copy_from_slice(&t.header.encode(REQUEST_TRACE_UNFINISHED));
    assert!(RequestTrace::decode(&unfinished).is_err(), "an unfinished trace decodes");
}

/// A record from its fields, in the order of the struct.
pub fn record(
    queue: u16,
    op: RequestOp,
    status: RequestStatus,
    sector: u64,
    len: u64,
    issued_ns: u64,
    completed_ns: u64,
) -> RequestRecord {
    RequestRecord { queue, op, status, sector, len, issued_ns, completed_ns }
}

/// Seeds: a trace of every request type and status on two queues; an empty read-write one.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let rec = record;
    let header = RequestTraceHeader {
        image: ImageId(Sha256Digest::of(b"img")),
        device_bytes: 64 << 20,
        queues: 2,
        read_only: true,
    };
    use RequestOp as O;
    use RequestStatus as S;
    let full = RequestTrace {
        header,
        records: vec![
            rec(0, O::Read, S::Ok, 0, 4096, 10, 2_000),
            rec(1, O::Read, S::Ok, 8, 65536, 20, 30),
            rec(0, O::Flush, S::Ok, 0, 0, 2_100, 2_100),
            rec(1, O::Write, S::IoErr, 16, 512, 3_000, 4_000),
            rec(0, O::GetId, S::Ok, 0, 20, 4_100, 4_200),
            rec(1, O::Discard, S::Unsupp, 1 << 20, 1 << 20, 4_300, 4_400),
            rec(0, O::WriteZeroes, S::Unsupp, 24, 4096, 4_500, 4_600),
            rec(1, O::Unsupported, S::Unsupp, 0, 0, 4_700, 4_700),
            rec(0, O::Invalid, S::Dropped, 0, 0, 5, 5),
        ],
    };
    let empty = RequestTrace {
        header: RequestTraceHeader { queues: 1, read_only: false, ..header },
        records: vec![],
    };
    vec![("all-types".into(), full.encode()), ("empty".into(), empty.encode())]
}
