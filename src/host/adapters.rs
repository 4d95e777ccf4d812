//! The core's host interfaces ([`Effects`], [`StreamHost`], [`ProbeHost`])
//! over proxy-wasm: each method is one host call (or none), every status
//! mapped so that nothing traps.

use std::cell::Cell;
use std::time::Duration;

use proxy_wasm::types::LogLevel;

use super::calls::{self, HostStore, Metric};
use crate::shared::host_api::{CalloutResponse, Effects, Level, ProbeHost, StreamHost};
use crate::shared::names::{Stat, StatTable, OBSERVATIONS_QUEUE};
use crate::shared::store::{SetOutcome, SharedStore};

/// Envoy's metric ids for one configuration's stats.
pub type Stats = StatTable<Metric>;

pub fn define_stats(cfg: &crate::config::Config) -> Stats {
    StatTable::new(cfg, |_, name, kind| match kind {
        crate::shared::names::StatKind::Counter => Metric::counter(name),
        crate::shared::names::StatKind::Gauge => Metric::gauge(name),
        crate::shared::names::StatKind::Histogram => Metric::histogram(name),
    })
}

/// The observation queue: registered by the probe, resolved lazily by the
/// routers once the probe has registered it.
#[derive(Debug, Default)]
pub struct Queue {
    pub vm_id: String,
    pub id: Cell<Option<u32>>,
}

impl Queue {
    fn resolve(&self) -> Option<u32> {
        if self.id.get().is_none() {
            self.id
                .set(calls::resolve_queue(&self.vm_id, OBSERVATIONS_QUEUE));
        }
        self.id.get()
    }
}

/// One event's view of the host.
pub struct Host<'a> {
    pub stats: &'a Stats,
    pub queue: Option<&'a Queue>,
    /// The size of the request body Envoy buffered (for a replacement).
    pub body_size: usize,
}

impl<'a> Host<'a> {
    pub fn new(stats: &'a Stats) -> Host<'a> {
        Host {
            stats,
            queue: None,
            body_size: 0,
        }
    }
}

fn level(l: Level) -> LogLevel {
    match l {
        Level::Debug => LogLevel::Debug,
        Level::Info => LogLevel::Info,
        Level::Warn => LogLevel::Warn,
        Level::Error => LogLevel::Error,
        Level::Critical => LogLevel::Critical,
    }
}

impl SharedStore for Host<'_> {
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, String> {
        HostStore.get(key)
    }
    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, String> {
        HostStore.set(key, value, cas)
    }
}

impl Effects for Host<'_> {
    fn count(&mut self, stat: Stat, delta: i64) {
        if let Some(m) = self.stats.get(stat) {
            m.add(delta);
        }
    }
    fn set_gauge(&mut self, stat: Stat, value: u64) {
        if let Some(m) = self.stats.get(stat) {
            m.set(value);
        }
    }
    fn record(&mut self, stat: Stat, value: u64) {
        if let Some(m) = self.stats.get(stat) {
            m.set(value);
        }
    }
    fn stat(&mut self, stat: Stat) -> u64 {
        self.stats.get(stat).map_or(0, |m| m.get())
    }
    fn log(&mut self, l: Level, msg: &str) {
        calls::log(level(l), msg);
    }
    fn now_ms(&mut self) -> u64 {
        calls::now_ms()
    }
}

impl StreamHost for Host<'_> {
    fn request_header(&mut self, name: &str) -> Option<String> {
        calls::request_header(name)
    }
    fn set_request_header(&mut self, name: &str, value: Option<&str>) -> bool {
        calls::set_request_header(name, value)
    }
    fn add_response_header(&mut self, name: &str, value: &str) {
        calls::add_response_header(name, value);
    }
    fn replace_request_body(&mut self, body: &[u8]) -> bool {
        calls::replace_request_body(self.body_size, body)
    }
    fn clear_route_cache(&mut self) -> bool {
        calls::clear_route_cache()
    }
    fn set_filter_state(&mut self, key: &str, value: &[u8]) {
        calls::set_filter_state(key, value);
    }
    fn enqueue(&mut self, _queue: &str, value: &[u8]) -> bool {
        self.queue
            .and_then(Queue::resolve)
            .is_some_and(|id| calls::enqueue(id, value))
    }
    fn property(&mut self, path: &[&str]) -> Option<Vec<u8>> {
        calls::property(path)
    }
    fn response_status(&mut self) -> Option<u32> {
        calls::response_header(":status").and_then(|s| s.parse().ok())
    }
    fn response_body(&mut self, start: usize, len: usize) -> Option<Vec<u8>> {
        calls::response_body(start, len)
    }
}

impl ProbeHost for Host<'_> {
    fn dispatch(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout_ms: u64,
    ) -> Result<u32, String> {
        calls::dispatch(cluster, headers, body, Duration::from_millis(timeout_ms))
    }
    fn dequeue(&mut self, _queue: &str) -> Option<Vec<u8>> {
        calls::dequeue(self.queue?.id.get()?)
    }
    fn set_tick_ms(&mut self, ms: u64) -> bool {
        calls::set_tick_ms(ms)
    }
}

/// The answer to a callout, read from the host on demand.
pub struct Callout {
    pub num_headers: usize,
    pub body_size: usize,
}

impl CalloutResponse for Callout {
    fn header_count(&mut self) -> usize {
        self.num_headers
    }
    fn status(&mut self) -> Option<u32> {
        calls::call_response_header(":status").and_then(|s| s.parse().ok())
    }
    fn header(&mut self, name: &str) -> Option<String> {
        calls::call_response_header(name)
    }
    fn body(&mut self, max: usize) -> Option<Vec<u8>> {
        calls::call_response_body(self.body_size.min(max))
    }
}
