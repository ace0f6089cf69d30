//! `STATUS` walks every service in order, each answer naming the next, and describes a
//! service without recording anything.

use retry_after_estimator::config::Config;

const TWO_SERVICES: &str = "[[service]]\nname = \"chat\"\nbackends = [{ address = \"127.0.0.1:9001\", max_ongoing_requests = 2 }]\n\
    [service.backpressure]\nretry_after_policy = \"scheduled_returns\"\nretry_after_s = 5\n\
    [[service]]\nname = \"api\"\nbackends = [{ address = \"127.0.0.1:9002\" }]\n";

#[test]
fn status_walks_every_service_by_name_and_names_none_after_the_last() {
    let estimator = Config::parse(TWO_SERVICES).unwrap().estimator();
    let first = estimator.status(None).unwrap();
    assert_eq!(
        (first.service.as_str(), first.next.as_deref()),
        ("api", Some("chat"))
    );
    let second = estimator.status(first.next.as_deref()).unwrap();
    assert_eq!((second.service.as_str(), second.next), ("chat", None));
    assert_eq!(second.retry_after_policy.as_str(), "scheduled_returns");
    for unknown in ["a", "apj", "zzz", "cha"] {
        assert_eq!(estimator.status(Some(unknown)), None, "{unknown}");
    }
}

#[test]
fn a_cold_service_reports_its_static_answer_and_nothing_judged() {
    let estimator = Config::parse(TWO_SERVICES).unwrap().estimator();
    let chat = estimator.status(Some("chat")).unwrap();
    assert_eq!((chat.seconds, chat.millis), (Some(5), Some(5000)));
    assert_eq!(chat.rung.as_str(), "static");
    assert_eq!(chat.reason.map(|r| r.as_str()), Some("drain_not_warm"));
    assert_eq!((chat.returns_promised, chat.admission_judged), (0, 0));
    assert_eq!((chat.admitted_share, chat.drain_rate), (None, None));
    // Asking twice records nothing: the same answer.
    assert_eq!(estimator.status(Some("chat")), Some(chat));
}
