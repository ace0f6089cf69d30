//! Kept returns: the proxy keeps the place each rejection promised.
//!
//! A rejected client with a key (a header, its address, a return cookie's nonce) is given a
//! place in the service's [`TicketBook`] at the earliest second with room for it
//! ([`promise`]), and told that second. When it comes back then, [`Router::arrive_kept`]
//! admits it whatever the queue holds; fresh arrivals only get the room the second's places
//! leave ([`FreshRoom`]). The book is the caller's, so proxies can keep one each or share one.
//!
//! [`Router::arrive_kept`]: crate::Router::arrive_kept

use std::{net::IpAddr, time::Duration};

use retry_after_policy::{
    KeptReturnsSettings, KeyHasher, Promise, ReturnCookie, TicketBook, TicketKey, deadline_s,
    give_place, source_address,
};

/// The return cookie's name unless configured otherwise.
pub const RETURN_COOKIE: &str = "retry_after_return";

/// Where a proxy finds a returning client's key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyFrom {
    /// A request header's value (an API key): the same on every attempt of a client.
    Header(String),
    /// A signed return cookie of this name, set on the rejection; any proxy holding the same
    /// secret honours it.
    Cookie(String),
}

/// A proxy's kept returns: where keys come from, the book's settings, and the secret keys
/// and cookies are signed with.
#[derive(Clone, Debug)]
pub struct Keeping {
    /// Where a client's key is found.
    pub key_from: KeyFrom,
    /// The book's settings.
    pub settings: KeptReturnsSettings,
    /// HMAC-SHA1 under the proxies' shared secret.
    pub hasher: KeyHasher,
    /// Where a client's address is read while each source's share of the drain is bounded
    /// (`settings.source_share_percent`): this header's last entry (what the load balancer in
    /// front saw, in its `X-Forwarded-For`), or the connection's peer (also for a request
    /// without the header: a client cannot leave its share by leaving the header out).
    pub source_header: Option<String>,
    /// The header whose value is the seconds a request may wait (`x-request-timeout`), and
    /// the wait every request is allowed: a place beyond either is not given, and the client
    /// is told its seconds and `x-should-retry: false` ([`deadline_s`]).
    pub deadline_header: Option<String>,
    /// The wait every request is allowed, in seconds (`None`: no budget).
    pub max_wait_s: Option<u64>,
}

impl Keeping {
    /// The key a request's source is followed under, from the source header's value and the
    /// connection's `peer`: `None` while sources are not bounded.
    pub fn source(&self, header: Option<&[u8]>, peer: IpAddr) -> Option<TicketKey> {
        if self.settings.source_share_percent == 0 {
            return None;
        }
        let peer = peer.to_string();
        let header = self.source_header.as_ref().and(header);
        Some(self.hasher.key(source_address(header, peer.as_bytes())))
    }

    /// The wait a request allows, from its deadline header's value and the budget: `None`
    /// for no deadline.
    pub fn deadline(&self, header: Option<&[u8]>) -> Option<u64> {
        let header = self
            .deadline_header
            .as_ref()
            .and(header)
            .and_then(|v| std::str::from_utf8(v).ok());
        deadline_s(header, self.max_wait_s)
    }

    /// What a request says of itself as a possible return: its key (hashed), from the header
    /// or from a return cookie that verifies for `service` (anything else: nothing). `cookie`
    /// is the request's `Cookie` header, `header` the key header's value.
    pub fn returning(
        &self,
        service: &str,
        header: Option<&[u8]>,
        cookie: Option<&str>,
    ) -> Option<Returning> {
        match &self.key_from {
            KeyFrom::Header(_) => Some(Returning {
                key: self.hasher.key(header?),
                cookie_due: None,
            }),
            KeyFrom::Cookie(name) => {
                let value = cookie_value(cookie?, name)?;
                let cookie = ReturnCookie::read(value, &self.hasher, service).ok()?;
                Some(Returning {
                    key: TicketKey(cookie.nonce),
                    cookie_due: Some(cookie.due),
                })
            }
        }
    }

    /// The `Set-Cookie` value for a place due at `place.due`, given at `now_s` (cookie keys
    /// only): [`ReturnCookie::set_cookie`], alive until the place's grace ends.
    pub fn set_cookie(
        &self,
        service: &str,
        place: &Promise,
        nonce: u64,
        now_s: u64,
    ) -> Option<String> {
        let KeyFrom::Cookie(name) = &self.key_from else {
            return None;
        };
        let cookie = ReturnCookie {
            due: place.due,
            nonce,
        };
        Some(cookie.set_cookie(&self.hasher, service, name, now_s, self.settings.grace_s))
    }
}

/// The value of cookie `name` in a `Cookie` header.
pub fn cookie_value<'a>(header: &'a str, name: &str) -> Option<&'a str> {
    header.split(';').find_map(|pair| {
        let (k, v) = pair.trim().split_once('=')?;
        (k == name).then_some(v)
    })
}

/// A request that may be a return: its key, and the due second of the return cookie it
/// carried, verified, if the key is a cookie's nonce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Returning {
    /// The book's key for the client.
    pub key: TicketKey,
    /// The verified cookie's due second.
    pub cookie_due: Option<u64>,
}

/// Give `key`, from `source` (see [`Keeping::source`]), a place at `now` (on the book's
/// clock), behind the `queue_depth` requests queued and every place already given, at
/// `drain_rate`, no sooner than `clamp.0` seconds: [`give_place`] without a hint. `None` when
/// the drain rate is not known, no second up to the book's horizon has room, the source has
/// had its share, or the book refuses the key.
pub fn promise(
    book: &mut TicketBook,
    key: TicketKey,
    source: Option<TicketKey>,
    now: Duration,
    queue_depth: usize,
    drain_rate: Option<f64>,
    clamp: (u64, u64),
) -> Option<Promise> {
    let elapsed = f64::from(now.subsec_millis()) / 1000.0;
    let depth = queue_depth as u64;
    give_place(
        book,
        key,
        source,
        now.as_secs(),
        elapsed,
        depth,
        drain_rate,
        clamp,
        None,
        || None,
    )
    .kept()
}

/// The fresh arrivals a router admitted in the current second, against the room the
/// second's reserved returns leave.
#[derive(Clone, Copy, Debug, Default)]
pub struct FreshRoom {
    second: u64,
    admitted: u64,
}

impl FreshRoom {
    /// Whether one more fresh arrival fits second `now_s`: with `returns` expected in it
    /// ([`TicketBook::expected`]), fewer than `drain_rate` (a second's worth) admitted in
    /// all; always while the drain rate is unknown.
    pub fn has_room(&self, now_s: u64, returns: f64, drain_rate: Option<f64>) -> bool {
        let admitted = if self.second == now_s {
            self.admitted
        } else {
            0
        };
        drain_rate.is_none_or(|d| admitted as f64 + returns < d)
    }

    /// One fresh arrival admitted in second `now_s`.
    pub fn admitted(&mut self, now_s: u64) {
        if self.second != now_s {
            *self = Self {
                second: now_s,
                admitted: 0,
            };
        }
        self.admitted += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KeptArrival, Router};

    fn key(k: u64) -> Option<Returning> {
        Some(Returning {
            key: TicketKey(k),
            cookie_due: None,
        })
    }

    #[test]
    fn a_return_at_its_place_is_admitted_ahead_of_fresh_arrivals() {
        let mut book = TicketBook::new(KeptReturnsSettings::default());
        let mut router = Router::new(1, 1);
        let d = Some(2.0);
        assert_eq!(
            router.arrive_kept(0, key(1), &mut book, 100, d),
            KeptArrival::Queued
        );
        let rejected = router.arrive_kept(1, key(2), &mut book, 100, d);
        assert!(matches!(
            rejected,
            KeptArrival::Rejected { queue_depth: 1, .. }
        ));
        let p = promise(
            &mut book,
            TicketKey(2),
            None,
            Duration::from_secs(100),
            1,
            d,
            (1, 60),
        )
        .unwrap();
        assert_eq!((p.due, p.seconds), (101, 1));
        // Early: told the same second, its place kept.
        assert_eq!(
            router.arrive_kept(2, key(2), &mut book, 100, d),
            KeptArrival::Early { due: 101 }
        );
        // At its second the queue is still full, and it is admitted all the same; a fresh
        // arrival is not.
        assert_eq!(
            router.arrive_kept(3, key(2), &mut book, 101, d),
            KeptArrival::Returned
        );
        assert!(matches!(
            router.arrive_kept(4, key(3), &mut book, 101, d),
            KeptArrival::Rejected { .. }
        ));
        assert_eq!(router.queue_depth(), 2);
    }

    #[test]
    fn fresh_arrivals_get_the_room_the_places_leave() {
        let mut room = FreshRoom::default();
        // 4 a second, 3 of them reserved: one fresh arrival fits.
        assert!(room.has_room(100, 3.0, Some(4.0)));
        room.admitted(100);
        assert!(!room.has_room(100, 3.0, Some(4.0)));
        assert!(room.has_room(101, 3.0, Some(4.0)), "a new second");
        assert!(room.has_room(100, 99.0, None), "no drain rate, no limit");
    }

    #[test]
    fn a_deadline_comes_from_the_header_named_and_the_budget() {
        let keeping = |header: Option<&str>, budget| Keeping {
            key_from: KeyFrom::Header("x-api-key".to_owned()),
            settings: KeptReturnsSettings::default(),
            hasher: KeyHasher::new(b"s"),
            source_header: None,
            deadline_header: header.map(str::to_owned),
            max_wait_s: budget,
        };
        assert_eq!(
            keeping(Some("x-request-timeout"), None).deadline(Some(b"12.5")),
            Some(12)
        );
        assert_eq!(
            keeping(Some("x-request-timeout"), Some(5)).deadline(Some(b"12")),
            Some(5)
        );
        assert_eq!(
            keeping(None, None).deadline(Some(b"12")),
            None,
            "no header named"
        );
        assert_eq!(keeping(None, Some(7)).deadline(None), Some(7));
        assert_eq!(
            keeping(Some("x-request-timeout"), None).deadline(Some(b"soon")),
            None
        );
    }

    #[test]
    fn a_cookie_is_found_among_others_and_verified() {
        let keeping = Keeping {
            key_from: KeyFrom::Cookie(RETURN_COOKIE.to_owned()),
            settings: KeptReturnsSettings::default(),
            hasher: KeyHasher::new(b"s"),
            source_header: None,
            deadline_header: None,
            max_wait_s: None,
        };
        let place = Promise {
            due: 1000,
            seconds: 7,
        };
        // Given at 993, due at 1000, 30 s of grace: alive through the whole of second 1030.
        let set = keeping.set_cookie("api", &place, 5, 993).unwrap();
        assert!(set.ends_with("; Max-Age=38; Path=/; HttpOnly"), "{set}");
        // A place 150 s away, told the clamp's 60: the cookie outlives the early visit.
        let far = Promise {
            due: 1150,
            seconds: 60,
        };
        let far_set = keeping.set_cookie("api", &far, 5, 1000).unwrap();
        assert!(
            far_set.ends_with("; Max-Age=181; Path=/; HttpOnly"),
            "{far_set}"
        );
        let value = set.split(';').next().unwrap();
        let header = format!("theme=dark; {value}; lang=en");
        let back = keeping.returning("api", None, Some(&header)).unwrap();
        assert_eq!((back.key, back.cookie_due), (TicketKey(5), Some(1000)));
        assert_eq!(keeping.returning("other", None, Some(&header)), None);
        assert_eq!(keeping.returning("api", None, Some("theme=dark")), None);
    }

    #[test]
    fn a_source_is_the_headers_last_entry_or_else_the_peer() {
        let mut keeping = Keeping {
            key_from: KeyFrom::Header("x-api-key".to_owned()),
            settings: KeptReturnsSettings::default(),
            hasher: KeyHasher::new(b"s"),
            source_header: Some("x-forwarded-for".to_owned()),
            deadline_header: None,
            max_wait_s: None,
        };
        let peer: IpAddr = [127, 0, 0, 1].into();
        assert_eq!(keeping.source(Some(b"10.0.0.9"), peer), None, "not bounded");
        keeping.settings.source_share_percent = 10;
        let lb_saw = keeping.hasher.key(b"10.0.0.9");
        // What the client wrote itself comes first; the load balancer appends what it saw.
        assert_eq!(
            keeping.source(Some(b"6.6.6.6, 10.0.0.9"), peer),
            Some(lb_saw)
        );
        // Without the header (or an empty entry), the peer: leaving it out is no way around.
        let from_peer = Some(keeping.hasher.key(b"127.0.0.1"));
        assert_eq!(keeping.source(None, peer), from_peer);
        assert_eq!(keeping.source(Some(b"10.0.0.9, "), peer), from_peer);
    }
}
