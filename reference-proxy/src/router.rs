//! The router: one proxy's queue and placement, as a state machine without I/O.
//!
//! Events go in, decisions come out, and time is passed in:
//!
//! * [`Router::arrive`]: a request arrives. It joins the queue, or, when the queue holds
//!   `max_queued_requests` already, it is rejected, with the queue depth and backoff streak a
//!   `Retry-After` is computed from.
//! * [`Router::poll`]: place queued requests, head first, by power of two choices over the
//!   [`Fleet`]: two live replicas drawn at random, the one with fewer requests ongoing, if it
//!   has fewer than its `max_ongoing_requests`. When neither has room, placement waits a
//!   backoff of 25 ms doubling to 500 ms ([`Wake::At`]) and the backoff streak (consecutive
//!   failed placements) grows; a placement ends it.
//! * [`Fleet::complete`], [`Fleet::set_up`]: a placed request finished; a replica was lost or
//!   came into service.
//!
//! The fleet is apart from the router so that several proxies can place onto one set of
//! replicas, each with its own queue and streak, as replicas that enforce their own
//! `max_ongoing_requests` make them do. The tokio proxy ([`crate::proxy`]) and the
//! evaluation's simulator run this code; the random draws come from a seeded generator the
//! router owns, so a run is repeatable.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, VecDeque},
    time::{Duration, Instant},
};

use rand::{RngExt, SeedableRng, rngs::StdRng};
use retry_after_policy::{Held, TicketBook};

use crate::kept::{FreshRoom, Returning};

/// First placement backoff after a failed placement.
pub const BACKOFF_START: Duration = Duration::from_millis(25);
/// Longest placement backoff.
pub const BACKOFF_MAX: Duration = Duration::from_millis(500);

/// The placement backoff after `streak` consecutive failed placements (`streak` ≥ 1).
pub fn backoff(streak: u32) -> Duration {
    BACKOFF_START
        .saturating_mul(1 << streak.saturating_sub(1).min(5))
        .min(BACKOFF_MAX)
}

#[derive(Clone, Copy, Debug)]
struct Replica {
    max_ongoing: usize,
    ongoing: usize,
    up: bool,
}

/// The replicas requests are placed on: each one's cap, requests ongoing and whether it is in
/// service.
#[derive(Clone, Debug, Default)]
pub struct Fleet {
    replicas: Vec<Replica>,
}

impl Fleet {
    /// A fleet of replicas in service, each taking at most the given number of requests at
    /// once.
    pub fn new(max_ongoing: impl IntoIterator<Item = usize>) -> Self {
        let mut fleet = Self::default();
        for max in max_ongoing {
            fleet.add(max, true);
        }
        fleet
    }

    /// Add a replica, in service or not yet; returns its index.
    pub fn add(&mut self, max_ongoing: usize, up: bool) -> usize {
        self.replicas.push(Replica {
            max_ongoing: max_ongoing.max(1),
            ongoing: 0,
            up,
        });
        self.replicas.len() - 1
    }

    /// Take `replica` out of placement (lost) or put it in (added).
    pub fn set_up(&mut self, replica: usize, up: bool) {
        if let Some(r) = self.replicas.get_mut(replica) {
            r.up = up;
        }
    }

    /// A request placed on `replica` finished (served or failed).
    pub fn complete(&mut self, replica: usize) {
        if let Some(r) = self.replicas.get_mut(replica) {
            r.ongoing = r.ongoing.saturating_sub(1);
        }
    }

    /// Idle capacity: the sum over replicas in service of their free share of
    /// `max_ongoing_requests` (2.0: two replicas' worth idle).
    pub fn idle_replicas(&self) -> f64 {
        self.replicas
            .iter()
            .filter(|r| r.up)
            .map(|r| (r.max_ongoing - r.ongoing.min(r.max_ongoing)) as f64 / r.max_ongoing as f64)
            .sum()
    }

    /// Power of two choices: the less loaded of two live replicas drawn at random, if it has
    /// room; the request is counted on it.
    fn place(&mut self, rng: &mut StdRng) -> Option<usize> {
        let live: Vec<usize> = (0..self.replicas.len())
            .filter(|&i| self.replicas[i].up)
            .collect();
        let (a, b) = match live.len() {
            0 => return None,
            1 => (live[0], live[0]),
            n => {
                let a = rng.random_range(0..n);
                let b = (a + rng.random_range(1..n)) % n;
                (live[a], live[b])
            }
        };
        let pick = if self.replicas[a].ongoing <= self.replicas[b].ongoing {
            a
        } else {
            b
        };
        let replica = &mut self.replicas[pick];
        (replica.ongoing < replica.max_ongoing).then(|| {
            replica.ongoing += 1;
            pick
        })
    }
}

/// What became of an arriving request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// It joined the queue.
    Queued,
    /// The queue was full: reject it.
    Rejected {
        /// Requests queued when it arrived.
        queue_depth: usize,
        /// Consecutive failed placements then.
        backoff_streak: u32,
    },
}

/// What became of an arriving request when the proxy keeps returns
/// ([`Router::arrive_kept`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeptArrival {
    /// Its place was due: queued, whatever the queue holds.
    Returned,
    /// It joined the queue as a fresh arrival (or early, into free room: its place is taken).
    Queued,
    /// It came back before its place, with no free room: rejected, told the place's second.
    Early {
        /// The second its place is due.
        due: u64,
    },
    /// No room for a fresh arrival: reject it (and give it a place,
    /// [`crate::kept::promise`]).
    Rejected {
        /// Requests queued when it arrived.
        queue_depth: usize,
        /// Consecutive failed placements then.
        backoff_streak: u32,
    },
}

/// When to poll the router next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    /// The queue is empty: after the next arrival.
    OnArrival,
    /// Placement backs off until then; arrivals and completions before it change nothing.
    At(Instant),
}

/// One proxy's queue of `T` (whatever stands for a waiting request) and its placement state.
#[derive(Debug)]
pub struct Router<T> {
    queue: VecDeque<T>,
    max_queued_requests: usize,
    backoff_streak: u32,
    retry_at: Option<Instant>,
    rng: StdRng,
    fresh: FreshRoom,
}

impl<T> Router<T> {
    /// An empty queue bounded by `max_queued_requests`; `seed` fixes the placement draws.
    pub fn new(max_queued_requests: usize, seed: u64) -> Self {
        Self {
            queue: VecDeque::new(),
            max_queued_requests,
            backoff_streak: 0,
            retry_at: None,
            rng: StdRng::seed_from_u64(seed),
            fresh: FreshRoom::default(),
        }
    }

    /// A request arrives: queued, or rejected (and `request` dropped) when the queue is full.
    pub fn arrive(&mut self, request: T) -> Arrival {
        if self.queue.len() >= self.max_queued_requests {
            return Arrival::Rejected {
                queue_depth: self.queue.len(),
                backoff_streak: self.backoff_streak,
            };
        }
        self.queue.push_back(request);
        Arrival::Queued
    }

    /// A request arrives at second `now_s` and the proxy keeps returns in `book`: a place
    /// that is due is taken and the request queued whatever the queue holds; a fresh arrival
    /// is queued only into the room the second's reserved returns leave of `drain_rate` (a
    /// second's worth; no limit while it is unknown) and the queue's bound; a client early
    /// for its place is queued if that room is there (taking its place), else told the
    /// place's second.
    pub fn arrive_kept(
        &mut self,
        request: T,
        returning: Option<Returning>,
        book: &mut TicketBook,
        now_s: u64,
        drain_rate: Option<f64>,
    ) -> KeptArrival {
        let held = returning.map_or(Held::Nothing, |r| book.held(r.key, r.cookie_due, now_s));
        if held == Held::Due {
            if let Some(r) = returning {
                book.take(r.key, r.cookie_due, now_s);
            }
            self.queue.push_back(request);
            return KeptArrival::Returned;
        }
        // Free room goes to a client in line first: a newcomer gets it only when no one is.
        let in_line = matches!(held, Held::Early(_));
        let room = self.queue.len() < self.max_queued_requests
            && (self.queue.is_empty()
                || ((in_line || !book.line_ahead(now_s))
                    && self.fresh.has_room(now_s, book.expected(now_s), drain_rate)));
        match (room, held) {
            (true, _) => {
                if let (Some(r), Held::Early(_)) = (returning, held) {
                    book.take(r.key, r.cookie_due, now_s);
                }
                self.fresh.admitted(now_s);
                self.queue.push_back(request);
                KeptArrival::Queued
            }
            (false, Held::Early(due)) => KeptArrival::Early { due },
            (false, _) => KeptArrival::Rejected {
                queue_depth: self.queue.len(),
                backoff_streak: self.backoff_streak,
            },
        }
    }

    /// Place what can be placed at `now`, head of the queue first, pushing each request with
    /// its replica onto `placed`; says when to poll again.
    pub fn poll(&mut self, now: Instant, fleet: &mut Fleet, placed: &mut Vec<(T, usize)>) -> Wake {
        loop {
            if self.queue.is_empty() {
                return Wake::OnArrival;
            }
            if let Some(at) = self.retry_at {
                if now < at {
                    return Wake::At(at);
                }
                self.retry_at = None;
            }
            let Some(replica) = fleet.place(&mut self.rng) else {
                self.backoff_streak = self.backoff_streak.saturating_add(1);
                let at = now + backoff(self.backoff_streak);
                self.retry_at = Some(at);
                return Wake::At(at);
            };
            self.backoff_streak = 0;
            let request = self.queue.pop_front().expect("the queue is not empty");
            placed.push((request, replica));
        }
    }

    /// Requests waiting in the queue.
    pub fn queue_depth(&self) -> usize {
        self.queue.len()
    }

    /// Consecutive failed placements.
    pub fn backoff_streak(&self) -> u32 {
        self.backoff_streak
    }
}

/// The clients a proxy has told to come back whose time has not come yet (the retry backlog
/// of the `router_queue_drain_rate-retry_backlog` variant), earliest first.
#[derive(Clone, Debug, Default)]
pub struct RetryBacklog {
    due: BinaryHeap<Reverse<Instant>>,
}

impl RetryBacklog {
    /// Clients still away at `now` (those due by then are forgotten).
    pub fn outstanding(&mut self, now: Instant) -> usize {
        while self.due.peek().is_some_and(|d| d.0 <= now) {
            self.due.pop();
        }
        self.due.len()
    }

    /// A client was told to come back at `at`.
    pub fn promise(&mut self, at: Instant) {
        self.due.push(Reverse(at));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_full_queue_rejects_with_its_depth_and_streak() {
        let mut router = Router::new(2, 1);
        assert_eq!(router.arrive(1), Arrival::Queued);
        assert_eq!(router.arrive(2), Arrival::Queued);
        assert_eq!(
            router.arrive(3),
            Arrival::Rejected {
                queue_depth: 2,
                backoff_streak: 0
            }
        );
    }

    #[test]
    fn placement_fills_the_fleet_then_backs_off_doubling_until_room_comes() {
        let t0 = Instant::now();
        let mut fleet = Fleet::new([1, 1]);
        let mut router = Router::new(10, 7);
        for i in 0..4 {
            router.arrive(i);
        }
        let mut placed = Vec::new();
        let wake = router.poll(t0, &mut fleet, &mut placed);
        // Both replicas take one each; placement of the third can only fail.
        assert_eq!(placed.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(wake, Wake::At(t0 + ms(25)));
        assert_eq!((router.queue_depth(), router.backoff_streak()), (2, 1));
        // A completion before the backoff ends changes nothing until then.
        fleet.complete(placed[0].1);
        placed.clear();
        assert_eq!(
            router.poll(t0 + ms(10), &mut fleet, &mut placed),
            Wake::At(t0 + ms(25))
        );
        assert!(placed.is_empty());
        // At the deadline the freed replica is found by one of the two draws, or the streak
        // grows and the backoff doubles.
        let mut now = t0 + ms(25);
        loop {
            match router.poll(now, &mut fleet, &mut placed) {
                Wake::At(at) if placed.is_empty() => {
                    assert_eq!(at - now, backoff(router.backoff_streak()));
                    now = at;
                }
                _ => break,
            }
        }
        assert_eq!(placed.len(), 1);
        assert_eq!(router.queue_depth(), 1);
    }

    #[test]
    fn backoff_doubles_from_25_ms_to_half_a_second() {
        let got: Vec<u64> = (1..=7).map(|s| backoff(s).as_millis() as u64).collect();
        assert_eq!(got, vec![25, 50, 100, 200, 400, 500, 500]);
    }

    #[test]
    fn a_lost_replica_takes_no_placement_and_an_added_one_does() {
        let t0 = Instant::now();
        let mut fleet = Fleet::new([4]);
        let added = fleet.add(4, false);
        fleet.set_up(0, false);
        let mut router = Router::new(10, 3);
        router.arrive(());
        let mut placed = Vec::new();
        assert!(matches!(
            router.poll(t0, &mut fleet, &mut placed),
            Wake::At(_)
        ));
        fleet.set_up(added, true);
        router.poll(t0 + ms(25), &mut fleet, &mut placed);
        assert_eq!(placed, vec![((), added)]);
        assert_eq!(fleet.idle_replicas(), 0.75);
    }

    #[test]
    fn the_retry_backlog_forgets_clients_once_due() {
        let t0 = Instant::now();
        let mut backlog = RetryBacklog::default();
        backlog.promise(t0 + ms(1000));
        backlog.promise(t0 + ms(3000));
        assert_eq!(backlog.outstanding(t0), 2);
        assert_eq!(backlog.outstanding(t0 + ms(1000)), 1);
        assert_eq!(backlog.outstanding(t0 + ms(5000)), 0);
    }
}
