//! The layer's answers in place of the inner service: refusals (429, 413, 503, and in gRPC
//! form), the trailers of a stopped gRPC stream, and the headers after a refund.

use bytes::Bytes;
use http::{Response, header};

use super::Config;
use super::future::RefundByStatus;
use super::stream::Stopped;
use crate::decision::Decision;
use crate::error::StoreError;
use crate::headers::{Fields, HeaderStyle, PreparedHeaders};
use crate::key::Key;
use crate::limiter::Limiter;
use crate::rejection::{Rejection, grpc_resource_exhausted, too_many_requests};
use crate::store::{Check, Store};

impl<K, St: Store> Config<K, St> {
    /// The rate-limit headers of `key`'s state now (a query, charging nothing): what a
    /// response says after a refund or a settlement changed its charge. None when the store
    /// cannot tell: no header rather than a wrong one.
    pub(super) async fn headers_now(
        &self,
        policy: usize,
        key: &Key,
        priority: crate::Priority,
        collect: bool,
    ) -> PreparedHeaders {
        let limiter = self.limiter_at(policy);
        let query = Check::new(key, 0).with_priority(priority);
        match limiter.decide(query).await {
            Ok(verdict) => {
                limiter.surface().headers.prepare(self.settings.headers, &verdict.decision, collect)
            }
            Err(_) => PreparedHeaders::default(),
        }
    }

    /// The response to a request `limiter` refused; `budget` is the shaping budget it
    /// exceeded; `grpc` whether the request is a gRPC call, answered in gRPC form (never
    /// through the custom rejection: a gRPC client could not read it); `collect` whether its
    /// rate-limit headers are handed on (in the response's
    /// [`Collected`](crate::headers::Collected)) rather than written.
    pub(super) fn reject(
        &self,
        limiter: &Limiter<St>,
        key: &Key,
        decision: Decision,
        budget: Option<std::time::Duration>,
        grpc: bool,
        collect: bool,
    ) -> Response<Bytes> {
        if collect {
            let headers = limiter.surface().headers.prepare(self.settings.headers, &decision, true);
            let style = Fields { style: HeaderStyle::None, ..self.settings.headers };
            let mut res = self.reject_with(limiter, key, decision, budget, grpc, style);
            headers.apply(&mut res);
            return res;
        }
        self.reject_with(limiter, key, decision, budget, grpc, self.settings.headers)
    }

    /// [`reject`](Self::reject), writing the rate-limit headers of `style`.
    pub(super) fn reject_with(
        &self,
        limiter: &Limiter<St>,
        key: &Key,
        decision: Decision,
        budget: Option<std::time::Duration>,
        grpc: bool,
        style: Fields,
    ) -> Response<Bytes> {
        tracing::debug!(
            policy = limiter.policy().name(),
            key = %self.observer.show(key),
            outcome = ?decision.outcome(),
            grpc,
            "tollgate: limited"
        );
        if grpc {
            return grpc_resource_exhausted(limiter.surface(), &decision, style);
        }
        match &self.settings.rejection {
            None => too_many_requests(limiter.surface(), &decision, style),
            Some(f) => {
                let limited = limiter.rate_limited(decision, budget);
                let mut res = f(&limited);
                // The callback's own `Retry-After` wins.
                let own = res.headers().get(header::RETRY_AFTER).cloned();
                limited.add_headers(style, &mut res);
                if let Some(value) = own {
                    res.headers_mut().insert(header::RETRY_AFTER, value);
                }
                res
            }
        }
    }

    /// The answer to a request whose upload policing stopped before the handler answered: a
    /// refusal as at admission, or a 503 when the store could not decide (failing closed).
    pub(super) fn stopped(
        &self,
        limiter: &Limiter<St>,
        key: &Key,
        why: Stopped,
        (grpc, collect): (bool, bool),
    ) -> Response<Bytes> {
        match why {
            Stopped::Limited(decision) => self.reject(limiter, key, decision, None, grpc, collect),
            Stopped::Unavailable(error) => {
                let error = StoreError::backend(error.to_string());
                self.refuse(&Rejection::Unavailable(error), grpc)
            }
        }
    }

    /// The trailers ending a gRPC response of the policy at `index` stopped by policing: the
    /// status of its refusal (`RESOURCE_EXHAUSTED`, or `UNAVAILABLE` failing closed), its
    /// message and `grpc-retry-pushback-ms`.
    pub(super) fn stop_trailers(&self, index: usize, why: &Stopped) -> http::HeaderMap {
        let style = self.settings.headers;
        let res = match why {
            Stopped::Limited(decision) => {
                grpc_resource_exhausted(self.limiter_at(index).surface(), decision, style)
            }
            Stopped::Unavailable(error) => {
                let error = StoreError::backend(error.to_string());
                Rejection::Unavailable(error).grpc_response(style)
            }
        };
        let mut trailers = res.into_parts().0.headers;
        trailers.remove(header::CONTENT_TYPE);
        trailers
    }

    /// A refusal other than a 429, in gRPC form for a gRPC call.
    pub(super) fn refuse(&self, rejection: &Rejection, grpc: bool) -> Response<Bytes> {
        let style = self.settings.headers;
        if grpc { rejection.grpc_response(style) } else { rejection.response(style) }
    }
}

impl<K, St> RefundByStatus for Config<K, St>
where
    K: Send + Sync,
    St: Store,
{
    fn refund_by_status(
        &self,
        status: http::StatusCode,
        policy: usize,
        key: &Key,
        (cost, priority): (u64, crate::Priority),
        collect: bool,
    ) -> Option<PreparedHeaders> {
        if !self.refunds(status) {
            return None;
        }
        let limiter = self.limiter_at(policy);
        limiter.refund_sync(key, cost);
        let query = Check::new(key, 0).with_priority(priority);
        let Some(Ok(verdict)) = limiter.check_sync(query) else {
            return Some(PreparedHeaders::default());
        };
        Some(limiter.surface().headers.prepare(self.settings.headers, &verdict.decision, collect))
    }
}
