//! A worker's view of the fleet snapshot: read from shared data on each
//! request (one host call), decoded only when its CAS changed, and ignored
//! when older than `probe.snapshot_max_age_ms`.

use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::types::LogLevel;

use super::calls::{log, HostStore};
use crate::config::Config;
use crate::directory::SharedStore;
use crate::snapshot::{Snapshot, SNAPSHOT_KEY};

/// Per configured region: its index in the snapshot's region list.
pub type RegionIndex = Rc<Vec<Option<usize>>>;
pub type Fresh = Option<(Rc<Snapshot>, RegionIndex)>;

pub struct View {
    /// The snapshot decoded at `cas`, with each configured region's index in it.
    cached: Option<(u32, Rc<Snapshot>, RegionIndex)>,
    warned_cas: u32,
}

impl View {
    pub fn new() -> RefCell<View> {
        RefCell::new(View {
            cached: None,
            warned_cas: 0,
        })
    }

    /// The current snapshot if there is a fresh one.
    pub fn current(&mut self, cfg: &Config, now_ms: u64) -> Fresh {
        let (bytes, cas) = match HostStore.get(SNAPSHOT_KEY) {
            Ok(Some(v)) => v,
            _ => return None,
        };
        let hit = self.cached.as_ref().is_some_and(|(c, _, _)| *c == cas);
        if !hit {
            match Snapshot::decode(&bytes) {
                Ok(s) => {
                    let index = cfg
                        .regions
                        .iter()
                        .map(|r| s.regions.iter().position(|x| x.name == r.name))
                        .collect();
                    self.cached = Some((cas, Rc::new(s), Rc::new(index)));
                }
                Err(e) => {
                    if self.warned_cas != cas {
                        self.warned_cas = cas;
                        log(
                            LogLevel::Warn,
                            &format!("llm-geo-router: {e}; routing without it"),
                        );
                    }
                    self.cached = None;
                    return None;
                }
            }
        }
        let (_, snap, index) = self.cached.as_ref()?;
        snap.is_fresh(now_ms, u64::from(cfg.probe.snapshot_max_age_ms))
            .then(|| (snap.clone(), index.clone()))
    }
}
