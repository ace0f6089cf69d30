//! The discrete-event simulator: a scenario under a policy on a simulated clock, seeded, with
//! the product's own code for everything but the sockets and the kernel.
//!
//! What runs is the code the real run runs: the reference proxy's [`Router`] and
//! [`RetryBacklog`], the agent's [`ServiceEstimator`] (drain-rate EWMA, judge, ladder, built
//! from the same configuration text through the agent's own parser), the client library's
//! [`OwnReturns::decide`] on the estimator's push, and the clients' [`Behaviour`]. What is
//! simulated is what the kernel and the sockets would do: each agent sees its proxy's requests
//! in flight and completed per replica (the client-side counts its probe reads) at every tick,
//! and a request takes its drawn service time and nothing else (no network time).
//!
//! The counts are the ones the probe would read, limits included: a streamed response (a
//! replica with `chunks` > 1) is counted complete at its first pause, as
//! docs/kernel-observation.md says the kernel counts it. The replica servers send a streamed
//! response's headers at once and its first chunk one interval later, so that pause comes
//! right after the headers, while the replica stays busy with the response to its end.
//!
//! Several proxies share one [`Fleet`]: the replicas hold their own `max_ongoing_requests`
//! and a proxy's placement sees their true load (a fresh probe per placement). Each proxy has
//! an agent of its own, as proxies on separate nodes have, and each attempt of a client goes
//! to a proxy the scenario's front picks among those in service: one drawn at random, or the
//! one the client's key hashes to.

use std::{
    cmp::Reverse,
    collections::BinaryHeap,
    time::{Duration, Instant},
};

use rand::{RngExt, SeedableRng, rngs::StdRng};
use retry_after_client::OwnReturns;
use retry_after_estimator::{
    config::Config,
    {BackendLoad, ServiceEstimator, ServiceLoad, ServiceSettings, SideLoad},
};
use retry_after_policy::{
    Hint, KeptReturnsSettings, KeyHasher, ReturnCookie, Rung, TicketBook, TicketKey,
};
use retry_after_protocol::{EstimatePush, HandedOut, Report};
use retry_after_reference_proxy::{
    Arrival, Fleet, HeaderPolicy, KeptArrival, Placement, RetryBacklog, Returning, Router, Wake,
    give_place, proxy::jitter_seed, told,
};

use crate::{
    load::{Attempt, Behaviour, Outcome},
    policy::{Deadlines, KeptBy, Policy, SERVICE},
    record::{JudgeFigures, RunResult},
    run::{DRAIN_LIMIT, clients},
    scenario::{EventKind, Front, Scenario},
    seeds,
};

/// When the probe counts a streamed response complete, from its start: the replica sends the
/// headers at once and the first chunk after a pause, and the turn ends at the first pause
/// once the client has acknowledged the headers (a loopback round trip and a delayed ACK).
const STREAM_SEEN_COMPLETE: Duration = Duration::from_millis(1);

/// Simulate `scenario` under `policy` with `seed`: the same arrivals, behaviours and seeds as
/// the real-socket run ([`crate::run::run`]), and the same record.
pub fn simulate(scenario: &Scenario, policy: Policy, seed: u64) -> RunResult {
    let mut sim = Sim::new(scenario, policy, seed);
    sim.run();
    sim.finish()
}

/// Something due at a moment of simulated time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// Client `0` arrives and sends its first attempt.
    Arrive(usize),
    /// Client `0` sends its next attempt.
    Retry(usize),
    /// The attempt `attempt` placed on `replica` (in its life `epoch`) is served.
    Served {
        replica: usize,
        epoch: u32,
        attempt: usize,
    },
    /// The probe counts the streamed response of `attempt` on `replica` complete (its first
    /// pause), before the replica has finished it.
    SeenComplete {
        replica: usize,
        epoch: u32,
        attempt: usize,
    },
    /// Proxy `0`'s placement backoff ends.
    Wake(usize),
    /// Every agent reads its counters and pushes its estimate.
    Tick,
    /// Every proxy reports to its agent.
    Report,
    /// The scenario's event `0`.
    Fleet(usize),
}

struct Client {
    arrival: Duration,
    behaviour: Behaviour,
    rng: StdRng,
    attempts: u32,
    after_suggested_s: Option<u64>,
    /// The return cookie it was last given, kept as a browser or an SDK's cookie jar would.
    cookie: Option<String>,
    /// The second of the place its key was last given, as the proxies' shared table holds it.
    shared_due: Option<u64>,
}

/// Admissions and rejections since a proxy's last report.
#[derive(Default)]
struct Counts {
    since: Duration,
    admitted: u64,
    rejected: u64,
    retry_admitted: u64,
    retry_rejected: u64,
    /// (rung, seconds) → rejections that carried it.
    handed_out: std::collections::BTreeMap<(Rung, u64), u64>,
}

impl Counts {
    /// `handed_out=` as the client library's reporter writes it.
    fn handed_out(&self) -> Option<String> {
        let entries: Vec<String> = self
            .handed_out
            .iter()
            .map(|(&(rung, seconds), &count)| {
                let mut entry = String::new();
                let _ = HandedOut {
                    rung,
                    seconds,
                    count,
                }
                .write(&mut entry);
                entry
            })
            .collect();
        // Every rejection says what it carried, as the reference proxy's reporter does.
        Some(if entries.is_empty() {
            "none".to_owned()
        } else {
            entries.join(",")
        })
    }
}

struct SimProxy {
    router: Router<usize>,
    backlog: RetryBacklog,
    jitter: StdRng,
    agent: ServiceEstimator,
    push: Option<EstimatePush>,
    pushes: u64,
    /// When the push arrived.
    pushed_at: Duration,
    /// The returns this proxy promised, as the client library keeps them.
    own: OwnReturns,
    /// The places this proxy keeps (kept returns).
    book: TicketBook,
    /// This proxy's requests in flight and completed, per replica (its agent's client side).
    in_flight: Vec<u64>,
    completed: Vec<u64>,
    wake: Option<Duration>,
    counts: Counts,
    reported: (u64, u64),
}

struct Sim<'a> {
    scenario: &'a Scenario,
    policy: Policy,
    base: Instant,
    now: Duration,
    events: BinaryHeap<Reverse<(Duration, u64, Event)>>,
    sequence: u64,
    fleet: Fleet,
    replica_rngs: Vec<StdRng>,
    epochs: Vec<u32>,
    on_replica: Vec<Vec<usize>>,
    proxies: Vec<SimProxy>,
    /// Which proxies the front sends attempts to (they leave and join by events).
    proxy_up: Vec<bool>,
    clients: Vec<Client>,
    warm_up_clients: usize,
    attempts: Vec<Attempt>,
    attempt_proxy: Vec<usize>,
    answered: Vec<bool>,
    /// Whether the probe has counted each attempt's response complete.
    seen: Vec<bool>,
    waiting: usize,
    done: usize,
    idle: f64,
    /// The part of `idle` while some proxy had requests queued.
    idle_queued: f64,
    placed: Vec<(usize, usize)>,
    /// The proxies' shared secret: clients' keys and return cookies.
    hasher: KeyHasher,
}

impl<'a> Sim<'a> {
    fn new(scenario: &'a Scenario, policy: Policy, seed: u64) -> Self {
        let settings = agent_settings(scenario, policy);
        let replicas = scenario.replicas.len();
        let mut fleet = Fleet::default();
        for r in &scenario.replicas {
            fleet.add(r.max_ongoing_requests, r.present);
        }
        let proxies: Vec<SimProxy> = (0..scenario.proxies)
            .map(|p| {
                let seed = seeds::proxy(seed, p);
                SimProxy {
                    router: Router::new(scenario.max_queued_requests, seed),
                    backlog: RetryBacklog::default(),
                    jitter: StdRng::seed_from_u64(jitter_seed(seed)),
                    agent: ServiceEstimator::new(settings.clone()),
                    push: None,
                    pushes: 0,
                    pushed_at: Duration::ZERO,
                    own: OwnReturns::default(),
                    book: TicketBook::new(kept_settings(policy)),
                    in_flight: vec![0; replicas],
                    completed: vec![0; replicas],
                    wake: None,
                    counts: Counts::default(),
                    reported: (0, 0),
                }
            })
            .collect();
        let clients: Vec<Client> = clients(scenario, seed)
            .into_iter()
            .enumerate()
            .map(|(client, (arrival, behaviour))| Client {
                arrival,
                behaviour,
                rng: StdRng::seed_from_u64(seeds::client(seed, client)),
                attempts: 0,
                after_suggested_s: None,
                cookie: None,
                shared_due: None,
            })
            .collect();
        let warm_up = scenario.warm_up();
        let mut sim = Self {
            scenario,
            policy,
            base: Instant::now(),
            now: Duration::ZERO,
            events: BinaryHeap::new(),
            sequence: 0,
            fleet,
            replica_rngs: (0..replicas)
                .map(|i| StdRng::seed_from_u64(seeds::replica(seed, i)))
                .collect(),
            epochs: vec![0; replicas],
            on_replica: vec![Vec::new(); replicas],
            proxy_up: vec![true; proxies.len()],
            proxies,
            warm_up_clients: clients.iter().take_while(|c| c.arrival < warm_up).count(),
            clients,
            attempts: Vec::new(),
            attempt_proxy: Vec::new(),
            answered: Vec::new(),
            seen: Vec::new(),
            waiting: 0,
            done: 0,
            idle: 0.0,
            idle_queued: 0.0,
            placed: Vec::new(),
            hasher: KeyHasher::new(&seed.to_be_bytes()),
        };
        if let Some(first) = sim.clients.first() {
            sim.at(first.arrival, Event::Arrive(0));
        }
        sim.at(Duration::ZERO, Event::Tick);
        sim.at(Duration::ZERO, Event::Report);
        for (i, e) in scenario.events.iter().enumerate() {
            sim.at(e.at, Event::Fleet(i));
        }
        sim
    }

    fn at(&mut self, when: Duration, event: Event) {
        self.sequence += 1;
        self.events.push(Reverse((when, self.sequence, event)));
    }

    fn instant(&self) -> Instant {
        self.base + self.now
    }

    fn run(&mut self) {
        let length = self.scenario.length();
        let warm_up = self.scenario.warm_up();
        while let Some(Reverse((when, _, event))) = self.events.pop() {
            if when > length + DRAIN_LIMIT || self.now >= length && self.done == self.clients.len()
            {
                break;
            }
            if self.waiting > 0 && when > warm_up {
                let from = self.now.max(warm_up);
                let idle = (when - from).as_secs_f64() * self.fleet.idle_replicas();
                self.idle += idle;
                if self.proxies.iter().any(|p| p.router.queue_depth() > 0) {
                    self.idle_queued += idle;
                }
            }
            self.now = when;
            match event {
                Event::Arrive(c) => {
                    if let Some(next) = self.clients.get(c + 1) {
                        self.at(next.arrival, Event::Arrive(c + 1));
                    }
                    self.send(c);
                }
                Event::Retry(c) => {
                    self.waiting -= 1;
                    self.send(c);
                }
                Event::Served {
                    replica,
                    epoch,
                    attempt,
                } => self.served(replica, epoch, attempt),
                Event::SeenComplete {
                    replica,
                    epoch,
                    attempt,
                } => {
                    if epoch == self.epochs[replica] {
                        self.seen_complete(replica, attempt);
                    }
                }
                Event::Wake(p) => {
                    if self.proxies[p].wake == Some(when) {
                        self.proxies[p].wake = None;
                        self.poll(p);
                    }
                }
                Event::Tick => {
                    self.tick();
                    self.at(when + self.scenario.agent_tick, Event::Tick);
                }
                Event::Report => {
                    self.report();
                    self.at(when + self.scenario.report_every, Event::Report);
                }
                Event::Fleet(i) => self.fleet_event(i),
            }
        }
    }

    /// Client `c` sends its next attempt, to the proxy the front picks.
    fn send(&mut self, c: usize) {
        let p = self.front_pick(c);
        let client = &mut self.clients[c];
        client.attempts += 1;
        let number = client.attempts;
        let index = self.attempts.len();
        self.attempts.push(Attempt {
            client: c,
            number,
            sent: self.now,
            answered: self.now,
            outcome: Outcome::Failed,
            after_suggested_s: client.after_suggested_s,
            gave_up_after: false,
        });
        self.attempt_proxy.push(p);
        self.answered.push(false);
        self.seen.push(false);
        let retry = number > 1;
        if let Some(by) = self.policy.kept() {
            return self.send_kept(c, index, p, retry, by);
        }
        let proxy = &mut self.proxies[p];
        match proxy.router.arrive(index) {
            Arrival::Queued => {
                proxy.counts.admitted += 1;
                proxy.counts.retry_admitted += u64::from(retry);
                self.poll(p);
            }
            Arrival::Rejected {
                queue_depth,
                backoff_streak,
            } => {
                proxy.counts.rejected += 1;
                proxy.counts.retry_rejected += u64::from(retry);
                let seconds = self
                    .retry_after(p, queue_depth, backoff_streak)
                    .map(|h| h.seconds);
                self.rejected(c, index, seconds, false);
            }
        }
    }

    /// The proxy client `c`'s next attempt reaches, among those in service: drawn at random
    /// (by the client's own draws), or the one its key hashes to.
    fn front_pick(&mut self, c: usize) -> usize {
        let up = &self.proxy_up;
        let in_service = (0..up.len()).filter(|&p| up[p]);
        match self.scenario.front {
            Front::KeyHash => {
                let key = self.client_key(c).0;
                let weight = |p: &usize| mix(key ^ mix(*p as u64 + 1));
                in_service.max_by_key(weight).unwrap_or(0)
            }
            Front::Random => {
                let n = up.iter().filter(|u| **u).count();
                let nth = match n {
                    1 => 0,
                    n => self.clients[c].rng.random_range(0..n),
                };
                in_service.clone().nth(nth).unwrap_or(0)
            }
        }
    }

    /// Client `c`'s attempt `index` at proxy `p` when proxies keep returns: admitted, told the
    /// time left to its place, or given one (a hint when no place can be given).
    fn send_kept(&mut self, c: usize, index: usize, p: usize, retry: bool, by: KeptBy) {
        let now_s = self.now.as_secs();
        let returning = self.returning(c, by);
        let proxy = &mut self.proxies[p];
        let (drain_rate, clamp) = proxy.push.as_ref().map_or((None, (1, 60)), |push| {
            (push.drain_rate, push.constants.clamp())
        });
        let arrival =
            proxy
                .router
                .arrive_kept(index, returning, &mut proxy.book, now_s, drain_rate);
        let (queue_depth, backoff_streak) = match arrival {
            KeptArrival::Returned | KeptArrival::Queued => {
                proxy.counts.admitted += 1;
                proxy.counts.retry_admitted += u64::from(retry);
                self.poll(p);
                return;
            }
            KeptArrival::Early { due } => {
                let seconds = told(due, now_s, clamp).seconds;
                self.reject_with(c, index, p, retry, Some(seconds), false);
                return;
            }
            KeptArrival::Rejected {
                queue_depth,
                backoff_streak,
            } => (queue_depth, backoff_streak),
        };
        let key = match by {
            KeptBy::Key | KeptBy::SharedKey => self.client_key(c),
            KeptBy::Cookie => TicketKey(self.proxies[p].jitter.random()),
        };
        // The place every proxy gives (give_place): without a drain rate yet, a fresh hint's
        // second; a key refused by the book, or no room within the horizon, gets the hint
        // alone. The hint is handed out (and counted) only where it is asked for: always
        // without a drain rate, else only when no place is given.
        let asked = match drain_rate {
            None => self.retry_after(p, queue_depth, backoff_streak),
            Some(_) => None,
        };
        let deadline = self.deadline_left(c);
        let place = give_place(
            &mut self.proxies[p].book,
            key,
            None,
            self.now.as_secs(),
            f64::from(self.now.subsec_millis()) / 1000.0,
            queue_depth as u64,
            drain_rate,
            clamp,
            deadline,
            || asked,
        );
        let hint = match (place, drain_rate) {
            (Placement::HintAlone, Some(_)) => self.retry_after(p, queue_depth, backoff_streak),
            _ => asked,
        }
        .map(|h| h.seconds);
        let seconds = match place {
            Placement::BeyondDeadline(place) => Some(place.seconds),
            Placement::Kept(place) => {
                self.remember_place(c, by, key, place.due);
                Some(place.seconds)
            }
            Placement::HintAlone => hint,
        };
        let beyond = matches!(place, Placement::BeyondDeadline(_));
        self.reject_with(c, index, p, retry, seconds, beyond);
    }

    /// The wait client `c`'s request allows, where the proxy reads it (kept returns that honour
    /// deadlines): `None` for none.
    fn deadline_left(&self, c: usize) -> Option<u64> {
        match self.policy {
            Policy::KeptReturns(_, _, Deadlines::Honoured) => {
                let client = &self.clients[c];
                client.behaviour.deadline_left(self.now - client.arrival)
            }
            _ => None,
        }
    }

    /// What client `c` carries back to its place due at `due`, kept under `key`: nothing more
    /// for its own key, a return cookie, or the place replicated to every proxy.
    fn remember_place(&mut self, c: usize, by: KeptBy, key: TicketKey, due: u64) {
        match by {
            KeptBy::Key => {}
            KeptBy::Cookie => {
                let cookie = ReturnCookie { due, nonce: key.0 };
                self.clients[c].cookie = Some(cookie.write(&self.hasher, SERVICE));
            }
            // Replicated to every proxy (a peers' stick table): the latest place wins.
            KeptBy::SharedKey => self.clients[c].shared_due = Some(due),
        }
    }

    /// Client `c`'s key: what its requests carry (a header's value), as the book keeps it.
    fn client_key(&self, c: usize) -> TicketKey {
        self.hasher.key(format!("client-{c}").as_bytes())
    }

    /// What client `c`'s attempt says of it as a possible return.
    fn returning(&self, c: usize, by: KeptBy) -> Option<Returning> {
        match by {
            KeptBy::Key => Some(Returning {
                key: self.client_key(c),
                cookie_due: None,
            }),
            KeptBy::SharedKey => Some(Returning {
                key: self.client_key(c),
                cookie_due: self.clients[c].shared_due,
            }),
            KeptBy::Cookie => {
                let value = self.clients[c].cookie.as_deref()?;
                let cookie = ReturnCookie::read(value, &self.hasher, SERVICE).ok()?;
                Some(Returning {
                    key: TicketKey(cookie.nonce),
                    cookie_due: Some(cookie.due),
                })
            }
        }
    }

    /// Proxy `p` rejects attempt `index` of client `c` with `seconds`, and, if
    /// `told_not_to_retry`, `x-should-retry: false`.
    fn reject_with(
        &mut self,
        c: usize,
        index: usize,
        p: usize,
        retry: bool,
        seconds: Option<u64>,
        told_not_to_retry: bool,
    ) {
        let counts = &mut self.proxies[p].counts;
        counts.rejected += 1;
        counts.retry_rejected += u64::from(retry);
        if let Some(s) = seconds {
            *counts.handed_out.entry((Rung::Computed, s)).or_default() += 1;
        }
        self.rejected(c, index, seconds, told_not_to_retry);
    }

    /// The `Retry-After` proxy `p` hands out, as the reference proxy computes it, and whether
    /// it comes from a fresh estimate.
    fn retry_after(&mut self, p: usize, depth: usize, streak: u32) -> Option<Hint> {
        let now = self.instant();
        let header = self.policy.header();
        let proxy = &mut self.proxies[p];
        if header == HeaderPolicy::None {
            return None;
        }
        let with_backlog = header == HeaderPolicy::FromAgentWithRetryBacklog;
        let counted = if with_backlog {
            depth + proxy.backlog.outstanding(now)
        } else {
            depth
        };
        // Before the first push the client library has no estimate and no static value of
        // its own: no header, as the real proxy.
        let push = proxy.push.as_ref()?;
        let jitter_draw: f64 = proxy.jitter.random();
        let decision = proxy.own.decide(
            push,
            proxy.pushed_at,
            self.now,
            (Some(counted as u64), Some(streak)),
            jitter_draw,
        );
        let hint = decision.hint()?;
        let seconds = hint.seconds;
        if with_backlog {
            proxy.backlog.promise(now + Duration::from_secs(seconds));
        }
        *proxy
            .counts
            .handed_out
            .entry((decision.rung, seconds))
            .or_default() += 1;
        Some(hint)
    }

    /// Client `c`'s attempt `index` is rejected with `suggested_s`, and told not to retry or
    /// not: recorded, and the client comes back, or gives up.
    fn rejected(
        &mut self,
        c: usize,
        index: usize,
        suggested_s: Option<u64>,
        told_not_to_retry: bool,
    ) {
        self.answer(
            index,
            Outcome::Rejected {
                suggested_s,
                told_not_to_retry,
            },
        );
        let client = &mut self.clients[c];
        if client.attempts >= self.scenario.attempts {
            self.done += 1;
            return;
        }
        let (wait, honoured) =
            client
                .behaviour
                .wait(suggested_s, client.attempts, client.rng.random());
        let since_first = self.now - client.arrival;
        if client
            .behaviour
            .gives_up(since_first, wait, told_not_to_retry)
        {
            self.attempts[index].gave_up_after = true;
            self.done += 1;
            return;
        }
        client.after_suggested_s = honoured;
        self.waiting += 1;
        self.at(self.now + wait, Event::Retry(c));
    }

    fn answer(&mut self, attempt: usize, outcome: Outcome) {
        self.attempts[attempt].answered = self.now;
        self.attempts[attempt].outcome = outcome;
        self.answered[attempt] = true;
    }

    /// Poll proxy `p`'s router and start what it placed.
    fn poll(&mut self, p: usize) {
        let now = self.instant();
        let mut placed = std::mem::take(&mut self.placed);
        let wake = self.proxies[p]
            .router
            .poll(now, &mut self.fleet, &mut placed);
        for (attempt, replica) in placed.drain(..) {
            self.proxies[p].in_flight[replica] += 1;
            self.on_replica[replica].push(attempt);
            let spec = self.scenario.replicas[replica].spec;
            let service = spec
                .service_time
                .draw(&mut self.replica_rngs[replica])
                .mul_f64(spec.slowdown);
            let epoch = self.epochs[replica];
            self.at(
                self.now + service,
                Event::Served {
                    replica,
                    epoch,
                    attempt,
                },
            );
            if spec.chunks > 1 {
                self.at(
                    self.now + STREAM_SEEN_COMPLETE,
                    Event::SeenComplete {
                        replica,
                        epoch,
                        attempt,
                    },
                );
            }
        }
        self.placed = placed;
        match wake {
            Wake::OnArrival => self.proxies[p].wake = None,
            Wake::At(at) => {
                let at = at - self.base;
                if self.proxies[p].wake != Some(at) {
                    self.proxies[p].wake = Some(at);
                    self.at(at, Event::Wake(p));
                }
            }
        }
    }

    fn served(&mut self, replica: usize, epoch: u32, attempt: usize) {
        if epoch != self.epochs[replica] {
            return; // failed when its replica was lost
        }
        self.fleet.complete(replica);
        self.on_replica[replica].retain(|a| *a != attempt);
        let p = self.attempt_proxy[attempt];
        self.seen_complete(replica, attempt);
        self.answer(attempt, Outcome::Served);
        self.done += 1;
        self.poll(p);
    }

    /// The probe counts `attempt` on `replica` as completed (once).
    fn seen_complete(&mut self, replica: usize, attempt: usize) {
        if std::mem::replace(&mut self.seen[attempt], true) {
            return;
        }
        let p = self.attempt_proxy[attempt];
        self.proxies[p].in_flight[replica] -= 1;
        self.proxies[p].completed[replica] += 1;
    }

    fn fleet_event(&mut self, i: usize) {
        match self.scenario.events[i].kind {
            EventKind::LoseReplica(r) => {
                self.fleet.set_up(r, false);
                self.epochs[r] += 1;
                for attempt in std::mem::take(&mut self.on_replica[r]) {
                    self.fleet.complete(r);
                    // A streamed response already counted complete is no longer in flight.
                    if !std::mem::replace(&mut self.seen[attempt], true) {
                        self.proxies[self.attempt_proxy[attempt]].in_flight[r] -= 1;
                    }
                    self.answer(attempt, Outcome::Failed);
                    self.done += 1;
                }
            }
            EventKind::AddReplica(r) => self.fleet.set_up(r, true),
            EventKind::ProxyLeaves(p) => self.proxy_up[p] = false,
            // Started afresh: the places it kept and the returns it promised are gone; its
            // agent, a node's daemon, kept running.
            EventKind::ProxyJoins(p) => {
                self.proxy_up[p] = true;
                let proxy = &mut self.proxies[p];
                proxy.book = TicketBook::new(kept_settings(self.policy));
                proxy.own = OwnReturns::default();
            }
        }
        for p in 0..self.proxies.len() {
            self.poll(p);
        }
    }

    /// Every agent reads its proxy's counts, as its probe would, and pushes its estimate.
    fn tick(&mut self) {
        let now = self.instant();
        let replicas = &self.scenario.replicas;
        // A simulated replica serves `max_ongoing_requests` at once, each answer streamed from
        // when it is served: the rest wait for their first body byte. A proxy's own share of
        // them (its client side) is taken as its in flight beyond the replica's places, exact
        // with one proxy and an upper bound with several; no scenario sets
        // `replica_queue = "waiting"` yet.
        let waiting = |r: usize, in_flight: u64| {
            in_flight.saturating_sub(replicas[r].max_ongoing_requests as u64)
        };
        let server: Vec<SideLoad> = (0..replicas.len())
            .map(|r| {
                let in_flight = self.proxies.iter().map(|p| p.in_flight[r]).sum();
                SideLoad {
                    in_flight,
                    waiting: waiting(r, in_flight),
                    completed_total: self.proxies.iter().map(|p| p.completed[r]).sum(),
                }
            })
            .collect();
        for proxy in &mut self.proxies {
            let settings = proxy.agent.settings();
            let load = ServiceLoad {
                rejected_at: settings.rejected_at,
                replica_queue: settings.replica_queue,
                backends: (0..replicas.len())
                    .map(|r| BackendLoad {
                        client: SideLoad {
                            in_flight: proxy.in_flight[r],
                            waiting: waiting(r, proxy.in_flight[r]),
                            completed_total: proxy.completed[r],
                        },
                        server: server[r],
                        max_ongoing_requests: Some(replicas[r].max_ongoing_requests as u64),
                    })
                    .collect(),
                frontend_in_flight: None,
            };
            proxy.agent.observe_load(now, load);
            proxy.pushes += 1;
            proxy.push = Some(proxy.agent.push(proxy.pushes));
            proxy.pushed_at = self.now;
        }
    }

    /// Every proxy tells its agent what it did since its last report.
    fn report(&mut self) {
        let now = self.instant();
        let base = self.base;
        let at = self.now;
        for proxy in &mut self.proxies {
            let counts = std::mem::replace(
                &mut proxy.counts,
                Counts {
                    since: at,
                    ..Counts::default()
                },
            );
            let handed_out = counts.handed_out();
            let report = Report {
                service: SERVICE,
                handed_out: handed_out.as_deref(),
                admitted: counts.admitted,
                rejected: counts.rejected,
                queue_depth: Some(proxy.router.queue_depth() as u64),
                backoff_streak: Some(proxy.router.backoff_streak()),
                retry_admitted: Some(counts.retry_admitted),
                retry_rejected: Some(counts.retry_rejected),
                tickets: None,
            };
            proxy.agent.report(Some(base + counts.since), now, &report);
            proxy.reported.0 += counts.admitted;
            proxy.reported.1 += counts.rejected;
        }
    }

    fn finish(self) -> RunResult {
        let rung: Option<Rung> = self.policy.rung();
        let reported = self.proxies.iter().fold((0.0, 0.0), |(a, r), p| {
            (a + p.reported.0 as f64, r + p.reported.1 as f64)
        });
        let judge = match rung {
            Some(_) => JudgeFigures::from_stats(
                self.proxies.iter().map(|p| p.agent.judge()),
                rung,
                Some(reported),
            ),
            None => JudgeFigures::default(),
        };
        let attempts = self
            .attempts
            .into_iter()
            .zip(self.answered)
            .filter_map(|(a, answered)| answered.then_some(a))
            .collect();
        RunResult {
            ignores_header: self
                .clients
                .iter()
                .map(|c| c.behaviour.ignores_header())
                .collect(),
            scenario: self.scenario.name.clone(),
            policy: self.policy,
            attempts,
            clients: self.clients.len(),
            warm_up_clients: self.warm_up_clients,
            warm_up: self.scenario.warm_up(),
            measured_s: self.scenario.measured().as_secs_f64(),
            max_attempts: self.scenario.attempts,
            idle_replica_s_while_waiting: self.idle,
            idle_replica_s_queued: self.idle_queued,
            unfinished: self.clients.len() - self.done,
            judge,
            access_log: Vec::new(),
            replicas_served: None,
        }
    }
}

/// A 64-bit mix (SplitMix64's finalizer): the front's hash of a key with a proxy. The front
/// hashes by highest weight (rendezvous hashing), which keeps a key where it was while its
/// proxy stays, as a consistent hash ring does.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The books' settings: the defaults, under every policy (only kept returns fill them).
fn kept_settings(policy: Policy) -> KeptReturnsSettings {
    match policy {
        Policy::KeptReturns(..) => KeptReturnsSettings::default(),
        _ => KeptReturnsSettings {
            max_keys: 0,
            horizon_s: 0,
            ..KeptReturnsSettings::default()
        },
    }
}

/// The agent's settings for the scenario's service under `policy`, through the agent's own
/// configuration parser (the backends' addresses stand in for the replicas).
fn agent_settings(scenario: &Scenario, policy: Policy) -> ServiceSettings {
    let backends: Vec<(String, usize)> = scenario
        .replicas
        .iter()
        .enumerate()
        .map(|(i, r)| (format!("127.0.0.1:{}", 10_000 + i), r.max_ongoing_requests))
        .collect();
    let text = format!(
        "[agent]\ntick_interval_ms = {}\n{}",
        scenario.agent_tick.as_millis(),
        policy.service_config(&backends)
    );
    let config = Config::parse(&text).expect("the evaluation's agent configuration is valid");
    config.services[0].settings()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::figures::figures;

    fn scenario(extra: &str) -> Scenario {
        Scenario::parse(&format!(
            "name = \"t\"\ntitle = \"t\"\nmax_ongoing_requests = 4\nmax_queued_requests = 16\nreplicas = [{{ count = 4, service_time = {{ distribution = \"exponential\", mean_ms = 100 }} }}]\nphases = [{{ seconds = 10, rate = 1.5 }}]\n{extra}"
        ))
        .unwrap()
    }

    /// Every client's attempts are numbered without a gap, only the last may end other than
    /// in a rejection, and every client finished one way.
    fn check_bookkeeping(result: &RunResult) {
        let mut last = vec![0u32; result.clients];
        let mut ended = vec![false; result.clients];
        for a in &result.attempts {
            assert_eq!(a.number, last[a.client] + 1, "client {}", a.client);
            assert!(
                !ended[a.client],
                "client {} went on after it ended",
                a.client
            );
            last[a.client] = a.number;
            ended[a.client] =
                !matches!(a.outcome, Outcome::Rejected { .. }) || a.number == result.max_attempts;
        }
        let finished = ended.iter().filter(|e| **e).count();
        assert_eq!(finished + result.unfinished, result.clients);
    }

    #[test]
    fn a_run_is_the_same_for_the_same_seed_and_not_for_another() {
        let s = scenario("");
        let (a, b, c) = (
            simulate(&s, Policy::ComputedDefaults, 3),
            simulate(&s, Policy::ComputedDefaults, 3),
            simulate(&s, Policy::ComputedDefaults, 4),
        );
        assert_eq!(a.attempts.len(), b.attempts.len());
        assert!(
            a.attempts
                .iter()
                .zip(&b.attempts)
                .all(|(x, y)| (x.client, x.sent, x.outcome) == (y.client, y.sent, y.outcome))
        );
        assert_ne!(a.attempts.len(), c.attempts.len());
    }

    #[test]
    fn every_attempt_is_accounted_for_and_the_judge_agrees_with_the_clients() {
        for policy in [
            Policy::Static(5),
            Policy::ComputedDefaults,
            Policy::ComputedRetryBacklog,
            Policy::ScheduledReturns(retry_after_policy::OverloadRule::LatestWithRoom, None),
            Policy::KeptReturns(KeptBy::Key, None, Deadlines::Ignored),
            Policy::KeptReturns(KeptBy::Cookie, None, Deadlines::Ignored),
        ] {
            let scenario = scenario("");
            let result = simulate(&scenario, policy, 1);
            check_bookkeeping(&result);
            let f = figures(&result);
            assert_eq!(
                f.succeeded + f.gave_up + f.unfinished,
                f.clients,
                "{policy}"
            );
            // What the proxy reported is every attempt, but those of the last interval (the
            // run ends before its report).
            let (admitted, rejected) = result.judge.reported.expect("reports");
            let reported = (admitted + rejected) as usize;
            let end = result.attempts.iter().map(|a| a.sent).max().unwrap();
            let last_interval = result
                .attempts
                .iter()
                .filter(|a| a.sent + scenario.report_every > end)
                .count();
            assert!(reported <= result.attempts.len(), "{policy}");
            assert!(
                reported + last_interval >= result.attempts.len(),
                "{policy}"
            );
            let seen = f.admitted_at_suggested().unwrap();
            let judged = f.judge_admitted.unwrap();
            assert!(
                (seen - judged).abs() <= 0.05,
                "{policy}: clients {seen}, judge {judged}"
            );
        }
    }

    #[test]
    fn kept_places_admit_every_retry_at_its_place_through_any_proxy_by_cookie() {
        let s = scenario("proxies = 4");
        let by_cookie = figures(&simulate(
            &s,
            Policy::KeptReturns(KeptBy::Cookie, None, Deadlines::Ignored),
            1,
        ));
        let by_key = figures(&simulate(
            &s,
            Policy::KeptReturns(KeptBy::Key, None, Deadlines::Ignored),
            1,
        ));
        // A cookie is honoured by whichever proxy the client comes back through; a key only
        // by the proxy that gave the place (one in four here).
        assert!(
            by_cookie.admitted_at_suggested().unwrap() >= 0.99,
            "{by_cookie:?}"
        );
        assert!(by_key.admitted_at_suggested().unwrap() < 0.9, "{by_key:?}");
    }

    #[test]
    fn behind_a_front_hashing_keys_a_key_finds_its_place_and_a_proxy_leaving_moves_only_its_own() {
        let s = scenario("proxies = 4\nfront = \"key-hash\"");
        let by_key = figures(&simulate(
            &s,
            Policy::KeptReturns(KeptBy::Key, None, Deadlines::Ignored),
            1,
        ));
        assert!(
            by_key.admitted_at_suggested().unwrap() >= 0.99,
            "{by_key:?}"
        );
        // Proxy 3 leaves 4 s in: its keys move to the others, every other key stays.
        let leaves =
            scenario("proxies = 4\nfront = \"key-hash\"\n[[events]]\nat_s = 4\nproxy_leaves = 3\n");
        let mut sim = Sim::new(
            &leaves,
            Policy::KeptReturns(KeptBy::Key, None, Deadlines::Ignored),
            1,
        );
        let clients = sim.clients.len();
        let before: Vec<usize> = (0..clients).map(|c| sim.front_pick(c)).collect();
        sim.proxy_up[3] = false;
        let after: Vec<usize> = (0..clients).map(|c| sim.front_pick(c)).collect();
        let on_3 = before.iter().filter(|p| **p == 3).count();
        assert!(
            on_3 * 5 > clients && on_3 * 3 < clients,
            "{on_3} of {clients}"
        );
        for (was, is) in before.iter().zip(&after) {
            assert!(*is != 3 && (*was == 3 || was == is), "{was} → {is}");
        }
        // Every retry of a client whose key stayed where it was is admitted at its place; the
        // retries not admitted are of clients whose key moved (and lost the place it held).
        let run = simulate(
            &leaves,
            Policy::KeptReturns(KeptBy::Key, None, Deadlines::Ignored),
            1,
        );
        let stayed = |c: usize| before[c] != 3;
        let retries = |moved: bool| {
            run.attempts
                .iter()
                .filter(move |a| a.number > 1 && stayed(a.client) != moved)
        };
        assert!(retries(false).count() > 100);
        assert!(retries(false).all(|a| a.outcome == Outcome::Served));
        let moved_rejected = retries(true)
            .filter(|a| a.outcome != Outcome::Served)
            .count();
        let all = figures(&run);
        assert!(all.admitted_at_suggested().unwrap() < 1.0, "{all:?}");
        assert!(moved_rejected > 0, "the moved keys lost places");
    }

    #[test]
    fn a_lost_replica_fails_what_it_was_serving_and_takes_no_more() {
        let s = scenario("events = [{ at_s = 3, lose_replica = 0 }]");
        let result = simulate(&s, Policy::Static(5), 1);
        check_bookkeeping(&result);
        let failed: Vec<_> = result
            .attempts
            .iter()
            .filter(|a| a.outcome == Outcome::Failed)
            .collect();
        // Up to its four requests in progress fail at the loss, at once, and nothing after.
        assert!((1..=4).contains(&failed.len()), "{}", failed.len());
        let at = s.events[0].at;
        assert!(failed.iter().all(|a| a.answered == at));
    }

    #[test]
    fn several_proxies_share_the_fleet_without_exceeding_its_capacity() {
        let one = simulate(&scenario(""), Policy::Static(5), 1);
        let four = simulate(&scenario("proxies = 4"), Policy::Static(5), 1);
        check_bookkeeping(&four);
        let (g1, g4) = (figures(&one).goodput, figures(&four).goodput);
        // Capacity 160 a second whatever the number of proxies placing on it.
        assert!(g1 <= 160.0 * 1.05 && g4 <= 160.0 * 1.05, "{g1} {g4}");
        assert!(g4 > 100.0, "{g4}");
    }
}
