//! What the core asks of its host: stats, logs and shared data for every
//! root; request and response manipulation for the filters; callouts,
//! ticks and the queue for the probe. The host layer implements these over
//! proxy-wasm; [`Recorder`] implements them in memory for the tests, the
//! simulator and the CLI, which thereby run the very state machines the
//! `.wasm` runs.

use std::collections::HashMap;

use crate::shared::names::Stat;
use crate::shared::store::{MemoryStore, SetOutcome, SharedStore};

/// Severity of a log line (Envoy's levels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
    Critical,
}

/// Stats, logs and shared data: what every root uses.
pub trait Effects: SharedStore {
    /// Add to a counter (or a gauge, for in-flight counts).
    fn count(&mut self, stat: Stat, delta: i64);
    fn set_gauge(&mut self, stat: Stat, value: u64);
    /// Add a sample to a histogram.
    fn record(&mut self, stat: Stat, value: u64);
    /// A stat's process-wide value (not a histogram's).
    fn stat(&mut self, stat: Stat) -> u64;
    fn log(&mut self, level: Level, msg: &str);
    /// The host's clock, ms since the Unix epoch.
    fn now_ms(&mut self) -> u64;
}

/// What an HTTP filter can do to its stream besides flow control.
pub trait StreamHost: Effects {
    /// A request header's value (names lowercase; pseudo-headers too).
    fn request_header(&mut self, name: &str) -> Option<String>;
    /// Set (`Some`) or remove (`None`) a request header; false when the
    /// host refused.
    fn set_request_header(&mut self, name: &str, value: Option<&str>) -> bool;
    fn add_response_header(&mut self, name: &str, value: &str);
    /// Replace the buffered request body; false when the host refused.
    fn replace_request_body(&mut self, body: &[u8]) -> bool;
    /// Make Envoy choose the route again (after the cluster header changed);
    /// false when the host refused.
    fn clear_route_cache(&mut self) -> bool;
    fn set_filter_state(&mut self, key: &str, value: &[u8]);
    /// Put a message on a shared queue; false when it was dropped (no such
    /// queue yet, or the host refused).
    fn enqueue(&mut self, queue: &str, value: &[u8]) -> bool;
    /// A property of the stream (Envoy's attributes), as raw bytes.
    fn property(&mut self, path: &[&str]) -> Option<Vec<u8>>;
    /// The response's `:status`, once response headers are there.
    fn response_status(&mut self) -> Option<u32>;
    /// `len` bytes of the response body chunk being passed, from `start`.
    fn response_body(&mut self, start: usize, len: usize) -> Option<Vec<u8>>;
}

/// A callout's answer, read lazily (each read is a host call).
pub trait CalloutResponse {
    /// How many headers the answer carries: none when the callout failed
    /// (timeout, reset, no such cluster: Envoy hands the root no headers).
    fn header_count(&mut self) -> usize;
    /// The `:status` header, if there is one that parses.
    fn status(&mut self) -> Option<u32>;
    fn header(&mut self, name: &str) -> Option<String>;
    /// At most `max` bytes of the body.
    fn body(&mut self, max: usize) -> Option<Vec<u8>>;
}

/// What the probe singleton does besides stats, logs and shared data.
pub trait ProbeHost: Effects {
    /// Send an HTTP callout through an Envoy cluster; the token identifies
    /// its answer.
    fn dispatch(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout_ms: u64,
    ) -> Result<u32, String>;
    /// The next message on a shared queue this root registered.
    fn dequeue(&mut self, queue: &str) -> Option<Vec<u8>>;
    /// Period of the next ticks; false when the host refused it.
    fn set_tick_ms(&mut self, ms: u64) -> bool;
}

/// Everything in memory: stats by [`Stat`], shared data in a
/// [`MemoryStore`], request header changes, logs, queue messages and
/// callouts recorded in order. One `Recorder` stands for one Envoy process
/// (its stats and shared data are what all its roots share).
#[derive(Debug, Default, Clone)]
pub struct Recorder {
    pub now_ms: u64,
    pub stats: HashMap<Stat, i64>,
    /// Histogram samples, in order.
    pub samples: HashMap<Stat, Vec<u64>>,
    pub store: MemoryStore,
    pub logs: Vec<(Level, String)>,
    /// The current stream's request headers as the filters see them (the
    /// client's, with the filters' writes applied).
    pub headers: Vec<(String, String)>,
    /// Request header writes of the current stream, in order.
    pub request_headers: Vec<(String, Option<String>)>,
    pub response_headers: Vec<(String, String)>,
    pub replaced_body: Option<Vec<u8>>,
    pub route_cache_cleared: u32,
    pub filter_state: Vec<(String, Vec<u8>)>,
    pub queues: HashMap<String, std::collections::VecDeque<Vec<u8>>>,
    pub properties: HashMap<String, Vec<u8>>,
    /// The `:status` of the current stream's response.
    pub status: Option<u32>,
    /// The response body chunk being passed.
    pub response_chunk: Vec<u8>,
    /// Callouts dispatched: (token, cluster, path).
    pub callouts: Vec<(u32, String, String)>,
    /// The bodies of the callouts that carried one: (token, body).
    pub callout_bodies: Vec<(u32, Vec<u8>)>,
    pub next_token: u32,
    pub tick_ms: Option<u64>,
    /// Clusters whose callouts the host refuses (as Envoy does for an
    /// unknown cluster).
    pub refuse_clusters: Vec<String>,
    /// The host refuses request header writes and route-cache clears (as
    /// Envoy does once a stream's headers are gone).
    pub refuse_header_writes: bool,
    /// The host drops queue messages (as when the queue is not registered).
    pub refuse_enqueue: bool,
}

impl Recorder {
    /// Start a stream whose request carries these headers.
    pub fn request(&mut self, headers: &[(&str, &str)]) {
        self.next_stream();
        self.headers = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
    }

    /// Forget what one stream did (its headers, body, filter state and
    /// properties); stats, shared data, queues and logs stay.
    pub fn next_stream(&mut self) {
        self.headers.clear();
        self.request_headers.clear();
        self.response_headers.clear();
        self.replaced_body = None;
        self.route_cache_cleared = 0;
        self.filter_state.clear();
        self.properties.clear();
        self.status = None;
        self.response_chunk.clear();
    }

    /// The last value written to a request header in this stream (`None`
    /// when never written, `Some(None)` when removed).
    pub fn request_header(&self, name: &str) -> Option<Option<&str>> {
        self.request_headers
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_deref())
    }

    pub fn value(&self, stat: Stat) -> i64 {
        self.stats.get(&stat).copied().unwrap_or(0)
    }

    /// Publish a snapshot as the probe does: to shared data, then its
    /// version gauge.
    pub fn publish(&mut self, snapshot: &crate::fleet::snapshot::Snapshot) {
        let _ = self
            .store
            .set(crate::shared::names::SNAPSHOT_KEY, &snapshot.encode(), None);
        self.set_gauge(
            Stat::Global(crate::shared::names::Global::ProbeSnapshotVersion),
            snapshot.version,
        );
    }
}

impl SharedStore for Recorder {
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, String> {
        self.store.get(key)
    }
    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, String> {
        self.store.set(key, value, cas)
    }
}

impl Effects for Recorder {
    fn count(&mut self, stat: Stat, delta: i64) {
        *self.stats.entry(stat).or_insert(0) += delta;
    }
    fn set_gauge(&mut self, stat: Stat, value: u64) {
        self.stats
            .insert(stat, i64::try_from(value).unwrap_or(i64::MAX));
    }
    fn record(&mut self, stat: Stat, value: u64) {
        self.samples.entry(stat).or_default().push(value);
    }
    fn stat(&mut self, stat: Stat) -> u64 {
        u64::try_from(self.value(stat)).unwrap_or(0)
    }
    fn log(&mut self, level: Level, msg: &str) {
        self.logs.push((level, msg.to_string()));
    }
    fn now_ms(&mut self) -> u64 {
        self.now_ms
    }
}

impl StreamHost for Recorder {
    fn request_header(&mut self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }
    fn set_request_header(&mut self, name: &str, value: Option<&str>) -> bool {
        if self.refuse_header_writes {
            return false;
        }
        self.headers.retain(|(n, _)| n != name);
        if let Some(v) = value {
            self.headers.push((name.to_string(), v.to_string()));
        }
        self.request_headers
            .push((name.to_string(), value.map(str::to_string)));
        true
    }
    fn add_response_header(&mut self, name: &str, value: &str) {
        self.response_headers
            .push((name.to_string(), value.to_string()));
    }
    fn replace_request_body(&mut self, body: &[u8]) -> bool {
        self.replaced_body = Some(body.to_vec());
        true
    }
    fn clear_route_cache(&mut self) -> bool {
        if self.refuse_header_writes {
            return false;
        }
        self.route_cache_cleared += 1;
        true
    }
    fn set_filter_state(&mut self, key: &str, value: &[u8]) {
        self.filter_state.push((key.to_string(), value.to_vec()));
    }
    fn enqueue(&mut self, queue: &str, value: &[u8]) -> bool {
        if self.refuse_enqueue {
            return false;
        }
        self.queues
            .entry(queue.to_string())
            .or_default()
            .push_back(value.to_vec());
        true
    }
    fn property(&mut self, path: &[&str]) -> Option<Vec<u8>> {
        self.properties.get(&path.join(".")).cloned()
    }
    fn response_status(&mut self) -> Option<u32> {
        self.status
    }
    fn response_body(&mut self, start: usize, len: usize) -> Option<Vec<u8>> {
        self.response_chunk
            .get(start..start.checked_add(len)?)
            .map(<[u8]>::to_vec)
    }
}

impl ProbeHost for Recorder {
    fn dispatch(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        _timeout_ms: u64,
    ) -> Result<u32, String> {
        if self.refuse_clusters.iter().any(|c| c == cluster) {
            return Err("BadArgument".into());
        }
        self.next_token += 1;
        if let Some(b) = body {
            self.callout_bodies.push((self.next_token, b.to_vec()));
        }
        let path = headers
            .iter()
            .find(|(n, _)| *n == ":path")
            .map_or("", |(_, v)| v);
        self.callouts
            .push((self.next_token, cluster.to_string(), path.to_string()));
        Ok(self.next_token)
    }
    fn dequeue(&mut self, queue: &str) -> Option<Vec<u8>> {
        self.queues.get_mut(queue)?.pop_front()
    }
    fn set_tick_ms(&mut self, ms: u64) -> bool {
        self.tick_ms = Some(ms);
        true
    }
}

/// A callout answer held in memory.
#[derive(Debug, Clone, Default)]
pub struct Answer {
    pub status: Option<u32>,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl CalloutResponse for Answer {
    fn header_count(&mut self) -> usize {
        // `status: None` stands for a failed callout: no headers at all.
        self.status.map_or(0, |_| 1 + self.headers.len())
    }
    fn status(&mut self) -> Option<u32> {
        self.status
    }
    fn header(&mut self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    }
    fn body(&mut self, max: usize) -> Option<Vec<u8>> {
        Some(self.body.get(..max.min(self.body.len()))?.to_vec())
    }
}
