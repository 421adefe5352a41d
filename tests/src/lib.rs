//! End-to-end test harness for Tessera, judged by real tools.
//!
//! - [`fixtures`]: deterministic source trees, one per code path.
//! - [`compare`]: source tree vs mounted image, attribute by attribute.
//! - [`judge`]: `e2fsck -fn`, loop mounts (serialized), an rw workload, ext4-view.
//! - [`tessera`]: locating and running the `tessera` binary.
//! - [`daemon`]: `tessera serve` as a child process and a libblkio client reading from it;
//!   [`metrics`]: scraping its `/metrics`; [`replay`]: replaying a request trace through libblkio.
//! - [`oci`]: OCI images made with umoci/skopeo and hand-written layers.
//! - [`nginx`]: nginx as a real HTTP origin; [`proxy`]: the latency/bandwidth/fault proxy in
//!   front of it (the network model).
//! - [`tls`]: a throwaway CA and server certificate (openssl CLI).
//! - [`reference`]: the same pipeline with `mkfs.ext4 -d`, to validate the harness itself.
//! - [`workloads`]: the package-set image and the guest workloads of `cargo xtask bench lazy`.
//!
//! ```no_run
//! use tessera_e2e::{compare, fixtures, judge};
//! # fn main() -> anyhow::Result<()> {
//! let dir = tempfile::tempdir()?;
//! fixtures::by_name("kinds")?.generate(&dir.path().join("src"))?;
//! // ... build an image, then:
//! # let img = dir.path().join("img");
//! judge::e2fsck(&img)?;
//! let mnt = judge::LoopMount::ro(&img)?;
//! let diffs = compare::compare_trees(&dir.path().join("src"), mnt.path())?;
//! assert!(diffs.is_empty(), "{}", compare::render(&diffs));
//! # Ok(()) }
//! ```

pub mod cold;
pub mod compare;
pub mod daemon;
pub mod debian;
pub mod fixtures;
pub mod floor;
pub mod frontend;
pub mod guest;
pub mod judge;
pub mod metrics;
pub mod nginx;
pub mod oci;
pub mod pin;
pub mod pipeline;
pub mod prng;
pub mod proxy;
pub mod pyhttp;
pub mod record;
pub mod reference;
pub mod registry;
pub mod replay;
pub mod s3;
pub mod scale;
pub mod tessera;
pub mod testutil;
pub mod tls;
pub mod token_server;
pub mod workloads;
