//! Micro-benchmark of one estimate call, against a baseline measured in the same run.
//!
//! Prints a markdown table: nanoseconds per call (median of several batches) and the ratio to
//! the baseline, which is the formula alone, `ceil(depth / drain × factor)` clamped, on the same
//! inputs. Target: one estimate call under 1 µs.
//!
//! Run with `cargo bench -p retry-after-estimator --bench estimate`.

use std::{
    hint::black_box,
    time::{Duration, Instant},
};

use rand::{RngExt, SeedableRng, rngs::SmallRng};
use retry_after_estimator::{
    endpoint::Endpoint,
    {
        BackendLoad, DrainRateConstants, PolicyConstants, Query, RejectedAt, ReplicaQueue,
        RetryAfterPolicy, ServiceEstimator, ServiceLoad, ServiceSettings, SideLoad,
    },
};

const BATCH: u32 = 100_000;
const BATCHES: usize = 15;

fn main() {
    let t0 = Instant::now();
    let mut estimator = warm_estimator(t0);
    let mut rng = SmallRng::seed_from_u64(7);
    let at = t0 + Duration::from_secs(10);

    let baseline = median_ns(|i| {
        let depth = black_box(10 + (i & 7) as u64);
        let drain = black_box(40.0_f64);
        let factor = black_box(1.25_f64);
        black_box((depth as f64 / drain * factor).ceil().clamp(1.0, 60.0) as u64);
    });
    let estimate = median_ns(|i| {
        let query = Query {
            queue_depth: Some(black_box(10 + (i & 7) as u64)),
            backoff_streak: Some(1),
        };
        black_box(estimator.answer_and_record(at, query, rng.random()));
    });
    let kernel_depth = median_ns(|_| {
        black_box(estimator.answer_and_record(at, Query::default(), rng.random()));
    });

    println!("| call | ns per call | ratio to baseline |");
    println!("|---|---|---|");
    println!("| baseline: the formula alone | {baseline:.1} | 1.00 |");
    for (name, ns) in [
        ("estimate, depth from the proxy", estimate),
        ("estimate, depth from the kernel", kernel_depth),
    ] {
        println!("| {name} | {ns:.1} | {:.2} |", ns / baseline);
    }
}

/// Median over batches of the time per call.
fn median_ns(mut call: impl FnMut(u32)) -> f64 {
    let mut samples: Vec<f64> = (0..BATCHES)
        .map(|_| {
            let start = Instant::now();
            for i in 0..BATCH {
                call(i);
            }
            start.elapsed().as_nanos() as f64 / f64::from(BATCH)
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[BATCHES / 2]
}

/// A computed-policy service with four backends behind this node's proxy (frontend declared),
/// warmed with ten ticks of load.
fn warm_estimator(t0: Instant) -> ServiceEstimator {
    let backends: Vec<_> = (0..4)
        .map(|i| (Endpoint::AnyAddress(9000 + i), Some(8)))
        .collect();
    let mut estimator = ServiceEstimator::new(ServiceSettings {
        name: "bench".into(),
        rejected_at: RejectedAt::Proxy,
        replica_queue: ReplicaQueue::BeyondCapacity,
        policy: RetryAfterPolicy::RouterQueueDrainRate,
        constants: PolicyConstants::default(),
        drain: DrainRateConstants::default(),
        retry_after_s: Some(5),
        status_code: 429,
        backends,
        frontend: Some(Endpoint::AnyAddress(8000)),
    });
    for tick in 0..10u64 {
        let side = SideLoad {
            in_flight: 8,
            waiting: 0,
            completed_total: tick * 10,
        };
        let load = ServiceLoad {
            rejected_at: RejectedAt::Proxy,
            replica_queue: ReplicaQueue::BeyondCapacity,
            backends: (0..4)
                .map(|_| BackendLoad {
                    client: side,
                    server: side,
                    max_ongoing_requests: Some(8),
                })
                .collect(),
            frontend_in_flight: Some(60),
        };
        estimator.observe_load(t0 + Duration::from_secs(tick), load);
    }
    estimator
}
