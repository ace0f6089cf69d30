//! The HTTP/2 streams the programs leave in the kernel's stream table: those of connections
//! that closed with streams open (noted in the close notices), and those open longer than the
//! stream timeout. The agent abandons them, counted in their connection's counters, so that
//! every stream the programs started ends exactly once: at the tick after a close notice, and
//! at the sweep for age, a tenth of the timeout apart (10 s at most). The table is walked only
//! then, not at every tick.
//!
//! The same sweep drops segments parked longer than [`PARKED_MAX_AGE_NS`] (their gap never
//! filled: the connection closed, or its walk lost its place), so the parking map never fills
//! with them.
//!
//! Removing an entry succeeds for one remover only, the programs or the agent, so a stream
//! whose end the programs see while the agent sweeps is counted once, by whichever removed it.

use std::{
    collections::{BTreeMap, HashSet},
    time::Duration,
};

use aya::{
    Ebpf,
    maps::{HashMap, MapData, MapError},
};
use retry_after_common::{
    Side,
    h2::{
        BODIES_MAP, CLOSED_MAP, DEFAULT_MAX_STREAMS, PARKED_MAP, PARKED_MAX_AGE_NS, ParkKey,
        ParkedBytes, STREAMS_MAP, StreamEntry, StreamKey,
    },
};

use super::{ProbeError, map_error};

/// The longest time between two sweeps for age.
const MAX_AGE_SWEEP_INTERVAL_NS: u64 = 10_000_000_000;

/// How the stream table is sized and swept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Http2Options {
    /// Entries of the stream table: open streams of every connection together.
    pub max_streams: u32,
    /// A stream open this long is abandoned, counted as expired.
    pub stream_timeout: Duration,
}

impl Default for Http2Options {
    fn default() -> Self {
        Self {
            max_streams: DEFAULT_MAX_STREAMS,
            stream_timeout: Duration::from_secs(300),
        }
    }
}

/// What the sweeps abandoned of one watch slot and side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    /// Streams abandoned.
    pub abandoned: u64,
    /// Of those, streams whose body had begun: their bodies ended with them.
    pub bodies_ended: u64,
}

/// The streams a sweep abandoned, by the watch slot, generation and side they counted in.
#[derive(Debug, Default)]
pub struct Abandoned {
    /// Per (slot, side): the slot's generation, and what was abandoned under it.
    by_slot: BTreeMap<(u16, u8), (u32, Swept)>,
    /// Streams abandoned because they were open longer than the timeout.
    pub expired: u64,
}

impl Abandoned {
    /// What was abandoned of watch slot `slot` under `generation`, seen from `side`.
    pub fn of(&self, slot: u32, generation: u32, side: Side) -> Swept {
        match self.by_slot.get(&(slot as u16, side as u8)) {
            Some((g, swept)) if *g == generation => *swept,
            _ => Swept::default(),
        }
    }

    fn count(&mut self, entry: &StreamEntry, body_ended: bool) {
        let counted = self
            .by_slot
            .entry((entry.slot, entry.side))
            .or_insert((entry.generation, Swept::default()));
        if counted.0 != entry.generation {
            *counted = (entry.generation, Swept::default());
        }
        counted.1.abandoned += 1;
        counted.1.bodies_ended += u64::from(body_ended);
    }
}

/// The stream table and the close notices, taken from the object once its programs are
/// loaded, and what the sweeps abandoned.
pub struct StreamSweeper {
    streams: HashMap<MapData, StreamKey, StreamEntry>,
    bodies: HashMap<MapData, StreamKey, u8>,
    closed: HashMap<MapData, u64, u64>,
    parked: HashMap<MapData, ParkKey, ParkedBytes>,
    timeout: Duration,
    /// When the next sweep for age is due (the programs' clock; 0: at the first sweep).
    next_age_sweep_ns: u64,
    abandoned: Abandoned,
}

impl StreamSweeper {
    /// Take the stream table, the close notices and the parking map out of `ebpf`.
    ///
    /// # Errors
    /// `MissingMap` if the object lacks one.
    pub fn take(ebpf: &mut Ebpf, timeout: Duration) -> Result<Self, ProbeError> {
        Ok(Self {
            streams: take_map(ebpf, STREAMS_MAP)?,
            bodies: take_map(ebpf, BODIES_MAP)?,
            closed: take_map(ebpf, CLOSED_MAP)?,
            parked: take_map(ebpf, PARKED_MAP)?,
            timeout,
            next_age_sweep_ns: 0,
            abandoned: Abandoned::default(),
        })
    }

    /// What the sweeps abandoned so far.
    pub fn abandoned(&self) -> &Abandoned {
        &self.abandoned
    }

    /// One sweep at `now_ns` (the programs' clock): abandon the streams of every connection
    /// noted closed and, when the sweep for age is due, every stream open longer than the
    /// timeout; drop the entries of watches that are gone (`live(slot, generation)` false)
    /// without counting them.
    ///
    /// # Errors
    /// `Map` if a map cannot be read.
    pub fn sweep(
        &mut self,
        now_ns: u64,
        live: impl Fn(u32, u32) -> bool,
    ) -> Result<(), ProbeError> {
        let closed: HashSet<u64> = self
            .closed
            .keys()
            .collect::<Result<_, _>>()
            .map_err(|source| map_error("read", CLOSED_MAP, source))?;
        let timeout_ns = u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX);
        let age_sweep = now_ns >= self.next_age_sweep_ns;
        if closed.is_empty() && !age_sweep {
            return Ok(());
        }
        if age_sweep {
            let every = (timeout_ns / 10).min(MAX_AGE_SWEEP_INTERVAL_NS);
            self.next_age_sweep_ns = now_ns.saturating_add(every);
            self.drop_stale_parked(now_ns)?;
        }
        let mut gone = Vec::new();
        for item in self.streams.iter() {
            let (key, entry) = match item {
                Ok(item) => item,
                // Removed by the programs between the key and its value.
                Err(MapError::KeyNotFound) => continue,
                Err(source) => return Err(map_error("read", STREAMS_MAP, source)),
            };
            let closed = closed.contains(&key.connection);
            let expired = !closed && now_ns.saturating_sub(entry.opened_ns) > timeout_ns;
            let live = live(u32::from(entry.slot), entry.generation);
            if closed || expired || !live {
                gone.push((key, entry, expired, live));
            }
        }
        for (key, entry, expired, live) in gone {
            // Only the one removal that succeeds counts: the programs may have ended it. Its
            // body's entry goes after it, as the programs' ends take them (`h2`'s streams,
            // "Bodies").
            if self.streams.remove(&key).is_ok() {
                let body_ended = self.bodies.remove(&key).is_ok();
                if live {
                    self.abandoned.count(&entry, body_ended);
                    self.abandoned.expired += u64::from(expired);
                }
            }
        }
        for connection in closed {
            // Gone already only if something else removed it; nothing to count either way.
            let _ = self.closed.remove(&connection);
        }
        Ok(())
    }

    /// Drop the segments parked longer than [`PARKED_MAX_AGE_NS`].
    fn drop_stale_parked(&mut self, now_ns: u64) -> Result<(), ProbeError> {
        let keys: Vec<ParkKey> = self.parked.keys().filter_map(Result::ok).collect();
        for key in keys {
            let stale = match self.parked.get(&key, 0) {
                Ok(parked) => now_ns.saturating_sub(parked.parked_ns) > PARKED_MAX_AGE_NS,
                Err(MapError::KeyNotFound) => false,
                Err(source) => return Err(map_error("read", PARKED_MAP, source)),
            };
            if stale {
                let _ = self.parked.remove(&key);
            }
        }
        Ok(())
    }
}

/// Map `name` taken out of `ebpf`, typed.
fn take_map<K: aya::Pod, V: aya::Pod>(
    ebpf: &mut Ebpf,
    name: &'static str,
) -> Result<HashMap<MapData, K, V>, ProbeError> {
    let map = ebpf
        .take_map(name)
        .ok_or_else(|| super::missing_map(name))?;
    HashMap::try_from(map).map_err(|source| ProbeError::MissingMap { name, source })
}
