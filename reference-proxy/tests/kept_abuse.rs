//! Kept returns against clients that do not play fair: a forged or replayed cookie, a key that
//! collects places without coming back, a client back a thousand times early, a flood of
//! distinct keys. Each gets a bounded outcome (treated as fresh, capped per key, counted) and
//! none takes another key's place. What a flood does to the process's memory is measured in
//! `kept_flood_memory.rs`, a process of its own.

use std::time::Duration;

use retry_after_policy::{
    KeptReturnsSettings, KeyHasher, ReturnCookie, TicketBook, TicketKey, TicketOutcome,
};
use retry_after_reference_proxy::{KeptArrival, Returning, Router, promise};

/// Drain rate of the service in every case: 10 requests a second.
const DRAIN: Option<f64> = Some(10.0);
const CLAMP: (u64, u64) = (1, 60);
const SERVICE: &str = "api";

fn keyed(k: TicketKey) -> Option<Returning> {
    Some(Returning {
        key: k,
        cookie_due: None,
    })
}

/// A router whose queue (bound 2) is full at second `now`.
fn full_router(book: &mut TicketBook, now: u64) -> Router<u32> {
    let mut router = Router::new(2, 1);
    router.arrive_kept(0, None, book, now, None);
    router.arrive_kept(1, None, book, now, None);
    router
}

/// A client rejected at `now` with `key`, given a place; the place's second.
fn rejected_with_place(
    book: &mut TicketBook,
    router: &mut Router<u32>,
    key: TicketKey,
    now: u64,
) -> u64 {
    let arrival = router.arrive_kept(9, keyed(key), book, now, DRAIN);
    assert!(
        matches!(arrival, KeptArrival::Rejected { .. }),
        "{arrival:?}"
    );
    promise(
        book,
        key,
        None,
        Duration::from_secs(now),
        router.queue_depth(),
        DRAIN,
        CLAMP,
    )
    .expect("a place")
    .due
}

/// What a proxy makes of a cookie header's value: a possible return, or nothing.
fn from_cookie(value: &str, hasher: &KeyHasher) -> Option<Returning> {
    let cookie = ReturnCookie::read(value, hasher, SERVICE).ok()?;
    Some(Returning {
        key: TicketKey(cookie.nonce),
        cookie_due: Some(cookie.due),
    })
}

#[test]
fn a_forged_cookie_is_a_fresh_arrival_and_takes_no_place() {
    let hasher = KeyHasher::new(b"the proxies' secret");
    let mut book = TicketBook::new(KeptReturnsSettings::default());
    let mut router = full_router(&mut book, 100);
    let honest = ReturnCookie { due: 105, nonce: 7 };
    book.issue(TicketKey(7), 105, 100);
    // The same place signed with another secret, and the honest value with its second moved.
    let forged = honest.write(&KeyHasher::new(b"a guess"), SERVICE);
    let moved = honest.write(&hasher, SERVICE).replacen("105.", "101.", 1);
    for value in [
        forged.as_str(),
        moved.as_str(),
        "105.0000000000000007.",
        "garbage",
    ] {
        assert_eq!(from_cookie(value, &hasher), None, "{value}");
        let arrival = router.arrive_kept(5, from_cookie(value, &hasher), &mut book, 105, DRAIN);
        assert!(
            matches!(arrival, KeptArrival::Rejected { .. }),
            "{value}: {arrival:?}"
        );
    }
    // The honest holder still has its place.
    let own = from_cookie(&honest.write(&hasher, SERVICE), &hasher);
    assert_eq!(
        router.arrive_kept(6, own, &mut book, 105, DRAIN),
        KeptArrival::Returned
    );
}

#[test]
fn a_replayed_cookie_is_admitted_once_then_counted_and_treated_as_fresh() {
    let hasher = KeyHasher::new(b"secret");
    let mut book = TicketBook::new(KeptReturnsSettings::default());
    let mut router = full_router(&mut book, 100);
    let value = ReturnCookie {
        due: 103,
        nonce: 42,
    }
    .write(&hasher, SERVICE);
    book.issue(TicketKey(42), 103, 100);
    let at_103 = |router: &mut Router<u32>, book: &mut TicketBook| {
        router.arrive_kept(1, from_cookie(&value, &hasher), book, 103, DRAIN)
    };
    assert_eq!(at_103(&mut router, &mut book), KeptArrival::Returned);
    for _ in 0..100 {
        assert!(matches!(
            at_103(&mut router, &mut book),
            KeptArrival::Rejected { .. }
        ));
    }
    assert_eq!(book.counters().get(TicketOutcome::Replayed), 100);
    assert_eq!(book.counters().get(TicketOutcome::Honoured), 1);
}

#[test]
fn a_key_that_collects_places_holds_its_cap_and_loses_them_unused() {
    let mut book = TicketBook::new(KeptReturnsSettings::default());
    let mut router = full_router(&mut book, 100);
    let greedy = TicketKey(0xabcd << 32);
    let due = rejected_with_place(&mut book, &mut router, greedy, 100);
    // Rejected again and again before its second: told the same second, no new place.
    for now in 100..due {
        assert_eq!(
            router.arrive_kept(3, keyed(greedy), &mut book, now, DRAIN),
            KeptArrival::Early { due }
        );
        assert_eq!(
            promise(
                &mut book,
                greedy,
                None,
                Duration::from_secs(now),
                2,
                DRAIN,
                CLAMP
            )
            .map(|p| p.due),
            Some(due)
        );
    }
    assert_eq!(book.reserved(due), 1, "one place, whatever it asked");
    // It never comes: the place expires after its grace, and another key gets the room.
    let after = due + u64::from(book.settings().grace_s) + 1;
    assert_eq!(
        book.held(greedy, None, after),
        retry_after_policy::Held::Nothing
    );
    assert_eq!(book.counters().get(TicketOutcome::Expired), 1);
    assert_eq!(
        book.outstanding(due),
        1,
        "past seconds no longer count ahead"
    );
    assert_eq!(
        book.place(after, 0.0, 0, 10.0, 1),
        Some(after + 1),
        "the next client is placed from now, nothing held ahead of it"
    );
}

#[test]
fn a_client_back_a_thousand_times_early_keeps_its_place_and_nothing_grows() {
    let mut book = TicketBook::new(KeptReturnsSettings::default());
    let mut router = full_router(&mut book, 100);
    let eager = TicketKey(0x1234 << 32);
    let due = rejected_with_place(&mut book, &mut router, eager, 100);
    for _ in 0..1000 {
        assert_eq!(
            router.arrive_kept(4, keyed(eager), &mut book, 100, DRAIN),
            KeptArrival::Early { due }
        );
    }
    assert_eq!(book.counters().get(TicketOutcome::Early), 1000);
    assert_eq!(
        book.counters().get(TicketOutcome::Issued),
        1,
        "one place, kept"
    );
    assert_eq!(
        router.arrive_kept(4, keyed(eager), &mut book, due, DRAIN),
        KeptArrival::Returned
    );
}

#[test]
fn a_flood_of_distinct_keys_is_refused_places_and_takes_none_already_given() {
    let settings = KeptReturnsSettings {
        max_keys: 1_000,
        ..KeptReturnsSettings::default()
    };
    let mut book = TicketBook::new(settings);
    let mut router = full_router(&mut book, 100);
    let hasher = KeyHasher::new(b"secret");
    let honest = hasher.key(b"honest client");
    let due = rejected_with_place(&mut book, &mut router, honest, 100);
    // 200,000 distinct keys, each rejected and asking for a place, in the same second as
    // the honest client, before its place is due.
    let (mut placed, mut not_placed) = (0u64, 0u64);
    for i in 0..200_000u64 {
        let key = hasher.key(&i.to_be_bytes());
        match promise(
            &mut book,
            key,
            None,
            Duration::from_secs(100),
            2,
            DRAIN,
            CLAMP,
        ) {
            Some(_) => placed += 1,
            None => not_placed += 1,
        }
    }
    let c = book.counters();
    eprintln!(
        "flood of 200,000 keys, book of 1,000: {placed} placed, {not_placed} not (the book: issued {}, refused {}, unplaced {}, expired {})",
        c.get(TicketOutcome::Issued),
        c.get(TicketOutcome::Refused),
        c.get(TicketOutcome::Unplaced),
        c.get(TicketOutcome::Expired),
    );
    // The book counts every outcome the callers saw, the honest client's place among them.
    assert_eq!(c.get(TicketOutcome::Issued), placed + 1);
    assert_eq!(
        c.get(TicketOutcome::Refused) + c.get(TicketOutcome::Unplaced),
        not_placed
    );
    // No more places than the book has slots (1,000), whatever the flood.
    assert!(placed < 1_000, "{placed}");
    // The honest client's place was neither taken nor moved.
    assert_eq!(book.held(honest, None, due), retry_after_policy::Held::Due);
}

#[test]
fn memory_per_service_at_100000_keys() {
    let book = TicketBook::new(KeptReturnsSettings::default());
    let bytes = book.memory_bytes();
    eprintln!(
        "a book of 100,000 keys (the default) holds {bytes} bytes ({:.1} MiB, {:.1} bytes a key)",
        bytes as f64 / 1048576.0,
        bytes as f64 / 100_000.0
    );
    assert!(bytes < 4 << 20, "{bytes}");
}

#[test]
fn one_address_rotating_ten_thousand_keys_takes_its_share_and_honest_clients_keep_their_places() {
    // 10% of the drain (10 a second) for any one address: a place a second.
    let settings = KeptReturnsSettings {
        source_share_percent: 10,
        ..KeptReturnsSettings::default()
    };
    let mut book = TicketBook::new(settings);
    let hasher = KeyHasher::new(b"secret");
    let attacker = Some(hasher.key(b"203.0.113.9"));
    let mut router = full_router(&mut book, 100);
    // For 10 s, the address sends 1,000 requests a second, each with a key never seen, all
    // rejected; 4 honest clients a second, each from an address of its own, are rejected too,
    // and come back at their places.
    let (mut attacker_placed, mut attacker_not) = (0u64, 0u64);
    let mut attacker_per_second = std::collections::BTreeMap::<u64, u64>::new();
    let mut honest = Vec::new();
    for second in 100..110u64 {
        for i in 0..1_000u64 {
            let at = Duration::from_millis(second * 1000 + i);
            let key = hasher.key(format!("rotated {second} {i}").as_bytes());
            match promise(&mut book, key, attacker, at, 2, DRAIN, CLAMP) {
                Some(place) => {
                    attacker_placed += 1;
                    *attacker_per_second.entry(place.due).or_default() += 1;
                }
                None => attacker_not += 1,
            }
        }
        for c in 0..4u64 {
            let key = hasher.key(format!("honest {second} {c}").as_bytes());
            let source = Some(hasher.key(format!("198.51.100.{}", second * 4 + c).as_bytes()));
            let arrival = router.arrive_kept(9, keyed(key), &mut book, second, DRAIN);
            assert!(matches!(arrival, KeptArrival::Rejected { .. }));
            let place = promise(
                &mut book,
                key,
                source,
                Duration::from_millis(second * 1000 + 500),
                router.queue_depth(),
                DRAIN,
                CLAMP,
            )
            .expect("an honest client gets a place");
            honest.push((key, place.due));
        }
    }
    let c = book.counters();
    eprintln!(
        "10,000 rotated keys from one address: {attacker_placed} placed, {attacker_not} not \
         (over_share {}); 40 honest clients placed, the last due {} s after the first",
        c.get(TicketOutcome::OverShare),
        honest.last().unwrap().1 - honest[0].1
    );
    // The address had its share: one place a second at 10% of 10 a second, and one at once.
    assert!(attacker_placed <= 11, "{attacker_placed}");
    assert_eq!(c.get(TicketOutcome::OverShare), attacker_not);
    assert!(
        attacker_per_second.values().all(|&n| n <= 2),
        "{attacker_per_second:?}"
    );
    // Every honest client is admitted at its place, which the flood did not push back: 4 a
    // second against a drain of 10, so within a few seconds of its rejection.
    for (key, due) in honest {
        assert!(due <= 112, "due {due}");
        assert_eq!(
            router.arrive_kept(9, keyed(key), &mut book, due, DRAIN),
            KeptArrival::Returned
        );
    }
}
