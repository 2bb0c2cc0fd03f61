//! Every value the builders can refuse in a configuration file is reported at the field it
//! names: its path, and the line and column of its value (issue 33, "config errors").
//!
//! One table, one row per refusal: the fields of a tier (of each kind), of its penalty box and
//! reserve, of the policy, and of a rule (the layer's settings), with the bad value marked `@`
//! in the row's text. The test reads the text without the mark and expects the error at the
//! mark's line and column, naming exactly that field.
#![cfg(feature = "config")]

use tollgate::config::{ConfigFileError, LimitsConfig};

/// Where a row's text goes.
#[derive(Debug, Clone, Copy)]
enum In {
    /// A tier of policy `p`, written as a table of its own (`[[policies.p.tiers]]`, `name =
    /// "t"` first), under a policy whose `algorithm` is given or the default.
    Tier(Option<&'static str>),
    /// Policy `p`'s own table, before one valid tier.
    Policy,
    /// A rule applying policy `free` (100 a minute) keyed by the peer's address.
    Rule,
}

/// One refusal: where the text goes, the text (one field a line, the bad value after `@`), the
/// field path expected (a tier's below `tiers[0]`), and a part of the message expected.
struct Row {
    place: In,
    text: String,
    field: &'static str,
    says: &'static str,
}

/// Every refusal the builders (and the file's own checks) make, by field: one row a line,
/// `place | text | field | part of the message`. The place is `tier` (followed by the policy's
/// `algorithm` when it is not the default), `policy` or `rule`; the text's fields are separated
/// by `; `, its bad value marked `@`. Lines starting with `#` are comments.
const ROWS: &str = r#"
# A rate tier's quota.
tier | count = @0; period = "1s" | count | count must be at least 1
tier | count = @4294967296; period = "1s" | count | exceeds the maximum
tier sliding_log | count = @10001; period = "1m" | count | sliding log limit 10001 exceeds 10000
tier | count = 5; period = @"0s" | period | period must be at least 1 ns
tier | count = 5; period = @"1 fortnight" | period | invalid duration
tier | count = 5; period = @"40years" | period | spans more than
# The period alone is fine; the burst's refill (1,000 years) is what is too long.
tier | count = 1; period = "1year"; burst = @1000 | burst | spans more than
tier | count = 5; period = "1s"; burst = @0 | burst | burst must be at least 1
tier | count = 5; period = "1s"; burst = @4294967296 | burst | burst 4294967296 exceeds the maximum
tier fixed_window | count = 5; period = "1s"; burst = @9 | burst | burst 9 != count 5
tier | count = 5; period = "1s"; unit = @"tokens" | unit | unknown unit
tier | count = @-1; period = "1s" | count | invalid value
tier | count = 5; period = "1s"; kind = @"window" | kind | unknown variant
# A penalty box: each of its three fields at its own place.
tier | count = 5; period = "1m"; block = @"0s" | block | block 0ns must be between
tier | count = 5; period = "1m"; block = @"40years" | block | must be between 1 ns and
tier | count = 5; period = "1m"; block = "1m"; block_after = @0 | block_after | refusals 0 must be between 1 and 1000
tier | count = 5; period = "1m"; block = "1m"; block_after = @0; block_window = "1m" | block_after | refusals 0 must be between 1 and 1000
tier | count = 5; period = "1m"; block = "1m"; block_after = @5000; block_window = "1m" | block_after | refusals 5000 must be between 1 and 1000
tier | count = 5; period = "1m"; block = "1m"; block_after = @5000 | block_after | refusals 5000 must be between 1 and 1000
tier | count = 5; period = "1m"; block = "1m"; block_after = @-1 | block_after | invalid value
tier | count = 5; period = "1m"; block = "1m"; block_after = 2; block_window = @"0s" | block_window | window 0ns must be between
tier | count = 5; period = "1m"; block = "1m"; block_after = 2; block_window = @"40years" | block_window | must be between 1 ns and
tier | count = 5; period = "1m"; block = "1m"; block_window = @"1m" | block_window | `block_after` is above 1
tier | count = 5; period = "1m"; block = "1m"; block_after = 1; block_window = @"1m" | block_window | `block_after` is above 1
tier | count = 5; period = "1m"; block_after = @2 | block_after | needs `block`
tier | count = 5; period = "1m"; block_window = @"1m" | block_window | needs `block`
# Reserved capacity: the field whose value the builder refuses.
tier | count = 5; period = "1m"; reserve_critical = @5 | reserve_critical | critical 5 + standard 0 must be less than the capacity 5
tier | count = 5; period = "1m"; reserve_standard = @5 | reserve_standard | critical 0 + standard 5 must be less than the capacity 5
# Critical alone fits; the standard reserve on top of it is what does not.
tier | count = 5; period = "1m"; reserve_critical = 1; reserve_standard = @4 | reserve_standard | critical 1 + standard 4 must be less than the capacity 5
tier | count = 5; period = "1m"; reserve_standard = 1; reserve_critical = @5 | reserve_critical | critical 5 + standard 1 must be less than the capacity 5
tier token_bucket | count = 5; period = "1m"; reserve_critical = @1 | reserve_critical | reserved capacity runs on gcra only, not token_bucket
tier | count = 5; period = "1m"; reserve_critical = @-1 | reserve_critical | invalid value
# A concurrency tier.
tier | kind = "concurrency"; max = @0 | max | count must be at least 1
tier | kind = "concurrency"; max = @4294967296 | max | max 4294967296 exceeds the maximum
tier | kind = "concurrency"; max = 4; lease = @"0s" | lease | lease 0ns must be between 1ms and
tier | kind = "concurrency"; max = 4; lease = @"40years" | lease | must be between 1ms and
tier | kind = "concurrency"; max = 4; typical_hold = @"soon" | typical_hold | invalid duration
tier | kind = "concurrency"; max = 4; burst = @2 | burst | a concurrency tier has no `burst`
# A calendar tier, with a penalty box.
tier | kind = "calendar"; count = @0; period = "day" | count | count must be at least 1
tier | kind = "calendar"; count = @4294967296; period = "day" | count | exceeds the maximum
tier | kind = "calendar"; count = 5; period = @"1d" | period | is not a calendar period
tier | kind = "calendar"; count = 5; period = "day"; time_zone = @"Europe/Atlantis" | time_zone | unknown time zone
tier | kind = "calendar"; count = 5; period = "day"; block = "1h"; block_after = @0 | block_after | refusals 0 must be between 1 and 1000
tier | kind = "calendar"; count = 5; period = "day"; block = "1h"; block_after = 3; block_window = @"0s" | block_window | window 0ns must be between
tier | kind = "calendar"; count = 5; period = "day"; reserve_critical = @1 | reserve_critical | a calendar tier has no `reserve_critical`
# The policy's own fields.
policy | algorithm = @"gcra2" | algorithm | unknown algorithm
policy | changed_tiers = @"carry" | changed_tiers | unknown variant
# A rule's settings (the layer builder's, and the file's own).
rule | cost = @200 | cost | 200 units exceed the capacity of tier `free`
rule | cost = @-1 | cost | invalid value
rule | max_delay = "1s"; max_waiters = @0 | max_waiters | must be at least 1 when shaping
rule | tarpit = "1s"; max_waiters = @0 | max_waiters | must be at least 1
rule | max_delay = @"soon" | max_delay | invalid duration
rule | tarpit = @"soon" | tarpit | invalid duration
rule | allow_cidrs = ["10.0.0.0/8", @"nope"] | allow_cidrs[1] | is not a CIDR
rule | ipv6_prefix = @129 | ipv6_prefix | must be at most 128
rule | refund_on = [@"6xx"] | refund_on[0] | is not a status
rule | refund_on = @[] | refund_on | an empty list would refund nothing
rule | priority_header = @"bad header" | priority_header | is not a header name
rule | on_stream = @"stream" | on_stream | unknown variant
rule | headers = @"all" | headers | unknown variant
rule | missing_key = @"deny" | missing_key | is not "reject"
rule | methods = @[] | methods | an empty list would match no request
rule | skip_paths = [@"api"] | skip_paths[0] | is not a path pattern
rule | trusted_proxies = @["10.0.0.0/8"] | trusted_proxies | applies to the `client_ip` key only
"#;

/// The rows of [`ROWS`]; a malformed line panics.
fn rows() -> Vec<Row> {
    let rows: Vec<Row> = ROWS
        .lines()
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| {
            let cells: Vec<&'static str> = line.split(" | ").collect();
            let [place, text, field, says] = cells[..] else {
                panic!("a row has four cells: {line}")
            };
            let place = match place.split_once(' ') {
                Some(("tier", algorithm)) => In::Tier(Some(algorithm)),
                None if place == "tier" => In::Tier(None),
                None if place == "policy" => In::Policy,
                None if place == "rule" => In::Rule,
                _ => panic!("unknown place in row: {line}"),
            };
            Row { place, text: text.replace("; ", "\n"), field, says }
        })
        .collect();
    assert_eq!(rows.len(), 64, "every row read");
    rows
}

/// `text` without its `@`, and the 1-based line and column (in characters) where it was.
fn marked(text: &str) -> (String, usize, usize) {
    let at = text.find('@').expect("a row marks its bad value with @");
    let before = &text[..at];
    let line = before.matches('\n').count() + 1;
    let column = before[before.rfind('\n').map_or(0, |i| i + 1)..].chars().count() + 1;
    (format!("{before}{}", &text[at + 1..]), line, column)
}

/// The whole file for `row`: its text and the line and column of the bad value in it.
fn file(row: &Row) -> (String, usize, usize) {
    let (head, tail) = match row.place {
        In::Tier(algorithm) => (
            format!(
                "[policies.p]\n{}[[policies.p.tiers]]\nname = \"t\"\n",
                algorithm.map_or(String::new(), |a| format!("algorithm = \"{a}\"\n"))
            ),
            String::new(),
        ),
        In::Policy => (
            "[policies.p]\n".to_owned(),
            "\ntiers = [{ name = \"t\", count = 5, period = \"1s\" }]\n".to_owned(),
        ),
        In::Rule => (
            "[policies.free]\ntiers = [{ name = \"free\", count = 100, period = \"1m\" }]\n\
             [[rules]]\nname = \"r\"\npolicy = \"free\"\n"
                .to_owned(),
            String::new(),
        ),
    };
    let (text, line, column) = marked(&row.text);
    let offset = head.matches('\n').count();
    (format!("{head}{text}{tail}\n"), line + offset, column)
}

/// The path a row's field has in the document.
fn path(row: &Row) -> String {
    match row.place {
        In::Tier(_) => format!("policies.p.tiers[0].{}", row.field),
        In::Policy => format!("policies.p.{}", row.field),
        In::Rule => format!("rules[0].{}", row.field),
    }
}

fn error(text: &str) -> ConfigFileError {
    match LimitsConfig::from_toml(text, "tollgate.toml") {
        Ok(_) => panic!("the file should be refused:\n{text}"),
        Err(e) => e,
    }
}

/// What is wrong with `row`'s error, if anything.
fn misplaced(row: &Row) -> Option<String> {
    let (text, line, column) = file(row);
    let expected = format!("{line}:{column}: {}: ...{}...", path(row), row.says);
    let e = match LimitsConfig::from_toml(&text, "tollgate.toml") {
        Ok(_) => return Some(format!("expected {expected}\n    got      accepted")),
        Err(e) => e,
    };
    let got = (e.line(), e.column(), e.field().map(str::to_owned));
    let placed = got == (Some(line), Some(column), Some(path(row)));
    (!placed || !e.message().contains(row.says))
        .then(|| format!("expected {expected}\n    got      {e}"))
}

#[test]
fn every_refused_value_is_reported_at_its_own_field() {
    let rows = rows();
    let wrong: Vec<String> = rows
        .iter()
        .filter_map(|row| {
            misplaced(row).map(|why| format!("  {}:\n    {why}", row.text.replace('\n', "; ")))
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} rows wrong:\n{}",
        wrong.len(),
        rows.len(),
        wrong.join("\n")
    );
}

/// The line and column are of the field's value, and `Display` starts with them: an editor
/// jumps to the value the message is about (`block_after = 0` on line 8, not `block` above).
#[test]
fn block_after_zero_is_reported_at_block_after() {
    let text = "[policies.login]\n[[policies.login.tiers]]\nname = \"minute\"\ncount = 10\n\
                period = \"1m\"\nblock = \"15m\"\nblock_after = 0\nblock_window = \"1m\"\n";
    let e = error(text);
    assert_eq!(
        e.to_string(),
        "tollgate.toml:7:15: policies.login.tiers[0].block_after: tier `minute`: penalty: \
         refusals 0 must be between 1 and 1000"
    );
    let source = std::error::Error::source(&e).unwrap();
    assert!(matches!(
        source.downcast_ref::<tollgate::ConfigError>(),
        Some(tollgate::ConfigError::Penalty { tier, .. }) if tier == "minute"
    ));
}
