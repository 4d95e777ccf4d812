//! llm-geo-router-sim: a deterministic discrete-event simulator of
//! llm-geo-router against baseline routing policies, over the engine
//! emulator's own model (`engine_emulator::model`) and the plugin's own core
//! (`llm_geo_router`), so simulated and live numbers can be compared.
//!
//! `trace` and `fleet` are the input formats; `scenario` generates them;
//! `workload` prepares a trace once for every policy; `sim` runs one policy
//! (`geo` for the geo-router, `policy` for the baselines, `trie` their
//! prefix trees, `events` the clock); `report` and `plot` turn runs into
//! numbers and SVG.

pub mod events;
pub mod fleet;
pub mod geo;
pub mod plot;
pub mod policy;
pub mod report;
pub mod rng;
pub mod scenario;
pub mod sim;
pub mod trace;
pub mod trie;
pub mod workload;

use fleet::Fleet;
use policy::PolicyName;
use serde_json::Value;
use sim::Run;
use workload::Workload;

/// Runs each policy on its own fresh engines, in parallel; the results come
/// back in the order asked and do not depend on the scheduling.
pub fn simulate_all(
    fleet: &Fleet,
    work: &Workload,
    policies: &[PolicyName],
    overrides: Option<&Value>,
) -> Result<Vec<Run>, String> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = policies
            .iter()
            .map(|&p| scope.spawn(move || sim::run(fleet, work, p, overrides)))
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

    #[test]
    fn parallel_runs_equal_sequential_ones() {
        let s = scenario::generate(scenario::Kind::D, 5);
        let trace: Vec<_> = s.trace.into_iter().take(150).collect();
        let work = Workload::new(&s.fleet, trace).unwrap();
        let all = simulate_all(&s.fleet, &work, &PolicyName::ALL, None).unwrap();
        for (p, r) in PolicyName::ALL.iter().zip(&all) {
            let alone = sim::run(&s.fleet, &work, *p, None).unwrap();
            assert_eq!(r.policy, *p);
            assert_eq!(r.records, alone.records, "{p:?}");
        }
    }
}
