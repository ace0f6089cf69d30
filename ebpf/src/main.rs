//! The eBPF programs of retry-after-agent.
//!
//! Four programs count: three attach to the root of the cgroup v2 hierarchy (or to the
//! cgroups of `agent.attach_cgroups`), so they see every TCP socket there without touching any
//! application; the fourth is a tracepoint:
//!
//! * `ra_sockops` (sock_ops): a connection to or from a watched endpoint is established →
//!   count it, start tracking it in its socket's own storage, and ask for state callbacks; it
//!   reaches TCP_CLOSE → close its open turn, count the close, forget it.
//! * `ra_destroy` (tp_btf `tcp_destroy_sock`): the close of a connection that was adopted
//!   after it opened, which asked for no state callbacks.
//! * `ra_ingress` / `ra_egress` (cgroup_skb): every TCP segment a tracked socket receives or
//!   sends → feed the turn state machine of `retry_after_common::turn`, through the TLS record
//!   framing of `retry_after_common::tls` on an encrypted connection; on an HTTP/2
//!   connection, walk its frames and count its streams instead (`retry_after_common::h2`).
//!   Segments are seen as they arrive, before the application reads them, so a request
//!   waiting unread in a socket buffer is already counted.
//!
//! * `ra_ingress_parked` (cgroup_skb, never attached): reached by a tail call from
//!   `ra_ingress`, it walks the HTTP/2 segments that arrived ahead of a gap and were parked
//!   (`parking.rs`), once the gap has filled.
//!
//! On a kernel without `bpf_loop` (before 5.17) the agent loads `ra_ingress_step` and
//! `ra_egress_step` instead, which take a segment's HTTP/2 frame steps in a loop of fixed
//! bound and walk on in `ra_ingress_more` / `ra_egress_more` (and the parked segments in
//! `ra_parked_step`), reached by tail calls (`steps.rs`). Each of the four counting programs
//! also has a `_noh2` twin without HTTP/2 streams (an HTTP/2 connection is left out), for a
//! kernel that refuses both. Two more, `ra_floor_in` / `ra_floor_out` (cgroup_skb), let every segment
//! pass at once: the data path's floor, which the bench measures; the agent never attaches
//! them. The feature probes (`features.rs`) are loaded at start and never attached.
//!
//! The programs only observe: every path returns "allow", whatever happens.

#![no_std]
#![no_main]
// Atomic adds (see counters.rs); the eBPF build enables unstable features for this crate.
#![allow(internal_features)]
#![feature(core_intrinsics)]
#![feature(asm_experimental_arch)]

mod addresses;
mod adoption;
mod counters;
mod exchange;
mod features;
mod first_flight;
mod h2_walk;
mod http1;
mod lifecycle;
mod maps;
mod packet;
mod parking;
mod segments;
mod steps;
mod streams;
mod walk_lock;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
