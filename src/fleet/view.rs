//! A worker's view of the fleet snapshot. The probe writes the snapshot to
//! shared data, then sets its version gauge; a filter reads the gauge (one
//! cheap host call) and copies and decodes the snapshot only when the
//! version differs from the one it holds. A snapshot older than
//! `probe.snapshot_max_age_ms` is not used: the filters then behave as
//! with no probe at all (nearest region, level 0).

use std::rc::Rc;

use crate::config::Config;
use crate::fleet::snapshot::Snapshot;
use crate::shared::host_api::{Effects, Level};
use crate::shared::names::{Global, Stat, SNAPSHOT_KEY};

/// Per configured region: its index in the snapshot's region list.
pub type RegionIndex = Rc<Vec<Option<usize>>>;

/// The snapshot in force and the index of each configured region in it.
#[derive(Debug, Clone)]
pub struct Fresh {
    pub snapshot: Rc<Snapshot>,
    pub index: RegionIndex,
}

impl Fresh {
    pub fn level(&self) -> u8 {
        self.snapshot.level
    }
}

#[derive(Debug, Default)]
pub struct View {
    /// The version gauge's value when the snapshot was copied in, and the
    /// decoded snapshot (`None`: none published, or it did not decode).
    cached: Option<(u64, Option<Fresh>)>,
    /// The version whose decode failure was logged (once per version).
    warned: u64,
    /// Copies of the snapshot made (for tests and benchmarks).
    pub copies: u64,
}

impl View {
    pub fn new() -> View {
        View::default()
    }

    /// The snapshot if there is a fresh one at `now_ms`.
    pub fn current(&mut self, cfg: &Config, host: &mut dyn Effects, now_ms: u64) -> Option<Fresh> {
        let version = host.stat(Stat::Global(Global::ProbeSnapshotVersion));
        let stale_copy = self.cached.as_ref().is_none_or(|(v, _)| *v != version);
        if stale_copy {
            let fresh = if version == 0 {
                None
            } else {
                self.copy_in(cfg, host, version)
            };
            self.cached = Some((version, fresh));
        }
        let fresh = self.cached.as_ref()?.1.as_ref()?;
        fresh
            .snapshot
            .is_fresh(now_ms, u64::from(cfg.probe.snapshot_max_age_ms))
            .then(|| fresh.clone())
    }

    fn copy_in(&mut self, cfg: &Config, host: &mut dyn Effects, version: u64) -> Option<Fresh> {
        self.copies += 1;
        let (bytes, _) = host.get(SNAPSHOT_KEY).ok().flatten()?;
        match Snapshot::decode(&bytes) {
            Ok(s) => {
                let index = cfg
                    .regions
                    .iter()
                    .map(|r| s.regions.iter().position(|x| x.name == r.name))
                    .collect();
                Some(Fresh {
                    snapshot: Rc::new(s),
                    index: Rc::new(index),
                })
            }
            Err(e) => {
                if self.warned != version {
                    self.warned = version;
                    host.log(
                        Level::Warn,
                        &format!("llm-geo-router: {e}; routing without it"),
                    );
                }
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::host_api::Recorder;
    use crate::shared::store::SharedStore;

    fn cfg() -> Config {
        Config::parse(br#"{"regions":[{"name":"a","cluster":"a","capacity_rps":1}],"probe":{"snapshot_max_age_ms":2000}}"#)
            .unwrap()
    }

    fn publish(host: &mut Recorder, version: u64, at_ms: u64) {
        let s = Snapshot {
            version,
            generated_ms: at_ms,
            level: u8::try_from(version % 6).unwrap(),
            ..Snapshot::all_healthy(&cfg())
        };
        host.set(SNAPSHOT_KEY, &s.encode(), None).unwrap();
        host.set_gauge(Stat::Global(Global::ProbeSnapshotVersion), version);
    }

    #[test]
    fn copies_only_when_the_version_changes_and_ignores_stale_snapshots() {
        let c = cfg();
        let mut host = Recorder::default();
        let mut view = View::new();
        // Nothing published: no snapshot, no copy attempted.
        assert!(view.current(&c, &mut host, 1_000).is_none());
        assert_eq!((view.copies, host.store.gets), (0, 0));
        publish(&mut host, 1, 1_000);
        for now in [1_000, 1_500, 2_900] {
            assert_eq!(view.current(&c, &mut host, now).unwrap().level(), 1);
        }
        assert_eq!(view.copies, 1);
        // Older than snapshot_max_age_ms: not used, and not copied again.
        assert!(view.current(&c, &mut host, 3_001).is_none());
        assert_eq!(view.copies, 1);
        publish(&mut host, 2, 3_000);
        assert_eq!(view.current(&c, &mut host, 3_001).unwrap().level(), 2);
        // A reloaded probe starts its versions again: any change is a change.
        publish(&mut host, 1, 3_100);
        assert_eq!(view.current(&c, &mut host, 3_200).unwrap().level(), 1);
        assert_eq!(view.copies, 3);
    }

    #[test]
    fn a_snapshot_that_does_not_decode_is_logged_once_per_version() {
        let c = cfg();
        let mut host = Recorder::default();
        let mut view = View::new();
        host.set(SNAPSHOT_KEY, b"garbage", None).unwrap();
        host.set_gauge(Stat::Global(Global::ProbeSnapshotVersion), 7);
        for _ in 0..3 {
            assert!(view.current(&c, &mut host, 1).is_none());
        }
        assert_eq!(host.logs.len(), 1);
        assert_eq!(view.copies, 1);
    }
}
