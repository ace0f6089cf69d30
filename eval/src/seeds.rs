//! How one run's seed becomes the seeds of its parts, the same in the real-socket run and the
//! simulator, so both meet the same clients, service times and draws.

/// Seed of client `client`'s own draws (its jitter, its choice of proxy).
pub fn client(seed: u64, client: usize) -> u64 {
    seed ^ (client as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Seed of replica `replica`'s service times.
pub fn replica(seed: u64, replica: usize) -> u64 {
    seed.wrapping_add(1 + replica as u64)
}

/// Seed of proxy `proxy` (the first proxy's is the run's own).
pub fn proxy(seed: u64, proxy: usize) -> u64 {
    seed.wrapping_add(proxy as u64 * 7919)
}
