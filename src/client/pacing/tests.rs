//! The pacing layer over scripted servers (paused time).

mod scripted {

    use std::time::Duration;

    use http::StatusCode;
    use tokio::time::Instant;

    use crate::hints::{MAX_QUOTAS, Reported};

    use super::super::state::*;
    use super::super::*;

    fn quota(remaining: u64, reset: Option<u64>) -> Reported {
        Reported {
            name: Some("q".into()),
            limit: Some(10),
            remaining,
            reset: reset.map(Duration::from_secs),
        }
    }

    fn remaining(state: &State) -> Vec<i64> {
        state.quotas.iter().map(|q| q.remaining).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn units_spent_do_not_come_back_from_late_responses() {
        let now = Instant::now();
        let mut state = State { informed: true, ..State::default() };
        let seqs: Vec<u64> = (0..3).map(|_| state.try_reserve(now).unwrap()).collect();
        assert_eq!(seqs, [1, 2, 3]);
        // Answered out of order: the second request's r=5 arrives first.
        state.observe(now, 2, StatusCode::OK, vec![quota(5, Some(1))], None);
        assert_eq!(remaining(&state), [3], "r=5 less both requests in flight, either may be later");
        state.observe(now, 1, StatusCode::OK, vec![quota(7, Some(1))], None);
        assert_eq!(remaining(&state), [4], "a late r=7 does not bring units back: r=5 less one");
        state.observe(now, 3, StatusCode::OK, vec![quota(4, Some(1))], None);
        assert_eq!(remaining(&state), [4], "the third request was counted once, not twice");
        assert_eq!(state.in_flight(), 0);
    }

    /// Every order in which the server can decide four concurrent requests, and every order in
    /// which their answers can come back (each after its decision): the count never exceeds
    /// what the server has once the requests in flight are decided, and is exact at the end.
    #[tokio::test(start_paused = true)]
    async fn requests_overtaking_one_another_never_make_the_count_too_high() {
        #[derive(Clone, Copy, Debug, PartialEq)]
        enum Event {
            Decide(u64),
            Answer(u64),
        }
        /// All sequences of the events left in which each answer follows its decision.
        fn orders(decided: &mut Vec<u64>, left: &mut Vec<Event>, out: &mut Vec<Vec<Event>>) {
            if left.is_empty() {
                return;
            }
            for i in 0..left.len() {
                let event = left[i];
                if let Event::Answer(seq) = event
                    && !decided.contains(&seq)
                {
                    continue;
                }
                left.remove(i);
                if let Event::Decide(seq) = event {
                    decided.push(seq);
                }
                let mut rest = Vec::new();
                orders(decided, left, &mut rest);
                if rest.is_empty() {
                    out.push(vec![event]);
                }
                for mut tail in rest {
                    tail.insert(0, event);
                    out.push(tail);
                }
                if let Event::Decide(_) = event {
                    decided.pop();
                }
                left.insert(i, event);
            }
        }
        let now = Instant::now();
        let seqs = [2, 3, 4, 5];
        let mut all = Vec::new();
        let mut events: Vec<Event> =
            seqs.iter().flat_map(|&s| [Event::Decide(s), Event::Answer(s)]).collect();
        orders(&mut Vec::new(), &mut events, &mut all);
        assert_eq!(all.len(), 2520, "8! / 2^4 orders");
        for order in all {
            // The first request alone: 10 units, 9 left.
            let mut state = State::default();
            let first = state.try_reserve(now).unwrap();
            state.observe(now, first, StatusCode::OK, vec![quota(9, None)], None);
            for &seq in &seqs {
                assert_eq!(state.try_reserve(now), Ok(seq));
            }
            let mut level: i64 = 9;
            let mut told: HashMap<u64, u64> = HashMap::new();
            let mut undecided = seqs.len() as i64;
            for event in &order {
                match *event {
                    Event::Decide(seq) => {
                        level -= 1;
                        undecided -= 1;
                        told.insert(seq, level.unsigned_abs());
                    }
                    Event::Answer(seq) => {
                        state.observe(
                            now,
                            seq,
                            StatusCode::OK,
                            vec![quota(told[&seq], None)],
                            None,
                        );
                        let believed = state.quotas[0].remaining;
                        assert!(
                            believed <= level - undecided,
                            "{order:?}: {believed} at {event:?}"
                        );
                    }
                }
            }
            assert_eq!(remaining(&state), [5], "{order:?}: exact once all are answered");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_long_request_compares_with_every_answer_read_meanwhile_in_bounded_memory() {
        let now = Instant::now();
        let mut state = State::default();
        let first = state.try_reserve(now).unwrap();
        state.observe(now, first, StatusCode::OK, vec![quota(200, None)], None);
        let long = state.try_reserve(now).unwrap();
        for i in 0..100 {
            let seq = state.try_reserve(now).unwrap();
            let r = if i == 3 { 5 } else { 150 };
            state.observe(now, seq, StatusCode::OK, vec![quota(r, None)], None);
            assert!(state.quotas[0].recent.len() <= MAX_RECENT);
        }
        // The long request may have been decided after the one that said 5.
        state.observe(now, long, StatusCode::OK, vec![quota(150, None)], None);
        assert_eq!(remaining(&state), [5]);
        assert!(state.quotas[0].recent.is_empty() && state.quotas[0].sent.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn the_learned_refill_stops_at_the_limit_less_the_requests_in_flight() {
        let now = Instant::now();
        let mut state = State::default();
        let first = state.try_reserve(now).unwrap();
        state.observe(now, first, StatusCode::OK, vec![quota(4, None)], None);
        state.quotas[0].interval = Some(Duration::from_millis(100));
        for _ in 0..3 {
            state.try_reserve(now).unwrap();
        }
        // Ten seconds later the server holds at most 10 units, and the three requests in
        // flight may still take three of them; one stays while requests are in flight.
        let later = now + Duration::from_secs(10);
        let sent = std::iter::from_fn(|| state.try_reserve(later).ok()).count();
        assert_eq!(sent, 6);
    }

    #[tokio::test(start_paused = true)]
    async fn with_requests_in_flight_the_last_unit_waits_for_them() {
        let now = Instant::now();
        let mut state = State::default();
        let first = state.try_reserve(now).unwrap();
        state.observe(now, first, StatusCode::OK, vec![quota(3, None)], None);
        assert_eq!(state.try_reserve(now), Ok(2));
        assert_eq!(state.try_reserve(now), Ok(3));
        // One unit left and two requests in flight: it waits for them.
        assert_eq!(state.try_reserve(now), Err(None));
        state.observe(now, 2, StatusCode::OK, vec![quota(2, None)], None);
        assert_eq!(state.try_reserve(now), Err(None));
        state.observe(now, 3, StatusCode::OK, vec![quota(1, None)], None);
        // Alone, a request may take the last unit.
        assert_eq!(state.try_reserve(now), Ok(4));
        assert_eq!(remaining(&state), [0]);
    }

    #[tokio::test(start_paused = true)]
    async fn requests_in_flight_are_subtracted_once() {
        let now = Instant::now();
        let mut state = State { informed: true, ..State::default() };
        for _ in 0..4 {
            state.try_reserve(now).unwrap();
        }
        // The server answers in order: each r already counts the requests sent before.
        for (seq, r) in [(1, 9), (2, 8), (3, 7), (4, 6)] {
            state.observe(now, seq, StatusCode::OK, vec![quota(r, Some(1))], None);
            assert_eq!(remaining(&state), [6], "after request {seq}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_quota_full_again_is_refilled_less_what_is_in_flight() {
        let now = Instant::now();
        let mut state = State::default();
        let first = state.try_reserve(now).unwrap();
        state.observe(now, first, StatusCode::OK, vec![quota(1, Some(2))], None);
        // One left: one request goes, the next waits for the reset at 2 s.
        let second = state.try_reserve(now).unwrap();
        assert_eq!(state.try_reserve(now), Err(Some(now + Duration::from_secs(2))));
        // At 2 s, with that request still in flight: 10 - 1 = 9 left, one taken now.
        let later = now + Duration::from_secs(2);
        state.try_reserve(later).unwrap();
        assert_eq!(remaining(&state), [8]);
        assert_eq!(state.quotas[0].reset_at, None);
        assert_eq!(state.in_flight(), 2);
        // The answer to the request sent before the refill is older than it: not read.
        state.observe(later, second, StatusCode::OK, vec![quota(0, Some(1))], None);
        assert_eq!(remaining(&state), [8]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_exhausted_quota_without_a_reset_waits_for_answers_then_is_forgotten() {
        let now = Instant::now();
        let mut state = State { informed: true, ..State::default() };
        state.try_reserve(now).unwrap();
        state.try_reserve(now).unwrap();
        let no_reset = Reported { name: Some("q".into()), limit: None, remaining: 0, reset: None };
        state.observe(now, 2, StatusCode::OK, vec![no_reset], None);
        // Nothing left and no reset time: wait for the response still in flight.
        assert_eq!(state.try_reserve(now), Err(None));
        state.abandon(1);
        // Nothing more will come: the quota is forgotten, the request goes.
        assert_eq!(state.try_reserve(now), Ok(3));
        assert!(state.quotas.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn before_the_first_answer_requests_go_one_at_a_time() {
        let now = Instant::now();
        let mut state = State::default();
        assert_eq!(state.try_reserve(now), Ok(1));
        assert_eq!(state.try_reserve(now), Err(None));
        // The first request failed: the next one goes, alone.
        state.abandon(1);
        assert_eq!(state.try_reserve(now), Ok(2));
        assert_eq!(state.try_reserve(now), Err(None));
        // An answer without rate-limit fields: nothing limits what follows.
        state.observe(now, 2, StatusCode::OK, vec![], None);
        assert_eq!(state.try_reserve(now), Ok(3));
        assert_eq!(state.try_reserve(now), Ok(4));
    }

    #[tokio::test(start_paused = true)]
    async fn the_refill_rate_is_learned_as_a_lower_bound() {
        // A server refilling 4 units per second, capacity 10: empty, it is full again in 2.5 s,
        // which its `t` rounds up to 3 s.
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut state = State::default();
        let send = |state: &mut State, now: Instant, r: u64, t: u64| {
            let seq = state.try_reserve(now).unwrap();
            state.observe(now, seq, StatusCode::OK, vec![quota(r, Some(t))], None);
        };
        for r in (0..10).rev() {
            send(&mut state, at(0), r, 3);
        }
        assert_eq!(state.quotas[0].interval, None, "no refill seen yet");
        assert_eq!(state.try_reserve(at(0)), Err(Some(at(3000))));
        // At the reset the server is full: r=9. From the first answer (r=9 at 0 s), 10
        // requests spent and 9 + 10 - 9 - 1 = 9 units refilled in 3 s at least.
        send(&mut state, at(3000), 9, 1);
        let interval = Duration::from_nanos(333_333_334);
        assert_eq!(state.quotas[0].interval, Some(interval));
        for r in (0..9).rev() {
            send(&mut state, at(3000), r, 3);
        }
        assert_eq!(state.quotas[0].interval, Some(interval));
        // Nothing left: the next unit is one interval away, not at the reset (6 s).
        assert_eq!(state.try_reserve(at(3000)), Err(Some(at(3000) + interval)));
        assert_eq!(state.try_reserve(at(3333)), Err(Some(at(3000) + interval)));
        let seq = state.try_reserve(at(3334)).unwrap();
        // The server had 4/3 units: r=0; 0 + 20 - 9 - 1 = 10 refilled in 3.334 s.
        state.observe(at(3334), seq, StatusCode::OK, vec![quota(0, Some(3))], None);
        assert_eq!(state.quotas[0].interval, Some(interval), "333.4 ms is no better");
        // A refusal while extrapolating: the rate is dropped and never learned again.
        let seq = state.try_reserve(at(3668)).unwrap();
        state.observe(at(3668), seq, StatusCode::TOO_MANY_REQUESTS, vec![quota(0, Some(3))], None);
        assert_eq!(state.quotas[0].interval, None);
        assert!(!state.quotas[0].learns);
        assert_eq!(state.try_reserve(at(3668)), Err(Some(at(6668))));
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_first_answer_does_not_raise_the_bound_above_the_rate() {
        // 4 units per second, capacity 100. The anchor was sent and decided at 0 s with 50
        // left, and its answer took 500 ms; the next was sent, decided and answered at 1.5 s
        // with 50 + 6 - 1 = 55 left. Timed from the anchor's arrival, 5 units in 1 s would be
        // 5/s; timed from when it was sent, they take 1.5 s: 300 ms each, under 4/s.
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let report = |r| Reported {
            name: Some("q".into()),
            limit: Some(100),
            remaining: r,
            reset: Some(Duration::from_secs(13)),
        };
        let mut state = State::default();
        let first = state.try_reserve(at(0)).unwrap();
        state.observe(at(500), first, StatusCode::OK, vec![report(50)], None);
        let second = state.try_reserve(at(1500)).unwrap();
        state.observe(at(1500), second, StatusCode::OK, vec![report(55)], None);
        let learned = state.quotas[0].interval.unwrap();
        assert_eq!(learned, Duration::from_millis(300));
        assert!(learned >= Duration::from_millis(250), "never faster than the server refills");
    }

    #[tokio::test(start_paused = true)]
    async fn a_429_blocks_until_its_retry_after_and_huge_values_do_not_overflow() {
        let now = Instant::now();
        let mut state = State::default();
        let seq = state.try_reserve(now).unwrap();
        state.observe(
            now,
            seq,
            StatusCode::TOO_MANY_REQUESTS,
            vec![],
            Some(Duration::from_secs(3)),
        );
        assert_eq!(state.try_reserve(now), Err(Some(now + Duration::from_secs(3))));
        state.observe(now, 9, StatusCode::TOO_MANY_REQUESTS, vec![], Some(Duration::MAX));
        assert_eq!(state.try_reserve(now), Err(Some(now + MAX_WAIT)));
        // A 503's Retry-After is the retry policy's business, not the pacing's.
        let mut state = State::default();
        state.observe(
            now,
            1,
            StatusCode::SERVICE_UNAVAILABLE,
            vec![],
            Some(Duration::from_secs(3)),
        );
        assert_eq!(state.try_reserve(now), Ok(1));
    }

    #[tokio::test(start_paused = true)]
    async fn quotas_per_partition_are_bounded() {
        let now = Instant::now();
        let mut state = State::default();
        for round in 0..3 {
            let reported = (0..MAX_QUOTAS)
                .map(|i| Reported {
                    name: Some(format!("q{round}-{i}").into()),
                    limit: Some(5),
                    remaining: 5,
                    reset: Some(Duration::from_secs(1)),
                })
                .collect();
            state.observe(now, round + 1, StatusCode::OK, reported, None);
        }
        assert_eq!(state.quotas.len(), MAX_QUOTAS);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_partitions_are_swept_when_there_are_too_many() {
        let layer = PacingLayer::new();
        let head = |i: usize| {
            http::Request::get(format!("http://h{i}.test/")).body(()).unwrap().into_parts().0
        };
        let busy = layer.shared.partition(&RequestHead::from(&head(0))).unwrap();
        busy.lock().blocked_until = Some(Instant::now() + Duration::from_secs(5));
        drop(busy);
        for i in 1..MAX_PARTITIONS {
            layer.shared.partition(&RequestHead::from(&head(i)));
        }
        assert_eq!(layer.shared.len(), MAX_PARTITIONS);
        // One more: every idle partition goes, the one that still delays stays.
        layer.shared.partition(&RequestHead::from(&head(MAX_PARTITIONS)));
        assert_eq!(layer.shared.len(), 2);
        assert_eq!(layer.delay(&RequestHead::from(&head(0))), Some(Duration::from_secs(5)));
    }
}
