//! Prints the side-by-side benchmark results of BENCHMARKS.md as ratios, tollgate / peer: per
//! case the median and the range of the ratios of each run (criterion baselines `run1`,
//! `run2`, ..., each run measuring both sides back to back), against the targets.
//!
//! Reads `$CRITERION_HOME` (set by `benches/compare.sh` to `<target dir>/criterion`), else
//! `target/criterion`. `bash benches/compare.sh` runs the benchmarks and then this.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Criterion's median estimate (ns) per benchmark id (`group/function/parameter`) and run.
type Runs = BTreeMap<String, BTreeMap<String, f64>>;

fn load(root: &Path) -> Runs {
    let mut runs: Runs = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            if !path.is_dir() {
                continue;
            }
            let name = entry.file_name().to_string_lossy().into_owned();
            let estimates = path.join("estimates.json");
            if name.starts_with("run") && estimates.is_file() {
                let id = dir.strip_prefix(root).unwrap_or(&dir).to_string_lossy().into_owned();
                if let Some(ns) = median_of(&estimates) {
                    runs.entry(id).or_default().insert(name, ns);
                }
            } else {
                stack.push(path);
            }
        }
    }
    runs
}

fn median_of(estimates: &PathBuf) -> Option<f64> {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(estimates).ok()?).ok()?;
    json["median"]["point_estimate"].as_f64()
}

/// Median, minimum and maximum.
fn spread(mut v: Vec<f64>) -> Option<(f64, f64, f64)> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some((v[v.len() / 2], v[0], v[v.len() - 1]))
}

/// Per run, `f` of the runs' medians of `ids` (runs missing any id are skipped).
fn per_run(runs: &Runs, ids: &[&str], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let Some(first) = runs.get(ids[0]) else { return Vec::new() };
    first
        .keys()
        .filter_map(|run| {
            let values: Option<Vec<f64>> =
                ids.iter().map(|id| runs.get(*id).and_then(|r| r.get(run)).copied()).collect();
            values.map(|v| f(&v))
        })
        .collect()
}

/// Prints a row: `ratios` per run; the target is met when the median is on the right side of
/// `limit` (`at_most`: the ratio must not exceed it).
fn row(what: &str, ratios: Vec<f64>, limit: f64, at_most: bool) {
    let n = ratios.len();
    let Some((median, lo, hi)) = spread(ratios) else { return };
    let met = if at_most { median <= limit } else { median >= limit };
    let target = format!("{}{limit}x", if at_most { "<= " } else { ">= " });
    let verdict = if met { "met" } else { "NOT MET" };
    println!("{what:<58} {median:>6.2}x  [{lo:.2}-{hi:.2}]  n={n}  {target:<9} {verdict}");
}

fn main() {
    let root = std::env::var_os("CRITERION_HOME").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("target/criterion"),
        PathBuf::from,
    );
    let runs = load(&root);
    println!("{:<58} {:>7}  {:<13}", "case (ratio tollgate / peer per run)", "median", "[range]");

    for keys in ["1", "10000", "1000000"] {
        for threads in ["1", "2"] {
            let ours = format!("store/tollgate/{keys}_{threads}");
            let theirs = format!("store/governor/{keys}_{threads}");
            let what = format!("store check, {keys} keys, {threads} thread(s) / governor");
            row(&what, per_run(&runs, &[&ours, &theirs], |v| v[0] / v[1]), 0.9, true);
        }
    }

    let memory = |peer: &str| -> Option<Vec<f64>> {
        let text = std::fs::read_to_string(root.join(format!("memory/{peer}.json"))).ok()?;
        let json = serde_json::from_str::<serde_json::Value>(&text).ok()?;
        let keys = json["keys"].as_f64().unwrap_or(1_000_000.0);
        json["runs"]
            .as_array()
            .map(|r| r.iter().filter_map(|b| b.as_f64()).map(|b| b / keys).collect())
    };
    if let (Some(ours), Some(theirs)) = (memory("tollgate"), memory("governor")) {
        let (m, lo, hi) = spread(ours.clone()).unwrap_or_default();
        let met = if m <= 36.0 { "met" } else { "NOT MET" };
        println!(
            "{:<58} {m:>6.1} B  [{lo:.1}-{hi:.1}]  n={}  <= 36 B    {met}",
            "memory per idle IPv4 key, 1,000,000 keys",
            ours.len()
        );
        let ratios = ours.iter().zip(&theirs).map(|(a, b)| a / b).collect();
        row("memory per idle IPv4 key / governor (informative)", ratios, 1.0, true);
    }

    let overhead = |case: &str| {
        let ours = format!("layer_overhead/tollgate/{case}");
        let theirs = format!("layer_overhead/tower_governor/{case}");
        per_run(&runs, &[&ours, &theirs], |v| v[0] / v[1])
    };
    row(
        "layer overhead over bare axum, allowed, headers / tower_governor",
        overhead("allowed"),
        0.6,
        true,
    );
    row(
        "layer overhead over bare axum, allowed, no headers / tower_governor",
        overhead("allowed_no_headers"),
        1.0,
        true,
    );
    row("layer overhead over bare axum, 429 / tower_governor", overhead("limited"), 0.1, true);

    // Redis: time per check, so a throughput ratio is the peer's time over ours.
    let throughput = |ours: &str, theirs: &str| per_run(&runs, &[ours, theirs], |v| v[1] / v[0]);
    for (id, what, limit) in [
        ("redis/tollgate_1_tier", "redis 1 tier, throughput / INCR", 0.65),
        ("redis/lua_gcra", "redis plain Lua GCRA script, throughput / INCR (informative)", 0.0),
    ] {
        row(what, throughput(id, "redis/incr"), limit, false);
    }
    row(
        "redis 2 tiers, throughput / 1 tier",
        throughput("redis/tollgate_2_tiers", "redis/tollgate_1_tier"),
        0.8,
        false,
    );
}
