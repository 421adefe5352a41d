//! `boot_trace`: the boot trace text decoder ([`Trace::decode`], `docs/formats/profile.md`):
//! files written line by line by `tessera serve --record-trace` (possibly cut short by a killed
//! daemon) and read by `tessera profile`.
//!
//! Input: raw trace text. Properties: never a panic; what decodes re-encodes to the identical
//! bytes (the decoder rejects anything the encoder would not write); [`Trace::new`] accepts its
//! entries (first-touch order, each chunk once); the text cut short by a byte does not decode.

use tessera_image::{ChunkId, ImageId, Sha256Digest, Trace, TraceEntry};

/// The fuzz target body.
pub fn run(data: &[u8]) {
    let Ok(t) = Trace::decode(data) else { return };
    let text = t.encode();
    assert!(text.as_bytes() == data, "trace decode/encode is not the identity");
    assert_eq!(Trace::new(t.image(), t.entries().to_vec()).expect("Trace::new refuses a decoded trace"), t);
    assert!(Trace::decode(&data[..data.len() - 1]).is_err(), "a cut-short trace decodes");
}

/// Seeds: a trace of four chunks (two at the same time), a header-only trace.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let image = ImageId(Sha256Digest::of(b"image"));
    let entry = |c: u8, at_us| TraceEntry { chunk: ChunkId::of(&[c]), at_us };
    let t = Trace::new(image, vec![entry(1, 0), entry(2, 10), entry(3, 10), entry(4, 1_234_567)])
        .expect("seed trace");
    let empty = Trace::new(image, vec![]).expect("seed trace");
    vec![("four".into(), t.encode().into_bytes()), ("header-only".into(), empty.encode().into_bytes())]
}
