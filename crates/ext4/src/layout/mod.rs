//! Device layout: group geometry, backup superblock positions and the sequential block allocator.

pub mod alloc;
pub mod geometry;
