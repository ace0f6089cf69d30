//! The LLM gateway layouts end to end (`retry_after_testkit::gateway`): vLLM's CPU engine
//! behind nginx and behind HAProxy, neither capping the engine's concurrency, the official
//! OpenAI SDK streaming through them at a multiple of what the engine completes, each static
//! value and policy of `gateway::ANSWERS` in turn. Prints the table docs/evaluation.md keeps:
//! clients rejected and admitted at their first return, the waits the SDK chose over the time
//! vLLM's queue then took to drain, p99 time to success against the clairvoyant bound, the
//! engine's places left idle while clients waited.
//!
//! Usage: `llm-gateway-bench [SECONDS] [OVERLOAD] [TOKENS] [ONLY] [BEFORE]` (defaults 15 1.7
//! 256; ONLY: the runs whose service name holds it, e.g. `haproxy`, `''` for all; run as root
//! after `./dev setup`, with the agent built: `cargo build --release -p retry-after-agent`).
//! BEFORE: an agent built from before the framing walk (commit 148e714's parent), whose
//! responses end at the quiet turn: the same runs again with it, one engine for both series.
//! Each run's readings, a second a line, follow the tables.

use retry_after_testkit::{
    engine::Vllm,
    engine_load, free_port,
    gateway::{self, ANSWERS, AgentBuild, Layout, Load, Proxy},
    require_root,
};

/// The engine's batch (`--max-num-seqs`), as the engine tests run it.
const BATCH: u32 = 8;

fn main() {
    require_root();
    let mut args = std::env::args().skip(1);
    let mut next = |default: f64| {
        args.next()
            .map_or(default, |a| a.parse().expect("a number"))
    };
    let (seconds, overload, tokens) = (next(15.0) as u32, next(1.7), next(256.0) as u32);
    let only = args.next().unwrap_or_default();
    let mut builds = vec![AgentBuild::Current];
    builds.extend(args.next().map(|path| AgentBuild::QuietTurn(path.into())));
    let engine = Vllm::start(free_port(), BATCH);
    let capacity = engine_load::capacity(&engine, BATCH, tokens);
    println!(
        "the engine completes {capacity:.2} answers of {tokens} tokens a second with its batch of {BATCH} full; clients arrive at {overload} times that for {seconds} s"
    );
    let load = Load {
        batch: BATCH,
        capacity,
        tokens,
        overload,
        seconds,
    };
    let layouts: Vec<Layout> = [Proxy::Nginx, Proxy::Haproxy]
        .into_iter()
        .flat_map(|proxy| {
            ANSWERS.map(|answer| Layout {
                proxy,
                answer,
                seed: 61,
            })
        })
        .filter(|layout| layout.service().contains(&only))
        .collect();
    let series: Vec<_> = builds
        .iter()
        .map(|build| gateway::series(&engine, &layouts, &load, build))
        .collect();
    for (build, series) in builds.iter().zip(&series) {
        println!("\n{}", build.name());
        for figures in series {
            println!("\n{}", figures.readings());
            figures.check_counts();
        }
    }
}
