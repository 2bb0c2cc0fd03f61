//! Calendar windows: fixed windows aligned to a time zone's calendar (minute, hour, day, ISO
//! week, month, year), with the time zone arithmetic done by jiff.
//!
//! A window is `[start, end)` in whole seconds since the Unix epoch (every boundary of the IANA
//! database falls on a whole second). The state of a tier is the list of windows it counted in,
//! each with its own bounds, so that its reset is known without the time zone (the Redis
//! scripts, which have no time zone data, keep the same list).
//!
//! When shaping, a request may be reserved units in the window `now` falls in or one of the
//! next [`LOOKAHEAD`] - 1 windows: Redis receives these windows' bounds with each check, and
//! a request that would leave after them is refused by both stores alike.

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use jiff::Timestamp;
use jiff::civil::Date;
use jiff::tz::TimeZone;

use crate::quota::{Calendar, CalendarPeriod};

/// Windows a shaped request may be reserved in: the current one and the next seven.
pub(crate) const LOOKAHEAD: usize = 8;

/// `[start, end)`, seconds since the Unix epoch.
pub(crate) type Window = (i64, i64);

/// The windows a tier counted in: `(start, end, units used)`, ascending.
pub(crate) type Counted = Vec<(i64, i64, u64)>;

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// A calendar tier, validated: its zone looked up, and the window the clock was last in.
#[derive(Debug)]
pub(crate) struct CalendarSpec {
    pub(crate) calendar: Calendar,
    pub(crate) zone: jiff::tz::TimeZone,
    pub(crate) cache: WindowCache,
}

// A calendar tier is what its `Calendar` says: the zone is looked up from its name, and the
// cache is only a cache.
impl PartialEq for CalendarSpec {
    fn eq(&self, other: &Self) -> bool {
        self.calendar == other.calendar
    }
}

impl Eq for CalendarSpec {}

impl Hash for CalendarSpec {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.calendar.hash(state);
    }
}

/// The window the clock was last in, packed in one word so that reading it is one load:
/// `start + 2^37` in the high 38 bits, the length in the low 26 (a window lasts at most 367
/// days, under 2^25 s); 0 when empty.
#[derive(Debug, Default)]
pub(crate) struct WindowCache(AtomicU64);

const BIAS: i64 = 1 << 37;
const LEN_BITS: u32 = 26;

impl WindowCache {
    fn get(&self, t: i64) -> Option<Window> {
        let packed = self.0.load(Ordering::Relaxed);
        if packed == 0 {
            return None;
        }
        #[allow(clippy::cast_possible_wrap)] // 38 bits
        let start = (packed >> LEN_BITS) as i64 - BIAS;
        #[allow(clippy::cast_possible_wrap)] // 26 bits
        let end = start + (packed & ((1 << LEN_BITS) - 1)) as i64;
        (start <= t && t < end).then_some((start, end))
    }

    fn put(&self, (start, end): Window) {
        let (Ok(biased), Ok(len)) = (u64::try_from(start + BIAS), u64::try_from(end - start))
        else {
            return;
        };
        if biased < 1 << (64 - LEN_BITS) && len < 1 << LEN_BITS {
            self.0.store(biased << LEN_BITS | len, Ordering::Relaxed);
        }
    }
}

/// The second since the epoch holding the instant `t` (nanoseconds).
fn seconds(t: u64) -> i64 {
    i64::try_from(t / NANOS_PER_SEC).unwrap_or(i64::MAX)
}

/// The window holding the instant `t` (nanoseconds since the Unix epoch).
pub(crate) fn window_at(spec: &CalendarSpec, t: u64) -> Window {
    let t = seconds(t);
    if let Some(w) = spec.cache.get(t) {
        return w;
    }
    let w = compute(spec.calendar.period(), &spec.zone, t)
        .filter(|&(s, e)| s <= t && t < e)
        // Only at the edges of what jiff represents (years -9999 and 9999): whole seconds.
        .unwrap_or((t, t + 1));
    spec.cache.put(w);
    w
}

/// The window after `w`.
pub(crate) fn next(spec: &CalendarSpec, w: Window) -> Window {
    let t = u64::try_from(w.1).unwrap_or(0).saturating_mul(NANOS_PER_SEC);
    let next = window_at(spec, t);
    if next.0 >= w.1 { next } else { (w.1, next.1.max(w.1 + 1)) }
}

/// The window of `period` in `tz` holding second `t`.
fn compute(period: CalendarPeriod, tz: &TimeZone, t: i64) -> Option<Window> {
    let ts = Timestamp::from_second(t).ok()?;
    let unit = match period {
        CalendarPeriod::Minute => 60,
        CalendarPeriod::Hour => 3600,
        _ => return days(period, tz, ts),
    };
    // Minutes and hours of the zone's clock at `t`'s offset; a change of offset (a transition)
    // ends a window and starts the next, so that every window is one stretch of one clock.
    let offset = i64::from(tz.to_offset(ts).seconds());
    let mut start = t - (t + offset).rem_euclid(unit);
    let mut end = start + unit;
    let after = Timestamp::from_second(t + 1).ok()?;
    if let Some(prev) = tz.preceding(after).next() {
        let p = prev.timestamp().as_second();
        if start < p && p <= t {
            start = p;
        }
    }
    if let Some(next) = tz.following(ts).next() {
        let n = next.timestamp().as_second();
        if t < n && n < end {
            end = n;
        }
    }
    Some((start, end))
}

/// Days, weeks, months and years: from 00:00 of the first day (or the first instant after it,
/// where midnight is skipped) to 00:00 of the first day of the next.
fn days(period: CalendarPeriod, tz: &TimeZone, ts: Timestamp) -> Option<Window> {
    let date = ts.to_zoned_datetime(tz.clone()).date();
    let (first, next) = match period {
        CalendarPeriod::Week => {
            let mut first = date;
            for _ in 0..date.weekday().to_monday_zero_offset() {
                first = first.yesterday().ok()?;
            }
            let mut next = first;
            for _ in 0..7 {
                next = next.tomorrow().ok()?;
            }
            (first, next)
        }
        CalendarPeriod::Month => {
            let first = date.first_of_month();
            let next = if first.month() == 12 {
                Date::new(first.year().checked_add(1)?, 1, 1).ok()?
            } else {
                Date::new(first.year(), first.month() + 1, 1).ok()?
            };
            (first, next)
        }
        CalendarPeriod::Year => {
            let first = date.first_of_year();
            (first, Date::new(first.year().checked_add(1)?, 1, 1).ok()?)
        }
        _ => (date, date.tomorrow().ok()?),
    };
    let start = first.to_zoned_datetime(tz.clone()).ok()?.timestamp().as_second();
    let end = next.to_zoned_datetime(tz.clone()).ok()?.timestamp().as_second();
    Some((start, end))
}

/// A second as an instant in units of `unit` nanoseconds (0 before the epoch).
#[inline]
pub(crate) fn to_units(second: i64, unit: u64) -> u64 {
    u64::try_from(second).unwrap_or(0).saturating_mul(NANOS_PER_SEC / unit)
}

/// The window holding instant `t` (units), as the tier's clock sees it.
fn window_of(spec: &CalendarSpec, unit: u64, t: u64) -> Window {
    window_at(spec, t.saturating_mul(unit))
}

/// Forgets the windows that ended by `now` (units).
pub(crate) fn prune(counted: &mut Counted, unit: u64, now: u64) {
    counted.retain(|w| to_units(w.1, unit) > now);
}

/// The earliest instant >= `from` (units) at which `cost` more units fit the window holding
/// it: `from` itself unless a counted window holding it is full, then the end of that window
/// (where the next one starts, and its count with it), and so on through the counted windows.
///
/// Only counted windows can be full, and they carry their own bounds, so this needs neither
/// the time zone nor a lookahead: the Redis scripts decide it from the same list.
pub(crate) fn earliest(counted: &Counted, count: u64, unit: u64, from: u64, cost: u64) -> u64 {
    let mut t = from;
    // Ascending and disjoint: one pass moves `t` through consecutive full windows.
    for w in counted {
        let (start, end) = (to_units(w.0, unit), to_units(w.1, unit));
        if start <= t && t < end && w.2.saturating_add(cost) > count {
            t = end;
        }
    }
    t
}

/// Whether instant `at` (units) lies after the lookahead from `now`: a request may be charged
/// in the window holding `now` or one of the next [`LOOKAHEAD`] - 1 windows. If so, the end of
/// the window holding `now`, when the lookahead moves on.
pub(crate) fn beyond(spec: &CalendarSpec, unit: u64, now: u64, at: u64) -> Option<u64> {
    let mut w = window_of(spec, unit, now);
    let current = to_units(w.1, unit);
    if at < current {
        return None;
    }
    for _ in 1..LOOKAHEAD {
        w = next(spec, w);
    }
    (at >= to_units(w.1, unit)).then_some(current)
}

/// Charges `cost` to the window holding `at` (units).
pub(crate) fn charge(counted: &mut Counted, spec: &CalendarSpec, unit: u64, at: u64, cost: u64) {
    let (start, end) = window_of(spec, unit, at);
    match counted.binary_search_by_key(&start, |w| w.0) {
        Ok(p) => counted[p].2 = counted[p].2.saturating_add(cost),
        Err(p) => counted.insert(p, (start, end, cost)),
    }
}

/// Gives `cost` back to the window holding `at` (units), if it is still counted.
pub(crate) fn refund(counted: &mut Counted, unit: u64, at: u64, cost: u64) {
    let holds = |w: &(i64, i64, u64)| to_units(w.0, unit) <= at && at < to_units(w.1, unit);
    if let Some(p) = counted.iter().position(holds) {
        counted[p].2 = counted[p].2.saturating_sub(cost);
        if counted[p].2 == 0 {
            counted.remove(p);
        }
    }
}

/// `(remaining, units until the last counted window ends)` at `now` (units), after pruning.
pub(crate) fn status(counted: &Counted, count: u64, unit: u64, now: u64) -> (u64, u64) {
    let current = counted
        .iter()
        .find(|w| to_units(w.0, unit) <= now && now < to_units(w.1, unit))
        .map_or(0, |w| w.2);
    let reset = counted.last().map_or(0, |w| to_units(w.1, unit).saturating_sub(now));
    (count.saturating_sub(current), reset)
}

/// The bounds of the windows around `now` (nanoseconds) that a Redis script needs to decide
/// at its own clock, which may differ from `now` by up to `margin` seconds, or at a key's
/// clock guard up to `until` (nanoseconds; ignored when before `now`): every window from the
/// one holding `now - margin` to the `lookahead - 1`-th after the one holding the later of
/// `now` and `until`, plus `margin`, as their starts and the last one's end (at most 10,000).
#[cfg(feature = "redis")]
pub(crate) fn bounds(
    spec: &CalendarSpec,
    now: u64,
    until: u64,
    margin: u64,
    lookahead: usize,
) -> Vec<i64> {
    let first = window_at(spec, now.saturating_sub(margin * NANOS_PER_SEC));
    let last = window_at(spec, now.max(until).saturating_add(margin * NANOS_PER_SEC));
    let mut out = vec![first.0];
    let mut w = first;
    // Up to the window holding `now + margin`, then `lookahead - 1` more; bounded in case the
    // two never meet (they always do: windows are contiguous).
    let mut after = 0;
    for _ in 0..10_000 {
        out.push(w.1);
        if w.0 >= last.0 {
            after += 1;
            if after >= lookahead {
                break;
            }
        }
        w = next(spec, w);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::Calendar;

    fn spec(calendar: Calendar) -> CalendarSpec {
        let zone = match calendar.time_zone() {
            "UTC" => TimeZone::UTC,
            name => TimeZone::get(name).unwrap(),
        };
        CalendarSpec { calendar, zone, cache: WindowCache::default() }
    }

    /// Seconds of an RFC 3339 instant.
    fn at(s: &str) -> i64 {
        s.parse::<Timestamp>().unwrap().as_second()
    }

    fn window(spec: &CalendarSpec, s: &str) -> (i64, i64) {
        window_at(spec, u64::try_from(at(s)).unwrap() * NANOS_PER_SEC)
    }

    #[test]
    fn berlin_days_are_23_and_25_hours_long_across_daylight_saving_changes() {
        let berlin = spec(Calendar::per_day(1).in_time_zone("Europe/Berlin"));
        // 2025-03-30: clocks go from 02:00 CET to 03:00 CEST.
        assert_eq!(
            window(&berlin, "2025-03-30T12:00:00Z"),
            (at("2025-03-29T23:00:00Z"), at("2025-03-30T22:00:00Z"))
        );
        // 2025-10-26: clocks go from 03:00 CEST back to 02:00 CET.
        assert_eq!(
            window(&berlin, "2025-10-26T12:00:00Z"),
            (at("2025-10-25T22:00:00Z"), at("2025-10-26T23:00:00Z"))
        );
    }

    #[test]
    fn the_repeated_hour_is_a_window_of_its_own() {
        let berlin = spec(Calendar::per_hour(1).in_time_zone("Europe/Berlin"));
        // 02:30 CEST, then 02:30 CET an hour later: two windows.
        assert_eq!(
            window(&berlin, "2025-10-26T00:30:00Z"),
            (at("2025-10-26T00:00:00Z"), at("2025-10-26T01:00:00Z"))
        );
        assert_eq!(
            window(&berlin, "2025-10-26T01:30:00Z"),
            (at("2025-10-26T01:00:00Z"), at("2025-10-26T02:00:00Z"))
        );
        // India's hours start at half past, UTC.
        let kolkata = spec(Calendar::per_hour(1).in_time_zone("Asia/Kolkata"));
        assert_eq!(
            window(&kolkata, "2025-01-01T10:00:00Z"),
            (at("2025-01-01T09:30:00Z"), at("2025-01-01T10:30:00Z"))
        );
    }

    #[test]
    fn weeks_start_on_monday_and_months_on_the_first() {
        let utc = spec(Calendar::per_week(1));
        // Wednesday 2025-01-01: the week began on Monday 2024-12-30.
        assert_eq!(
            window(&utc, "2025-01-01T08:00:00Z"),
            (at("2024-12-30T00:00:00Z"), at("2025-01-06T00:00:00Z"))
        );
        let ny = spec(Calendar::per_month(1).in_time_zone("America/New_York"));
        assert_eq!(
            window(&ny, "2025-03-01T03:00:00Z"), // still February in New York
            (at("2025-02-01T05:00:00Z"), at("2025-03-01T05:00:00Z"))
        );
        let year = spec(Calendar::per_year(1));
        assert_eq!(
            window(&year, "2024-12-31T23:59:59Z"),
            (at("2024-01-01T00:00:00Z"), at("2025-01-01T00:00:00Z"))
        );
    }

    #[test]
    fn windows_follow_each_other_and_the_cache_keeps_the_last() {
        let berlin = spec(Calendar::per_hour(1).in_time_zone("Europe/Berlin"));
        let mut w = window(&berlin, "2025-10-25T20:10:00Z");
        for _ in 0..100 {
            let n = next(&berlin, w);
            assert_eq!(n.0, w.1, "contiguous");
            assert!(n.1 > n.0);
            w = n;
        }
        let cache = WindowCache::default();
        assert_eq!(cache.get(5), None);
        cache.put((-3600, 82_800));
        assert_eq!(cache.get(0), Some((-3600, 82_800)));
        assert_eq!(cache.get(82_800), None);
    }

    #[test]
    #[cfg(feature = "redis")]
    fn bounds_cover_the_margin_and_the_lookahead() {
        let minutes = spec(Calendar::per_minute(1));
        let now = 1_000_000 * NANOS_PER_SEC + 30 * NANOS_PER_SEC; // 30 s into minute 16,667
        let b = bounds(&minutes, now, 0, 60, LOOKAHEAD);
        let m = 1_000_030 / 60 * 60; // the minute holding `now` starts here
        assert_eq!(b.first(), Some(&(m - 60)));
        assert_eq!(b.last(), Some(&(m + 60 + 60 * 8)));
        assert!(b.windows(2).all(|p| p[1] - p[0] == 60));
        // A key's guard 10 minutes ahead: its window, and the margin after it, are covered.
        let b = bounds(&minutes, now, now + 600 * NANOS_PER_SEC, 60, 1);
        assert_eq!(b.first(), Some(&(m - 60)));
        assert_eq!(b.last(), Some(&(m + 60 * 12)));
        // A guard behind now changes nothing.
        assert_eq!(bounds(&minutes, now, 5, 60, 1), bounds(&minutes, now, 0, 60, 1));
    }
}
