//! Host calls that cannot trap: every `proxy_wasm::hostcalls` status is
//! mapped to an `Option`/`Result` here, instead of the SDK's `unwrap()`.

use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType};

use crate::shared::store::{SetOutcome, SharedStore};

pub fn log(level: LogLevel, msg: &str) {
    let _ = hostcalls::log(level, msg);
}

pub fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64)
}

pub fn property(path: &[&str]) -> Option<Vec<u8>> {
    hostcalls::get_property(path.to_vec()).ok().flatten()
}

pub fn plugin_configuration() -> Vec<u8> {
    hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// A header value as text. Values are bytes: HTTP/1.1 allows obs-text
/// (0x80-0xFF), so a client or an engine can send one that is not UTF-8,
/// and the SDK's `get_map_value` panics (traps the VM) on it. Invalid
/// sequences become U+FFFD, which matches no key, tier or token.
fn header_value(map: MapType, name: &str) -> Option<String> {
    hostcalls::get_map_value_bytes(map, name)
        .ok()
        .flatten()
        .map(|b| match String::from_utf8(b) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
}

/// The host's clock in nanoseconds since the Unix epoch (0 if unavailable).
pub fn now_ns() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64)
}

pub fn request_header(name: &str) -> Option<String> {
    header_value(MapType::HttpRequestHeaders, name)
}

pub fn set_request_header(name: &str, value: Option<&str>) -> bool {
    hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value).is_ok()
}

pub fn add_response_header(name: &str, value: &str) {
    let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value);
}

/// The buffered request body (`None`: the host could not read it; an
/// empty body reads as empty).
pub fn request_body(size: usize) -> Option<Vec<u8>> {
    if size == 0 {
        return Some(Vec::new());
    }
    hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
        .ok()
        .flatten()
}

/// `len` bytes of the current response body chunk from `start`.
pub fn response_body(start: usize, len: usize) -> Option<Vec<u8>> {
    hostcalls::get_buffer(BufferType::HttpResponseBody, start, len)
        .ok()
        .flatten()
}

pub fn replace_request_body(old_size: usize, body: &[u8]) -> bool {
    hostcalls::set_buffer(BufferType::HttpRequestBody, 0, old_size, body).is_ok()
}

pub fn call_response_header(name: &str) -> Option<String> {
    header_value(MapType::HttpCallResponseHeaders, name)
}

pub fn call_response_body(size: usize) -> Option<Vec<u8>> {
    hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size)
        .ok()
        .flatten()
}

pub fn send_response(status: u32, headers: &[(&str, &str)], body: &[u8]) {
    let _ = hostcalls::send_http_response(status, headers.to_vec(), Some(body));
}

/// Make context `id` (an HTTP context of this VM) the one the next host
/// calls act on; false if the host knows no such context (it ended).
pub fn set_effective_context(id: u32) -> bool {
    hostcalls::set_effective_context(id).is_ok()
}

/// Resume the effective context's paused request.
pub fn resume_request() -> bool {
    hostcalls::resume_http_request().is_ok()
}

/// Re-evaluate the route after changing the header it selects on.
pub fn clear_route_cache() -> bool {
    hostcalls::call_foreign_function("clear_route_cache", None).is_ok()
}

pub fn dispatch(
    cluster: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<u32, String> {
    hostcalls::dispatch_http_call(cluster, headers.to_vec(), body, vec![], timeout)
        .map_err(|s| format!("{s:?}"))
}

/// An Envoy stat; a failed definition yields a stat that does nothing.
#[derive(Debug, Clone, Copy)]
pub struct Metric(Option<u32>);

impl Metric {
    pub fn counter(name: &str) -> Metric {
        Metric(hostcalls::define_metric(MetricType::Counter, name).ok())
    }
    pub fn gauge(name: &str) -> Metric {
        Metric(hostcalls::define_metric(MetricType::Gauge, name).ok())
    }
    pub fn histogram(name: &str) -> Metric {
        Metric(hostcalls::define_metric(MetricType::Histogram, name).ok())
    }
    pub fn add(self, delta: i64) {
        if let Some(id) = self.0 {
            let _ = hostcalls::increment_metric(id, delta);
        }
    }
    /// A gauge's value, or a histogram's sample.
    pub fn set(self, value: u64) {
        if let Some(id) = self.0 {
            let _ = hostcalls::record_metric(id, value);
        }
    }
    pub fn get(self) -> u64 {
        self.0
            .and_then(|id| hostcalls::get_metric(id).ok())
            .unwrap_or(0)
    }
}

/// Envoy's shared data as the directory's store.
pub struct HostStore;

impl SharedStore for HostStore {
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, String> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(v), Some(cas))) => Ok(Some((v, cas))),
            Ok((Some(v), None)) => Ok(Some((v, 0))),
            Ok((None, _)) => Ok(None),
            Err(s) => Err(format!("{s:?}")),
        }
    }
    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, String> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(SetOutcome::Stored),
            Err(proxy_wasm::types::Status::CasMismatch) => Ok(SetOutcome::CasMismatch),
            Err(s) => Err(format!("{s:?}")),
        }
    }
}

pub fn response_header(name: &str) -> Option<String> {
    header_value(MapType::HttpResponseHeaders, name)
}

pub fn set_tick_ms(ms: u64) -> bool {
    hostcalls::set_tick_period(Duration::from_millis(ms)).is_ok()
}

pub fn register_queue(name: &str) -> Option<u32> {
    hostcalls::register_shared_queue(name).ok()
}

pub fn resolve_queue(vm_id: &str, name: &str) -> Option<u32> {
    hostcalls::resolve_shared_queue(vm_id, name).ok().flatten()
}

pub fn enqueue(queue: u32, value: &[u8]) -> bool {
    hostcalls::enqueue_shared_queue(queue, Some(value)).is_ok()
}

pub fn dequeue(queue: u32) -> Option<Vec<u8>> {
    hostcalls::dequeue_shared_queue(queue).ok().flatten()
}

/// Write a filter state object (read by access logs as `%FILTER_STATE(wasm.<key>:PLAIN)%`).
pub fn set_filter_state(key: &str, value: &[u8]) {
    let _ = hostcalls::set_property(vec![key], Some(value));
}
