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
/// field path expected, and a part of the message expected.
struct Row {
    place: In,
    text: &'static str,
    field: &'static str,
    says: &'static str,
}

const fn row(place: In, text: &'static str, field: &'static str, says: &'static str) -> Row {
    Row { place, text, field, says }
}

const RATE: In = In::Tier(None);

/// Every refusal the builders (and the file's own checks) make, by field.
const ROWS: &[Row] = &[
    // A rate tier's quota.
    row(RATE, "count = @0\nperiod = \"1s\"", "tiers[0].count", "count must be at least 1"),
    row(RATE, "count = @4294967296\nperiod = \"1s\"", "tiers[0].count", "exceeds the maximum"),
    row(
        In::Tier(Some("sliding_log")),
        "count = @10001\nperiod = \"1m\"",
        "tiers[0].count",
        "sliding log limit 10001 exceeds 10000",
    ),
    row(RATE, "count = 5\nperiod = @\"0s\"", "tiers[0].period", "period must be at least 1 ns"),
    row(RATE, "count = 5\nperiod = @\"1 fortnight\"", "tiers[0].period", "invalid duration"),
    row(RATE, "count = 5\nperiod = @\"40years\"", "tiers[0].period", "spans more than"),
    // The period alone is fine; the burst's refill (1,000 years) is what is too long.
    row(RATE, "count = 1\nperiod = \"1year\"\nburst = @1000", "tiers[0].burst", "spans more than"),
    row(
        RATE,
        "count = 5\nperiod = \"1s\"\nburst = @0",
        "tiers[0].burst",
        "burst must be at least 1",
    ),
    row(
        RATE,
        "count = 5\nperiod = \"1s\"\nburst = @4294967296",
        "tiers[0].burst",
        "burst 4294967296 exceeds the maximum",
    ),
    row(
        In::Tier(Some("fixed_window")),
        "count = 5\nperiod = \"1s\"\nburst = @9",
        "tiers[0].burst",
        "burst 9 != count 5",
    ),
    row(RATE, "count = 5\nperiod = \"1s\"\nunit = @\"tokens\"", "tiers[0].unit", "unknown unit"),
    row(RATE, "count = @-1\nperiod = \"1s\"", "tiers[0].count", "invalid value"),
    row(RATE, "count = 5\nperiod = \"1s\"\nkind = @\"window\"", "tiers[0].kind", "unknown variant"),
    // A penalty box: each of its three fields at its own place.
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nblock = @\"0s\"",
        "tiers[0].block",
        "block 0ns must be between",
    ),
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nblock = @\"40years\"",
        "tiers[0].block",
        "must be between 1 ns and",
    ),
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nblock = \"1m\"\nblock_after = @0",
        "tiers[0].block_after",
        "refusals 0 must be between 1 and 1000",
    ),
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nblock = \"1m\"\nblock_after = @0\nblock_window = \"1m\"",
        "tiers[0].block_after",
        "refusals 0 must be between 1 and 1000",
    ),
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nblock = \"1m\"\nblock_after = @5000\nblock_window = \"1m\"",
        "tiers[0].block_after",
        "refusals 5000 must be between 1 and 1000",
    ),
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nblock = \"1m\"\nblock_after = @5000",
        "tiers[0].block_after",
        "refusals 5000 must be between 1 and 1000",
    ),
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nblock = \"1m\"\nblock_after = @-1",
        "tiers[0].block_after",
        "invalid value",
    ),
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nblock = \"1m\"\nblock_after = 2\nblock_window = @\"0s\"",
        "tiers[0].block_window",
        "window 0ns must be between",
    ),
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nblock = \"1m\"\nblock_after = 2\nblock_window = @\"40years\"",
        "tiers[0].block_window",
        "must be between 1 ns and",
    ),
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nblock = \"1m\"\nblock_window = @\"1m\"",
        "tiers[0].block_window",
        "`block_after` is above 1",
    ),
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nblock = \"1m\"\nblock_after = 1\nblock_window = @\"1m\"",
        "tiers[0].block_window",
        "`block_after` is above 1",
    ),
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nblock_after = @2",
        "tiers[0].block_after",
        "needs `block`",
    ),
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nblock_window = @\"1m\"",
        "tiers[0].block_window",
        "needs `block`",
    ),
    // Reserved capacity: the field whose value the builder refuses.
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nreserve_critical = @5",
        "tiers[0].reserve_critical",
        "critical 5 + standard 0 must be less than the capacity 5",
    ),
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nreserve_standard = @5",
        "tiers[0].reserve_standard",
        "critical 0 + standard 5 must be less than the capacity 5",
    ),
    // Critical alone fits; the standard reserve on top of it is what does not.
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nreserve_critical = 1\nreserve_standard = @4",
        "tiers[0].reserve_standard",
        "critical 1 + standard 4 must be less than the capacity 5",
    ),
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nreserve_standard = 1\nreserve_critical = @5",
        "tiers[0].reserve_critical",
        "critical 5 + standard 1 must be less than the capacity 5",
    ),
    row(
        In::Tier(Some("token_bucket")),
        "count = 5\nperiod = \"1m\"\nreserve_critical = @1",
        "tiers[0].reserve_critical",
        "reserved capacity runs on gcra only, not token_bucket",
    ),
    row(
        RATE,
        "count = 5\nperiod = \"1m\"\nreserve_critical = @-1",
        "tiers[0].reserve_critical",
        "invalid value",
    ),
    // A concurrency tier.
    row(
        In::Tier(None),
        "kind = \"concurrency\"\nmax = @0",
        "tiers[0].max",
        "count must be at least 1",
    ),
    row(
        In::Tier(None),
        "kind = \"concurrency\"\nmax = @4294967296",
        "tiers[0].max",
        "max 4294967296 exceeds the maximum",
    ),
    row(
        In::Tier(None),
        "kind = \"concurrency\"\nmax = 4\nlease = @\"0s\"",
        "tiers[0].lease",
        "lease 0ns must be between 1ms and",
    ),
    row(
        In::Tier(None),
        "kind = \"concurrency\"\nmax = 4\nlease = @\"40years\"",
        "tiers[0].lease",
        "must be between 1ms and",
    ),
    row(
        In::Tier(None),
        "kind = \"concurrency\"\nmax = 4\ntypical_hold = @\"soon\"",
        "tiers[0].typical_hold",
        "invalid duration",
    ),
    row(
        In::Tier(None),
        "kind = \"concurrency\"\nmax = 4\nburst = @2",
        "tiers[0].burst",
        "a concurrency tier has no `burst`",
    ),
    // A calendar tier, with a penalty box.
    row(
        In::Tier(None),
        "kind = \"calendar\"\ncount = @0\nperiod = \"day\"",
        "tiers[0].count",
        "count must be at least 1",
    ),
    row(
        In::Tier(None),
        "kind = \"calendar\"\ncount = @4294967296\nperiod = \"day\"",
        "tiers[0].count",
        "exceeds the maximum",
    ),
    row(
        In::Tier(None),
        "kind = \"calendar\"\ncount = 5\nperiod = @\"1d\"",
        "tiers[0].period",
        "is not a calendar period",
    ),
    row(
        In::Tier(None),
        "kind = \"calendar\"\ncount = 5\nperiod = \"day\"\ntime_zone = @\"Europe/Atlantis\"",
        "tiers[0].time_zone",
        "unknown time zone",
    ),
    row(
        In::Tier(None),
        "kind = \"calendar\"\ncount = 5\nperiod = \"day\"\nblock = \"1h\"\nblock_after = @0",
        "tiers[0].block_after",
        "refusals 0 must be between 1 and 1000",
    ),
    row(
        In::Tier(None),
        "kind = \"calendar\"\ncount = 5\nperiod = \"day\"\nblock = \"1h\"\nblock_after = 3\nblock_window = @\"0s\"",
        "tiers[0].block_window",
        "window 0ns must be between",
    ),
    row(
        In::Tier(None),
        "kind = \"calendar\"\ncount = 5\nperiod = \"day\"\nreserve_critical = @1",
        "tiers[0].reserve_critical",
        "a calendar tier has no `reserve_critical`",
    ),
    // The policy's own fields.
    row(In::Policy, "algorithm = @\"gcra2\"", "algorithm", "unknown algorithm"),
    row(In::Policy, "changed_tiers = @\"carry\"", "changed_tiers", "unknown variant"),
    // A rule's settings (the layer builder's, and the file's own).
    row(In::Rule, "cost = @200", "cost", "200 units exceed the capacity of tier `free`"),
    row(In::Rule, "cost = @-1", "cost", "invalid value"),
    row(
        In::Rule,
        "max_delay = \"1s\"\nmax_waiters = @0",
        "max_waiters",
        "must be at least 1 when shaping",
    ),
    row(In::Rule, "tarpit = \"1s\"\nmax_waiters = @0", "max_waiters", "must be at least 1"),
    row(In::Rule, "max_delay = @\"soon\"", "max_delay", "invalid duration"),
    row(In::Rule, "tarpit = @\"soon\"", "tarpit", "invalid duration"),
    row(In::Rule, "allow_cidrs = [\"10.0.0.0/8\", @\"nope\"]", "allow_cidrs[1]", "is not a CIDR"),
    row(In::Rule, "ipv6_prefix = @129", "ipv6_prefix", "must be at most 128"),
    row(In::Rule, "refund_on = [@\"6xx\"]", "refund_on[0]", "is not a status"),
    row(In::Rule, "refund_on = @[]", "refund_on", "an empty list would refund nothing"),
    row(In::Rule, "priority_header = @\"bad header\"", "priority_header", "is not a header name"),
    row(In::Rule, "on_stream = @\"stream\"", "on_stream", "unknown variant"),
    row(In::Rule, "headers = @\"all\"", "headers", "unknown variant"),
    row(In::Rule, "missing_key = @\"deny\"", "missing_key", "is not \"reject\""),
    row(In::Rule, "methods = @[]", "methods", "an empty list would match no request"),
    row(In::Rule, "skip_paths = [@\"api\"]", "skip_paths[0]", "is not a path pattern"),
    row(
        In::Rule,
        "trusted_proxies = @[\"10.0.0.0/8\"]",
        "trusted_proxies",
        "applies to the `client_ip` key only",
    ),
];

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
    let (text, line, column) = marked(row.text);
    let offset = head.matches('\n').count();
    (format!("{head}{text}{tail}\n"), line + offset, column)
}

/// The path a row's field has in the document.
fn path(row: &Row) -> String {
    match row.place {
        In::Tier(_) | In::Policy => format!("policies.p.{}", row.field),
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
    let wrong: Vec<String> = ROWS
        .iter()
        .filter_map(|row| {
            misplaced(row).map(|why| format!("  {}:\n    {why}", row.text.replace('\n', "; ")))
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} rows wrong:\n{}",
        wrong.len(),
        ROWS.len(),
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
