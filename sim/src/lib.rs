//! llm-geo-router-sim: a deterministic discrete-event simulator of
//! llm-geo-router against baseline routing policies, over the engine
//! emulator's own model (`engine_emulator::model`) and the plugin's own core
//! (`llm_geo_router`), so simulated and live numbers can be compared.
//!
//! `trace` and `topology` (the `--fleet` file) are the input formats; `scenario` generates them;
//! `workload` prepares a trace once for every policy; `sim` runs one policy
//! (`geo` for the geo-router, `policy` for the baselines, with `llmd` the
//! llm-d router and `mesh` the mesh default, `deploy` how a baseline is
//! deployed, `trie` their prefix trees, `events` the clock);
//! `report` and `plot` turn runs into numbers and SVG.

pub mod deploy;
pub mod events;
pub mod geo;
pub mod llmd;
pub mod mesh;
pub mod plot;
pub mod policy;
pub mod report;
pub mod rng;
pub mod scenario;
pub mod sim;
pub mod topology;
pub mod trace;
pub mod trie;
pub mod workload;

use deploy::Job;
use serde_json::Value;
use sim::{Options, Run};
use topology::Topology;
use workload::Workload;

/// Runs each job (a policy and its deployment, `deploy::jobs`) on its own
/// fresh engines, in parallel; the results come back in the order asked and
/// do not depend on the scheduling. The geo-router runs as
/// `options.proxies` Envoys per client region reading the regions' load
/// from `options.source` (`sim::run_options`).
pub fn simulate_all(
    fleet: &Topology,
    work: &Workload,
    jobs: &[Job],
    overrides: Option<&Value>,
    options: Options,
) -> Result<Vec<Run>, String> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|j| {
                scope.spawn(move || {
                    let options = sim::Options {
                        exchange: j.exchange,
                        ..options
                    };
                    sim::run_options(fleet, work, j.policy, &j.deployment, overrides, options)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a simulation thread panicked".to_string()))
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use deploy::Deployment;
    use policy::PolicyName;

    #[test]
    fn parallel_runs_equal_sequential_ones() {
        let s = scenario::generate(scenario::Kind::D, 5);
        let trace: Vec<_> = s.trace.into_iter().take(150).collect();
        let work = Workload::new(&s.fleet, trace).unwrap();
        let deployments = [
            Deployment::Oracle,
            Deployment::PerClientRegion,
            Deployment::Global("fra".into()),
        ];
        let jobs = deploy::jobs(&PolicyName::ALL, &deployments);
        assert_eq!(jobs.len(), 2 + 8 * 3);
        let all = simulate_all(&s.fleet, &work, &jobs, None, Options::default()).unwrap();
        for (j, r) in jobs.iter().zip(&all) {
            let alone = sim::run(&s.fleet, &work, j.policy, &j.deployment, None).unwrap();
            assert_eq!((r.policy, &r.deployment), (j.policy, &j.deployment));
            assert_eq!(r.label(), j.label());
            assert_eq!(r.records, alone.records, "{}", j.label());
        }
    }
}
