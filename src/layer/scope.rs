//! What the layer limits, per request: filters, allow-lists, and the selector that chooses one
//! of several policies.

use std::collections::HashSet;
use std::net::IpAddr;

use http::{Method, StatusCode};
use ipnet::IpNet;

use crate::error::ConfigError;
use crate::key::{Key, RequestHead};
use crate::limiter::Limiter;
use crate::policy::Policy;
use crate::store::Store;

/// What to do with a request the layer's [selector](super::RateLimitLayerBuilder::select)
/// chose no policy for.
///
/// ```
/// use bytes::Bytes;
/// use http::{Request, Response, StatusCode};
/// use http_body_util::Full;
/// use tollgate::layer::Unselected;
/// use tollgate::{Policy, Quota, RateLimitLayer, key::GlobalKey};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let layer = RateLimitLayer::builder(Policy::single("pro", Quota::per_second(100)).unwrap())
///     .key(GlobalKey)
///     .select(|head| head.headers.get("x-plan").and_then(|v| v.to_str().ok()))
///     .unselected(Unselected::Reject(StatusCode::FORBIDDEN))
///     .build()
///     .unwrap();
/// let svc = layer.layer(service_fn(|_req| async {
///     Ok::<_, std::convert::Infallible>(Response::new(Full::<Bytes>::default()))
/// }));
/// let pro = Request::builder().header("x-plan", "pro").body(Full::<Bytes>::default()).unwrap();
/// assert_eq!(svc.clone().oneshot(pro).await.unwrap().status(), StatusCode::OK);
/// let none = Request::new(Full::<Bytes>::default());
/// assert_eq!(svc.oneshot(none).await.unwrap().status(), StatusCode::FORBIDDEN);
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Unselected {
    /// Pass it on unlimited, untouched (default).
    #[default]
    Pass,
    /// Refuse it with this status and a problem+json body
    /// ([`Rejection::Unselected`](crate::Rejection::Unselected)); a gRPC call gets the
    /// matching gRPC status ([`Rejection::grpc_status`](crate::Rejection::grpc_status)).
    Reject(StatusCode),
}

pub(super) type FilterFn = Box<dyn Fn(&RequestHead<'_>) -> bool + Send + Sync>;
pub(super) type SelectFn = Box<dyn for<'a> Fn(&RequestHead<'a>) -> Option<&'a str> + Send + Sync>;

/// One filter: a request is limited when every condition holds.
pub(super) enum Condition {
    Predicate(FilterFn),
    Only(Box<[Method]>),
    Skip(Box<[Method]>),
}

impl Condition {
    #[inline]
    fn holds(&self, head: &RequestHead<'_>) -> bool {
        match self {
            Self::Predicate(f) => f(head),
            Self::Only(methods) => methods.contains(head.method),
            Self::Skip(methods) => !methods.contains(head.method),
        }
    }
}

/// A policy added for the selector: to be bound when the layer is built, or already bound.
pub(super) enum Added<St: Store> {
    Policy(Policy),
    Limiter(Limiter<St>),
}

impl<St: Store> Added<St> {
    pub(super) fn policy(&self) -> &Policy {
        match self {
            Self::Policy(p) => p,
            Self::Limiter(l) => l.policy(),
        }
    }

    /// The policy to bind to another store (a limiter is bound to its own).
    pub(super) fn unbound<St2: Store>(self) -> Added<St2> {
        match self {
            Self::Policy(p) => Added::Policy(p),
            Self::Limiter(l) => Added::Policy(l.policy().clone()),
        }
    }
}

/// What the builder collected; checked by [`validate`](Self::validate) and turned into a
/// [`Scope`] by [`build`](Self::build).
pub(super) struct ScopeBuilder<St: Store> {
    pub(super) conditions: Vec<Condition>,
    pub(super) allow_keys: Vec<Key>,
    pub(super) allow_cidrs: Vec<String>,
    pub(super) policies: Vec<Added<St>>,
    pub(super) select: Option<SelectFn>,
    pub(super) unselected: Option<Unselected>,
}

impl<St: Store> Default for ScopeBuilder<St> {
    fn default() -> Self {
        Self {
            conditions: Vec::new(),
            allow_keys: Vec::new(),
            allow_cidrs: Vec::new(),
            policies: Vec::new(),
            select: None,
            unselected: None,
        }
    }
}

fn invalid(setting: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { setting, reason: reason.into() }
}

impl<St: Store> ScopeBuilder<St> {
    /// The same settings for a layer over another store.
    pub(super) fn restore<St2: Store>(self) -> ScopeBuilder<St2> {
        ScopeBuilder {
            conditions: self.conditions,
            allow_keys: self.allow_keys,
            allow_cidrs: self.allow_cidrs,
            policies: self.policies.into_iter().map(Added::unbound).collect(),
            select: self.select,
            unselected: self.unselected,
        }
    }

    /// Checks the settings; `first` is the policy the builder started with.
    pub(super) fn validate(&self, first: &Policy) -> Result<(), ConfigError> {
        if self.conditions.iter().any(|c| matches!(c, Condition::Only(m) if m.is_empty())) {
            return Err(invalid("only_methods", "an empty list would limit nothing"));
        }
        if self.select.is_none() {
            if !self.policies.is_empty() {
                return Err(invalid(
                    "policy",
                    "added policies are only chosen by a selector; set one with `select`",
                ));
            }
            if self.unselected.is_some() {
                return Err(invalid("unselected", "applies only with a selector (`select`)"));
            }
        }
        let mut names = HashSet::new();
        for policy in std::iter::once(first).chain(self.policies.iter().map(Added::policy)) {
            if !names.insert(policy.name()) {
                return Err(invalid(
                    "policy",
                    format!(
                        "two policies are named `{}`; the selector chooses them by name",
                        policy.name()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The scope, with the added policies bound to `store`; `None` when nothing is set.
    pub(super) fn build(self, store: &St) -> Result<Option<Box<Scope<St>>>, ConfigError> {
        let nets = self
            .allow_cidrs
            .iter()
            .map(|s| {
                let s = s.trim();
                s.parse::<IpNet>()
                    .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
                    .map(|n| n.trunc())
                    .map_err(|_| {
                        invalid("allow_cidrs", format!("{s:?} is not a CIDR or an address"))
                    })
            })
            .collect::<Result<Box<[IpNet]>, _>>()?;
        if self.conditions.is_empty()
            && self.allow_keys.is_empty()
            && nets.is_empty()
            && self.select.is_none()
        {
            return Ok(None);
        }
        let others = self
            .policies
            .into_iter()
            .map(|added| match added {
                Added::Policy(p) => Limiter::with_store(p, store.clone()),
                Added::Limiter(l) => Ok(l),
            })
            .collect::<Result<Box<[_]>, _>>()?;
        Ok(Some(Box::new(Scope {
            conditions: self.conditions.into(),
            allow_keys: self.allow_keys.into_iter().collect(),
            allow_nets: nets,
            select: self.select,
            others,
            unselected: self.unselected.unwrap_or_default(),
        })))
    }
}

/// The built settings that choose what is limited.
pub(super) struct Scope<St: Store> {
    conditions: Box<[Condition]>,
    allow_keys: HashSet<Key>,
    allow_nets: Box<[IpNet]>,
    select: Option<SelectFn>,
    /// The policies added with `policy`, after the builder's own (index 0).
    pub(super) others: Box<[Limiter<St>]>,
    unselected: Unselected,
}

/// Where a request goes.
pub(super) enum Route {
    /// Limited by the policy at this index (0: the builder's own).
    Limit(usize),
    /// Passed on untouched.
    Pass,
    /// Refused with this status (unselected).
    Refuse(StatusCode),
}

impl<St: Store> Scope<St> {
    /// The filters, then the selector; `position` finds a policy by name.
    #[inline]
    pub(super) fn route(
        &self,
        head: &RequestHead<'_>,
        position: impl Fn(&str) -> Option<usize>,
    ) -> Route {
        if !self.conditions.iter().all(|c| c.holds(head)) {
            return Route::Pass;
        }
        let Some(select) = &self.select else { return Route::Limit(0) };
        match select(head).and_then(position) {
            Some(i) => Route::Limit(i),
            None => match self.unselected {
                Unselected::Pass => Route::Pass,
                Unselected::Reject(status) => Route::Refuse(status),
            },
        }
    }

    /// Whether `key` is allow-listed: itself or (for a composite key) one of its parts is one
    /// of the allowed keys, or an address in an allowed network.
    #[inline]
    pub(super) fn allows(&self, key: &Key) -> bool {
        if self.allow_keys.is_empty() && self.allow_nets.is_empty() {
            return false;
        }
        let one = |k: &Key| {
            (!self.allow_keys.is_empty() && self.allow_keys.contains(k))
                || matches!(k, Key::Ip(ip) if self.allow_nets.iter().any(|n| n.contains(ip)))
        };
        one(key) || matches!(key, Key::Tuple(parts) if parts.iter().any(one))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::quota::Quota;
    use crate::store::MemoryStore;

    fn scope(b: ScopeBuilder<MemoryStore>) -> Scope<MemoryStore> {
        *b.build(&MemoryStore::new()).unwrap().unwrap()
    }

    #[test]
    fn allow_list_matches_keys_networks_and_tuple_parts() {
        let s = scope(ScopeBuilder {
            allow_keys: vec![Key::text("internal")],
            allow_cidrs: vec!["10.0.0.0/8".into(), " 2001:db8::/48".into(), "192.0.2.7".into()],
            ..ScopeBuilder::default()
        });
        let ip = |s: &str| Key::Ip(s.parse().unwrap());
        assert!(s.allows(&Key::text("internal")));
        assert!(!s.allows(&Key::text("external")));
        assert!(s.allows(&ip("10.200.1.1")));
        assert!(s.allows(&ip("192.0.2.7")));
        assert!(!s.allows(&ip("192.0.2.8")));
        assert!(s.allows(&ip("2001:db8:0:1::")));
        assert!(!s.allows(&ip("2001:db9::")));
        assert!(s.allows(&Key::Tuple(Arc::new([ip("10.1.1.1"), Key::text("GET")]))));
        assert!(s.allows(&Key::Tuple(Arc::new([ip("203.0.113.1"), Key::text("internal")]))));
        assert!(!s.allows(&Key::Tuple(Arc::new([ip("203.0.113.1"), Key::text("GET")]))));
    }

    #[test]
    fn nothing_set_builds_no_scope() {
        let b = ScopeBuilder::<MemoryStore>::default();
        assert!(b.build(&MemoryStore::new()).unwrap().is_none());
    }

    #[test]
    fn bad_settings_are_named() {
        let first = Policy::single("a", Quota::per_second(1)).unwrap();
        let setting = |b: ScopeBuilder<MemoryStore>| match b.validate(&first) {
            Err(ConfigError::Invalid { setting, .. }) => setting,
            other => panic!("{other:?}"),
        };
        let b =
            ScopeBuilder { conditions: vec![Condition::Only(Box::new([]))], ..Default::default() };
        assert_eq!(setting(b), "only_methods");
        let b = ScopeBuilder {
            policies: vec![Added::Policy(Policy::single("b", Quota::per_second(1)).unwrap())],
            ..Default::default()
        };
        assert_eq!(setting(b), "policy");
        let b = ScopeBuilder { unselected: Some(Unselected::Pass), ..Default::default() };
        assert_eq!(setting(b), "unselected");
        let b = ScopeBuilder {
            policies: vec![Added::Policy(Policy::single("a", Quota::per_second(9)).unwrap())],
            select: Some(Box::new(|_| None)),
            ..Default::default()
        };
        assert_eq!(setting(b), "policy");
        let b = ScopeBuilder { allow_cidrs: vec!["10.0.0.0/33".into()], ..Default::default() };
        match b.build(&MemoryStore::new()) {
            Err(ConfigError::Invalid { setting, reason }) => {
                assert_eq!(setting, "allow_cidrs");
                assert!(reason.contains("10.0.0.0/33"), "{reason}");
            }
            other => panic!("{:?}", other.map(|s| s.is_some())),
        }
    }
}
