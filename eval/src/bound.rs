//! The clairvoyant bound: what no `Retry-After` assignment can beat for a scenario, knowing the
//! future.
//!
//! The bound serves the scenario's own clients (the same arrivals as every run) first come,
//! first served, on the fleet's request places: each replica in service takes
//! `max_ongoing_requests` requests at once, each for a service time drawn from that replica's
//! distribution. A client takes the place that frees first (at its arrival if one is free);
//! places come at a replica's addition and go at its loss (work started on it before is
//! counted as served: the bound errs on the side of the clients). Nothing waits while a place
//! is free.
//!
//! A client who arrives while the proxies' queues are full (counting only the clients the
//! bound queued, who wait there until their start; the queues of all proxies together) is
//! rejected once and told to come back at exactly its start, where it is admitted.
//!
//! Why it is a bound: every retry is admitted (at most one retry a client); no capacity is
//! idle while anyone waits (0 idle replica-seconds); and no client starts later than a
//! first-come-first-served order on every place the fleet has would start it, while a
//! `Retry-After` can only delay a client. Its waits are the ones of a work-conserving order,
//! so its mean wait is the least any order gets with equal work per request; its p99 is the
//! first-come-first-served one, which an order that sends a few clients to the very back could
//! lower a little, so read the p99 ratio as against that reference. It assumes every client
//! obeys and waits as long as it is told: the bound is about the answers.

use std::{cmp::Reverse, collections::BinaryHeap, time::Duration};

use rand::{SeedableRng, rngs::StdRng};

use crate::{
    figures::{Figures, mean, percentile},
    run::{DRAIN_LIMIT, clients},
    scenario::{EventKind, Scenario},
};

/// The bound's figures for `scenario` with `seed`'s arrivals.
pub fn bound(scenario: &Scenario, seed: u64) -> Figures {
    let arrivals: Vec<Duration> = clients(scenario, seed).into_iter().map(|c| c.0).collect();
    let warm_up = scenario.warm_up();
    let window = warm_up..scenario.length();
    let end = scenario.length() + DRAIN_LIMIT;
    let mut places = Places::new(scenario);
    let mut rng = StdRng::seed_from_u64(seed ^ 0xb00d);
    let queue_bound = scenario.max_queued_requests * scenario.proxies;
    let mut queued: BinaryHeap<Reverse<Duration>> = BinaryHeap::new();
    let mut f = Figures::default();
    let mut times = Vec::new();
    let mut served_in_window = 0;
    for &arrival in &arrivals {
        let measured = arrival >= warm_up;
        f.clients += usize::from(measured);
        let Some((start, replica)) = places.take(arrival) else {
            f.unfinished += usize::from(measured);
            continue;
        };
        let spec = scenario.replicas[replica].spec;
        let success = start + spec.service_time.draw(&mut rng).mul_f64(spec.slowdown);
        places.give_back(replica, success);
        while queued.peek().is_some_and(|s| s.0 <= arrival) {
            queued.pop();
        }
        let rejected = start > arrival && queued.len() >= queue_bound;
        if start > arrival && !rejected {
            queued.push(Reverse(start));
        }
        if window.contains(&success) {
            served_in_window += 1;
        }
        if !measured {
            continue;
        }
        if success > end {
            f.unfinished += 1;
            continue;
        }
        let retries = usize::from(rejected);
        let wait = start.saturating_sub(arrival);
        f.beyond_clamp += usize::from(
            rejected && wait > Duration::from_secs(retry_after_policy::MAX_RETRY_AFTER_S),
        );
        f.sent += 1 + retries;
        f.served += 1;
        f.rejected += retries;
        f.retries += retries;
        f.retries_admitted += retries;
        f.retries_at_suggested += retries;
        f.retries_at_suggested_admitted += retries;
        f.succeeded += 1;
        times.push((success - arrival).as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    f.p50_s = percentile(&times, 0.5);
    f.p99_s = percentile(&times, 0.99);
    f.mean_s = mean(times.iter().copied());
    f.goodput = served_in_window as f64 / scenario.measured().as_secs_f64();
    f
}

/// The fleet's request places: when each frees, per replica, within the replica's time in
/// service.
struct Places {
    /// (free from, replica), earliest first.
    free: BinaryHeap<Reverse<(Duration, usize)>>,
    /// When each replica is in service: from its start or addition to its loss.
    service: Vec<(Duration, Duration)>,
}

impl Places {
    fn new(scenario: &Scenario) -> Self {
        let mut service: Vec<(Duration, Duration)> = scenario
            .replicas
            .iter()
            .map(|r| {
                let from = if r.present {
                    Duration::ZERO
                } else {
                    Duration::MAX
                };
                (from, Duration::MAX)
            })
            .collect();
        for event in &scenario.events {
            match event.kind {
                EventKind::AddReplica(r) => service[r].0 = event.at,
                EventKind::LoseReplica(r) => service[r].1 = event.at,
                // The bound keeps every proxy's queue room throughout.
                EventKind::ProxyLeaves(_) | EventKind::ProxyJoins(_) => {}
            }
        }
        let mut free = BinaryHeap::new();
        for (r, replica) in scenario.replicas.iter().enumerate() {
            if service[r].0 < service[r].1 {
                for _ in 0..replica.max_ongoing_requests {
                    free.push(Reverse((service[r].0, r)));
                }
            }
        }
        Self { free, service }
    }

    /// The first place free for a client arriving at `arrival`: its start and replica.
    /// Places of replicas lost by then are gone.
    fn take(&mut self, arrival: Duration) -> Option<(Duration, usize)> {
        while let Some(Reverse((from, replica))) = self.free.pop() {
            let start = from.max(arrival);
            if start < self.service[replica].1 {
                return Some((start, replica));
            }
        }
        None
    }

    /// The place on `replica` is free again at `at`.
    fn give_back(&mut self, replica: usize, at: Duration) {
        if at < self.service[replica].1 {
            self.free.push(Reverse((at, replica)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(rate: f64) -> Scenario {
        Scenario::parse(&format!(
            "name = \"t\"\ntitle = \"t\"\nmax_ongoing_requests = 4\nmax_queued_requests = 32\nreplicas = [{{ count = 4, service_time = {{ distribution = \"fixed\", ms = 100 }} }}]\nphases = [{{ seconds = 20, rate = {rate} }}]\n"
        ))
        .unwrap()
    }

    #[test]
    fn under_capacity_nobody_waits_beyond_the_service_time() {
        let f = bound(&scenario(0.5), 1);
        assert!(f.clients > 1000);
        assert_eq!((f.rejected, f.unfinished), (0, 0));
        assert!((f.p99_s.unwrap() - 0.1).abs() < 0.05, "{f:?}");
    }

    #[test]
    fn in_overload_every_retry_is_admitted_and_the_backlog_grows_at_the_excess() {
        let f = bound(&scenario(1.5), 1);
        assert_eq!(f.retries, f.retries_admitted);
        assert_eq!(f.retries_at_suggested, f.retries_at_suggested_admitted);
        assert!(f.retries > 0 && f.retries <= f.clients);
        // 20 s at 1.5×: the backlog grows by 80 a second, so a client arriving at t waits
        // t / 2 and the last about 10 s; the p99 is close to that.
        let p99 = f.p99_s.unwrap();
        assert!((9.0..11.0).contains(&p99), "{p99}");
        // Served at capacity over the measured part.
        assert!((f.goodput - 160.0).abs() < 8.0, "{}", f.goodput);
        assert_eq!(f.succeeded + f.unfinished, f.clients);
    }
}
