//! Many Envoys, one view: what each Envoy of a deployment learns reaches
//! the others through the probe's callouts, within about a tick.
//!
//! Each Envoy's probe keeps an outbox of news: this Envoy's placements (a
//! region served a prompt: the checkpoints it wrote, their stamp and the
//! prompt's end), stored-response ids, the engines' usage reports, and its
//! own load (in-flight requests per region, and its demand). Every
//! `exchange.interval_ms` it sends the outbox as one message to
//! `exchange.fanout` peers through the peers' Envoy cluster, and empties it.
//! A peer's `exchange` filter checks the message whole, merges its
//! placements and stored responses into shared data at once, and queues it
//! for its probe, which takes the loads and usage reports and puts in its
//! own outbox what was news to it: each Envoy forwards each item once (relay, not all-to-all), so the
//! bytes an Envoy sends and receives per routed request of the deployment
//! are about `fanout` items, at any number of Envoys.
//!
//! Merging is idempotent and order-free. Directory entries and response
//! records are last-writer-wins registers (a stamp per prefix and region;
//! newest wins); loads are per origin, newest wins; usage reports are
//! events, taken once per (origin, sequence number). A lost, repeated or
//! reordered message changes only how fresh a view is.
//!
//! Message layout (little endian):
//! `magic "LGRX" ‖ version u8 (2) ‖ 0 u8 ‖ layout u32 ‖ sender u64 ‖ sent ms u64
//! ‖ groups u16`, then the groups, then `checksum u64`: XXH3-64 of every
//! byte before it. Per group (one origin Envoy)
//! `origin u64 ‖ has load u8 [‖ taken ms u64 ‖ demand f32 ‖ in-flight u32 ×
//! regions] ‖ items u16`, then per item `seq u32 ‖ kind u8 ‖ len u16 ‖ body`:
//! - kind 1, placement: `region u16 ‖ stamp u64 ‖ blocks u32 ‖ end tag u32 ‖
//!   n u8 ‖ checkpoint hash u64 × n` (1 ≤ n ≤ 64);
//! - kind 2, stored response: `region u16 ‖ recorded ms u64 ‖ id hash u64`;
//! - kind 3, usage report: the router's report as the probe's queue carries it;
//! - kind 4, session record: `region u16 ‖ recorded ms u64 ‖ session hash u64
//!   ‖ prompt blocks u32 ‖ last block hash u64`.
//!
//! A message is refused whole, never merged in part, when any of it is
//! malformed, damaged (its checksum does not match: any flipped bit, which
//! would otherwise decode as other news), beyond the size limit, or of
//! another layout (region list, hash seed, block size or protocol version
//! differ: its hashes and region numbers would mean other things here).
//! The checksum is against damage, not forgery: who may send is the peers'
//! listener's mutual TLS (docs/OPERATIONS.md, "Many Envoys, one view").
//!
//! The message and its checks are in `message`, an Envoy's peers, merge
//! and outbox in `peers`, the filter that takes a peer's message in `filter`.

pub mod filter;
pub mod message;
pub mod peers;

pub use filter::{ExchangeStream, SharedMaps};
pub use message::{
    decode_note, encode_note, layout, seal, Body, Group, Item, Load, Message, Refusal, MAGIC,
    MAX_HASHES, NOTE_TAG, PEER_TAG, VERSION,
};
pub use peers::{plan, Apply, Exchange, Merged, MAX_PEERS};
