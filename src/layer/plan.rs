//! What a request needs, decided once: per policy, when the layer is built ([`Plan`]), and per
//! request, read once from its head ([`Demand`]).

use super::Config;
use super::meter::{Needs, content_length};
use super::stream::StreamMode;
use crate::grpc::is_grpc;
use crate::key::{KeyExtractor, RequestHead};
use crate::limiter::Limiter;
use crate::quota::Unit;
use crate::store::Store;

/// What the requests of one bound policy need, derived from the layer's settings and the
/// policy's tiers when the layer is built, so that a request only reads it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    /// What a request must have measured while it runs (slots, bytes, reported units).
    pub(super) needs: Needs,
    /// Every tier a rate counting requests: the request's cost is every tier's cost.
    pub(super) plain: bool,
    /// Policing, not in dry run: a decision made at once can be answered at once.
    pub(super) at_once: bool,
    /// Whether a check decided at once asks for a ticket.
    pub(super) ticket: bool,
    /// Admitted without a ticket, its charge given back by key when the response's status
    /// says so (the store can, exactly, and nothing else needs the ticket).
    pub(super) untracked: bool,
    /// Whether an admission that came with a ticket is still answered at once: nothing is
    /// metered and no cost is settled from the response head.
    pub(super) answers_with_ticket: bool,
    /// Whether a check that may wait asks for a ticket (beside shaping, which always does).
    pub(super) ticket_to_wait: bool,
    /// Whether a `refund_if` predicate is set (statuses other than 405 may give back).
    pub(super) refund_if: bool,
    /// Shaping streamed bodies: their byte tiers (and a gRPC call's message tiers) are not
    /// checked at admission (the body's first grant waits for room instead of the request
    /// being refused).
    pub(super) shape_streams: bool,
}

impl Plan {
    pub(super) fn new<St: Store>(settings: &super::Settings, limiter: &Limiter<St>) -> Self {
        let policy = limiter.policy();
        let needs = Needs::of(policy);
        let metered = needs.any();
        // Whether a response's status may give its request's charge back.
        let refunds_by_status = !settings.charge_method_not_allowed || settings.refund_if.is_some();
        // Whether the charge may be given back after the response.
        let needs_ticket = refunds_by_status || settings.settle_cost.is_some();
        let untracked = !metered
            && settings.settle_cost.is_none()
            && refunds_by_status
            && limiter.refunds_sync();
        let shape_streams = settings.stream() == StreamMode::Shape
            && !settings.dry_run
            && (needs.request_bytes()
                || needs.response_bytes()
                || needs.request_messages()
                || needs.response_messages());
        Self {
            needs,
            plain: policy.is_plain(),
            // A request whose body is shaped as it streams may be admitted without a ticket
            // (its byte tiers cost nothing at admission): it always takes the general path.
            at_once: settings.max_delay.is_none() && !settings.dry_run && !shape_streams,
            ticket: (needs_ticket && !untracked) || metered,
            untracked,
            answers_with_ticket: !metered && settings.settle_cost.is_none(),
            ticket_to_wait: needs_ticket || metered,
            refund_if: settings.refund_if.is_some(),
            shape_streams,
        }
    }

    /// The length of a request body charged at admission: its `Content-Length`, unless the
    /// layer shapes streams and some tier counting request bytes can never hold it at once
    /// (for `priority`): such a body streams, metered as it passes.
    pub(super) fn admitted_length(
        &self,
        policy: &crate::Policy,
        length: Option<u64>,
        priority: crate::Priority,
    ) -> Option<u64> {
        let length = length?;
        let too_large = |t: &crate::Tier| {
            t.unit() == Unit::RequestBytes
                && t.kind() != crate::TierKind::Concurrency
                && length > t.capacity_for(priority)
        };
        match self.shape_streams && policy.tiers().iter().any(too_large) {
            true => None,
            false => Some(length),
        }
    }

    /// The per-tier costs of a request costing `cost` whose body is `length` long, if known.
    #[inline]
    pub(super) fn costs(
        &self,
        policy: &crate::Policy,
        cost: u64,
        length: Option<u64>,
        grpc: bool,
    ) -> crate::Costs {
        let mut costs = policy.costs(cost, length);
        if self.shape_streams {
            costs.unstream(policy, length.is_some(), grpc);
        }
        costs
    }
}

/// What a request asks of its policy, read once from its head: the layer's cost and class
/// closures run here, once per request, whichever path decides it.
pub(super) struct Demand {
    /// Units per request (the layer's cost).
    pub(super) cost: u64,
    /// The body's length charged at admission (its `Content-Length`, unless it streams).
    pub(super) length: Option<u64>,
    /// The request's class for reserved capacity.
    pub(super) priority: crate::Priority,
    /// The cost of each tier, for a policy that is not plain.
    pub(super) costs: Option<crate::Costs>,
    /// Whether the request is a gRPC call (refused in gRPC form, its messages metered), once
    /// read: a plain policy's request admitted at once never asks.
    grpc: Option<bool>,
}

impl Demand {
    /// What `head` asks of the policy at `policy`.
    pub(super) fn read<K: KeyExtractor, St: Store>(
        config: &Config<K, St>,
        policy: usize,
        head: &RequestHead<'_>,
    ) -> Self {
        let (cost, priority) = (config.cost(head), config.priority(head));
        let plan = config.plan_at(policy);
        if plan.plain {
            // Every tier a rate counting requests: no body length, no message, nothing more.
            return Demand { cost, length: None, priority, costs: None, grpc: None };
        }
        let grpc = is_grpc(head.headers);
        let limiter = config.limiter_at(policy);
        let length = plan.admitted_length(limiter.policy(), content_length(head), priority);
        let costs = Some(plan.costs(limiter.policy(), cost, length, grpc));
        Demand { cost, length, priority, costs, grpc: Some(grpc) }
    }

    /// Whether the request, whose headers are `headers`, is a gRPC call.
    #[inline]
    pub(super) fn grpc(&self, headers: &http::HeaderMap) -> bool {
        self.grpc.unwrap_or_else(|| is_grpc(headers))
    }
}
