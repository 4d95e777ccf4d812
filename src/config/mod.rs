//! Plugin configuration: the JSON an operator writes into each plugin's
//! `configuration`, parsed once in `on_configure` into these types and
//! validated. One schema serves all three roots (`probe`, `guard`, `router`)
//! so that the same document can be given to each; every root validates the
//! whole of it, so a typo is refused wherever it is pasted.
//!
//! Unknown fields are refused (`deny_unknown_fields`): a misspelt option that
//! silently falls back to its default is worse than a refused config.
//!
//! `document` holds `Config` with its parse and validation entry; the
//! sections are in `regions`, `cache`, `routing`, `probe` and `ladder`, the
//! checks validation hands off in `section_checks`; `removed` lists the
//! fields an earlier release took; `error` the error and the value checks.

pub mod cache;
pub mod document;
pub mod error;
pub mod ladder;
pub mod probe;
pub mod regions;
pub mod removed;
pub mod routing;
mod section_checks;

pub use cache::{
    DirectoryConfig, ExchangeConfig, HolderUnavailable, PrefixConfig, ResponsesConfig, StreamUsage,
};
pub use document::{Config, InvalidRequests};
pub use error::ConfigError;
pub use ladder::{LadderConfig, TierConfig, TierPolicy, LADDER_RUNGS};
pub use probe::{
    AssessmentConfig, ContextConfig, ProbeConfig, ReleaseConfig, ReleaseSource,
    DEFAULT_BUSY_TICK_MS,
};
pub use regions::{
    LoadSource, PrometheusConfig, Region, ResidencyConfig, DEFAULT_SERVICE_MS, MAX_REGIONS,
};
pub use removed::REMOVED_FIELDS;
pub use routing::{BodyWaitAction, BodyWaitConfig, CostConfig, Headers, Link, MigrationConfig};
