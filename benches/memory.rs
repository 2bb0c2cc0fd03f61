//! Memory per idle key (BENCHMARKS.md): 1,000,000 distinct IPv4 keys, each checked once, held
//! by tollgate's `MemoryStore` and by governor's keyed `RateLimiter`. Each is measured in a
//! fresh child process (resident memory from `/proc/self/statm` before and after), three times;
//! the median is printed and written to `target/criterion/memory/<peer>.json` for
//! `benches/compare.sh`.
//!
//! `cargo bench --bench memory`

use std::net::{IpAddr, Ipv4Addr};
use std::num::NonZeroU32;
use std::process::Command;

use tollgate::key::Key;
use tollgate::store::{Check, MemoryStore};
use tollgate::{Policy, Quota};

const KEYS: u32 = 1_000_000;

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("linux /proc");
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    pages * 4096
}

fn ip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i))
}

/// In the child: fills one limiter with `KEYS` keys; prints the resident bytes they took.
fn child(peer: &str) {
    let before = resident_bytes();
    match peer {
        "tollgate" => {
            let policy = Policy::single("mem", Quota::per_second(10)).unwrap();
            let store = MemoryStore::builder().max_keys(2 * KEYS as usize).build().unwrap();
            let bound = store.bind_policy(&policy);
            for i in 0..KEYS {
                let key = Key::Ip(ip(i));
                assert!(store.check_now(&bound, Check::new(&key, 1)).decision.is_allowed());
            }
            assert_eq!(store.len(), KEYS as usize);
            println!("{}", resident_bytes() - before);
            std::hint::black_box((store, bound));
        }
        "governor" => {
            let limiter = governor::RateLimiter::keyed(governor::Quota::per_second(
                NonZeroU32::new(10).unwrap(),
            ));
            for i in 0..KEYS {
                assert!(limiter.check_key(&ip(i)).is_ok());
            }
            assert_eq!(limiter.len(), KEYS as usize);
            println!("{}", resident_bytes() - before);
            std::hint::black_box(limiter);
        }
        other => panic!("unknown peer {other}"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        child(&args[i + 1]);
        return;
    }
    // `cargo bench` passes `--bench`; a filter other than ours means another bench was asked for.
    if args.iter().skip(1).any(|a| !a.starts_with('-') && !"memory".contains(a.as_str())) {
        return;
    }
    let exe = std::env::current_exe().expect("own path");
    // Beside criterion's results: `$CRITERION_HOME` (which `benches/compare.sh` sets from the
    // target directory), else `target/criterion`.
    let home = std::env::var_os("CRITERION_HOME").map_or_else(
        || std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/criterion"),
        std::path::PathBuf::from,
    );
    let dir = home.join("memory");
    std::fs::create_dir_all(&dir).expect("create the results directory");
    println!("memory per idle key, {KEYS} IPv4 keys (median of 3 fresh processes):");
    for peer in ["tollgate", "governor"] {
        let mut runs: Vec<u64> = (0..3)
            .map(|_| {
                let out = Command::new(&exe).args(["--child", peer]).output().expect("child");
                assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
                String::from_utf8_lossy(&out.stdout).trim().parse().expect("bytes")
            })
            .collect();
        runs.sort_unstable();
        let per_key = runs[1] as f64 / f64::from(KEYS);
        println!("memory/{peer:<9} {per_key:6.1} bytes per key   (runs: {runs:?} bytes)");
        let json = format!("{{\"keys\":{KEYS},\"bytes_per_key\":{per_key:.2},\"runs\":{runs:?}}}");
        std::fs::write(dir.join(format!("{peer}.json")), json).expect("write result");
    }
}
