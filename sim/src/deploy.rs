//! How a baseline router is deployed: where its instances run, what each
//! one knows, and what its position costs the client. The geo-router is
//! always deployed as the plugin is, one Envoy per client region (`geo`).
//!
//! - `oracle`: one instance with exact, instant knowledge of every engine
//!   and every routed prefix, at no network position (the client reaches
//!   the engine directly). A limit, not a deployment anyone can run.
//! - `global:<region>`: one instance in the named engine region. Every
//!   request goes client → router → engine, so TTFT adds the client's round
//!   trip to the router's region and the router region's round trip to the
//!   engine's (`Topology::region_rtt`). It knows what it routed: in-flight
//!   counts and prefixes of all traffic (it sees all of it).
//! - `per-client-region`: one instance per client region, as the geo-router
//!   is, each with only its own traffic: its own prefix tree, its own
//!   in-flight counts, its own round-robin counter.
//!
//! Outside the oracle, what a router can only learn from the engines is a
//! scrape: GORGO's queued tokens every `probe.tick_ms`, the plugin's probe
//! tick; llm-d's waiting queues and KV usage every 50 ms, its own default.

use crate::policy::PolicyName;
use crate::topology::Topology;
use crate::workload::Workload;
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Deployment {
    Oracle,
    /// One instance in this engine region (by name).
    Global(String),
    PerClientRegion,
}

/// The spellings `parse` accepts, for messages and help.
pub const SPELLINGS: &str = "oracle, per-client-region, global:<region>";

impl Deployment {
    /// `oracle`, `per-client-region` or `global:<region>`; the region is
    /// checked against a fleet by `check`.
    pub fn parse(text: &str) -> Result<Deployment, String> {
        match text.trim() {
            "oracle" => Ok(Deployment::Oracle),
            "per-client-region" => Ok(Deployment::PerClientRegion),
            t => match t.strip_prefix("global:") {
                Some(region) if !region.trim().is_empty() => {
                    Ok(Deployment::Global(region.trim().to_string()))
                }
                Some(_) => Err(format!(
                    "'{t}' names no region: global:<region>, one of the fleet's regions"
                )),
                None => Err(format!("unknown deployment '{t}'; known: {SPELLINGS}")),
            },
        }
    }

    /// The router's region, for `global`; an unknown region is an error
    /// that lists the fleet's regions.
    pub fn router_region(&self, fleet: &Topology) -> Result<Option<usize>, String> {
        match self {
            Deployment::Global(name) => fleet.region_index(name).map(Some).ok_or_else(|| {
                let names: Vec<&str> = fleet.regions.iter().map(|r| r.name.as_str()).collect();
                format!(
                    "global:{name}: '{name}' is not a region of the fleet; its regions: {}",
                    names.join(", ")
                )
            }),
            Deployment::Oracle | Deployment::PerClientRegion => Ok(None),
        }
    }

    /// The default set: `oracle`, `per-client-region`, and `global` in the
    /// region where one router would be closest to the trace's clients (the
    /// lowest round trip summed over every request from its client region;
    /// the first region on ties).
    pub fn defaults(fleet: &Topology, work: &Workload) -> Vec<Deployment> {
        let mut per_client = vec![0u64; fleet.client_regions.len()];
        for p in &work.prepared {
            if let Some(n) = per_client.get_mut(p.client) {
                *n += 1;
            }
        }
        let cost = |g: usize| {
            per_client
                .iter()
                .enumerate()
                .map(|(c, n)| *n as f64 * fleet.rtt(c, g))
                .sum::<f64>()
        };
        let mut best = 0;
        for g in 1..fleet.regions.len() {
            if cost(g) < cost(best) {
                best = g;
            }
        }
        let mut out = vec![Deployment::Oracle, Deployment::PerClientRegion];
        if let Some(r) = fleet.regions.get(best) {
            out.push(Deployment::Global(r.name.clone()));
        }
        out
    }
}

impl fmt::Display for Deployment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Deployment::Oracle => f.write_str("oracle"),
            Deployment::Global(region) => write!(f, "global:{region}"),
            Deployment::PerClientRegion => f.write_str("per-client-region"),
        }
    }
}

/// Refuses a deployment given twice or a `global` region the fleet lacks.
pub fn check(deployments: &[Deployment], fleet: &Topology) -> Result<(), String> {
    for (i, d) in deployments.iter().enumerate() {
        if deployments.iter().take(i).any(|o| o == d) {
            return Err(format!("'{d}' is given more than once"));
        }
        d.router_region(fleet)?;
    }
    Ok(())
}

/// One simulation to run: a policy and, for a baseline, its deployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    pub policy: PolicyName,
    pub deployment: Deployment,
    /// Geo-router: its Envoys share what they learn (`Options::exchange`).
    pub exchange: bool,
}

impl Job {
    /// `geo-router`, or `<policy>@<deployment>` for a baseline, with
    /// `+exchange` when the Envoys share.
    pub fn label(&self) -> String {
        let l = label(self.policy, &self.deployment);
        if self.exchange {
            format!("{l}+exchange")
        } else {
            l
        }
    }
}

/// `jobs` with, after each geo-router run as deployed (per client region),
/// the same run with its Envoys sharing through the exchange.
pub fn with_exchange(jobs: Vec<Job>) -> Vec<Job> {
    let mut out = Vec::with_capacity(jobs.len() + 1);
    for j in jobs {
        let shared = (j.policy == PolicyName::GeoRouter
            && j.deployment == Deployment::PerClientRegion
            && !j.exchange)
            .then(|| Job {
                exchange: true,
                ..j.clone()
            });
        out.push(j);
        out.extend(shared);
    }
    out
}

pub fn label(policy: PolicyName, deployment: &Deployment) -> String {
    if policy == PolicyName::GeoRouter {
        match deployment {
            Deployment::Oracle => format!("{}(exact)", policy.as_str()),
            _ => policy.as_str().to_string(),
        }
    } else {
        format!("{}@{deployment}", policy.as_str())
    }
}

/// The runs for `policies` × `deployments`, in the order asked (policies
/// first): the geo-router once as deployed (per client region, starting from
/// what an operator knows), and when the oracle is asked for, once more
/// given the engines' exact figures (`geo-router(exact)`, a limit); every
/// baseline once per deployment.
pub fn jobs(policies: &[PolicyName], deployments: &[Deployment]) -> Vec<Job> {
    let mut out = Vec::new();
    for &policy in policies {
        if policy == PolicyName::GeoRouter {
            out.push(Job {
                policy,
                deployment: Deployment::PerClientRegion,
                exchange: false,
            });
            if deployments.contains(&Deployment::Oracle) {
                out.push(Job {
                    policy,
                    deployment: Deployment::Oracle,
                    exchange: false,
                });
            }
            continue;
        }
        for d in deployments {
            out.push(Job {
                policy,
                deployment: d.clone(),
                exchange: false,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario;

    #[test]
    fn spellings_and_refusals() {
        assert_eq!(Deployment::parse("oracle"), Ok(Deployment::Oracle));
        assert_eq!(
            Deployment::parse("per-client-region"),
            Ok(Deployment::PerClientRegion)
        );
        assert_eq!(
            Deployment::parse("global:iad"),
            Ok(Deployment::Global("iad".into()))
        );
        assert_eq!(
            Deployment::parse("everywhere").unwrap_err(),
            "unknown deployment 'everywhere'; known: oracle, per-client-region, global:<region>"
        );
        assert!(Deployment::parse("global:")
            .unwrap_err()
            .contains("names no region"));
        for d in ["oracle", "per-client-region", "global:fra"] {
            assert_eq!(Deployment::parse(d).unwrap().to_string(), d);
        }
    }

    #[test]
    fn regions_are_checked_against_the_fleet_and_repeats_refused() {
        let s = scenario::generate(scenario::Kind::A, 1);
        let d = |t: &str| Deployment::parse(t).unwrap();
        assert_eq!(d("global:fra").router_region(&s.fleet), Ok(Some(1)));
        assert_eq!(d("oracle").router_region(&s.fleet), Ok(None));
        assert_eq!(
            check(&[d("oracle"), d("global:sfo")], &s.fleet).unwrap_err(),
            "global:sfo: 'sfo' is not a region of the fleet; its regions: iad, fra, icn"
        );
        assert_eq!(
            check(&[d("global:iad"), d("oracle"), d("global:iad")], &s.fleet).unwrap_err(),
            "'global:iad' is given more than once"
        );
        assert!(check(&[d("global:iad"), d("global:icn")], &s.fleet).is_ok());
    }

    #[test]
    fn defaults_place_the_global_router_nearest_the_traffic() {
        // Scenario a: most requests from na, nearest iad.
        let s = scenario::generate(scenario::Kind::A, 1);
        let trace: Vec<_> = s.trace.into_iter().take(200).collect();
        let work = Workload::new(&s.fleet, trace).unwrap();
        assert_eq!(
            Deployment::defaults(&s.fleet, &work),
            [
                Deployment::Oracle,
                Deployment::PerClientRegion,
                Deployment::Global("iad".into())
            ]
        );
        // Only ap traffic: icn.
        let s = scenario::generate(scenario::Kind::A, 1);
        let trace: Vec<_> = s
            .trace
            .into_iter()
            .filter(|r| r.client_region == "ap")
            .take(20)
            .collect();
        let work = Workload::new(&s.fleet, trace).unwrap();
        assert_eq!(
            Deployment::defaults(&s.fleet, &work).last(),
            Some(&Deployment::Global("icn".into()))
        );
    }

    #[test]
    fn jobs_run_the_geo_router_once_and_baselines_per_deployment() {
        let ds = [Deployment::Oracle, Deployment::Global("iad".into())];
        let j = jobs(&[PolicyName::GeoRouter, PolicyName::CacheAware], &ds);
        let labels: Vec<String> = j.iter().map(Job::label).collect();
        assert_eq!(
            labels,
            [
                "geo-router",
                "geo-router(exact)",
                "cache-aware@oracle",
                "cache-aware@global:iad"
            ]
        );
        assert_eq!(j[0].deployment, Deployment::PerClientRegion);
        let j = jobs(&[PolicyName::GeoRouter], &ds[1..]);
        assert_eq!(j.len(), 1, "no exact row without the oracle");
    }
}
