//! glibc malloc tunables, set by a command before it starts any thread. An operator's
//! environment (`MALLOC_ARENA_MAX`, `MALLOC_MMAP_THRESHOLD_`, read by glibc at start) wins.

/// Malloc arenas a daemon uses unless `MALLOC_ARENA_MAX` says otherwise.
const MALLOC_ARENAS: i32 = 2;

/// Allocations from this size up get their own mapping in `tessera build` (see
/// [`map_large_allocations`]).
const MMAP_THRESHOLD: i32 = 4 << 20;

/// Cap glibc's malloc arenas at [`MALLOC_ARENAS`] before any thread starts (`tessera serve`). By
/// default glibc gives threads up to 8 arenas per CPU, and the fetch threads (64 for a remote
/// store) each leave freed run buffers resident in theirs: a daemon with a 64 MiB memory tier
/// held 117 MiB privately under random reads, 88 MiB with two arenas (`tests/tests/soak.rs`;
/// docs/daemon.md). The read path copies chunks from the memory tier and allocates little, so
/// contention on the two is low.
pub fn limit_arenas() {
    tune("MALLOC_ARENA_MAX", libc::M_ARENA_MAX, MALLOC_ARENAS);
}

/// Give every allocation of [`MMAP_THRESHOLD`] or more its own mapping (`tessera build`). A
/// build's large tables (the walked tree, the chunk map, ext4's per-inode arrays: tens to
/// hundreds of MiB at a million entries) live in phases; glibc's default threshold rises to the
/// size of the largest mapping freed (up to 32 MiB), after which such tables come from the heap,
/// whose freed middle stays resident while later phases allocate above it. A fixed threshold
/// returns each table to the system when it is freed and grows it with `mremap` instead of a
/// copy: peak RSS at 1 M entries 910 → 847 MiB (docs/benchmarks.md, "Scaling"). Chunk buffers
/// (the chunk size, 512 KiB by default) stay below it and keep being reused from the heap.
pub fn map_large_allocations() {
    tune("MALLOC_MMAP_THRESHOLD_", libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
}

/// Return the free memory of every malloc arena to the system (`tessera build`, between its
/// phases: [`tessera_builder::BuildConfig::release_memory`]). glibc gives back only the top of a
/// heap on its own; what chunking freed below live data (the chunk map, the source paths, the
/// worker threads' buffers in their arenas) stayed resident through ext4 synthesis, the build's
/// peak: 605–615 → 585 MiB at a million entries (docs/benchmarks.md, "Scaling").
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of the allocator's own arenas to the kernel
    // (madvise); it is thread-safe, takes each arena's lock, and touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// `mallopt(param, value)` unless the environment variable `env` (glibc's own name for the
/// tunable) is set.
fn tune(env: &str, param: libc::c_int, value: libc::c_int) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os(env).is_none() {
        // SAFETY: mallopt changes a glibc tunable; every caller runs before this process starts
        // any thread of its own, and the tunables here affect only allocations (and arenas) made
        // from now on.
        let ok = unsafe { libc::mallopt(param, value) };
        if ok == 0 {
            tracing::debug!(env, value, "mallopt refused; keeping glibc's default");
        }
    }
}
