//! Target `oci_layers`: arbitrary layer bytes through the layer reader (compression sniffing,
//! gzip/zstd, tar headers, PAX and GNU extensions), the changeset flattener, and pass 2's reads
//! of the surviving files — what `tessera build oci:…` does with a hostile image's layers.
//!
//! Input: a flags byte (`flags % 3 + 1` layers), then each layer but the last as a `u32` length
//! and that many bytes; the last layer takes the rest. Layers are applied in order, as the
//! build does; the first error ends the run (errors are the expected answer to most inputs).
//!
//! Checked: no panic, decompression bounded by a 64 MiB budget; the flattened tree is
//! well-formed (entries name existing nodes; names are non-empty, without `/` or NUL, not `.` or
//! `..`, at most 255 bytes, never a whiteout; each directory's names sorted and unique; content
//! refs exactly on regular files, with the file's size, in layers that exist); and pass 2 —
//! re-reading each layer and skipping to every surviving file — reads every file completely and
//! verifies the stream, since pass 1 already saw those bytes.

use std::io::{Cursor, Read};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use tessera_builder::source::{scan_layer, ContentRef, Flattener, LayerBlob, LayerStream};
use tessera_ext4::NodeKind;

use crate::{Input, Output};

/// Uncompressed bytes all layers together may expand to.
const BUDGET: u64 = 64 << 20;

fn blob(index: usize, bytes: &[u8]) -> LayerBlob {
    let raw: Arc<[u8]> = Arc::from(bytes);
    LayerBlob {
        name: format!("layer {index}"),
        open: Box::new(move || Ok(Box::new(Cursor::new(Arc::clone(&raw))) as Box<dyn Read + Send>)),
        digest: None,
        size: Some(bytes.len() as u64),
        diff_id: None,
    }
}

/// Split fuzz input into layers.
pub fn layers(data: &[u8]) -> Vec<&[u8]> {
    let mut input = Input::new(data);
    let count = usize::from(input.u8() % 3) + 1;
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        if i + 1 == count {
            out.push(input.rest());
        } else {
            let n = input.u32() as usize;
            out.push(input.bytes(n));
        }
    }
    out
}

/// The input format of [`run`], for seeds.
pub fn encode(layers: &[Vec<u8>]) -> Vec<u8> {
    assert!((1..=3).contains(&layers.len()));
    let mut o = Output::default();
    o.u8(layers.len() as u8 - 1);
    for (i, l) in layers.iter().enumerate() {
        if i + 1 < layers.len() {
            o.u32(l.len() as u32);
        }
        o.bytes(l);
    }
    o.buf
}

pub fn run(data: &[u8]) {
    let layers = layers(data);
    let blobs: Vec<LayerBlob> = layers.iter().enumerate().map(|(i, l)| blob(i, l)).collect();
    let used = Arc::new(AtomicU64::new(0));
    let mut flattener = Flattener::new(1_700_000_000);
    for (i, b) in blobs.iter().enumerate() {
        let Ok(stream) = LayerStream::open(b, Some((Arc::clone(&used), BUDGET))) else { return };
        let Ok(entries) = scan_layer(stream) else { return };
        if flattener.apply_layer(i, &b.name, &entries).is_err() {
            return;
        }
    }
    let Ok(flat) = flattener.finish() else { return };
    let nodes = &flat.tree.nodes;
    assert_eq!(nodes.len(), flat.content.len());
    assert!(matches!(nodes[0].kind, NodeKind::Directory { .. }), "the root is a directory");
    for (i, node) in nodes.iter().enumerate() {
        match (&node.kind, &flat.content[i]) {
            (NodeKind::Regular { size, .. }, Some(c)) => {
                assert_eq!(*size, c.size, "node {i}: size and content ref disagree");
                assert!(c.layer < blobs.len(), "node {i}: content in layer {}", c.layer);
            }
            (NodeKind::Regular { .. }, None) => panic!("node {i}: regular file without content"),
            (_, Some(_)) => panic!("node {i}: content on a non-file"),
            (NodeKind::Directory { entries }, None) => {
                for w in entries.windows(2) {
                    assert!(w[0].name < w[1].name, "node {i}: names unsorted or repeated");
                }
                for e in entries {
                    let n = &e.name[..];
                    assert!(!n.is_empty() && n.len() <= 255, "node {i}: name length {}", n.len());
                    assert!(!n.contains(&b'/') && !n.contains(&0), "node {i}: bad name {n:?}");
                    assert!(n != b"." && n != b"..", "node {i}: name {n:?}");
                    assert!(!n.starts_with(b".wh."), "node {i}: whiteout {n:?} in the tree");
                    assert!((e.node.0 as usize) < nodes.len(), "node {i}: entry names node {}", e.node.0);
                    assert!(e.node.0 != 0, "node {i}: entry names the root");
                }
            }
            (_, None) => {}
        }
    }
    // Pass 2, as the build's reader does it: per layer, files in stream order.
    let mut refs: Vec<ContentRef> = flat.content.iter().flatten().copied().collect();
    refs.sort_by_key(|c| (c.layer, c.offset));
    refs.dedup();
    for (i, b) in blobs.iter().enumerate() {
        let mine: Vec<&ContentRef> = refs.iter().filter(|c| c.layer == i).collect();
        if mine.is_empty() {
            continue;
        }
        // Pass 1 counted these bytes already; pass 2 has no budget, as in the build.
        let mut stream = LayerStream::reopen(b).unwrap_or_else(|e| panic!("{}: pass 2 open: {e}", b.name));
        let mut buf = Vec::new();
        for c in mine {
            stream
                .skip_to(c.offset)
                .unwrap_or_else(|e| panic!("{}: pass 2 skip to {}: {e}", b.name, c.offset));
            buf.resize(usize::try_from(c.size.min(1 << 20)).unwrap_or(1 << 20), 0);
            let mut left = c.size;
            while left > 0 {
                let n = usize::try_from(left.min(buf.len() as u64)).unwrap_or(buf.len());
                stream
                    .read_exact_checked(&mut buf[..n])
                    .unwrap_or_else(|e| panic!("{}: pass 2 read at {}: {e}", b.name, c.offset));
                left -= n as u64;
            }
        }
        stream.finish().unwrap_or_else(|e| panic!("{}: pass 2 finish: {e}", b.name));
    }
}
