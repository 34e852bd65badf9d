//! How much a bundle may unpack to, and how long and deep its entry paths
//! may be: a gzip bomb or an endless path is refused before it fills anything.

/// How many bytes of tar stream a bundle may unpack to per byte of its own:
/// driver files compress a few times over, deflate up to about a thousand
/// (a gzip bomb), which is refused before it fills the disk or memory.
pub const MAX_EXPANSION: u64 = 32;
/// Unpacked bytes every bundle may have whatever its size (tar's headers
/// and padding for a small one).
const UNPACKED_FLOOR: u64 = 1 << 20;
/// The longest entry path a bundle may have, in bytes and in components
/// (a driver's are a few components of tens of bytes). The unpack walks
/// paths by descriptor, where no `PATH_MAX` would stop a deeper one, and
/// an unpacked driver must stay readable by its path.
pub const MAX_ENTRY_PATH: usize = 1024;
pub const MAX_ENTRY_DEPTH: usize = 64;

/// The most bytes of tar stream a bundle of `compressed` bytes may unpack
/// to (headers included, so every file written is smaller). The tar reader
/// keeps long names and extended headers in memory, so this bounds memory
/// as well as disk.
pub fn max_unpacked(compressed: u64) -> u64 {
    compressed
        .saturating_mul(MAX_EXPANSION)
        .saturating_add(UNPACKED_FLOOR)
}
