//! The scripts' unit tests: key names, records and replies.

use super::*;
use crate::quota::Quota;

fn policy(name: &str, alg: Algorithm) -> Policy {
    Policy::builder(name)
        .algorithm(alg)
        .tier("a", Quota::per_second(10))
        .tier("b", Quota::per_hour(100))
        .build()
        .unwrap()
}

#[test]
fn keys_keep_the_hash_tag_whole_and_unambiguous() {
    let p = policy("api", Algorithm::Gcra);
    let raw = |parts: &(String, String), key: &Key| state_key(parts, &KeyNames::Raw, key);
    let k = raw(&key_parts("tollgate:", &p), &Key::text("a}b{c|d%"));
    let fp = format!("{:08x}", fingerprint(&p));
    assert_eq!(k, format!("tollgate:{{api|s8:a%7Db%7Bc%7Cd%25}}:{fp}"));
    assert_eq!(hash_tag(&k), "api|s8:a%7Db%7Bc%7Cd%25");
    // `|` in a policy name cannot be confused with the separator.
    let a = raw(&key_parts("", &policy("a|b", Algorithm::Gcra)), &Key::text("c"));
    let b = raw(&key_parts("", &policy("a", Algorithm::Gcra)), &Key::text("b|s1:c"));
    assert_ne!(hash_tag(&a), hash_tag(&b));
}

#[test]
fn hashed_keys_hide_the_key_and_keep_the_policy_in_the_hash_tag() {
    let p = policy("api", Algorithm::Gcra);
    let parts = key_parts("tollgate:", &p);
    let default = KeyNames::Hashed(derive_secret(DEFAULT_KEY_SECRET));
    let secret = Key::text("sk_live_SECRET");
    let k = state_key(&parts, &default, &secret);
    // Pinned: nodes of one fleet on different versions must name a key alike, so a change
    // of the hash, its input or the derivation of the secret must be deliberate. Checked
    // against an independent SipHash-2-4-128 (the reference vectors' implementation):
    // the secret is SipHash(key 0, "tollgate redis key secret\0tollgate:default"), the
    // name SipHash(secret, "s14:sk_live_SECRET"), its two halves as one u128 (the first
    // the low 64 bits) in hexadecimal.
    let fp = format!("{:08x}", fingerprint(&p));
    assert_eq!(k, format!("tollgate:{{api|#58973adca6b7b56939004a2f862241c6}}:{fp}"));
    assert_eq!(k.len(), "tollgate:{api|#}:".len() + 32 + 8);
    assert!(!k.contains("SECRET") && !k.contains("sk_live"), "{k}");
    assert_eq!(hash_tag(&k), &k["tollgate:{".len().."tollgate:{".len() + 37]);
    assert!(hash_tag(&k).starts_with("api|#"));
    assert_eq!(k, state_key(&parts, &default, &Key::text("sk_live_SECRET")), "stable");
    // Another secret, another name; keys whose texts look alike stay apart.
    let other = KeyNames::Hashed(derive_secret(b"another deployment"));
    assert_ne!(k, state_key(&parts, &other, &secret));
    let names = [Key::Global, Key::text("g"), Key::Missing, Key::text("m"), Key::text("")];
    let all: std::collections::HashSet<_> =
        names.iter().map(|key| state_key(&parts, &default, key)).collect();
    assert_eq!(all.len(), names.len());
    // The derivation reads every byte of the secret, whatever its length.
    assert_ne!(derive_secret(b"a"), derive_secret(b"a\0"));
    assert_ne!(derive_secret(DEFAULT_KEY_SECRET), *DEFAULT_KEY_SECRET.first_chunk().unwrap());
    assert_eq!(format!("{default:?}"), "Hashed", "the secret stays out of Debug");
}

#[test]
fn reconfigured_policies_get_new_keys() {
    let a = policy("api", Algorithm::Gcra);
    let b = policy("api", Algorithm::TokenBucket);
    let c = Policy::builder("api")
        .tier("a", Quota::per_second(10).with_burst(11))
        .tier("b", Quota::per_hour(100))
        .build()
        .unwrap();
    let names = KeyNames::Hashed(derive_secret(DEFAULT_KEY_SECRET));
    let key = |p: &Policy| state_key(&key_parts("", p), &names, &Key::Global);
    let keys: Vec<_> = [&a, &b, &c].into_iter().map(key).collect();
    assert_ne!(keys[0], keys[1]);
    assert_ne!(keys[0], keys[2]);
    assert_eq!(key(&a), keys[0], "stable");
}

#[test]
fn a_batch_sends_each_policy_once_and_every_check_as_doubles() {
    let doubles = |b: &[u8]| -> Vec<f64> {
        b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect()
    };
    let p = policy("api", Algorithm::SlidingLog);
    let prepared = Prepared::new(&p, 7);
    assert_eq!(prepared.keys("h".into()), ["h", "h:z1", "h:z2"]);
    let std = Priority::Standard;
    let a = prepared.check(&[2, 2], None, 0, std, 0);
    let b = prepared.check(&[0, 0], Some(Duration::from_nanos(5)), 0, std, 0);
    let checks = [(1, a.as_slice()), (4, b.as_slice())];
    let (policies, records) = batch(checks.iter().map(|(k, r)| (*k, &*prepared.policy, *r)));
    // unit, grace, algorithm, tiers, plain, then per tier its kind, count, period, burst, no
    // penalty box, no reserve.
    let z = [0.0; 5];
    let mut expected = vec![1.0, 7.0, 5.0, 2.0, 1.0, 0.0, 10.0, 1e9, 10.0];
    expected.extend(z);
    expected.extend([0.0, 100.0, 3.6e12, 100.0]);
    expected.extend(z);
    assert_eq!(doubles(&policies), expected);
    // op, key, policy, length, budget, no slots, the cost on each tier, the standard class.
    assert_eq!(
        doubles(&records),
        [1.0, 1.0, 1.0, 9.0, -1.0, 0.0, 2.0, 2.0, 1.0, 1.0, 4.0, 1.0, 9.0, 5.0, 0.0, 0.0, 0.0, 1.0]
    );
    assert_eq!(prepared.check_reply_len(), 13);
}

#[test]
fn plain_settlements_and_leases_are_records_of_the_one_driver() {
    let p = policy("api", Algorithm::TokenBucket);
    let prepared = Prepared::new(&p, 0);
    assert_eq!(prepared.family, Family::Rate);
    let charges: Charges =
        [Charge { at: 7_000_000_009, cost: 3, id: 0 }, Charge { at: 5, cost: 3, id: 2 }]
            .into_iter()
            .collect();
    // op, key, policy, length, no release, then per tier old, new, instant, entry id; the
    // tiers at costs of their own.
    assert_eq!(
        prepared.settle(&charges, |_| 3, |i| [1, 2][i], false, 0),
        [2.0, 0.0, 0.0, 15.0, 0.0, 3.0, 1.0, 7.0, 9.0, 0.0, 3.0, 2.0, 0.0, 5.0, 2.0]
    );
    // gcra.lua's: op, key, policy, then the same per tier.
    let whole = Prepared::new(&policy("api", Algorithm::Gcra), 0);
    assert_eq!(whole.family, Family::Gcra);
    assert_eq!(
        whole.settle(&charges, |_| 3, |i| [1, 2][i], false, 0),
        [2.0, 0.0, 0.0, 3.0, 1.0, 7.0, 9.0, 0.0, 3.0, 2.0, 0.0, 5.0, 2.0]
    );
    // op, key, policy, length, cost, block, useful, then the previous lease settled.
    let rest = Rest { granted: 3, spent: 2, charges };
    assert_eq!(
        prepared.lease(1, 64, 4, Some(&rest)),
        [3.0, 0.0, 0.0, 17.0, 1.0, 64.0, 4.0, 3.0, 2.0, 7.0, 9.0, 0.0, 3.0, 2.0, 0.0, 5.0, 2.0]
    );
    let fresh = prepared.lease(1, 64, 0, None);
    assert_eq!(fresh[..7], [3.0, 0.0, 0.0, 17.0, 1.0, 64.0, 0.0]);
    assert_eq!(fresh[7..], [0.0; 10]);
    assert_eq!(prepared.lease_reply_len(), 15);
}

/// A rolling deploy runs nodes of the version with a driver per kind of policy beside
/// nodes of this one on one Redis: a plain policy's state keys, hence its fingerprint
/// (which mixes in how the state is laid out), must not change. Pinned: computed by an
/// independent FNV-1a of the algorithm's name, the unit and each tier's count, period and
/// burst (little-endian u64s), xor `0x7632_0000 | n`, times the FNV prime, folded to 32
/// bits, with n the number of the script the version before ran (0 `gcra.lua`, 1 GCRA or
/// buckets, 2 windows, 3 sliding logs).
#[test]
fn plain_policies_keep_their_state_keys() {
    let two = |alg| {
        Policy::builder("api")
            .algorithm(alg)
            .tier("a", Quota::per_second(10).with_burst(10))
            .tier("b", Quota::per_hour(100).with_burst(100))
            .build()
            .unwrap()
    };
    let fractional =
        Policy::builder("api").tier("a", Quota::per_second(3).with_burst(3)).build().unwrap();
    let cases = [
        (two(Algorithm::Gcra), Family::Gcra, 0xc0b1_cd28),
        (fractional, Family::Rate, 0xefda_d502),
        (two(Algorithm::TokenBucket), Family::Rate, 0x80b9_075d),
        (two(Algorithm::LeakyBucket), Family::Rate, 0x5936_fcc4),
        (two(Algorithm::FixedWindow), Family::Window, 0x8657_4f76),
        (two(Algorithm::SlidingCounter), Family::Window, 0x5d8a_11a1),
        (two(Algorithm::SlidingLog), Family::Log, 0xecff_edc9),
    ];
    for (p, family, pinned) in cases {
        assert_eq!((super::family(&p), fingerprint(&p)), (family, pinned), "{:?}", p.algorithm());
    }
    // A policy of the same family that is not plain keeps a layout of its own.
    let boxed = Policy::builder("api")
        .algorithm(Algorithm::TokenBucket)
        .tier("a", Quota::per_second(10).with_burst(10))
        .tier("b", Quota::per_hour(100).with_burst(100))
        .penalty("a", crate::quota::Penalty::new(Duration::from_secs(1)))
        .build()
        .unwrap();
    assert_eq!(family(&boxed), Family::Rate);
    assert_ne!(layout(&boxed), layout(&two(Algorithm::TokenBucket)));
}

#[test]
fn a_penalty_box_gets_its_own_keys_and_its_numbers_with_its_tier() {
    use crate::quota::{Calendar, Penalty};
    let box_ = Penalty::new(Duration::from_secs(900)).after(3, Duration::from_secs(60));
    let base = || Policy::builder("api").tier("a", Quota::per_minute(10));
    let plain = base().build().unwrap();
    let calendar = base().calendar("d", Calendar::per_day(5)).build().unwrap();
    let boxed = base().penalty("a", box_).build().unwrap();
    let other = base().penalty("a", box_.after(4, Duration::from_secs(60))).build().unwrap();
    let fps: std::collections::HashSet<_> =
        [&plain, &calendar, &boxed].into_iter().map(fingerprint).collect();
    assert_eq!(fps.len(), 3, "a box changes how the state is kept (the policy is not plain)");
    // The box lives apart, named by its tier: another box keeps the state key, and finds
    // the box of the key where it was.
    assert_eq!(fingerprint(&boxed), fingerprint(&other));
    let keys = |p: &Policy| Prepared::new(p, 0).keys("tollgate:{api|k}:0123abcd".into());
    assert_eq!(keys(&boxed), ["tollgate:{api|k}:0123abcd", "tollgate:{api|k}:p:a"]);
    assert_eq!(keys(&boxed), keys(&other));
    assert_eq!(family(&boxed), Family::Rate);
    // Per tier of a policy of several kinds: kind, three parameters, then the box (block,
    // refusals, window; zeros for none), then the reserves (critical, standard).
    let args = |p: &Policy| Prepared::new(p, 0).policy.args.clone();
    let block = 900_000_000_000.0;
    assert_eq!(
        args(&boxed),
        [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 10.0, 6e10, 10.0, block, 3.0, 6e10, 0.0, 0.0]
    );
    assert_eq!(
        args(&calendar)[5..],
        [
            0.0, 10.0, 6e10, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
            0.0
        ]
    );
}

#[test]
fn a_reserve_gets_its_own_keys_its_numbers_and_the_class_in_the_record() {
    use crate::quota::Reserve;
    let base = || Policy::builder("api").tier("a", Quota::per_minute(10));
    let plain = base().build().unwrap();
    let reserved = base().reserve("a", Reserve::new().critical(2).standard(3)).build().unwrap();
    let other = base().reserve("a", Reserve::new().critical(3).standard(2)).build().unwrap();
    let fps: std::collections::HashSet<_> =
        [&plain, &reserved, &other].into_iter().map(fingerprint).collect();
    assert_eq!(fps.len(), 3);
    assert_eq!(family(&reserved), Family::Rate);
    let prepared = Prepared::new(&reserved, 0);
    assert_eq!(
        prepared.policy.args,
        [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 10.0, 6e10, 10.0, 0.0, 0.0, 0.0, 2.0, 3.0]
    );
    // op, key, policy, length, budget, lease, the costs, then the class (2 sheddable).
    let record = prepared.check(&[1], None, 0, Priority::Sheddable, 0);
    assert_eq!(record, [1.0, 0.0, 0.0, 8.0, -1.0, 0.0, 1.0, 2.0]);
}

#[test]
fn a_policed_calendar_check_sends_the_windows_around_now_and_a_shaped_one_the_lookahead() {
    use crate::quota::Calendar;
    let p = Policy::builder("api")
        .tier("a", Quota::per_minute(10))
        .calendar("d", Calendar::per_day(5))
        .build()
        .unwrap();
    let prepared = Prepared::new(&p, 0);
    // 2025-06-15 15:06:40 UTC: the day holds now - 60 s and now + 60 s.
    let now = 1_750_000_000 * NANOS_PER_SEC;
    let (start, end) = (1_749_945_600.0, 1_750_032_000.0);
    // op, key, policy, length, budget, lease, the costs, the class, then the bounds.
    let policed = prepared.check(&[1, 1], None, 0, Priority::Standard, now);
    assert_eq!(policed, [1.0, 0.0, 0.0, 12.0, -1.0, 0.0, 1.0, 1.0, 1.0, 2.0, start, end]);
    // Shaped: the day and the seven after it.
    let shaped = prepared.check(&[1, 1], Some(Duration::from_secs(1)), 0, Priority::Standard, now);
    let days: Vec<f64> = (0..9).map(|d| start + f64::from(d) * 86_400.0).collect();
    assert_eq!(shaped[9], 9.0);
    assert_eq!(shaped[10..], days[..]);
    // Near midnight, a policed check sends both days the server's clock may be in.
    let late =
        prepared.check(&[1, 1], None, 0, Priority::Standard, (end as u64 - 30) * NANOS_PER_SEC);
    assert_eq!(late[9..], [3.0, start, end, end + 86_400.0]);
}

#[test]
fn windows_below_a_millisecond_are_refused() {
    let tiny = Policy::builder("p")
        .algorithm(Algorithm::FixedWindow)
        .tier("t", Quota::new(1, Duration::from_micros(100)))
        .build()
        .unwrap();
    assert!(matches!(validate(&tiny), Err(ConfigError::UnsupportedByStore { .. })));
    let monthly = Policy::single("m", Quota::new(1000, Duration::from_secs(30 * 86_400))).unwrap();
    assert_eq!(validate(&monthly), Ok(()));
}

#[test]
fn decode_rebuilds_the_decision_and_the_charges() {
    let p = policy("api", Algorithm::Gcra);
    let reply = [1, 5, -1, 9, 100, -1, 0, 0, 99, 36_000_000_000, -1, 0, 0];
    let (d, charges) = decode(&p, 1, 7_000_000_009, &reply).unwrap();
    assert_eq!(d.outcome(), Outcome::Allowed);
    assert_eq!(d.delay(), Duration::from_nanos(5));
    assert_eq!(d.tiers()[1].remaining(), 99);
    assert_eq!(d.tiers()[1].reset_after(), Duration::from_secs(36));
    assert_eq!(charges.unwrap()[0], Charge { at: 7_000_000_014, cost: 1, id: 0 });
    let limited = [0, 0, 50, 0, 100, 50, 1, 0, 99, 1, -1, 0, 0];
    let (d, charges) = decode(&p, 1, 0, &limited).unwrap();
    assert_eq!(d.retry_after(), Some(Duration::from_nanos(50)));
    assert_eq!(d.violated_names(&p).collect::<Vec<_>>(), ["a"]);
    assert!(charges.is_none());
    assert!(decode(&p, 1, 0, &reply[..10]).is_err());
    assert!(decode(&p, 1, 0, &[3; 13]).is_err());
}
