//! What a flood of distinct keys does to the memory of a process keeping returns: its
//! resident set, read from `/proc/self/status`, before the book is made and after half a
//! million keys asked for places in it. The book's memory is taken at creation
//! (`TicketBook::memory_bytes`); the flood may touch its pages but can add nothing beyond
//! them. A test binary of its own, so that no other test allocates in the process meanwhile.

use std::time::Duration;

use retry_after_policy::{KeptReturnsSettings, KeyHasher, TicketBook, TicketOutcome};
use retry_after_reference_proxy::promise;

/// The process's resident set, bytes (`VmRSS` of `/proc/self/status`).
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("Linux's /proc");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS in kB");
    kib * 1024
}

#[test]
fn half_a_million_keys_grow_the_process_by_no_more_than_the_books_stated_size() {
    let hasher = KeyHasher::new(b"secret");
    let before = resident_bytes();
    let mut book = TicketBook::new(KeptReturnsSettings::default());
    let stated = book.memory_bytes() as u64;
    let mut placed = 0u64;
    // Half a million distinct keys, a thousand a second for 500 s: places expire and are
    // reused, and a bucket full of live places refuses the next key.
    for i in 0..500_000u64 {
        let key = hasher.key(&i.to_be_bytes());
        let now = Duration::from_secs(1_000 + i / 1_000);
        placed += u64::from(promise(&mut book, key, None, now, 0, Some(50.0), (1, 60)).is_some());
    }
    let after = resident_bytes();
    let c = book.counters();
    let grown = after.saturating_sub(before);
    eprintln!(
        "half a million keys: {placed} placed (refused {}, unplaced {}, expired {}); resident {:.1} MiB before, {:.1} MiB after (+{:.2} MiB), the book's stated size {:.2} MiB",
        c.get(TicketOutcome::Refused),
        c.get(TicketOutcome::Unplaced),
        c.get(TicketOutcome::Expired),
        before as f64 / 1048576.0,
        after as f64 / 1048576.0,
        grown as f64 / 1048576.0,
        stated as f64 / 1048576.0,
    );
    assert!(
        placed > 0,
        "the flood was given places while the book had room"
    );
    // The book's pages, and half a MiB for the harness (its output, the allocator's own).
    assert!(
        grown <= stated + (512 << 10),
        "the process grew {grown} bytes; the book states {stated}"
    );
}
