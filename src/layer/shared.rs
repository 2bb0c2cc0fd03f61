//! What a service reads of its layer's [`Config`]: the limiter and plan of each policy, a
//! request's cost and class, whether a status gives a charge back.

use super::plan::Plan;
use super::{Config, Cost, Observed};
use crate::decision::Decision;
use crate::key::{Key, RequestHead};
use crate::limiter::Limiter;
use crate::store::Store;

impl<K, St: Store> Config<K, St> {
    /// The limiter of the policy at `index`: 0 is the builder's own, then those added with
    /// `policy` in order.
    #[inline]
    pub(super) fn limiter_at(&self, index: usize) -> &Limiter<St> {
        match (index, &self.scope) {
            (0, _) | (_, None) => &self.limiter,
            (i, Some(scope)) => scope.others.get(i - 1).unwrap_or(&self.limiter),
        }
    }

    /// The index of the policy named `name`.
    pub(super) fn position(&self, name: &str) -> Option<usize> {
        if self.limiter.policy().name() == name {
            return Some(0);
        }
        let others = self.scope.as_ref().map_or(&[][..], |s| &s.others[..]);
        others.iter().position(|l| l.policy().name() == name).map(|i| i + 1)
    }

    /// Reports a decision of the policy at `index`.
    #[inline(never)]
    pub(super) fn observe(
        &self,
        index: usize,
        key: &Key,
        head: &RequestHead<'_>,
        decision: Option<&Decision>,
        outcome: Observed,
    ) {
        let policy = self.limiter_at(index).policy();
        self.observer.decided(index, policy, key, head, decision, outcome);
    }

    /// The [`Plan`] of the policy at `index` ([`limiter_at`](Self::limiter_at)'s order).
    #[inline]
    pub(super) fn plan_at(&self, index: usize) -> &Plan {
        self.plans.get(index).unwrap_or(&self.plans[0])
    }

    /// Whether a response of `status` gives its request's charge back: a `405 Method Not
    /// Allowed` (unless charged by choice), or a status of `refund_if`.
    pub(super) fn refunds(&self, status: http::StatusCode) -> bool {
        (status == http::StatusCode::METHOD_NOT_ALLOWED && !self.settings.charge_method_not_allowed)
            || self.settings.refund_if.as_ref().is_some_and(|f| f(status))
    }

    /// The request's cost in units.
    #[inline]
    pub(super) fn cost(&self, head: &RequestHead<'_>) -> u64 {
        match &self.settings.cost {
            Cost::Fixed(units) => *units,
            Cost::PerRequest(f) => f(head),
        }
    }

    /// The request's class ([`Priority::Standard`](crate::Priority::Standard) unless the layer picks it).
    #[inline]
    pub(super) fn priority(&self, head: &RequestHead<'_>) -> crate::Priority {
        self.settings.priority.as_ref().map_or(crate::Priority::Standard, |f| f(head))
    }
}
