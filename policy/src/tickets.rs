//! Kept returns: the places a proxy keeps for the clients it told to come back.
//!
//! A rejected client is given a ticket: a place at a due second, reserved in a
//! [`TicketBook`] under its key (a request header, its source address, or the nonce of a
//! [`ReturnCookie`]), kept hashed ([`KeyHasher`]). When it comes back with a ticket that is due
//! (from its second to `grace_s` after it) it is admitted whatever the queue holds; fresh
//! arrivals get only the room the returns of the second leave. A client that comes back
//! early keeps its place and is told the time left; a ticket unused past its grace expires.
//!
//! The book is a fixed table made once: `max_keys` slots in buckets of [`BUCKET`], and one
//! reservation counter per second up to the horizon. Nothing on the reject path allocates, and
//! no key can take another's place: a bucket full of live tickets refuses a new key (the
//! client is answered as by the hint policies, without a place) instead of evicting one.

use std::fmt;

use hmac::{Hmac, Mac};

use sha1::Sha1;

use crate::{SourceAllowances, TicketOutcome};

/// Slots per bucket: a key hashes to one bucket and takes any free slot in it.
pub const BUCKET: usize = 8;

/// The slots of `key`'s bucket in a table of `slots` slots (a whole number of buckets): its
/// high 32 bits modulo the buckets (a number every port holds exactly, LuaJIT's doubles
/// included). The book's keys and the followed sources are found so.
pub(crate) fn bucket_of(key: TicketKey, slots: usize) -> std::ops::Range<usize> {
    let buckets = (slots / BUCKET) as u64;
    let start = ((key.0 >> 32) % buckets) as usize * BUCKET;
    start..start + BUCKET
}

/// The settings of kept returns, per service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeptReturnsSettings {
    /// How long after its due second a ticket is still honoured (30 s). A late client takes
    /// no reserved room (its second has passed) but keeps its turn: a client that backs off
    /// on its own past its place still finds it.
    pub grace_s: u32,
    /// The farthest second a ticket may name, from now (300 s,
    /// [`crate::MAX_KEPT_RETRY_AFTER_S`]); a client told more than the header's clamp comes
    /// back early and is told the time left.
    pub horizon_s: u32,
    /// Keys the book holds at once (100,000): the bound of its memory.
    pub max_keys: usize,
    /// Places one key may hold at once (1): more for a key many clients share (an API key).
    pub max_returns_per_key: u16,
    /// The share of the drain, in percent, that the places given to one source (a client
    /// address) may take (0: no bound, the default; see [`SourceAllowances`]). Past it a
    /// rejection gets the hint without a place, counted as `over_share`.
    pub source_share_percent: u8,
    /// Sources followed at once while their share is bounded (4,096).
    pub max_sources: usize,
}

impl Default for KeptReturnsSettings {
    fn default() -> Self {
        Self {
            grace_s: 30,
            horizon_s: crate::MAX_KEPT_RETRY_AFTER_S as u32,
            max_keys: 100_000,
            max_returns_per_key: 1,
            source_share_percent: 0,
            max_sources: 4096,
        }
    }
}

/// A client's key as the book keeps it: the first 8 bytes of HMAC-SHA1 under the proxy's
/// secret, never the key itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TicketKey(pub u64);

/// HMAC-SHA1 under one secret, its key schedule made once.
#[derive(Clone)]
pub struct KeyHasher {
    mac: Hmac<Sha1>,
}

impl fmt::Debug for KeyHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("KeyHasher(..)")
    }
}

impl KeyHasher {
    /// A hasher under `secret` (any length).
    pub fn new(secret: &[u8]) -> Self {
        #[allow(clippy::expect_used)]
        let mac = Hmac::<Sha1>::new_from_slice(secret).expect("HMAC takes a key of any length");
        Self { mac }
    }

    /// HMAC-SHA1(secret, `message`).
    pub fn mac(&self, message: &[u8]) -> [u8; 20] {
        let mut mac = self.mac.clone();
        mac.update(message);
        mac.finalize().into_bytes().into()
    }

    /// The book's key for `raw` (a header value, an address, a cookie's nonce).
    pub fn key(&self, raw: &[u8]) -> TicketKey {
        let mac = self.mac(raw);
        let mut first = [0; 8];
        first.copy_from_slice(&mac[..8]);
        TicketKey(u64::from_be_bytes(first))
    }
}

/// A return cookie: the service, the due second (Unix time) and a nonce, signed, so that any
/// proxy holding the same secret can verify it. Written `<due>.<nonce>.<mac>`: the due
/// second in decimal, the nonce in 16 hex digits, HMAC-SHA1 of `<service>.<due>.<nonce>` in
/// 40.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReturnCookie {
    /// The second the place is due.
    pub due: u64,
    /// Distinguishes the cookies of one second; the book's key for the place.
    pub nonce: u64,
}

/// Why a cookie was not taken: it is treated as absent (the request is a fresh arrival).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CookieError {
    /// Not `<due>.<nonce>.<mac>` with a decimal due second and hex fields of the right length.
    #[error("malformed return cookie")]
    Malformed,
    /// The signature does not match (another secret, another service, or altered).
    #[error("return cookie signature does not match")]
    Forged,
}

impl ReturnCookie {
    /// The cookie's value, signed for `service`.
    pub fn write(&self, hasher: &KeyHasher, service: &str) -> String {
        let body = format!("{}.{:016x}", self.due, self.nonce);
        let mac = hasher.mac(format!("{service}.{body}").as_bytes());
        format!("{body}.{}", hex(&mac))
    }

    /// The `Set-Cookie` value that hands this cookie, named `name` and signed for `service`,
    /// to a client at `now_s`: `HttpOnly`, for every path, and alive until the place's grace
    /// has passed ([`ReturnCookie::max_age`]). Every proxy writes exactly this.
    pub fn set_cookie(
        &self,
        hasher: &KeyHasher,
        service: &str,
        name: &str,
        now_s: u64,
        grace_s: u32,
    ) -> String {
        let value = self.write(hasher, service);
        let max_age = self.max_age(now_s, grace_s);
        format!("{name}={value}; Max-Age={max_age}; Path=/; HttpOnly")
    }

    /// The cookie's `Max-Age` when set at `now_s` (any fraction of it): to the end of the last
    /// second of the grace, `due - now_s + grace_s + 1`, so that a client that was told
    /// less than the whole wait (the clamp) and comes back early still carries it at its
    /// place. A place cannot be due before it is given; were it, the cookie still lives
    /// through the grace.
    pub fn max_age(&self, now_s: u64, grace_s: u32) -> u64 {
        self.due.saturating_sub(now_s) + u64::from(grace_s) + 1
    }

    /// A cookie's value read and verified for `service`.
    ///
    /// # Errors
    /// [`CookieError`]: malformed, or signed by another secret or for another service.
    pub fn read(value: &str, hasher: &KeyHasher, service: &str) -> Result<Self, CookieError> {
        let mut parts = value.trim().split('.');
        let (Some(due), Some(nonce), Some(mac), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(CookieError::Malformed);
        };
        let due: u64 = due.parse().map_err(|_| CookieError::Malformed)?;
        if nonce.len() != 16 || mac.len() != 40 {
            return Err(CookieError::Malformed);
        }
        let nonce = u64::from_str_radix(nonce, 16).map_err(|_| CookieError::Malformed)?;
        let cookie = Self { due, nonce };
        let expected = hasher.mac(format!("{service}.{due}.{nonce:016x}").as_bytes());
        if !constant_time_eq(
            hex(&expected).as_bytes(),
            mac.to_ascii_lowercase().as_bytes(),
        ) {
            return Err(CookieError::Forged);
        }
        Ok(cookie)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// What a key holds at a moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// Nothing (or a ticket that just expired): a fresh arrival.
    Nothing,
    /// A place due now (its second to the grace after it).
    Due,
    /// A place due at this later second.
    Early(u64),
    /// A cookie's place already taken here: a replay, treated as a fresh arrival.
    Spent,
}

/// What the book has done since it was made, per [`TicketOutcome`]: the series an operator
/// watches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TicketCounters {
    counts: [u64; TicketOutcome::ALL.len()],
}

impl TicketCounters {
    /// The count of `outcome`.
    pub fn get(&self, outcome: TicketOutcome) -> u64 {
        self.counts[outcome as usize]
    }

    /// Count `n` more of `outcome`.
    pub fn add(&mut self, outcome: TicketOutcome, n: u64) {
        let count = &mut self.counts[outcome as usize];
        *count = count.saturating_add(n);
    }

    /// What happened since `earlier` (a report's counts).
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            counts: std::array::from_fn(|i| self.counts[i].saturating_sub(earlier.counts[i])),
        }
    }

    /// Every outcome with its count, in the vocabulary's order.
    pub fn iter(&self) -> impl Iterator<Item = (TicketOutcome, u64)> + '_ {
        TicketOutcome::ALL.iter().map(|&o| (o, self.get(o)))
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    key: u64,
    due: u64,
    /// Places left; 0 with `spent` set: a cookie's place taken (kept until it expires).
    count: u16,
    spent: bool,
}

impl Slot {
    fn is_free(&self, now: u64, grace: u64) -> bool {
        (self.count == 0 && !self.spent) || self.due + grace < now
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Bin {
    second: u64,
    reserved: u32,
    taken: u32,
    /// Of those taken, by their due second or the one after (a client that waited as told).
    on_time: u32,
}

/// One service's tickets: places per key and reservations per second, in fixed memory.
#[derive(Clone, Debug)]
pub struct TicketBook {
    settings: KeptReturnsSettings,
    slots: Box<[Slot]>,
    bins: Box<[Bin]>,
    counters: TicketCounters,
    shows: ShowRate,
    /// The latest second a place was given for.
    last_due: u64,
    /// Each source's places, when their share is bounded.
    sources: Option<SourceAllowances>,
}

/// The share of places whose client came back on time (in the due second or the next), over
/// the seconds settled so far (recent ones weigh most): the book counts a place due as this
/// share of one, so that places clients do not keep on time (clients that back off on their
/// own, and come early or late) leave their room to fresh arrivals instead of idle. Returns
/// are admitted all the same: a wrong share costs queueing, never a kept place.
#[derive(Clone, Copy, Debug)]
struct ShowRate {
    /// Every second up to this one has been settled.
    settled: u64,
    shown: f64,
    given: f64,
}

impl Default for ShowRate {
    fn default() -> Self {
        Self {
            settled: 0,
            shown: 1.0,
            given: 1.0,
        }
    }
}

/// Settled places beyond which older ones count half (a memory of a few thousand places).
const SHOW_MEMORY: f64 = 4096.0;

impl ShowRate {
    fn rate(&self) -> f64 {
        (self.shown / self.given).clamp(0.05, 1.0)
    }

    fn settle(&mut self, bin: &Bin) {
        self.shown += f64::from(bin.on_time.min(bin.reserved));
        self.given += f64::from(bin.reserved);
        if self.given > SHOW_MEMORY {
            self.shown /= 2.0;
            self.given /= 2.0;
        }
    }
}

impl TicketBook {
    /// An empty book, its memory taken at once.
    pub fn new(settings: KeptReturnsSettings) -> Self {
        let buckets = settings.max_keys.div_ceil(BUCKET).max(1);
        let bins = settings.horizon_s as usize + settings.grace_s as usize + 2;
        Self {
            settings,
            slots: vec![Slot::default(); buckets * BUCKET].into_boxed_slice(),
            bins: vec![Bin::default(); bins].into_boxed_slice(),
            counters: TicketCounters::default(),
            shows: ShowRate::default(),
            last_due: 0,
            sources: (settings.source_share_percent > 0).then(|| {
                SourceAllowances::new(settings.source_share_percent, settings.max_sources)
            }),
        }
    }

    /// Whether places are given for `now` or later: clients are in line.
    pub fn line_ahead(&self, now: u64) -> bool {
        self.last_due >= now
    }

    /// The share of places kept by their clients lately (1 until places have been settled).
    pub fn show_rate(&self) -> f64 {
        self.shows.rate()
    }

    /// Settle every second whose grace has passed by `now`: its places were kept or not.
    fn settle(&mut self, now: u64) {
        let last = now.saturating_sub(u64::from(self.settings.grace_s) + 1);
        let ring = self.bins.len() as u64;
        let first = (self.shows.settled + 1).max(last.saturating_sub(ring - 1));
        for second in first..=last {
            if let Some(bin) = self.bin(second).copied() {
                self.shows.settle(&bin);
            }
        }
        self.shows.settled = self.shows.settled.max(last);
    }

    /// Returns expected in second `second`: those taken in it, and those outstanding at the
    /// show rate.
    pub fn expected(&self, second: u64) -> f64 {
        self.bin(second).map_or(0.0, |b| {
            f64::from(b.taken) + f64::from(b.reserved.saturating_sub(b.taken)) * self.show_rate()
        })
    }

    /// The settings it was made with.
    pub fn settings(&self) -> &KeptReturnsSettings {
        &self.settings
    }

    /// What it has done so far.
    pub fn counters(&self) -> TicketCounters {
        self.counters
    }

    /// A rejected client given no place ([`give_place`](crate::give_place)): counted.
    pub fn unplaced(&mut self) {
        self.counters.add(TicketOutcome::Unplaced, 1);
    }

    /// A rejected client whose place lay beyond its deadline, given none: counted.
    pub fn beyond_deadline(&mut self) {
        self.counters.add(TicketOutcome::BeyondDeadline, 1);
    }

    /// Whether a place may go to a request of `source` at time `t` (seconds, with their
    /// fraction), the fleet draining `drain_rate`: always where sources are not bounded;
    /// otherwise one of its allowance is spent ([`SourceAllowances::spend`]), and a source
    /// past its share is counted as `over_share`.
    pub fn spend_source(&mut self, source: TicketKey, t: f64, drain_rate: f64) -> bool {
        let Some(sources) = &mut self.sources else {
            return true;
        };
        let spent = sources.spend(source, t, drain_rate);
        if !spent {
            self.counters.add(TicketOutcome::OverShare, 1);
        }
        spent
    }

    /// Bytes of memory it holds (fixed at creation).
    pub fn memory_bytes(&self) -> usize {
        size_of::<Self>()
            + self.slots.len() * size_of::<Slot>()
            + self.bins.len() * size_of::<Bin>()
            + self
                .sources
                .as_ref()
                .map_or(0, SourceAllowances::memory_bytes)
    }

    /// What `key` holds at second `now`. `cookie_due` is the due second of a place another
    /// proxy may have given `key`: a verified return cookie whose nonce `key` is, or a place
    /// shared between proxies (a stick table replicated by HAProxy's peers). An expired
    /// ticket is counted and forgotten here, and the place shown, if any, looked at instead;
    /// a place taken here is a replay when shown again, and forgotten for another one of the
    /// same key (shared places: a key holds a new place after one is taken). A place the book
    /// could not remember as taken (its bucket full of live places) holds nothing, counted as
    /// unrecorded: never a place that every replay would find.
    pub fn held(&mut self, key: TicketKey, cookie_due: Option<u64>, now: u64) -> Held {
        self.settle(now);
        let grace = u64::from(self.settings.grace_s);
        let window = |due: u64| {
            if now < due {
                Held::Early(due)
            } else if now <= due + grace {
                Held::Due
            } else {
                Held::Nothing
            }
        };
        if let Some(i) = self.find(key) {
            let slot = self.slots[i];
            if slot.spent {
                match cookie_due {
                    None => return Held::Nothing,
                    Some(due) if due == slot.due => {
                        self.counters.add(TicketOutcome::Replayed, 1);
                        return Held::Spent;
                    }
                    // Another place of the key, given since: its slot is free for it.
                    Some(_) => self.slots[i] = Slot::default(),
                }
            } else {
                let held = window(slot.due);
                if held != Held::Nothing {
                    return self.count_early(held);
                }
                self.counters
                    .add(TicketOutcome::Expired, u64::from(slot.count));
                self.slots[i] = Slot::default();
            }
        }
        let held = cookie_due.map_or(Held::Nothing, window);
        if held != Held::Nothing && !self.has_free_slot(key, now) {
            // A cookie's place whose taking could not be remembered (its bucket full of live
            // places) would stay good for every replay: it is a fresh arrival instead.
            self.counters.add(TicketOutcome::Unrecorded, 1);
            return Held::Nothing;
        }
        self.count_early(held)
    }

    fn count_early(&mut self, held: Held) -> Held {
        if matches!(held, Held::Early(_)) {
            self.counters.add(TicketOutcome::Early, 1);
        }
        held
    }

    /// `key` takes one of its places at `now` (due, or early into free room); `cookie_due`
    /// as for [`held`](Self::held): a cookie's place is remembered as spent until it
    /// expires, so that a replay is not admitted again.
    pub fn take(&mut self, key: TicketKey, cookie_due: Option<u64>, now: u64) {
        let due = match self.find(key) {
            Some(i) => {
                let slot = &mut self.slots[i];
                slot.count = slot.count.saturating_sub(1);
                slot.spent = cookie_due.is_some();
                slot.due
            }
            None => {
                let Some(due) = cookie_due else { return };
                if let Some(i) = self.free_slot(key, now) {
                    self.slots[i] = Slot {
                        key: key.0,
                        due,
                        count: 0,
                        spent: true,
                    };
                }
                due
            }
        };
        if due <= now {
            self.counters.add(TicketOutcome::Honoured, 1);
        }
        if let Some(bin) = self.bin_mut(due) {
            bin.taken = bin.taken.saturating_add(1);
            bin.on_time = bin.on_time.saturating_add(u32::from(now <= due + 1));
        }
    }

    /// Returns reserved for second `second` and not yet taken.
    pub fn outstanding(&self, second: u64) -> u32 {
        self.bin(second)
            .map_or(0, |b| b.reserved.saturating_sub(b.taken))
    }

    /// Returns reserved for second `second`.
    pub fn reserved(&self, second: u64) -> u32 {
        self.bin(second).map_or(0, |b| b.reserved)
    }

    /// The earliest second, at least `min_s` after second `now`, by whose end `drain_rate`
    /// has served what is ahead: the part of second `now` already gone (`elapsed`, 0 to 1),
    /// the `queue_depth` requests queued, every return expected up to it (outstanding places
    /// at the show rate) and one more. The returns drain in turn, not competing with fresh
    /// arrivals. `None` within the horizon, or without a usable drain rate.
    pub fn place(
        &self,
        now: u64,
        elapsed: f64,
        queue_depth: u64,
        drain_rate: f64,
        min_s: u64,
    ) -> Option<u64> {
        let horizon = u64::from(self.settings.horizon_s);
        let shows = self.show_rate();
        let gone = drain_rate * elapsed.clamp(0.0, 1.0);
        let ahead = |s: u64| {
            let returns = f64::from(self.outstanding(now + s)) * shows;
            if s == 0 { returns + gone } else { returns }
        };
        crate::policy::earliest_second(queue_depth, drain_rate, ahead, min_s, horizon)
            .map(|s| now + s)
    }

    /// Give `key` a place at `due` (a second from [`place`](Self::place)), at `now`; a key
    /// already holding a place gets another at the same second, up to
    /// `max_returns_per_key`. Returns the due second of the key's place, or `None` when its
    /// bucket is full of live tickets (counted as refused).
    pub fn issue(&mut self, key: TicketKey, due: u64, now: u64) -> Option<u64> {
        let cap = self.settings.max_returns_per_key.max(1);
        let i = match self.find(key) {
            Some(i) if !self.slots[i].spent => {
                let slot = &mut self.slots[i];
                if slot.count >= cap {
                    return Some(slot.due);
                }
                slot.count += 1;
                i
            }
            found => {
                let Some(i) = found.or_else(|| self.free_slot(key, now)) else {
                    self.counters.add(TicketOutcome::Refused, 1);
                    return None;
                };
                self.slots[i] = Slot {
                    key: key.0,
                    due,
                    count: 1,
                    spent: false,
                };
                i
            }
        };
        let due = self.slots[i].due;
        self.reserve(due);
        self.last_due = self.last_due.max(due);
        self.counters.add(TicketOutcome::Issued, 1);
        Some(due)
    }

    fn reserve(&mut self, due: u64) {
        let len = self.bins.len() as u64;
        let bin = &mut self.bins[(due % len) as usize];
        if bin.second != due {
            *bin = Bin {
                second: due,
                ..Bin::default()
            };
        }
        bin.reserved = bin.reserved.saturating_add(1);
    }

    fn bin(&self, second: u64) -> Option<&Bin> {
        let bin = &self.bins[(second % self.bins.len() as u64) as usize];
        (bin.second == second).then_some(bin)
    }

    fn bin_mut(&mut self, second: u64) -> Option<&mut Bin> {
        let len = self.bins.len() as u64;
        let bin = &mut self.bins[(second % len) as usize];
        (bin.second == second).then_some(bin)
    }

    fn bucket(&self, key: TicketKey) -> std::ops::Range<usize> {
        bucket_of(key, self.slots.len())
    }

    fn find(&self, key: TicketKey) -> Option<usize> {
        self.bucket(key).find(|&i| {
            let slot = &self.slots[i];
            slot.key == key.0 && (slot.count > 0 || slot.spent)
        })
    }

    /// Whether `key`'s bucket has a slot that holds nothing live at `now`.
    fn has_free_slot(&self, key: TicketKey, now: u64) -> bool {
        let grace = u64::from(self.settings.grace_s);
        self.bucket(key).any(|i| self.slots[i].is_free(now, grace))
    }

    /// A slot of `key`'s bucket that holds nothing live at `now`; an expired ticket found on
    /// the way is counted.
    fn free_slot(&mut self, key: TicketKey, now: u64) -> Option<usize> {
        let grace = u64::from(self.settings.grace_s);
        let i = self
            .bucket(key)
            .find(|&i| self.slots[i].is_free(now, grace))?;
        let slot = self.slots[i];
        if !slot.spent {
            self.counters
                .add(TicketOutcome::Expired, u64::from(slot.count));
        }
        Some(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn book() -> TicketBook {
        TicketBook::new(KeptReturnsSettings::default())
    }

    const K: TicketKey = TicketKey(7);

    #[test]
    fn a_place_is_due_from_its_second_to_the_grace_after_it() {
        let mut b = book();
        assert_eq!(b.issue(K, 110, 100), Some(110));
        assert_eq!(b.held(K, None, 105), Held::Early(110));
        assert_eq!(b.held(K, None, 110), Held::Due);
        assert_eq!(b.held(K, None, 115), Held::Due);
        assert_eq!(b.outstanding(110), 1);
        b.take(K, None, 112);
        assert_eq!((b.outstanding(110), b.reserved(110)), (0, 1));
        assert_eq!(b.held(K, None, 113), Held::Nothing);
        let c = b.counters();
        let got = [
            TicketOutcome::Issued,
            TicketOutcome::Honoured,
            TicketOutcome::Early,
        ]
        .map(|o| c.get(o));
        assert_eq!(got, [1, 1, 1]);
    }

    #[test]
    fn an_unused_place_expires_after_its_grace() {
        let mut b = book();
        b.issue(K, 110, 100);
        assert_eq!(b.held(K, None, 140), Held::Due);
        assert_eq!(b.held(K, None, 141), Held::Nothing);
        assert_eq!(b.counters().get(TicketOutcome::Expired), 1);
        assert_eq!(b.held(K, None, 142), Held::Nothing);
        assert_eq!(b.counters().get(TicketOutcome::Expired), 1, "counted once");
    }

    #[test]
    fn places_fill_the_drain_in_turn() {
        let mut b = book();
        // 2 a second, nothing queued: by the end of second 1 the drain has served four (the
        // rest of this second counts), then two a second.
        let dues: Vec<u64> = (0..6)
            .map(|i| {
                let due = b.place(100, 0.0, 0, 2.0, 1).unwrap();
                b.issue(TicketKey(i), due, 100).unwrap()
            })
            .collect();
        assert_eq!(dues, vec![101, 101, 101, 101, 102, 102]);
        // Ten queued ahead, the six places and this one: 17 served by the end of second 8.
        assert_eq!(b.place(100, 0.0, 10, 2.0, 1), Some(108));
        // Three quarters of this second gone: a second's place and a half are behind.
        assert_eq!(b.place(100, 0.75, 10, 2.0, 1), Some(109));
        assert_eq!(b.place(100, 0.0, 0, 0.0, 1), None);
    }

    #[test]
    fn a_full_bucket_refuses_a_new_key_and_keeps_every_live_one() {
        let mut b = TicketBook::new(KeptReturnsSettings {
            max_keys: 8,
            ..KeptReturnsSettings::default()
        });
        for k in 0..8 {
            assert!(b.issue(TicketKey(k << 32), 120, 100).is_some());
        }
        assert_eq!(b.issue(TicketKey(99 << 32), 120, 100), None);
        assert_eq!(b.counters().get(TicketOutcome::Refused), 1);
        assert!((0..8).all(|k| b.held(TicketKey(k << 32), None, 120) == Held::Due));
        // Once they expire, their slots serve new keys.
        assert_eq!(b.issue(TicketKey(99 << 32), 200, 160), Some(200));
    }

    #[test]
    fn one_key_holds_at_most_its_cap_of_places() {
        let mut b = book();
        assert_eq!(b.issue(K, 110, 100), Some(110));
        assert_eq!(
            b.issue(K, 120, 101),
            Some(110),
            "the key's place, unchanged"
        );
        assert_eq!((b.reserved(110), b.reserved(120)), (1, 0));
        let mut shared = TicketBook::new(KeptReturnsSettings {
            max_returns_per_key: 3,
            ..KeptReturnsSettings::default()
        });
        for _ in 0..5 {
            shared.issue(K, 110, 100);
        }
        assert_eq!(shared.reserved(110), 3);
    }

    #[test]
    fn a_cookie_is_honoured_once_here_even_when_another_proxy_gave_it() {
        let mut b = book();
        assert_eq!(b.held(K, Some(110), 109), Held::Early(110));
        assert_eq!(b.held(K, Some(110), 110), Held::Due);
        b.take(K, Some(110), 110);
        assert_eq!(b.held(K, Some(110), 111), Held::Spent);
        assert_eq!(b.counters().get(TicketOutcome::Replayed), 1);
        // The proxy that gave it: the same.
        let mut own = book();
        own.issue(K, 110, 100);
        own.take(K, Some(110), 110);
        assert_eq!(own.held(K, Some(110), 110), Held::Spent);
    }

    #[test]
    fn a_key_whose_places_are_shared_finds_each_new_place_and_each_is_taken_once() {
        // Places shared between proxies under a header key: the proxy sees each place's
        // second beside the key, its own or another proxy's.
        let mut b = book();
        b.issue(K, 110, 100);
        assert_eq!(b.held(K, Some(110), 110), Held::Due);
        b.take(K, Some(110), 110);
        assert_eq!(b.held(K, Some(110), 111), Held::Spent, "taken: a replay");
        // Later another proxy gives the key a new place: it is found here, once.
        assert_eq!(b.held(K, Some(150), 150), Held::Due);
        b.take(K, Some(150), 150);
        assert_eq!(b.held(K, Some(150), 151), Held::Spent);
        // A place of its own that expired gives way to one shown beside the key.
        b.issue(TicketKey(9), 200, 190);
        assert_eq!(b.held(TicketKey(9), Some(260), 260), Held::Due);
        assert_eq!(b.counters().get(TicketOutcome::Expired), 1);
    }

    #[test]
    fn a_cookie_whose_taking_cannot_be_remembered_is_a_fresh_arrival() {
        // One bucket, full of live places: a cookie's nonce there could not be remembered as
        // taken, so it would be good for every replay. It holds nothing instead.
        let mut b = TicketBook::new(KeptReturnsSettings {
            max_keys: BUCKET,
            ..KeptReturnsSettings::default()
        });
        for k in 100..100 + BUCKET as u64 {
            assert_eq!(b.issue(TicketKey(k), 200, 100), Some(200));
        }
        assert_eq!(b.held(K, Some(110), 110), Held::Nothing);
        assert_eq!(b.held(K, Some(110), 110), Held::Nothing, "nor on a replay");
        assert_eq!(b.counters().get(TicketOutcome::Unrecorded), 2);
        // Once a slot frees (a place taken), the cookie is honoured, once.
        b.take(TicketKey(100), None, 200);
        assert_eq!(b.held(K, Some(110), 111), Held::Due);
        b.take(K, Some(110), 111);
        assert_eq!(b.held(K, Some(110), 112), Held::Spent);
    }

    #[test]
    fn cookies_verify_only_under_their_secret_and_service() {
        let hasher = KeyHasher::new(b"s3cret");
        let cookie = ReturnCookie {
            due: 1_700_000_123,
            nonce: 0xdead_beef,
        };
        let value = cookie.write(&hasher, "api");
        assert_eq!(ReturnCookie::read(&value, &hasher, "api"), Ok(cookie));
        assert_eq!(
            ReturnCookie::read(&value, &hasher, "other"),
            Err(CookieError::Forged)
        );
        assert_eq!(
            ReturnCookie::read(&value, &KeyHasher::new(b"x"), "api"),
            Err(CookieError::Forged)
        );
        let later = value.replacen("1700000123", "1700000100", 1);
        assert_eq!(
            ReturnCookie::read(&later, &hasher, "api"),
            Err(CookieError::Forged)
        );
        for bad in ["", "1.2", "x.0000000000000001.00", "1.2.3.4"] {
            assert_eq!(
                ReturnCookie::read(bad, &hasher, "api"),
                Err(CookieError::Malformed),
                "{bad}"
            );
        }
    }

    #[test]
    fn keys_are_hmac_sha1_truncated() {
        // RFC 2202 test case 2: HMAC-SHA1("Jefe", "what do ya want for nothing?").
        let hasher = KeyHasher::new(b"Jefe");
        assert_eq!(
            hex(&hasher.mac(b"what do ya want for nothing?")),
            "effcdf6ae5eb2fa2d27416d5f184df9c259a7c79"
        );
        assert_eq!(
            hasher.key(b"what do ya want for nothing?"),
            TicketKey(0xeffc_df6a_e5eb_2fa2)
        );
    }
}
