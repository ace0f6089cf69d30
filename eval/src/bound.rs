//! The clairvoyant bound: the best any `Retry-After` assignment could do for a scenario,
//! knowing the future.
//!
//! The bound places the scenario's own clients (the same arrivals as every run) into the
//! fleet's capacity in arrival order, as a fluid: while anyone waits, requests start at the
//! rate the replicas in service complete them (Σ `max_ongoing_requests` ÷ mean service time;
//! a lost replica's share goes at its loss, an added one's comes at its addition), and a
//! client who finds nobody ahead starts at once. Each client then takes a service time drawn
//! from the distribution of a replica in service, weighted by its share of the capacity.
//!
//! A client who arrives while its proxy's queue is full (counting only the clients the bound
//! queued, who wait there until their start) is rejected once and told to come back at
//! exactly its start, where it is admitted. So the bound has every retry admitted, at most one
//! retry per client, no capacity idle while anyone waits (starts never pause while there is a
//! backlog), and the shortest waits a first-come-first-served order allows: for the p99 of the
//! wait, no order does better with equal work per request. It is a bound for the fluid model
//! of the fleet, not a promise for each draw: with few replicas a real run's luck in service
//! times can beat it by a little.
//!
//! Every client is assumed to obey its answer: the bound is about the answers, and a client
//! that ignores them is not the answer's to place.

use std::{cmp::Reverse, collections::BinaryHeap, time::Duration};

use rand::{RngExt, SeedableRng, rngs::StdRng};

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
    let fleet = Capacity::new(scenario);
    let mut rng = StdRng::seed_from_u64(seed ^ 0xb00d);
    let queue_bound = scenario.max_queued_requests * scenario.proxies;
    let mut queued: BinaryHeap<Reverse<Duration>> = BinaryHeap::new();
    let mut next_start = Duration::ZERO;
    let mut f = Figures::default();
    let mut times = Vec::new();
    let mut served_in_window = 0;
    for &arrival in &arrivals {
        let Some(start) = fleet.next_start(arrival.max(next_start)) else {
            f.unfinished += usize::from(arrival >= warm_up);
            continue;
        };
        next_start = start + Duration::from_secs_f64(1.0 / fleet.rate_at(start));
        let success = start + fleet.draw_service(start, &mut rng);
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
        if arrival < warm_up {
            continue;
        }
        f.clients += 1;
        if success > end {
            f.unfinished += 1;
            continue;
        }
        let retries = usize::from(rejected);
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
    f.mean_s = mean(&times);
    f.goodput = served_in_window as f64 / scenario.measured().as_secs_f64();
    f
}

/// The fleet's capacity over time, from the scenario's replicas and events.
struct Capacity<'a> {
    scenario: &'a Scenario,
    /// (from, replicas in service from then on), in time order.
    steps: Vec<(Duration, Vec<bool>)>,
}

impl<'a> Capacity<'a> {
    fn new(scenario: &'a Scenario) -> Self {
        let mut up: Vec<bool> = scenario.replicas.iter().map(|r| r.present).collect();
        let mut steps = vec![(Duration::ZERO, up.clone())];
        for event in &scenario.events {
            match event.kind {
                EventKind::LoseReplica(r) => up[r] = false,
                EventKind::AddReplica(r) => up[r] = true,
            }
            steps.push((event.at, up.clone()));
        }
        Self { scenario, steps }
    }

    fn up_at(&self, t: Duration) -> &[bool] {
        let i = self.steps.partition_point(|s| s.0 <= t);
        &self.steps[i.saturating_sub(1)].1
    }

    /// Requests per second the replicas in service at `t` start while busy.
    fn rate_at(&self, t: Duration) -> f64 {
        self.scenario
            .replicas
            .iter()
            .zip(self.up_at(t))
            .filter(|(_, up)| **up)
            .map(|(r, _)| r.capacity())
            .sum()
    }

    /// The first moment from `t` with capacity, if any.
    fn next_start(&self, t: Duration) -> Option<Duration> {
        if self.rate_at(t) > 0.0 {
            return Some(t);
        }
        self.steps
            .iter()
            .map(|s| s.0)
            .find(|&from| from > t && self.rate_at(from) > 0.0)
    }

    /// A service time from a replica in service at `t`, drawn by capacity share.
    fn draw_service(&self, t: Duration, rng: &mut StdRng) -> Duration {
        let rate = self.rate_at(t);
        let mut u = rng.random::<f64>() * rate;
        let up = self.up_at(t);
        let mut last = None;
        for (r, _) in self.scenario.replicas.iter().zip(up).filter(|(_, up)| **up) {
            last = Some(r);
            u -= r.capacity();
            if u < 0.0 {
                break;
            }
        }
        let r = last.expect("a replica in service");
        r.spec.service_time.draw(rng).mul_f64(r.spec.slowdown)
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
    }
}
