//! The `exchange` filter on the peers' listener, and the shared-data maps
//! a peer's placements, stored responses and session records merge into.

use crate::cache::directory::Directory;
use crate::cache::exchange::message::{layout, Body, Message, Refusal, PEER_TAG};
use crate::cache::sessions::Sessions;
use crate::cache::stored_responses::ResponseMap;
use crate::config::Config;
use crate::shared::flow::{Flow, Reply};

/// The `exchange` filter, on the peers' listener: a `POST` to
/// `exchange.path` is a peer's message. It is checked whole, then queued
/// for this Envoy's probe (which merges it); the peer is answered 204, or
/// 400 / 413 with the reason and the refusal counted. Any other request
/// goes on to the listener's routes (which should answer 404).
#[derive(Debug, Default)]
pub struct ExchangeStream {
    mine: bool,
}

impl ExchangeStream {
    pub fn new() -> ExchangeStream {
        ExchangeStream::default()
    }

    pub fn wants_body(&self) -> bool {
        self.mine
    }

    pub fn on_request_headers(
        &mut self,
        cfg: &Config,
        host: &mut dyn crate::shared::host_api::StreamHost,
        end_of_stream: bool,
    ) -> Flow {
        let method = host.request_header(":method");
        let path = host.request_header(":path");
        let path = path.as_deref().map(crate::request::openai::strip_path);
        if method.as_deref() != Some("POST") || path != Some(cfg.exchange.path.as_str()) {
            return Flow::Continue;
        }
        self.mine = true;
        let declared = host
            .request_header("content-length")
            .and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > u64::from(cfg.exchange.max_message_bytes)) {
            return refuse(host, 413, Refusal::TooLarge);
        }
        if end_of_stream {
            return refuse(host, 400, Refusal::Malformed("no body"));
        }
        Flow::Pause
    }

    /// The host could not read the complete body: refused (503, so the
    /// peer counts a failed send), never merged as an empty message.
    pub fn on_body_unreadable(
        &mut self,
        host: &mut dyn crate::shared::host_api::StreamHost,
    ) -> Flow {
        if !std::mem::replace(&mut self.mine, false) {
            return Flow::Continue;
        }
        refuse(host, 503, Refusal::Unreadable)
    }

    /// The body so far (`size` bytes), complete when `end_of_stream`.
    pub fn on_request_body(
        &mut self,
        cfg: &Config,
        host: &mut dyn crate::shared::host_api::StreamHost,
        size: usize,
        body: Option<&[u8]>,
    ) -> Flow {
        if !self.mine {
            return Flow::Continue;
        }
        if size > cfg.exchange.max_message_bytes as usize {
            self.mine = false;
            return refuse(host, 413, Refusal::TooLarge);
        }
        let Some(body) = body else {
            return Flow::Pause;
        };
        self.mine = false;
        let max = cfg.exchange.max_message_bytes as usize;
        match Message::decode(body, layout(cfg), cfg.regions.len(), max) {
            Ok(msg) => {
                // Placements and stored responses go to shared data now,
                // not at the probe's next tick: a peer's news is routable
                // within its transit. Merging is newest-wins per entry, so
                // the repeats a relay brings change nothing.
                let maps = SharedMaps::new(cfg);
                for item in msg.groups.iter().flat_map(|g| &g.items) {
                    maps.apply(&mut *host, cfg, &item.body);
                }
                let mut queued = Vec::with_capacity(body.len() + 1);
                queued.push(PEER_TAG);
                queued.extend_from_slice(body);
                if !host.enqueue(crate::shared::names::OBSERVATIONS_QUEUE, &queued) {
                    use crate::shared::names::{Global, Stat};
                    host.count(Stat::Global(Global::QueueDropped), 1);
                }
                Flow::Reply(Reply {
                    status: 204,
                    headers: Vec::new(),
                    body: Vec::new(),
                })
            }
            Err(e) => refuse(host, if e == Refusal::TooLarge { 413 } else { 400 }, e),
        }
    }
}

/// This Envoy's shared-data maps a peer's news goes to.
pub struct SharedMaps {
    pub dir: Directory,
    pub responses: ResponseMap,
    pub sessions: Sessions,
}

impl SharedMaps {
    pub fn new(cfg: &Config) -> SharedMaps {
        SharedMaps {
            dir: Directory::new(cfg),
            responses: ResponseMap::new(cfg),
            sessions: Sessions::new(cfg),
        }
    }

    /// A placement, stored response or session record, merged newest-wins
    /// (a usage report is the probe's).
    pub fn apply(
        &self,
        store: &mut dyn crate::shared::store::SharedStore,
        cfg: &Config,
        body: &Body,
    ) {
        match body {
            Body::Placement {
                region,
                stamp,
                blocks,
                tag,
                hashes,
            } => {
                self.dir.merge(
                    store,
                    hashes,
                    usize::from(*region),
                    *stamp,
                    (*blocks, u64::from(*tag)),
                );
            }
            Body::Response {
                region,
                at_ms,
                hash,
            } => {
                if let Some(r) = cfg.regions.get(usize::from(*region)) {
                    self.responses.merge(store, *hash, &r.name, *at_ms);
                }
            }
            Body::Session {
                region,
                at_ms,
                hash,
                blocks,
                last,
            } => {
                self.sessions
                    .merge(store, *hash, usize::from(*region), *at_ms, (*blocks, *last));
            }
            Body::Usage(_) => {}
        }
    }
}

fn refuse(host: &mut dyn crate::shared::host_api::StreamHost, status: u32, why: Refusal) -> Flow {
    use crate::shared::names::{Global, Stat};
    host.count(Stat::Global(Global::ExchangeRefused), 1);
    host.log(
        crate::shared::host_api::Level::Warn,
        &format!("llm-geo-router exchange: a peer message refused ({status}): {why}"),
    );
    Flow::Reply(Reply {
        status,
        headers: vec![("content-type", "text/plain".to_string())],
        body: format!("llm-geo-router exchange: refused: {why}\n").into_bytes(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::exchange::message::tests::cfg;
    use crate::shared::host_api::Recorder;
    use crate::shared::names::{Global, Stat};

    fn posted(cfg: &Config, host: &mut Recorder, s: &mut ExchangeStream) {
        let path = cfg.exchange.path.clone();
        host.request(&[(":method", "POST"), (":path", &path)]);
        assert_eq!(s.on_request_headers(cfg, host, false), Flow::Pause);
    }

    #[test]
    fn an_unreadable_body_is_refused_and_a_dropped_message_counted() {
        let cfg = cfg();
        let mut host = Recorder::default();
        let mut s = ExchangeStream::new();
        posted(&cfg, &mut host, &mut s);
        let Flow::Reply(r) = s.on_body_unreadable(&mut host) else {
            panic!("not refused")
        };
        assert_eq!(r.status, 503);
        assert_eq!(host.value(Stat::Global(Global::ExchangeRefused)), 1);
        // Not the exchange's request: untouched.
        assert_eq!(
            ExchangeStream::new().on_body_unreadable(&mut host),
            Flow::Continue
        );
        // A good message the queue drops: merged, answered, counted.
        let msg = Message {
            sender: 7,
            sent_ms: 1,
            groups: Vec::new(),
        }
        .encode(layout(&cfg), cfg.regions.len());
        host.refuse_enqueue = true;
        let mut s = ExchangeStream::new();
        posted(&cfg, &mut host, &mut s);
        let flow = s.on_request_body(&cfg, &mut host, msg.len(), Some(&msg));
        assert!(
            matches!(flow, Flow::Reply(ref r) if r.status == 204),
            "{flow:?}"
        );
        assert_eq!(host.value(Stat::Global(Global::QueueDropped)), 1);
    }
}
