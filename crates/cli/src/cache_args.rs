//! The host disk cache options shared by every command that reads a remote store
//! (`export`, `inspect`, `serve`, `warm`): flatten [`CacheArgs`] into the command's arguments.

use std::path::PathBuf;

use clap::Args;
use tessera_store::CacheConfig;

/// `--cache-dir DIR [--cache-size SIZE]`.
#[derive(Debug, Clone, Default, Args)]
pub struct CacheArgs {
    /// Host disk cache for a remote store: content-addressed, verified on every read, shared by
    /// every image and every tessera process on the host (data missing from it is fetched from
    /// the origin once per host). Ignored for a local store. Layout: docs/formats/cache.md.
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Keep the cache within SIZE bytes (e.g. 512M, 20G, 1TiB): least recently used chunks are
    /// evicted first, image metadata last. Default: unbounded (`tessera cache gc` trims later).
    #[arg(long, value_name = "SIZE", value_parser = crate::parse_size_arg, requires = "cache_dir")]
    pub cache_size: Option<u64>,
}

impl CacheArgs {
    /// The cache to open, if `--cache-dir` was given.
    pub fn config(&self) -> Option<CacheConfig> {
        self.cache_dir.as_ref().map(|dir| CacheConfig::new(dir).with_max_bytes(self.cache_size))
    }
}
