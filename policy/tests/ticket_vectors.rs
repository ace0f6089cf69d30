//! The shared ticket vectors: what the Rust [`TicketBook`], [`KeyHasher`] and
//! [`ReturnCookie`] do for sequences of operations, kept in `policy/tests/ticket_vectors.tsv`.
//! The Lua and Python ports of kept returns replay that file (`ports.rs` beside this one, and
//! LuaJIT in the root suite); this test fails when the Rust book drifts from it. After an
//! intended change, write the file anew with `UPDATE_VECTORS=1 cargo test -p
//! retry-after-policy --test ticket_vectors` and say why in the commit.
//!
//! One line per operation, tab-separated, the expected result last:
//!
//! ```text
//! book    max_keys grace_s horizon_s max_returns_per_key source_share_percent max_sources
//!                                       (a new, empty book)
//! held    key cookie_due|- now          -> nothing | due | early:<second> | spent
//! take    key cookie_due|- now          -> ok
//! issue   key due now                   -> <second> | refused
//! place   now elapsed depth drain min_s -> <second> | none
//! give    key source|- now elapsed depth drain|- low high hint|- fresh deadline|-
//!                                       -> <due>:<seconds> | none | beyond:<due>:<seconds>
//!                                       (give_place: the place a rejection is given)
//! expected second                       -> <returns, 6 decimals>
//! counters                              -> every TicketOutcome's count, in its order
//! mac     secret service|- message      -> 40 hex digits (HMAC-SHA1), and the key (16)
//! cookie  secret service due nonce      -> the cookie's value
//! read    secret service value          -> <due>.<nonce> | malformed | forged
//! setcookie secret service name due nonce now grace -> the whole Set-Cookie value
//! source  header|- peer                 -> the address a source is followed under
//! deadline header|- budget|-            -> the wait a request allows, whole seconds | -
//! ```
//!
//! Keys are 16 hex digits; `elapsed` and `drain` are written with `{:?}` (shortest exact).

use std::fmt::Write as _;

use rand::{Rng, RngExt, SeedableRng, rngs::SmallRng};
use retry_after_policy::{
    CookieError, Held, Hint, KeptReturnsSettings, KeyHasher, Placement, ReturnCookie, TicketBook,
    TicketKey, deadline_s, give_place, source_address,
};

#[path = "common/vectors_file.rs"]
mod vectors_file;

/// Books in the file, each with its run of operations.
const BOOKS: usize = 120;
/// Operations per book.
const OPS: usize = 40;

fn held_text(held: Held) -> String {
    match held {
        Held::Nothing => "nothing".to_owned(),
        Held::Due => "due".to_owned(),
        Held::Early(s) => format!("early:{s}"),
        Held::Spent => "spent".to_owned(),
    }
}

fn cookie_due_text(due: Option<u64>) -> String {
    due.map_or_else(|| "-".to_owned(), |d| d.to_string())
}

/// A key from a small set (so that keys meet again and buckets fill), its high half varied.
fn key(rng: &mut impl Rng) -> TicketKey {
    let high: u64 = rng.random_range(0..24);
    let low: u64 = rng.random_range(0..4);
    TicketKey((high << 32) | (low * 0x9e37_79b9))
}

fn one_book(rng: &mut impl Rng, out: &mut String) {
    let settings = KeptReturnsSettings {
        max_keys: [8, 16, 64][rng.random_range(0..3)],
        grace_s: rng.random_range(0..8),
        horizon_s: rng.random_range(1..40),
        max_returns_per_key: rng.random_range(1..4),
        source_share_percent: [0, 1, 5, 50][rng.random_range(0..4)],
        max_sources: [8, 16][rng.random_range(0..2)],
    };
    let mut book = TicketBook::new(settings);
    let _ = writeln!(
        out,
        "book\t{}\t{}\t{}\t{}\t{}\t{}",
        settings.max_keys,
        settings.grace_s,
        settings.horizon_s,
        settings.max_returns_per_key,
        settings.source_share_percent,
        settings.max_sources
    );
    let mut now: u64 = rng.random_range(1_000..2_000);
    for _ in 0..OPS {
        now += rng.random_range(0..3);
        let k = key(rng);
        let cookie_due = rng
            .random_bool(0.3)
            .then(|| now + rng.random_range(0..10) - 5);
        match rng.random_range(0..11) {
            0 | 1 => {
                let held = book.held(k, cookie_due, now);
                let _ = writeln!(
                    out,
                    "held\t{:016x}\t{}\t{now}\t{}",
                    k.0,
                    cookie_due_text(cookie_due),
                    held_text(held)
                );
            }
            2 => {
                book.take(k, cookie_due, now);
                let _ = writeln!(
                    out,
                    "take\t{:016x}\t{}\t{now}\tok",
                    k.0,
                    cookie_due_text(cookie_due)
                );
            }
            3..=5 => {
                let due = now + rng.random_range(0..60);
                let got = book.issue(k, due, now);
                let _ = writeln!(
                    out,
                    "issue\t{:016x}\t{due}\t{now}\t{}",
                    k.0,
                    got.map_or_else(|| "refused".to_owned(), |s| s.to_string())
                );
            }
            6 => {
                let elapsed = f64::from(rng.random_range(0..1000u32)) / 1000.0;
                let depth = rng.random_range(0..20u64);
                let drain = [0.0, 0.5, 1.0, 2.5, 7.25, 40.0][rng.random_range(0..6)];
                let min_s = rng.random_range(1..3u64);
                let got = book.place(now, elapsed, depth, drain, min_s);
                let _ = writeln!(
                    out,
                    "place\t{now}\t{elapsed:?}\t{depth}\t{drain:?}\t{min_s}\t{}",
                    got.map_or_else(|| "none".to_owned(), |s| s.to_string())
                );
            }
            8..=10 => give(rng, &mut book, k, now, out),
            _ => {
                let second = now + rng.random_range(0..6) - 2;
                let _ = writeln!(out, "expected\t{second}\t{:.6}", book.expected(second));
            }
        }
    }
    let counts: Vec<String> = book.counters().iter().map(|(_, n)| n.to_string()).collect();
    let _ = writeln!(out, "counters\t{}", counts.join(","));
}

/// A `give` line: the place [`give_place`] gives `key` at `now`, with or without a drain
/// rate, and a hint from a fresh estimate, the static value or absent.
fn give(rng: &mut impl Rng, book: &mut TicketBook, key: TicketKey, now: u64, out: &mut String) {
    let elapsed = f64::from(rng.random_range(0..1000u32)) / 1000.0;
    let depth = rng.random_range(0..20u64);
    let drain = rng
        .random_bool(0.5)
        .then(|| [0.5, 1.0, 2.5, 7.25, 40.0][rng.random_range(0..5)]);
    let low = rng.random_range(1..3u64);
    let clamp = (low, low + rng.random_range(0..60u64));
    let hint = rng.random_bool(0.8).then(|| Hint {
        seconds: rng.random_range(1..70),
        fresh: rng.random_bool(0.6),
    });
    // A few sources, so that one spends its allowance and buckets of sources fill.
    let source = rng.random_bool(0.8).then(|| {
        let high: u64 = rng.random_range(0..2);
        TicketKey((high << 32) | rng.random_range(0..6u64))
    });
    // Deadlines near the places given, so that some fall short of them.
    let deadline = rng.random_bool(0.4).then(|| rng.random_range(0..20u64));
    let got = give_place(
        book,
        key,
        source,
        now,
        elapsed,
        depth,
        drain,
        clamp,
        deadline,
        || hint,
    );
    let _ = writeln!(
        out,
        "give\t{:016x}\t{}\t{now}\t{elapsed:?}\t{depth}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
        key.0,
        source.map_or_else(|| "-".to_owned(), |s| format!("{:016x}", s.0)),
        drain.map_or_else(|| "-".to_owned(), |d| format!("{d:?}")),
        clamp.0,
        clamp.1,
        hint.map_or_else(|| "-".to_owned(), |h| h.seconds.to_string()),
        u8::from(hint.is_some_and(|h| h.fresh)),
        deadline.map_or_else(|| "-".to_owned(), |d| d.to_string()),
        placement_text(got)
    );
}

fn placement_text(placement: Placement) -> String {
    match placement {
        Placement::Kept(p) => format!("{}:{}", p.due, p.seconds),
        Placement::HintAlone => "none".to_owned(),
        Placement::BeyondDeadline(p) => format!("beyond:{}:{}", p.due, p.seconds),
    }
}

fn macs(rng: &mut impl Rng, out: &mut String) {
    for i in 0..20 {
        let secret = format!("secret-{}", rng.random_range(0..1000));
        let message = format!("client-{i}-{}", rng.random_range(0..1_000_000));
        let hasher = KeyHasher::new(secret.as_bytes());
        let mac: String = hasher
            .mac(message.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let _ = writeln!(
            out,
            "mac\t{secret}\t{message}\t{mac}\t{:016x}",
            hasher.key(message.as_bytes()).0
        );
        let cookie = ReturnCookie {
            due: 1_700_000_000 + rng.random_range(0..100_000),
            nonce: rng.random(),
        };
        let value = cookie.write(&hasher, "api");
        let _ = writeln!(
            out,
            "cookie\t{secret}\tapi\t{}\t{:016x}\t{value}",
            cookie.due, cookie.nonce
        );
        // The Set-Cookie a proxy sends with it, at a moment up to 200 s before its due
        // second (a place beyond the clamp) to 5 s after it, with a grace of 0 to 60 s.
        let now = cookie.due + 5 - rng.random_range(0..206);
        let grace: u32 = rng.random_range(0..61);
        let name = ["retry_after_return", "r"][i % 2];
        let _ = writeln!(
            out,
            "setcookie\t{secret}\tapi\t{name}\t{}\t{:016x}\t{now}\t{grace}\t{}",
            cookie.due,
            cookie.nonce,
            cookie.set_cookie(&hasher, "api", name, now, grace)
        );
        let mut bad = value.clone();
        bad.replace_range(0..1, if value.starts_with('1') { "2" } else { "1" });
        for (service, v) in [("api", value.as_str()), ("other", &value), ("api", &bad)] {
            let read = match ReturnCookie::read(v, &hasher, service) {
                Ok(c) => format!("{}.{:016x}", c.due, c.nonce),
                Err(CookieError::Malformed) => "malformed".to_owned(),
                Err(CookieError::Forged) => "forged".to_owned(),
            };
            let _ = writeln!(out, "read\t{secret}\t{service}\t{v}\t{read}");
        }
    }
    for v in [
        "",
        "1.2",
        "x.0000000000000001.00",
        "12.zzzzzzzzzzzzzzzz.0000000000000000000000000000000000000000",
    ] {
        let hasher = KeyHasher::new(b"s");
        let read = match ReturnCookie::read(v, &hasher, "api") {
            Ok(c) => format!("{}.{:016x}", c.due, c.nonce),
            Err(CookieError::Malformed) => "malformed".to_owned(),
            Err(CookieError::Forged) => "forged".to_owned(),
        };
        let _ = writeln!(out, "read\ts\tapi\t{v}\t{read}");
    }
}

fn vectors() -> String {
    let mut rng = SmallRng::seed_from_u64(31);
    let mut out = String::new();
    for _ in 0..BOOKS {
        one_book(&mut rng, &mut out);
    }
    macs(&mut rng, &mut out);
    sources(&mut out);
    deadlines(&mut out);
    out
}

/// `deadline` lines: the wait a request allows, from its deadline header's value (`-`: none)
/// and the proxy's budget (`-`: none).
fn deadlines(out: &mut String) {
    let headers = [
        None,
        Some("30"),
        Some(" 7 "),
        Some("2.9"),
        Some("0.25"),
        Some("0"),
        Some("999999999"),
        Some("1234567890"),
        Some(" "),
        Some("-1"),
        Some("+3"),
        Some("1e3"),
        Some(".5"),
        Some("5."),
        Some("1.2.3"),
        Some("ten"),
    ];
    for header in headers {
        for budget in [None, Some(5), Some(60)] {
            let text = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
            let _ = writeln!(
                out,
                "deadline\t{}\t{}\t{}",
                header.unwrap_or("-"),
                text(budget),
                text(deadline_s(header, budget))
            );
        }
    }
}

/// `source` lines: the address a request's source is followed under, from the source
/// header's value (`-`: none) and the peer's address.
fn sources(out: &mut String) {
    let headers = [
        None,
        Some("203.0.113.9"),
        Some("6.6.6.6, 203.0.113.9"),
        Some("6.6.6.6,203.0.113.9 "),
        Some(" 2001:db8::1 "),
        Some("203.0.113.9, "),
        Some(","),
        Some("a, b, c"),
    ];
    for header in headers {
        let address = source_address(header.map(str::as_bytes), b"127.0.0.1");
        let _ = writeln!(
            out,
            "source\t{}\t127.0.0.1\t{}",
            header.unwrap_or("-"),
            String::from_utf8_lossy(address)
        );
    }
}

#[test]
fn the_rust_book_is_the_shared_ticket_vectors() {
    vectors_file::check_or_update(&vectors(), "ticket_vectors.tsv", "ticket_vectors");
}
