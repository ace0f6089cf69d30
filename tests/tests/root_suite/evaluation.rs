//! A short run of the end-to-end evaluation (`./dev evaluate` runs the full one): the harness's
//! bookkeeping is checked against the proxy's access log and what the agent was told, and the
//! agent's judge is checked against what the clients saw.

use std::collections::BTreeMap;

use std::path::Path;

use retry_after_eval::{
    figures::{Figures, figures},
    load::Outcome,
    policy::{Deadlines, KeptBy, Policy},
    run::run,
    scenario::Scenario,
};

#[test]
fn every_attempt_is_accounted_for_and_the_judge_agrees_with_the_clients() {
    check_a_short_run(Policy::ComputedDefaults);
}

/// The proxy hands out a longer time than the agent's answer for its depth (it counts the
/// clients it told to come back): the judge grades what was handed out.
#[test]
fn the_judge_agrees_with_the_clients_when_the_proxy_hands_out_its_own_time() {
    check_a_short_run(Policy::ComputedRetryBacklog);
}

/// The proxy keeps the places it promises, by return cookie (set on the rejection, sent back
/// by the load's cookie jar): the judge grades the places handed out, and a retry at its
/// place is admitted.
#[test]
fn the_judge_agrees_with_the_clients_when_the_proxy_keeps_places() {
    let f = check_a_short_run(Policy::KeptReturns(
        KeptBy::Cookie,
        None,
        Deadlines::Ignored,
    ));
    assert!(
        f.admitted_at_suggested().unwrap() >= 0.95,
        "retries at their place: {f:?}"
    );
}

fn check_a_short_run(policy: Policy) -> Figures {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../eval/scenarios/steady-overload.toml");
    let scenario = Scenario::from_file(&file).unwrap().scaled_to(8.0);
    let result = run(&scenario, policy, 7, |_| {});
    let attempts = &result.attempts;
    assert!(result.clients > 1000, "{} clients", result.clients);
    assert_eq!(
        result.unfinished, 0,
        "every client finished within the drain limit"
    );

    // Each client's attempts are numbered 1, 2, … without a gap, and only the last may end
    // other than in a rejection.
    let mut by_client: BTreeMap<usize, Vec<_>> = BTreeMap::new();
    for a in attempts {
        by_client.entry(a.client).or_default().push(*a);
    }
    assert_eq!(by_client.len(), result.clients, "every client sent");
    for (client, mut tries) in by_client {
        tries.sort_by_key(|a| a.number);
        for (i, a) in tries.iter().enumerate() {
            assert_eq!(a.number as usize, i + 1, "client {client}");
            let last = i + 1 == tries.len();
            assert!(
                last || matches!(a.outcome, Outcome::Rejected { .. }),
                "client {client} went on after {:?}",
                a.outcome
            );
            assert!(a.answered >= a.sent);
        }
        let last = tries.last().unwrap();
        assert!(
            !matches!(last.outcome, Outcome::Rejected { .. }) || last.number == scenario.attempts,
            "client {client} stopped early"
        );
    }

    // The clients' rejections are the proxy's access log, line for line, and what they were
    // served the replicas' own count.
    let rejected = attempts
        .iter()
        .filter(|a| matches!(a.outcome, Outcome::Rejected { .. }))
        .count();
    let served = attempts
        .iter()
        .filter(|a| a.outcome == Outcome::Served)
        .count();
    assert_eq!(result.access_log.len(), rejected);
    assert_eq!(result.replicas_served, Some(served as u64));
    // Every attempt the proxy did not reject was served: no replica failed, no connection
    // broke.
    assert_eq!(rejected + served, attempts.len(), "attempts that failed");
    let f = figures(&result);
    // What the proxy told the agent it admitted and rejected, against the clients' records.
    let (reported_admitted, reported_rejected) = f.reported.expect("the proxy reported");
    assert_eq!(reported_admitted as usize, served);
    assert_eq!(reported_rejected as usize, rejected);
    // Measured clients: each succeeded, or gave up after its last attempt.
    assert_eq!(f.succeeded + f.gave_up, f.clients);

    // The judge's admitted share against the clients' own: within 5 points.
    let seen = f
        .admitted_at_suggested()
        .expect("retries at the suggested time");
    let judged = f.judge_admitted.expect("the judge graded computed answers");
    eprintln!(
        "retries at the suggested time: {} of {} admitted ({:.1}%); judge {:.1}%",
        f.retries_at_suggested_admitted,
        f.retries_at_suggested,
        seen * 100.0,
        judged * 100.0
    );
    assert!(f.retries_at_suggested > 100, "{f:?}");
    assert!(
        (seen - judged).abs() <= 0.05,
        "clients saw {seen:.3}, the judge {judged:.3}"
    );
    f
}
