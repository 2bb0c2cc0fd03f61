//! Prints the side-by-side benchmark results as ratios, tollgate / peer, against the targets of
//! BENCHMARKS.md. Reads criterion's saved baselines `run1`, `run2`, ... under
//! `target/criterion/` (each the median of its samples) and takes the median over the runs;
//! memory per key comes from `target/criterion/memory/`.
//!
//! `bash benches/compare.sh` runs the benchmarks and then this.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Median time (ns) per benchmark id (`group/function/parameter`), over all saved runs.
fn medians(root: &Path) -> BTreeMap<String, f64> {
    let mut runs: BTreeMap<String, Vec<f64>> = BTreeMap::new();
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
                    runs.entry(id).or_default().push(ns);
                }
            } else {
                stack.push(path);
            }
        }
    }
    runs.into_iter()
        .map(|(id, mut v)| {
            v.sort_by(f64::total_cmp);
            (id, v[v.len() / 2])
        })
        .collect()
}

fn median_of(estimates: &PathBuf) -> Option<f64> {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(estimates).ok()?).ok()?;
    json["median"]["point_estimate"].as_f64()
}

fn row(what: &str, ours: f64, theirs: f64, unit: &str, target: &str, met: bool) {
    let ratio = ours / theirs;
    let verdict = if met { "met" } else { "MISSED" };
    println!(
        "{what:<44} {ours:>10.1} {theirs:>10.1} {unit:<6} {ratio:>6.2}x  {target:<8} {verdict}"
    );
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/criterion");
    let m = medians(&root);
    let get = |id: &str| m.get(id).copied();
    println!(
        "{:<44} {:>10} {:>10} {:<6} {:>7}  {:<8}",
        "case", "tollgate", "peer", "unit", "ratio", "target"
    );

    for keys in ["1", "10000", "1000000"] {
        for threads in ["1", "2"] {
            let id = format!("{keys}_{threads}");
            if let (Some(a), Some(b)) =
                (get(&format!("store/tollgate/{id}")), get(&format!("store/governor/{id}")))
            {
                let what = format!("store check, {keys} keys, {threads} thread(s) / governor");
                row(&what, a, b, "ns", "<= 1.0x", a <= b);
            }
        }
    }

    let memory = |peer: &str| -> Option<f64> {
        let text = std::fs::read_to_string(root.join(format!("memory/{peer}.json"))).ok()?;
        serde_json::from_str::<serde_json::Value>(&text).ok()?["bytes_per_key"].as_f64()
    };
    if let (Some(a), Some(b)) = (memory("tollgate"), memory("governor")) {
        row("memory per idle IP key (1M keys) / governor", a, b, "B", "<= 40 B", a <= 40.0);
    }

    if let Some(bare) = get("layer/bare/allowed") {
        for path in ["allowed", "limited"] {
            if let (Some(a), Some(b)) = (
                get(&format!("layer/tollgate/{path}")),
                get(&format!("layer/tower_governor/{path}")),
            ) {
                let (target, limit) =
                    if path == "allowed" { ("<= 0.6x", 0.6) } else { ("<= 0.2x", 0.2) };
                let what = format!("layer overhead over bare axum, {path} / tower_governor");
                row(&what, a - bare, b - bare, "ns", target, (a - bare) <= limit * (b - bare));
            }
        }
    }

    // Redis: time per request, so throughput ratio = their time / our time.
    if let Some(incr) = get("redis/incr") {
        for mode in ["server_time", "client_clock"] {
            if let Some(one) = get(&format!("redis/gcra_1_tier/{mode}")) {
                let what = format!("redis 1-tier GCRA ({mode}), throughput / INCR");
                row(&what, 1e9 / one, 1e9 / incr, "req/s", ">= 0.6x", incr / one >= 0.6);
                if let Some(two) = get(&format!("redis/gcra_2_tier/{mode}")) {
                    let what = format!("redis 2 tiers ({mode}), throughput / 1 tier");
                    row(&what, 1e9 / two, 1e9 / one, "req/s", ">= 0.8x", one / two >= 0.8);
                }
            }
        }
        for ceiling in ["evalsha_trivial", "evalsha_get_set"] {
            if let Some(c) = get(&format!("redis/{ceiling}")) {
                println!(
                    "{:<44} {:>10.1} req/s ({:.2}x INCR)",
                    format!("  ceiling: {ceiling}"),
                    1e9 / c,
                    incr / c
                );
            }
        }
    }
}
