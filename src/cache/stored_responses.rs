//! The Responses API is stateful: a response stored by an engine (`store`,
//! the default) lives in the memory of the engine that produced it, so a
//! follow-up naming it (`previous_response_id`, or `GET`/`DELETE`
//! `/v1/responses/{id}`, `.../cancel`, `.../input_items`) must reach that
//! region. The router learns each response's `id` from the answer as it
//! passes and keeps `id → region` in a bounded shared-data map with a TTL:
//! `responses.slots` slots, one record each, keyed by a hash of the id (a
//! newer response whose hash lands in the same slot replaces the older
//! record; at the default size that is rare before the TTL ends).

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::shared::names::RESPONSES_KEY_PREFIX;
use crate::shared::store::{SharedStore, SlotKey};

/// Tag of the router's request to the probe to check whether a region's
/// engine keeps its Responses (`b'R'`, then the region as u16 LE, then the
/// id). Region indices are below 64, so an untagged observation on the
/// same queue (which starts with its region) never starts with it.
pub const STORE_CHECK_TAG: u8 = b'R';

/// The router's request to check `id` at `region` (see [`STORE_CHECK_TAG`]).
pub fn encode_store_check(region: u16, id: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(3 + id.len());
    b.push(STORE_CHECK_TAG);
    b.extend_from_slice(&region.to_le_bytes());
    b.extend_from_slice(id.as_bytes());
    b
}

/// A store check's region and id; `None` for anything else, or an id the
/// router would not keep.
pub fn decode_store_check(b: &[u8]) -> Option<(usize, &str)> {
    if b.first() != Some(&STORE_CHECK_TAG) {
        return None;
    }
    let region = u16::from_le_bytes(b.get(1..3)?.try_into().ok()?);
    let id = std::str::from_utf8(b.get(3..)?).ok()?;
    valid_id(id).then_some((usize::from(region), id))
}

/// The longest response id the router keeps (engines use about 40 bytes).
pub const MAX_ID_BYTES: usize = 256;
/// How far into an answer the router looks for the response's `id`: the
/// first member of the response object, or of the first stream event's
/// `response`.
pub const HEAD_BYTES: usize = 4096;

/// The id a `/v1/responses/{id}[/cancel|/input_items]` path names, if any
/// (query string ignored). `POST /v1/responses` itself names none.
pub fn path_id(path: &str) -> Option<&str> {
    let path = crate::request::openai::strip_path(path);
    let rest = path.strip_prefix("/v1/responses/")?;
    let id = match rest.split_once('/') {
        None => rest,
        Some((id, "cancel" | "input_items")) => id,
        Some(_) => return None,
    };
    valid_id(id).then_some(id)
}

/// A response id the router will look up or keep: 1..=256 bytes of
/// printable ASCII without quotes, backslashes or slashes.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_BYTES
        && id
            .bytes()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'"' | b'\\' | b'/'))
}

/// The response's `id` in the first bytes of an answer: the value of the
/// first `"id"` member (the response object's first member in vLLM's and
/// SGLang's answers and in the stream's `response.created` event). `None`
/// until it is complete in `head`, or when it is not a usable id.
pub fn find_id(head: &[u8]) -> Option<&str> {
    const KEY: &[u8] = b"\"id\"";
    let at = head.windows(KEY.len()).position(|w| w == KEY)?;
    let mut rest = head.get(at + KEY.len()..)?;
    let skip_ws = |r: &mut &[u8]| {
        while let Some((b, tail)) = r.split_first() {
            if !b.is_ascii_whitespace() {
                break;
            }
            *r = tail;
        }
    };
    skip_ws(&mut rest);
    rest = rest.strip_prefix(b":")?;
    skip_ws(&mut rest);
    rest = rest.strip_prefix(b"\"")?;
    let end = rest.iter().position(|&b| b == b'"')?;
    let id = std::str::from_utf8(rest.get(..end)?).ok()?;
    valid_id(id).then_some(id)
}

/// The answer's first bytes, until the response id is found in them.
#[derive(Debug, Default)]
pub struct Head {
    buf: Vec<u8>,
}

impl Head {
    /// How many bytes of the next chunk of `size` bytes are still wanted.
    pub fn wanted(&self, size: usize) -> usize {
        size.min(HEAD_BYTES.saturating_sub(self.buf.len()))
    }

    /// Add the chunk's first bytes; the id once it is complete.
    pub fn push(&mut self, bytes: &[u8]) -> Option<String> {
        let room = HEAD_BYTES.saturating_sub(self.buf.len());
        self.buf
            .extend_from_slice(bytes.get(..room.min(bytes.len())).unwrap_or_default());
        find_id(&self.buf).map(str::to_owned)
    }

    /// Whether the id can no longer be found (the head is full).
    pub fn exhausted(&self) -> bool {
        self.buf.len() >= HEAD_BYTES
    }
}

/// Where stored responses live: `id → region` in shared data.
#[derive(Debug, Clone, Copy)]
pub struct ResponseMap {
    pub slots: u32,
    pub ttl_ms: u64,
    pub seed: u64,
}

/// A record: the id's hash (8 bytes), when it was recorded (8), then the
/// region's name (so a reordered configuration does not misdirect).
const HEADER: usize = 16;

impl ResponseMap {
    /// The map of a configuration.
    pub fn new(cfg: &crate::config::Config) -> ResponseMap {
        ResponseMap {
            slots: cfg.responses.slots,
            ttl_ms: u64::from(cfg.responses.ttl_s) * 1000,
            seed: cfg.prefix.hash_seed,
        }
    }

    fn hash(&self, id: &str) -> u64 {
        xxh3_64_with_seed(id.as_bytes(), self.seed ^ 0x7265_7370_6f6e_7365)
    }

    fn key(&self, hash: u64) -> SlotKey {
        SlotKey::new(RESPONSES_KEY_PREFIX, hash % u64::from(self.slots.max(1)))
    }

    /// The region (its name) that stored response `id`, if this Envoy saw
    /// it within the TTL.
    pub fn lookup(&self, store: &mut dyn SharedStore, id: &str, now_ms: u64) -> Option<String> {
        let hash = self.hash(id);
        let (value, _) = store.get(self.key(hash).as_str()).ok().flatten()?;
        let stored = u64::from_le_bytes(value.get(..8)?.try_into().ok()?);
        let at = u64::from_le_bytes(value.get(8..HEADER)?.try_into().ok()?);
        if stored != hash || now_ms.saturating_sub(at) >= self.ttl_ms {
            return None;
        }
        String::from_utf8(value.get(HEADER..)?.to_vec()).ok()
    }

    /// The hash a response id is kept under (what the exchange carries).
    pub fn id_hash(&self, id: &str) -> u64 {
        self.hash(id)
    }

    /// Record that `region` stored response `id`.
    pub fn record(&self, store: &mut dyn SharedStore, id: &str, region: &str, now_ms: u64) {
        self.write(store, self.hash(id), region, now_ms);
    }

    /// A peer Envoy's record: kept unless the slot holds a newer one.
    /// True when it changed the map.
    pub fn merge(&self, store: &mut dyn SharedStore, hash: u64, region: &str, at_ms: u64) -> bool {
        let current = store.get(self.key(hash).as_str()).ok().flatten();
        let newer_held = current.is_some_and(|(v, _)| {
            let at = v
                .get(8..HEADER)
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .map_or(0, u64::from_le_bytes);
            at >= at_ms
        });
        if newer_held {
            return false;
        }
        self.write(store, hash, region, at_ms);
        true
    }

    fn write(&self, store: &mut dyn SharedStore, hash: u64, region: &str, now_ms: u64) {
        let mut value = Vec::with_capacity(HEADER + region.len());
        value.extend_from_slice(&hash.to_le_bytes());
        value.extend_from_slice(&now_ms.to_le_bytes());
        value.extend_from_slice(region.as_bytes());
        let _ = store.set(self.key(hash).as_str(), &value, None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::store::MemoryStore;

    #[test]
    fn paths_name_ids() {
        assert_eq!(path_id("/v1/responses/resp_1"), Some("resp_1"));
        assert_eq!(path_id("/v1/responses/resp_1/"), Some("resp_1"));
        assert_eq!(path_id("/v1/responses/resp_1?x=1"), Some("resp_1"));
        assert_eq!(path_id("/v1/responses/resp_1/cancel"), Some("resp_1"));
        assert_eq!(path_id("/v1/responses/resp_1/input_items"), Some("resp_1"));
        assert_eq!(path_id("/v1/responses/resp_1/other"), None);
        assert_eq!(path_id("/v1/responses"), None);
        assert_eq!(path_id("/v1/responses/"), None);
        assert_eq!(path_id("/v1/responses/a\"b"), None);
        assert_eq!(path_id(&format!("/v1/responses/{}", "x".repeat(257))), None);
    }

    #[test]
    fn the_first_id_in_the_head_is_the_response_id() {
        let json = br#"{"id":"resp_abc","object":"response","output":[{"id":"msg_1"}]}"#;
        assert_eq!(find_id(json), Some("resp_abc"));
        let sse = b"event: response.created\ndata: {\"response\":{\"id\" : \"resp_9\",\"created_at\":1},\"type\":\"response.created\"}\n\n";
        assert_eq!(find_id(sse), Some("resp_9"));
        // Incomplete: not yet.
        assert_eq!(find_id(br#"{"id":"resp_ab"#), None);
        assert_eq!(find_id(br#"{"object":"x"}"#), None);
        assert_eq!(find_id(br#"{"id":17}"#), None);
        assert_eq!(find_id(br#"{"id":""}"#), None);
    }

    #[test]
    fn head_finds_an_id_split_across_chunks_and_gives_up_when_full() {
        let mut h = Head::default();
        assert_eq!(
            h.push(b"event: response.created\ndata: {\"response\":{\"i"),
            None
        );
        assert_eq!(h.push(b"d\":\"resp_x\",").as_deref(), Some("resp_x"));
        let mut h = Head::default();
        assert_eq!(h.wanted(10_000), HEAD_BYTES);
        assert_eq!(h.push(&vec![b' '; 10_000]), None);
        assert!(h.exhausted());
        assert_eq!(h.wanted(10), 0);
    }

    #[test]
    fn map_keeps_ids_within_ttl_and_never_confuses_them() {
        let m = ResponseMap {
            slots: 1,
            ttl_ms: 1000,
            seed: 3,
        };
        let mut s = MemoryStore::default();
        assert_eq!(m.lookup(&mut s, "resp_a", 0), None);
        m.record(&mut s, "resp_a", "eu", 100);
        assert_eq!(m.lookup(&mut s, "resp_a", 1099).as_deref(), Some("eu"));
        assert_eq!(m.lookup(&mut s, "resp_a", 1100), None, "past the TTL");
        // One slot: a newer id replaces the record, and the older one is
        // then unknown, never another's region.
        m.record(&mut s, "resp_b", "us", 200);
        assert_eq!(m.lookup(&mut s, "resp_a", 300), None);
        assert_eq!(m.lookup(&mut s, "resp_b", 300).as_deref(), Some("us"));
        // A garbled record is unknown.
        s.map.values_mut().for_each(|(v, _)| v.truncate(5));
        assert_eq!(m.lookup(&mut s, "resp_b", 300), None);
    }
}
