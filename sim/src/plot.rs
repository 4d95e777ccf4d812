//! Hand-written SVG plots of simulation runs (no plotting crate): the TTFT
//! CDF per run (colour: the policy, line style: its deployment), requests
//! started per region over time, and the geo-router's ladder level over
//! time. Each is a self-contained SVG with axes, ticks, axis labels, a
//! title and a legend.

use crate::deploy::Deployment;
use crate::policy::PolicyName;
use crate::sim::Run;
use crate::topology::Topology;
use std::fmt::Write;

const W: f64 = 820.0;
const H: f64 = 460.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 48.0;
const BOTTOM: f64 = 62.0;

/// Colours that stay apart for people with the common colour deficiencies
/// (Okabe–Ito), then two greys.
const PALETTE: [&str; 9] = [
    "#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000", "#999999",
    "#F0E442",
];

fn colour(i: usize) -> &'static str {
    PALETTE.get(i % PALETTE.len()).copied().unwrap_or("#000000")
}

/// A policy's colour: the same in every plot.
fn policy_colour(p: PolicyName) -> &'static str {
    colour(PolicyName::ALL.iter().position(|x| *x == p).unwrap_or(0))
}

const SOLID: &str = "";
const DOTTED: &str = "2,3";
const DASHES: [&str; 4] = ["7,4", "10,3,2,3", "12,6", "4,4"];

/// Line style of a deployment: per client region solid (as the
/// geo-router), the oracle dotted, each global placement its own dashes
/// (by its place among `globals`).
fn deployment_dash(d: &Deployment, globals: &[&Deployment]) -> &'static str {
    match d {
        Deployment::PerClientRegion => SOLID,
        Deployment::Oracle => DOTTED,
        Deployment::Global(_) => {
            let k = globals.iter().position(|g| *g == d).unwrap_or(0);
            DASHES.get(k % DASHES.len()).copied().unwrap_or(SOLID)
        }
    }
}

fn dash_attr(dash: &str) -> String {
    if dash.is_empty() {
        String::new()
    } else {
        format!(r#" stroke-dasharray="{dash}""#)
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[derive(Debug, Clone)]
struct Axis {
    min: f64,
    max: f64,
    log: bool,
    ticks: Vec<(f64, String)>,
}

impl Axis {
    fn frac(&self, v: f64) -> f64 {
        let (a, b, v) = if self.log {
            (self.min.log10(), self.max.log10(), v.max(self.min).log10())
        } else {
            (self.min, self.max, v)
        };
        if b > a {
            ((v - a) / (b - a)).clamp(0.0, 1.0)
        } else {
            0.0
        }
    }

    /// A linear axis over [min, max] with about `n` round ticks.
    fn linear(min: f64, max: f64, n: usize, unit: &str) -> Axis {
        let max = if max > min { max } else { min + 1.0 };
        let raw = (max - min) / n.max(1) as f64;
        let mag = 10f64.powf(raw.log10().floor());
        let step = [1.0, 2.0, 2.5, 5.0, 10.0]
            .iter()
            .map(|m| m * mag)
            .find(|s| *s >= raw)
            .unwrap_or(10.0 * mag);
        let lo = (min / step).floor() * step;
        let hi = (max / step).ceil() * step;
        let mut ticks = Vec::new();
        let mut k = 0.0;
        while lo + k * step <= hi + step * 1e-9 {
            let v = lo + k * step;
            let label = if step >= 1.0 {
                format!("{v:.0}{unit}")
            } else {
                format!("{v:.2}{unit}")
            };
            ticks.push((v, label));
            k += 1.0;
        }
        Axis {
            min: lo,
            max: hi,
            log: false,
            ticks,
        }
    }

    /// A log axis over whole decades with 1-2-5 ticks.
    fn log(min: f64, max: f64, unit: &str) -> Axis {
        let lo = 10f64.powf(min.max(1e-3).log10().floor());
        let mut hi = 10f64.powf(max.max(lo * 10.0).log10().ceil());
        if hi <= lo {
            hi = lo * 10.0;
        }
        let mut ticks = Vec::new();
        let mut d = lo;
        // 1-2-5 ticks while they fit, else one per decade.
        let decades = (hi / lo).log10().round();
        let marks: &[f64] = if decades <= 3.0 {
            &[1.0, 2.0, 5.0]
        } else {
            &[1.0]
        };
        while d <= hi * 1.0001 {
            for &m in marks {
                let v = d * m;
                if v >= lo * 0.9999 && v <= hi * 1.0001 {
                    let label = if v >= 1_000_000.0 {
                        format!("{}M{unit}", (v / 1_000_000.0).round())
                    } else if v >= 1000.0 {
                        format!("{}k{unit}", (v / 1000.0).round())
                    } else {
                        format!("{}{unit}", (v * 1000.0).round() / 1000.0)
                    };
                    ticks.push((v, label));
                }
            }
            d *= 10.0;
        }
        Axis {
            min: lo,
            max: hi,
            log: true,
            ticks,
        }
    }
}

struct Chart {
    svg: String,
    x: Axis,
    y: Axis,
    legend: usize,
}

impl Chart {
    fn new(title: &str, x: Axis, y: Axis, x_label: &str, y_label: &str) -> Chart {
        let mut svg = String::new();
        let _ = write!(
            svg,
            r##"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="Helvetica, Arial, sans-serif" font-size="13">
<rect width="{W}" height="{H}" fill="#ffffff"/>
<text x="{}" y="26" text-anchor="middle" font-size="16" font-weight="bold">{}</text>
"##,
            (LEFT + W - RIGHT) / 2.0,
            esc(title)
        );
        let mut c = Chart {
            svg,
            x,
            y,
            legend: 0,
        };
        c.frame(x_label, y_label);
        c
    }

    fn px(&self, v: f64) -> f64 {
        LEFT + self.x.frac(v) * (W - LEFT - RIGHT)
    }

    fn py(&self, v: f64) -> f64 {
        H - BOTTOM - self.y.frac(v) * (H - TOP - BOTTOM)
    }

    fn frame(&mut self, x_label: &str, y_label: &str) {
        let (x0, x1, y0, y1) = (LEFT, W - RIGHT, H - BOTTOM, TOP);
        let mut s = String::new();
        for (v, label) in self.y.ticks.clone() {
            let y = self.py(v);
            let _ = writeln!(
                s,
                r##"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#e4e4e4"/><line x1="{}" y1="{y:.1}" x2="{x0}" y2="{y:.1}" stroke="#333"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                x0 - 5.0,
                x0 - 8.0,
                y + 4.0,
                esc(&label)
            );
        }
        for (v, label) in self.x.ticks.clone() {
            let x = self.px(v);
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{y1}" x2="{x:.1}" y2="{y0}" stroke="#e4e4e4"/><line x1="{x:.1}" y1="{y0}" x2="{x:.1}" y2="{}" stroke="#333"/><text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"##,
                y0 + 5.0,
                y0 + 20.0,
                esc(&label)
            );
        }
        let _ = writeln!(
            s,
            r##"<rect x="{x0}" y="{y1}" width="{}" height="{}" fill="none" stroke="#333"/>
<text x="{}" y="{}" text-anchor="middle">{}</text>
<text x="20" y="{}" text-anchor="middle" transform="rotate(-90 20 {})">{}</text>"##,
            x1 - x0,
            y0 - y1,
            (x0 + x1) / 2.0,
            H - 18.0,
            esc(x_label),
            (y0 + y1) / 2.0,
            (y0 + y1) / 2.0,
            esc(y_label)
        );
        self.svg.push_str(&s);
    }

    fn band(&mut self, from: f64, to: f64, label: &str) {
        let (a, b) = (self.px(from), self.px(to));
        let _ = writeln!(
            self.svg,
            r##"<rect x="{a:.1}" y="{TOP}" width="{:.1}" height="{}" fill="#d0d0d0" fill-opacity="0.45"/><text x="{:.1}" y="{}" text-anchor="middle" font-size="11" fill="#555">{}</text>"##,
            (b - a).max(0.0),
            H - TOP - BOTTOM,
            (a + b) / 2.0,
            TOP + 14.0,
            esc(label)
        );
    }

    fn hline(&mut self, v: f64, label: &str) {
        let y = self.py(v);
        let _ = writeln!(
            self.svg,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#777" stroke-dasharray="5,4"/><text x="{}" y="{:.1}" font-size="11" fill="#555">{}</text>"##,
            W - RIGHT,
            LEFT + 6.0,
            y - 4.0,
            esc(label)
        );
    }

    fn line(&mut self, points: &[(f64, f64)], colour: &str, dash: &str) {
        if points.is_empty() {
            return;
        }
        let mut d = String::new();
        for (k, (x, y)) in points.iter().enumerate() {
            let _ = write!(
                d,
                "{}{:.1},{:.1}",
                if k == 0 { "M" } else { " L" },
                self.px(*x),
                self.py(*y)
            );
        }
        let _ = writeln!(
            self.svg,
            r##"<path d="{d}" fill="none" stroke="{colour}" stroke-width="2"{}/>"##,
            dash_attr(dash)
        );
    }

    fn key(&mut self, label: &str, colour: &str, dash: &str) {
        let x = W - RIGHT + 16.0;
        let y = TOP + 10.0 + 22.0 * self.legend as f64;
        let _ = writeln!(
            self.svg,
            r##"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{colour}" stroke-width="3"{}/><text x="{}" y="{}">{}</text>"##,
            x + 26.0,
            dash_attr(dash),
            x + 32.0,
            y + 4.0,
            esc(label)
        );
        self.legend += 1;
    }

    fn note(&mut self, text: &str) {
        let x = W - RIGHT + 16.0;
        let y = TOP + 16.0 + 22.0 * self.legend as f64;
        let _ = writeln!(
            self.svg,
            r##"<text x="{x}" y="{y}" font-size="11" fill="#555">{}</text>"##,
            esc(text)
        );
        self.legend += 1;
    }

    fn finish(mut self) -> String {
        self.svg.push_str("</svg>\n");
        self.svg
    }
}

/// At most `n` points of a sorted sample's empirical CDF, as a staircase.
fn cdf_points(sorted: &[f64], n: usize) -> Vec<(f64, f64)> {
    let len = sorted.len();
    if len == 0 {
        return Vec::new();
    }
    let step = len.div_ceil(n.max(1)).max(1);
    let mut out = Vec::new();
    let mut prev = 0.0;
    let mut k = 0;
    while k < len {
        let idx = (k + step - 1).min(len - 1);
        let x = sorted.get(idx).copied().unwrap_or(0.0);
        let y = (idx + 1) as f64 / len as f64;
        out.push((x, prev));
        out.push((x, y));
        prev = y;
        k += step;
    }
    out
}

/// The baselines' deployments in `runs`, in order of appearance.
fn deployments(runs: &[Run]) -> Vec<&Deployment> {
    let mut out: Vec<&Deployment> = Vec::new();
    for r in runs.iter().filter(|r| r.policy != PolicyName::GeoRouter) {
        if !out.contains(&&r.deployment) {
            out.push(&r.deployment);
        }
    }
    out
}

/// TTFT CDF, one line per run (log time axis): the colour is the policy,
/// the line style the deployment; the legend lists both.
pub fn ttft_cdf(title: &str, runs: &[Run]) -> String {
    let samples: Vec<(&Run, Vec<f64>)> = runs
        .iter()
        .map(|r| {
            let mut v: Vec<f64> = r.records.iter().filter_map(|x| x.ttft_ms).collect();
            v.sort_by(f64::total_cmp);
            (r, v)
        })
        .collect();
    let lo = samples
        .iter()
        .filter_map(|(_, v)| v.first().copied())
        .fold(f64::INFINITY, f64::min);
    let hi = samples
        .iter()
        .filter_map(|(_, v)| v.last().copied())
        .fold(0.0, f64::max);
    let lo = if lo.is_finite() { lo.max(1.0) } else { 1.0 };
    let x = Axis::log(lo, hi.max(lo * 10.0), "");
    let y = Axis {
        min: 0.0,
        max: 1.0,
        log: false,
        ticks: [0.0, 0.25, 0.5, 0.75, 1.0]
            .iter()
            .map(|v| (*v, format!("{v:.2}")))
            .collect(),
    };
    let mut c = Chart::new(
        title,
        x,
        y,
        "time to first token (ms, log scale)",
        "fraction of requests",
    );
    c.hline(0.95, "p95");
    let deployed = deployments(runs);
    let globals: Vec<&Deployment> = deployed
        .iter()
        .copied()
        .filter(|d| matches!(d, Deployment::Global(_)))
        .collect();
    // The geo-router as deployed is solid; given exact figures (its oracle
    // row), it takes the oracle's line style.
    let dash = |r: &Run| {
        if r.policy == PolicyName::GeoRouter && r.deployment != Deployment::Oracle {
            SOLID
        } else {
            deployment_dash(&r.deployment, &globals)
        }
    };
    for (r, v) in &samples {
        c.line(&cdf_points(v, 300), policy_colour(r.policy), dash(r));
    }
    let mut policies: Vec<PolicyName> = Vec::new();
    for (r, _) in &samples {
        if !policies.contains(&r.policy) {
            policies.push(r.policy);
        }
    }
    for p in policies {
        c.key(p.as_str(), policy_colour(p), SOLID);
    }
    if !deployed.is_empty() {
        c.note("baselines deployed:");
        for d in deployed {
            let name = match d {
                Deployment::Oracle => "oracle (the limit)".to_string(),
                other => other.to_string(),
            };
            c.key(&name, "#555555", deployment_dash(d, &globals));
        }
    }
    c.finish()
}

fn span_s(runs: &[&Run], fleet: &Topology) -> f64 {
    let end = runs
        .iter()
        .map(|r| r.end_ms)
        .chain(fleet.outages.iter().map(|o| o.to_ms))
        .fold(1000.0, f64::max);
    end / 1000.0
}

/// Charts stacked vertically in one SVG, one panel each.
fn stack(panels: &[String]) -> String {
    let height = H * panels.len().max(1) as f64;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}">"##
    );
    for (k, panel) in panels.iter().enumerate() {
        let _ = writeln!(
            out,
            r##"<g transform="translate(0 {})">{}</g>"##,
            H * k as f64,
            panel
        );
    }
    out.push_str("</svg>\n");
    out
}

/// Requests started per region per second over time, one panel (SVG) per
/// run, on the same scales so they can be compared side by side.
pub fn region_load(title: &str, fleet: &Topology, runs: &[&Run]) -> String {
    let span = span_s(runs, fleet);
    let bucket_s = (span / 90.0).ceil().max(1.0);
    let buckets = (span / bucket_s).ceil().max(1.0) as usize;
    let regions = fleet.regions.len();
    let series: Vec<Vec<Vec<f64>>> = runs
        .iter()
        .map(|run| {
            let mut counts = vec![vec![0.0; buckets]; regions];
            for (t, r) in &run.starts {
                let b = ((t / 1000.0) / bucket_s) as usize;
                if let Some(c) = counts
                    .get_mut(*r)
                    .and_then(|v| v.get_mut(b.min(buckets - 1)))
                {
                    *c += 1.0 / bucket_s;
                }
            }
            counts
        })
        .collect();
    let ymax = series
        .iter()
        .flatten()
        .flatten()
        .fold(0.0f64, |a, b| a.max(*b));
    let mut panels = Vec::with_capacity(runs.len());
    for (run, counts) in runs.iter().zip(&series) {
        let x = Axis::linear(0.0, span, 8, "");
        let y = Axis::linear(0.0, ymax.max(1.0), 5, "");
        let mut c = Chart::new(
            &format!("{title}: {}", run.label()),
            x,
            y,
            "time (s)",
            &format!("requests started per second ({bucket_s:.0} s buckets)"),
        );
        for o in &fleet.outages {
            c.band(
                o.from_ms / 1000.0,
                o.to_ms / 1000.0,
                &format!("{} lost", o.region),
            );
        }
        for (r, region) in fleet.regions.iter().enumerate() {
            let pts: Vec<(f64, f64)> = counts
                .get(r)
                .map(|v| {
                    v.iter()
                        .enumerate()
                        .map(|(b, n)| ((b as f64 + 0.5) * bucket_s, *n))
                        .collect()
                })
                .unwrap_or_default();
            c.line(&pts, colour(r), SOLID);
            c.key(&region.name, colour(r), SOLID);
        }
        panels.push(c.finish());
    }
    stack(&panels)
}

/// Requests at each region's engine (running + waiting) over its slots,
/// sampled every `sim::SAMPLE_MS` over the middle half of the trace, one
/// panel per run on the same scales; above 1, requests wait for a slot.
pub fn region_occupancy(title: &str, fleet: &Topology, runs: &[&Run]) -> String {
    let series: Vec<Vec<Vec<(f64, f64)>>> = runs
        .iter()
        .map(|run| {
            fleet
                .regions
                .iter()
                .enumerate()
                .map(|(r, region)| {
                    let slots = f64::from(region.slots().max(1));
                    run.occupancy.get(r).map_or_else(Vec::new, |v| {
                        v.iter()
                            .enumerate()
                            .map(|(k, (n, _))| {
                                let t = run.window_ms.0 + k as f64 * crate::sim::SAMPLE_MS;
                                (t / 1000.0, f64::from(*n) / slots)
                            })
                            .collect()
                    })
                })
                .collect()
        })
        .collect();
    let ymax = series
        .iter()
        .flatten()
        .flatten()
        .fold(1.0f64, |a, (_, y)| a.max(*y));
    let (lo, hi) = series
        .iter()
        .flatten()
        .flatten()
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), (t, _)| {
            (lo.min(*t), hi.max(*t))
        });
    let lo = if lo.is_finite() { lo } else { 0.0 };
    let mut panels = Vec::with_capacity(runs.len());
    for (run, lines) in runs.iter().zip(&series) {
        let x = Axis::linear(lo.floor(), hi.max(lo + 1.0), 8, "");
        let y = Axis::linear(0.0, ymax, 5, "");
        let mut c = Chart::new(
            &format!("{title}: {}", run.label()),
            x,
            y,
            "time (s)",
            "requests at the engine / slots",
        );
        for (r, region) in fleet.regions.iter().enumerate() {
            c.line(
                lines.get(r).map_or(&[][..], Vec::as_slice),
                colour(r),
                SOLID,
            );
            c.key(&region.name, colour(r), SOLID);
        }
        c.note("(middle half of the trace;");
        c.note(" above 1: requests wait)");
        panels.push(c.finish());
    }
    stack(&panels)
}

/// The geo-router's ladder level over time, one line per client region's
/// Envoy.
pub fn ladder(title: &str, fleet: &Topology, run: &Run) -> String {
    let span = span_s(&[run], fleet);
    let x = Axis::linear(0.0, span, 8, "");
    let y = Axis {
        min: -0.2,
        max: 5.2,
        log: false,
        ticks: (0..=5).map(|l| (f64::from(l), format!("{l}"))).collect(),
    };
    let mut c = Chart::new(title, x, y, "time (s)", "ladder level");
    for o in &fleet.outages {
        c.band(
            o.from_ms / 1000.0,
            o.to_ms / 1000.0,
            &format!("{} lost", o.region),
        );
    }
    for (k, series) in run.levels.iter().enumerate() {
        let mut pts = Vec::new();
        let mut prev: Option<u8> = None;
        for (t, level) in series {
            let t = t / 1000.0;
            if let Some(p) = prev {
                if p != *level {
                    pts.push((t, f64::from(p)));
                }
            }
            pts.push((t, f64::from(*level)));
            prev = Some(*level);
        }
        let name = fleet.client_regions.get(k).map_or("?", String::as_str);
        // Offset each Envoy slightly so equal levels stay visible.
        let off = 0.06 * k as f64;
        let pts: Vec<(f64, f64)> = pts.into_iter().map(|(t, l)| (t, l + off)).collect();
        let dash = if k % 2 == 1 { "7,4" } else { SOLID };
        c.line(&pts, colour(k), dash);
        c.key(&format!("Envoy in {name}"), colour(k), dash);
    }
    c.note("(lines offset slightly");
    c.note(" so equal levels show)");
    c.finish()
}

/// Every plot of a set of runs, as (file name, SVG): the TTFT CDF of all
/// runs; requests started per region and occupancy per region for the
/// geo-router and, for each
/// deployment of the baselines, the baseline with the lowest p95 TTFT (or,
/// without a geo-router and with one deployment, the two best); the
/// geo-router's ladder level.
pub fn all(label: &str, fleet: &Topology, runs: &[Run]) -> Vec<(&'static str, String)> {
    let mut out = vec![(
        "ttft_cdf.svg",
        ttft_cdf(&format!("TTFT CDF: {label}"), runs),
    )];
    let p95 = |r: &Run| {
        let v: Vec<f64> = r.records.iter().filter_map(|x| x.ttft_ms).collect();
        crate::report::dist(&v).map_or(f64::INFINITY, |d| d.p95)
    };
    let geo = runs
        .iter()
        .find(|r| r.policy == crate::policy::PolicyName::GeoRouter);
    let mut others: Vec<&Run> = runs
        .iter()
        .filter(|r| r.policy != crate::policy::PolicyName::GeoRouter)
        .collect();
    others.sort_by(|a, b| p95(a).total_cmp(&p95(b)));
    let deployed = deployments(runs);
    let best: Vec<&Run> = deployed
        .iter()
        .filter_map(|d| others.iter().copied().find(|r| r.deployment == **d))
        .collect();
    let panels: Vec<&Run> = match geo {
        Some(g) => std::iter::once(g).chain(best).collect(),
        None if deployed.len() <= 1 => others.iter().take(2).copied().collect(),
        None => best,
    };
    if !panels.is_empty() {
        out.push((
            "region_load.svg",
            region_load(
                &format!("Requests started per region: {label}"),
                fleet,
                &panels,
            ),
        ));
        out.push((
            "region_occupancy.svg",
            region_occupancy(&format!("Occupancy per region: {label}"), fleet, &panels),
        ));
    }
    if let Some(g) = geo {
        out.push((
            "ladder.svg",
            ladder(&format!("geo-router ladder level: {label}"), fleet, g),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_have_round_ticks() {
        let a = Axis::linear(0.0, 187.0, 8, "");
        assert_eq!(a.ticks.first().map(|t| t.0), Some(0.0));
        assert_eq!(a.max, 200.0);
        assert_eq!(a.ticks.len(), 9);
        let l = Axis::log(37.0, 4100.0, "");
        assert_eq!((l.min, l.max), (10.0, 10000.0));
        assert!(l.ticks.iter().any(|(_, s)| s == "1k"));
        assert_eq!(l.ticks.len(), 10);
        assert_eq!(Axis::log(40.0, 200_000.0, "").ticks.len(), 6);
        assert!((l.frac(100.0) - 1.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn cdf_is_a_staircase_to_one() {
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        let p = cdf_points(&v, 100);
        assert_eq!(p.last(), Some(&(1000.0, 1.0)));
        assert!(p.len() <= 202);
        assert!(p.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
    }
}
